"""Reaching the Kubernetes API from the proxy: credentials from a kubeconfig or the pod,
a collection listed then watched (`ListWatch`), one object read (`get`), a server-side
apply (`apply`), a delete guarded by a resourceVersion (`delete`), and the backoff
between attempts.

The proxy talks to the API server with its own aiohttp session (it needs a few watches,
not a client library's thread pool). Credentials are loaded by the official `kubernetes`
package's loaders, re-read on every (re)connect so rotated service-account tokens and
refreshed kubeconfig credentials are picked up. Loading reads files, so callers run it
in a worker thread, never on the request path.

What goes wrong on the way is logged through `describe_error`, one place for every log
line about the API server: the error's type, the host and port, the OS's reason. Never
an object's repr (aiohttp's connection errors print their SSL context as
`<ssl.SSLContext object at 0x…>`), never a raw response body.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import random
import re
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

# The API server ends a watch after this long; it is then resumed from the last version.
WATCH_SECONDS = 60
# A watch silent for longer than this (no event, no bookmark) is presumed dead.
SILENCE_SECONDS = WATCH_SECONDS + 15


@dataclass(frozen=True)
class KubeAccess:
    base_url: str
    headers: dict[str, str]
    ssl_context: ssl.SSLContext | bool


def in_cluster() -> bool:
    return "KUBERNETES_SERVICE_HOST" in os.environ


def load_access(kubeconfig: Path | None) -> KubeAccess:
    """Credentials from `kubeconfig`, else in-cluster when in a pod, else the default
    kubeconfig (`$KUBECONFIG` or `~/.kube/config`). Blocking: call via a thread."""
    from kubernetes import client, config

    configuration = client.Configuration()
    # The kubernetes package ships no type hints; these two loaders return None.
    if kubeconfig is None and in_cluster():
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    else:
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=str(kubeconfig) if kubeconfig else None,
            client_configuration=configuration,
        )
    headers = {"Accept": "application/json"}
    # auth_settings() renders whatever the loader found (token, refreshed exec-plugin
    # credentials, basic auth) as the header it belongs in.
    settings: dict[str, Any] = dict(configuration.auth_settings())
    for setting in settings.values():
        if setting.get("in") == "header" and setting.get("value"):
            headers[setting["key"].title()] = setting["value"]
    context: ssl.SSLContext | bool
    if configuration.verify_ssl:
        context = ssl.create_default_context(cafile=configuration.ssl_ca_cert or None)
    else:
        context = False
    if configuration.cert_file and configuration.key_file and isinstance(context, ssl.SSLContext):
        context.load_cert_chain(configuration.cert_file, configuration.key_file)
    return KubeAccess(base_url=configuration.host.rstrip("/"), headers=headers, ssl_context=context)


class KubeApiError(Exception):
    """The API server answered with an error status. Carries the status and the API's own
    `Status` reason and message (which name the resource and what was refused), never a
    body that is not a `Status`."""

    def __init__(self, status: int, reason: str = "", message: str = "") -> None:
        self.status = status
        self.reason = reason
        self.message = message
        text = f"HTTP {status}" + (f" {reason}" if reason else "")
        super().__init__(f"{text}: {message[:300]}" if message else text)

    @classmethod
    def from_body(cls, status: int, body: str) -> KubeApiError:
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict) or parsed.get("kind") != "Status":
            return cls(status)
        return cls(status, str(parsed.get("reason") or ""), str(parsed.get("message") or ""))


MAX_DESCRIPTION = 300
_OBJECT_REPR = re.compile(r"<([\w.]+) object at 0x[0-9a-fA-F]+>")


def describe_error(error: BaseException) -> str:
    """An error on the way to the API server, for a log line: stable and useful, e.g.
    `ClientConnectorError connecting to 127.0.0.1:6443: ECONNREFUSED (Connection refused)`."""
    name = type(error).__name__
    if isinstance(error, aiohttp.ClientConnectorError):
        text = f"{name} connecting to {error.host}:{error.port}: {_os_reason(error.os_error)}"
    elif isinstance(error, KubeApiError):
        text = f"{name}: {error}"
    elif isinstance(error, OSError):  # timeouts, resets, unreadable kubeconfig files
        reason = _os_reason(error)
        text = f"{name}: {reason}" if reason else name
    else:
        detail = str(error)
        text = f"{name}: {detail}" if detail else name
    # A last guard for what the branches above did not foresee.
    text = _OBJECT_REPR.sub(r"<\1>", " ".join(text.split()))
    return text[:MAX_DESCRIPTION]


def _os_reason(error: BaseException) -> str:
    """The OS's (or the TLS library's) reason for `error`, without object reprs."""
    if isinstance(error, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {error.verify_message or error.reason}"
    if isinstance(error, ssl.SSLError):
        return str(error.reason or error.strerror or type(error).__name__)
    if isinstance(error, socket.gaierror):
        return f"name resolution failed: {error.strerror}"
    if isinstance(error, OSError) and error.errno and error.errno in errno.errorcode:
        return f"{errno.errorcode[error.errno]} ({os.strerror(error.errno)})"
    if isinstance(error, OSError) and error.strerror:
        return str(error.strerror)
    return str(error)


@dataclass
class Backoff:
    """Capped, jittered exponential delays between attempts at an unreachable API server."""

    first: float = 0.25
    cap: float = 5.0
    current: float = 0.0
    rng: random.Random = field(default_factory=random.Random)

    def next_delay(self) -> float:
        self.current = self.first if self.current == 0 else min(self.cap, self.current * 2)
        return self.current * (0.5 + self.rng.random() / 2)

    def reset(self) -> None:
        self.current = 0.0


Object = dict[str, Any]


@dataclass
class ListWatch:
    """One collection of the API (`path`, narrowed by `selector`: a field or label
    selector), listed and then watched from the listed version, forever: relisted when
    the version is too old (410 Gone), retried with `backoff` while the API server is
    unreachable, a silent watch bounded by its own timeouts.

    `on_listed` receives every object of each (re)list, the whole collection as it stands
    (an object missing from it was deleted meanwhile); `on_event` each watch event after
    (`ADDED`, `MODIFIED` or `DELETED`, and the object)."""

    path: str
    selector: dict[str, str]
    describe: str
    kubeconfig: Path | None
    on_listed: Callable[[list[Object]], Awaitable[None]]
    on_event: Callable[[str, Object], Awaitable[None]]
    on_api_state: Callable[[bool], None] | None = None
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("rolegate.proxy"))
    backoff: Backoff = field(default_factory=Backoff)
    _resource_version: str | None = None

    async def run(self, session: aiohttp.ClientSession) -> None:
        while True:
            try:
                access = await asyncio.to_thread(load_access, self.kubeconfig)
                await self._list(session, access)
                self._api_up(True)
                self.backoff.reset()
                while True:
                    await self._watch(session, access)
            except asyncio.CancelledError:
                raise
            except _Gone:
                self._resource_version = None
                continue
            except Exception as error:
                self._api_up(False)
                delay = self.backoff.next_delay()
                self.log.warning(
                    "kubernetes api unavailable source=%s error=%s retry_in=%.2fs",
                    self.describe,
                    describe_error(error),
                    delay,
                )
                await asyncio.sleep(delay)

    async def _list(self, session: aiohttp.ClientSession, access: KubeAccess) -> None:
        async with session.get(
            access.base_url + self.path,
            params=self.selector,
            headers=access.headers,
            ssl=access.ssl_context,
            timeout=aiohttp.ClientTimeout(total=15),
        ) as response:
            if response.status != 200:
                raise KubeApiError.from_body(response.status, await response.text())
            body = await response.json()
        self._resource_version = body["metadata"]["resourceVersion"]
        await self.on_listed(list(body.get("items") or ()))

    async def _watch(self, session: aiohttp.ClientSession, access: KubeAccess) -> None:
        params = {
            **self.selector,
            "watch": "1",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_SECONDS),
        }
        if self._resource_version:
            params["resourceVersion"] = self._resource_version
        async with session.get(
            access.base_url + self.path,
            params=params,
            headers=access.headers,
            ssl=access.ssl_context,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=SILENCE_SECONDS),
        ) as response:
            if response.status == 410:
                raise _Gone()
            if response.status != 200:
                raise KubeApiError.from_body(response.status, await response.text())
            async for line in response.content:
                if line.strip():
                    await self._event(json.loads(line))

    async def _event(self, event: Object) -> None:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Gone()
            raise KubeApiError(
                int(obj.get("code") or 500), str(obj.get("reason") or ""), str(obj.get("message"))
            )
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if version:
            self._resource_version = version
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            await self.on_event(kind, obj)

    def _api_up(self, up: bool) -> None:
        if self.on_api_state is not None:
            self.on_api_state(up)


class _Gone(Exception):
    """The watched resource version is too old: list again."""


async def get(session: aiohttp.ClientSession, access: KubeAccess, path: str) -> Object | None:
    """The object at `path`, or None when there is none (404); `KubeApiError` for any other
    refusal."""
    async with session.get(
        access.base_url + path,
        headers=access.headers,
        ssl=access.ssl_context,
        timeout=aiohttp.ClientTimeout(total=10),
    ) as response:
        if response.status == 404:
            return None
        if response.status != 200:
            raise KubeApiError.from_body(response.status, await response.text())
        found: Object = await response.json()
        return found


async def apply(
    session: aiohttp.ClientSession,
    access: KubeAccess,
    path: str,
    body: Object,
    field_manager: str,
) -> bool:
    """Server-side apply `body` at `path` as `field_manager`, taking over any field another
    manager held (`force`): False when the API server answers 404 (the object's parent, its
    namespace or its kind is not there); `KubeApiError` for any other refusal."""
    async with session.patch(
        access.base_url + path,
        params={"fieldManager": field_manager, "force": "true"},
        data=json.dumps(body),
        headers={**access.headers, "Content-Type": "application/apply-patch+yaml"},
        ssl=access.ssl_context,
        timeout=aiohttp.ClientTimeout(total=10),
    ) as response:
        if response.status == 404:
            return False
        if response.status >= 400:
            raise KubeApiError.from_body(response.status, await response.text())
        return True


async def delete(
    session: aiohttp.ClientSession, access: KubeAccess, path: str, resource_version: str
) -> bool:
    """Delete the object at `path` only if it is still at `resource_version` (a newer
    write keeps it): False when it is gone or was written since; `KubeApiError` for any
    other refusal."""
    body = {
        "apiVersion": "v1",
        "kind": "DeleteOptions",
        "preconditions": {"resourceVersion": resource_version},
    }
    async with session.delete(
        access.base_url + path,
        data=json.dumps(body),
        headers={**access.headers, "Content-Type": "application/json"},
        ssl=access.ssl_context,
        timeout=aiohttp.ClientTimeout(total=10),
    ) as response:
        if response.status in (404, 409):
            return False
        if response.status >= 400:
            raise KubeApiError.from_body(response.status, await response.text())
        return True
