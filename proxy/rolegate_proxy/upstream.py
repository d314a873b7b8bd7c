"""Talking to one upstream provider: the request body we send and the failures we classify."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from rolegate_policy.config import CompiledRole

from .credentials import KeyStore
from .routing import Attempt

# Statuses worth another machine or model: the fault is the upstream's, not the request's.
RETRYABLE_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504, 520, 522, 524, 529})


@dataclass
class UpstreamFailure(Exception):
    """One attempt that produced nothing usable; `detail` names the upstream, never content."""

    attempt: Attempt
    detail: str
    status: int | None = None
    retryable: bool = True
    retry_after: str | None = None
    body: bytes | None = None

    def describe(self) -> str:
        provider = self.attempt.provider
        return f"{provider.name} ({provider.endpoint}) for {self.attempt.model.name}: {self.detail}"


def upstream_body(body: dict[str, Any], attempt: Attempt) -> bytes:
    """The client's body with the role replaced by the concrete model, as UTF-8 JSON."""
    out = dict(body)
    out["model"] = attempt.model.name
    if attempt.provider_routing is not None:
        # Routing across the aggregator's machines is rolegate's decision, not the caller's.
        out["provider"] = attempt.provider_routing
    else:
        out.pop("provider", None)
    # orjson writes non-ASCII as UTF-8, never as \u escapes: the prompt goes out as it came.
    return orjson.dumps(out)


def upstream_headers(attempt: Attempt, keys: KeyStore, stream: bool) -> dict[str, str]:
    headers = {
        "Content-Type": "application/json",
        "Accept": "text/event-stream" if stream else "application/json",
    }
    ref = attempt.provider.api_key_secret_ref
    if ref is not None:
        found = keys.lookup(ref)
        if found.value is None:
            raise UpstreamFailure(
                attempt,
                f"no API key for Secret {ref.name}/{ref.key}: set the {found.searched}",
                retryable=True,
            )
        headers["Authorization"] = f"Bearer {found.value}"
    return headers


def chat_url(attempt: Attempt) -> str:
    return attempt.provider.endpoint.rstrip("/") + "/chat/completions"


def timeouts(attempt: Attempt, role: CompiledRole, stream: bool) -> aiohttp.ClientTimeout:
    settings = attempt.provider.timeouts
    if stream:
        # Silence between two reads longer than this means the stream is stuck (E4).
        idle = min(settings.idle_seconds, role.patience_seconds)
    else:
        # A non-streamed answer is usable only when complete: it may take the whole patience.
        idle = max(settings.idle_seconds, role.patience_seconds)
    return aiohttp.ClientTimeout(
        total=None, connect=None, sock_connect=settings.connect_seconds, sock_read=idle
    )


def describe_client_error(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect ({exc.os_error.strerror or exc.os_error})"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the connection was closed before a complete answer"
    if isinstance(exc, (TimeoutError, aiohttp.ServerTimeoutError)):
        return "timed out waiting for the upstream"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "the answer was cut off mid-body"
    if isinstance(exc, aiohttp.ClientError):
        return f"{type(exc).__name__}: {exc}"
    return type(exc).__name__


def failure_from_status(
    attempt: Attempt, status: int, body: bytes, headers: Any
) -> UpstreamFailure:
    message = _upstream_error_message(body)
    return UpstreamFailure(
        attempt,
        f"HTTP {status}" + (f": {message}" if message else ""),
        status=status,
        retryable=status in RETRYABLE_STATUSES,
        retry_after=headers.get("Retry-After"),
        body=body,
    )


def _upstream_error_message(body: bytes) -> str:
    try:
        payload = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return ""
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            message: str = error["message"]
            return message[:300]
    return ""
