"""Talking to one upstream provider: the request body we send and the failures we classify."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import aiohttp
import orjson

from ..core.breaker import TransportFault
from ..core.exclusions import (
    is_request_fault,
)
from ..core.routing import Attempt
from ..core.verdicts import Verdict
from .credentials import KeyStore


class RequestFault(StrEnum):
    """A 4xx about the request itself: never resent unchanged to the same model (SPEC E4)."""

    # Too long for this model: a later model of the role may have a larger context.
    CONTEXT_LENGTH = "context_length"
    # Refused by a content filter: about the request, goes back to the client as it is.
    CONTENT_FILTER = "content_filter"
    # Anything else the upstream says is wrong with the request.
    INVALID = "invalid"


@dataclass
class UpstreamFailure(Exception):
    """One attempt that produced nothing usable; `detail` names the upstream, never content."""

    attempt: Attempt
    detail: str
    status: int | None = None
    retry_after: str | None = None
    body: bytes | None = None
    # The aggregator's machine the failure came from, when the response named it.
    machine: str | None = None
    transport: TransportFault | None = None
    # A structural verdict that made a 200 answer unusable (empty, mangled).
    verdict: Verdict | None = None
    # The 200 answer could not be parsed (not UTF-8 JSON).
    unparsable: bool = False

    @property
    def request_fault(self) -> RequestFault | None:
        if self.status is None or not is_request_fault(self.status):
            return None
        if self.status == 404 and _says(self.body or b"", _UNROUTABLE_MARKERS):
            # An aggregator with no machine left for this model under the routing it was
            # sent (OpenRouter's "No endpoints found ..."): about the candidate, not the
            # request, so the next model may still answer.
            return None
        return classify_request_fault(self.body or b"")

    def describe(self) -> str:
        provider = self.attempt.provider
        where = f" via {self.machine}" if self.machine else ""
        return (
            f"{provider.name} ({provider.endpoint}) for {self.attempt.model.name}{where}: "
            f"{self.detail}"
        )


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
                transport=TransportFault.CONNECTION_FAILED,
            )
        headers["Authorization"] = f"Bearer {found.value}"
    return headers


def chat_url(attempt: Attempt) -> str:
    return attempt.provider.endpoint.rstrip("/") + "/chat/completions"


def timeouts(attempt: Attempt, *, stream: bool, budget: float) -> aiohttp.ClientTimeout:
    """`budget` is how long this attempt may stay silent (dispatch derives it from the role's
    patience). A stream's silence between two reads is also bounded by the provider's idle
    limit (E4); a non-streamed answer is one silence until it is complete."""
    settings = attempt.provider.timeouts
    idle = min(settings.idle_seconds, budget) if stream else budget
    return aiohttp.ClientTimeout(
        total=None, connect=None, sock_connect=settings.connect_seconds, sock_read=max(idle, 0.05)
    )


def transport_failure(
    attempt: Attempt, exc: BaseException, *, during_stream: bool
) -> UpstreamFailure:
    if isinstance(exc, (TimeoutError, aiohttp.ServerTimeoutError)):
        kind = TransportFault.TIMEOUT
    elif isinstance(exc, aiohttp.ClientConnectorError):
        kind = TransportFault.CONNECTION_FAILED
    else:
        kind = TransportFault.BROKEN_STREAM if during_stream else TransportFault.CONNECTION_FAILED
    return UpstreamFailure(attempt, describe_client_error(exc), transport=kind)


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
    payload = _json_object(body)
    message = _error_message(payload)
    return UpstreamFailure(
        attempt,
        f"HTTP {status}" + (f": {message}" if message else ""),
        status=status,
        retry_after=headers.get("Retry-After"),
        body=body,
        machine=machine_named_in(payload) if attempt.is_aggregator else None,
    )


def machine_named_in(payload: dict[str, Any] | None) -> str | None:
    """The sub-provider an aggregator's response names: `provider` at the top level, or
    OpenRouter's `error.metadata.provider_name`."""
    if payload is None:
        return None
    named = payload.get("provider")
    if isinstance(named, str) and named:
        return named
    error = payload.get("error")
    metadata = error.get("metadata") if isinstance(error, dict) else None
    if isinstance(metadata, dict) and isinstance(metadata.get("provider_name"), str):
        return str(metadata["provider_name"])
    return None


_CONTEXT_MARKERS = ("context_length", "context length", "maximum context", "too many tokens")
_FILTER_MARKERS = ("content_filter", "content filter", "content_policy", "moderation", "flagged")


def classify_request_fault(body: bytes) -> RequestFault:
    payload = _json_object(body)
    error = payload.get("error") if payload else None
    text = ""
    if isinstance(error, dict):
        text = f"{error.get('code') or ''} {error.get('type') or ''} {error.get('message') or ''}"
    text = text.lower()
    if any(marker in text for marker in _CONTEXT_MARKERS):
        return RequestFault.CONTEXT_LENGTH
    if any(marker in text for marker in _FILTER_MARKERS):
        return RequestFault.CONTENT_FILTER
    return RequestFault.INVALID


_UNROUTABLE_MARKERS = ("no endpoints found",)


def _says(body: bytes, markers: tuple[str, ...]) -> bool:
    payload = _json_object(body)
    error = payload.get("error") if payload else None
    message = error.get("message") if isinstance(error, dict) else None
    return isinstance(message, str) and any(m in message.lower() for m in markers)


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        payload = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return payload if isinstance(payload, dict) else None


def _error_message(payload: dict[str, Any] | None) -> str:
    if payload is None:
        return ""
    error = payload.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        message: str = error["message"]
        return message[:300]
    return ""
