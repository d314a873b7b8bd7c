"""Reaching the Kubernetes API from the proxy: credentials from a kubeconfig or the pod.

The proxy talks to the API server with its own aiohttp session (it needs one watch, not a
client library's thread pool). Credentials are loaded by the official `kubernetes`
package's loaders, re-read on every (re)connect so rotated service-account tokens and
refreshed kubeconfig credentials are picked up. Loading reads files, so callers run it
in a worker thread, never on the request path.

What goes wrong on the way is logged through `describe_error`, one place for every log
line about the API server: the error's type, the host and port, the OS's reason. Never
an object's repr (aiohttp's connection errors print their SSL context as
`<ssl.SSLContext object at 0x…>`), never a raw response body.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp


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
