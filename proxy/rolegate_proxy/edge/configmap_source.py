"""Live reload (SPEC D3, D6): the proxy's configuration from a ConfigMap, watched via the API.

A watch, not a mounted volume: a volume-mounted ConfigMap reaches the pod up to a minute
or more later, while a watch sees a change as soon as the API server stores it. Each
payload is validated (schema and content hash) before it replaces the configuration;
a bad payload is counted and logged and the last good configuration stays. While the API
server is unreachable the proxy keeps routing on what it has and reconnects with capped,
jittered backoff; a watch that goes silent is bounded by its own timeouts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from pydantic import ValidationError

from rolegate_policy.config import (
    ProxyConfig,
)

from .kube_api import KubeAccess, KubeApiError, describe_error, load_access

log = logging.getLogger("rolegate.proxy.config")

CONFIG_KEY = "config.json"
# The API server ends a watch after this long; we then resume from the last version.
WATCH_SECONDS = 60
# A watch silent for longer than this (no event, no bookmark) is presumed dead.
SILENCE_SECONDS = WATCH_SECONDS + 15


class ConfigRejected(ValueError):
    """A ConfigMap payload that cannot be served; the last good configuration stays."""


def parse_payload(configmap: dict[str, Any]) -> ProxyConfig:
    data = configmap.get("data") or {}
    text = data.get(CONFIG_KEY)
    if not isinstance(text, str):
        raise ConfigRejected(f"the ConfigMap has no `data.{CONFIG_KEY}` key")
    try:
        return ProxyConfig.from_json(text)
    except ValidationError as error:
        raise ConfigRejected(f"`data.{CONFIG_KEY}` is not a valid configuration: {error}") from None
    except ValueError as error:
        raise ConfigRejected(str(error)) from None


@dataclass
class Backoff:
    first: float = 0.25
    cap: float = 5.0
    current: float = 0.0
    rng: random.Random = field(default_factory=random.Random)

    def next_delay(self) -> float:
        self.current = self.first if self.current == 0 else min(self.cap, self.current * 2)
        return self.current * (0.5 + self.rng.random() / 2)

    def reset(self) -> None:
        self.current = 0.0


@dataclass
class ConfigMapSource:
    namespace: str
    name: str
    kubeconfig: Path | None = None
    # Set by the app: apply a validated configuration (returns True when it changed).
    on_config: Callable[[ProxyConfig], Any] | None = None
    on_api_state: Callable[[bool], None] | None = None
    on_rejected: Callable[[str], None] | None = None
    backoff: Backoff = field(default_factory=Backoff)
    _resource_version: str | None = None

    @property
    def describe(self) -> str:
        return f"configmap {self.namespace}/{self.name}"

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Forever: list, then watch from the listed version; relist when the version is
        too old (410 Gone); back off when the API server is unreachable."""
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
                log.warning(
                    "kubernetes api unavailable source=%s error=%s retry_in=%.2fs",
                    self.describe,
                    describe_error(error),
                    delay,
                )
                await asyncio.sleep(delay)

    def _url(self, access: KubeAccess) -> str:
        return f"{access.base_url}/api/v1/namespaces/{self.namespace}/configmaps"

    async def _list(self, session: aiohttp.ClientSession, access: KubeAccess) -> None:
        async with session.get(
            self._url(access),
            params={"fieldSelector": f"metadata.name={self.name}"},
            headers=access.headers,
            ssl=access.ssl_context,
            timeout=aiohttp.ClientTimeout(total=15),
        ) as response:
            if response.status != 200:
                raise KubeApiError.from_body(response.status, await response.text())
            body = await response.json()
        self._resource_version = body["metadata"]["resourceVersion"]
        for item in body.get("items") or ():
            await self._apply(item)

    async def _watch(self, session: aiohttp.ClientSession, access: KubeAccess) -> None:
        params = {
            "fieldSelector": f"metadata.name={self.name}",
            "watch": "1",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_SECONDS),
        }
        if self._resource_version:
            params["resourceVersion"] = self._resource_version
        async with session.get(
            self._url(access),
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

    async def _event(self, event: dict[str, Any]) -> None:
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
        if kind in ("ADDED", "MODIFIED"):
            await self._apply(obj)
        elif kind == "DELETED":
            log.warning("config source deleted source=%s keeping=last-good", self.describe)

    async def _apply(self, configmap: dict[str, Any]) -> None:
        try:
            config = parse_payload(configmap)
        except ConfigRejected as error:
            log.error("config rejected source=%s reason=%s", self.describe, error)
            if self.on_rejected is not None:
                self.on_rejected(str(error))
            return
        if self.on_config is not None:
            await self.on_config(config)

    def _api_up(self, up: bool) -> None:
        if self.on_api_state is not None:
            self.on_api_state(up)


class _Gone(Exception):
    """The watched resource version is too old: list again."""
