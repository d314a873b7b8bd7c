"""Relaying one chat request upstream and the answer back, streaming or not.

Streaming is committed lazily: events are held back until the first one that carries
content (or the end of the stream), so an upstream that fails before producing anything
is replaced by the next attempt and the client never sees it. Once committed, each event's
original bytes are written and flushed as they arrive. A stream that ends without its
terminating `[DONE]`, breaks, or carries an error event is never presented as complete:
the client receives an error event instead (SPEC E4).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from .chat_request import ChatRequest
from .credentials import KeyStore
from .errors import ProxyError
from .metrics import ProxyMetrics
from .routing import Attempt
from .sse import Event, EventFramer, MalformedEvent, decode_event_json, encode_event
from .upstream import (
    UpstreamFailure,
    chat_url,
    describe_client_error,
    failure_from_status,
    timeouts,
    upstream_body,
    upstream_headers,
)

log = logging.getLogger("rolegate.proxy")

DONE_EVENT = b"data: [DONE]\n\n"
TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError)


@dataclass(slots=True)
class Served:
    provider: str
    model: str
    machine: str | None

    def headers(self) -> dict[str, str]:
        headers = {"X-Rolegate-Provider": self.provider, "X-Rolegate-Model": self.model}
        if self.machine:
            headers["X-Rolegate-Machine"] = self.machine
        return headers


@dataclass(frozen=True, slots=True)
class Chunk:
    """A decoded chunk of a streamed answer with the original bytes we forward."""

    payload: dict[str, Any]
    raw: bytes


@dataclass(slots=True)
class RelayContext:
    session: aiohttp.ClientSession
    keys: KeyStore
    metrics: ProxyMetrics
    request_id: str
    base_headers: dict[str, str] = field(default_factory=dict)


async def relay(
    request: web.Request, chat: ChatRequest, attempts: Sequence[Attempt], ctx: RelayContext
) -> web.StreamResponse:
    failures: list[UpstreamFailure] = []
    for attempt in attempts:
        try:
            if chat.stream:
                return await _stream_attempt(request, chat, attempt, ctx)
            return await _complete_attempt(chat, attempt, ctx)
        except UpstreamFailure as failure:
            failures.append(failure)
            ctx.metrics.attempt_failures.labels(attempt.provider.name, _failure_kind(failure)).inc()
            if not failure.retryable:
                break
    raise _exhausted(chat, attempts, failures)


async def _complete_attempt(chat: ChatRequest, attempt: Attempt, ctx: RelayContext) -> web.Response:
    headers = upstream_headers(attempt, ctx.keys, stream=False)
    try:
        async with ctx.session.post(
            chat_url(attempt),
            data=upstream_body(chat.body, attempt),
            headers=headers,
            timeout=timeouts(attempt, chat.role, stream=False),
        ) as upstream:
            raw = await upstream.read()
            if upstream.status != 200:
                raise failure_from_status(attempt, upstream.status, raw, upstream.headers)
    except TRANSPORT_ERRORS as exc:
        raise UpstreamFailure(attempt, describe_client_error(exc)) from None
    try:
        # Decoded as UTF-8 whatever the Content-Type says (SPEC A1); we forward `raw`.
        payload = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UpstreamFailure(attempt, "answered 200 with a body that is not UTF-8 JSON") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("choices"), list):
        detail = "answered 200 without `choices`"
        if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
            detail = "answered 200 with an error object"
        raise UpstreamFailure(attempt, detail)
    served = _served_from(payload, attempt)
    return web.Response(
        body=raw,
        content_type="application/json",
        charset="utf-8",
        headers={**ctx.base_headers, **served.headers()},
    )


async def _stream_attempt(
    request: web.Request, chat: ChatRequest, attempt: Attempt, ctx: RelayContext
) -> web.StreamResponse:
    headers = upstream_headers(attempt, ctx.keys, stream=True)
    try:
        upstream = await ctx.session.post(
            chat_url(attempt),
            data=upstream_body(chat.body, attempt),
            headers=headers,
            timeout=timeouts(attempt, chat.role, stream=True),
        )
    except TRANSPORT_ERRORS as exc:
        raise UpstreamFailure(attempt, describe_client_error(exc)) from None
    try:
        if upstream.status != 200:
            try:
                raw = await upstream.read()
            except TRANSPORT_ERRORS:
                raw = b""
            raise failure_from_status(attempt, upstream.status, raw, upstream.headers)
        if "charset" not in upstream.headers.get("Content-Type", "").lower():
            # Noted, never failed: this header is why latin-1 fallbacks mangle text (A1).
            ctx.metrics.missing_charset.labels(attempt.provider.name).inc()
        reads = _reads(upstream, ctx, attempt)
        held, served = await _hold_until_content(reads, attempt)
        response = web.StreamResponse(
            headers={
                **ctx.base_headers,
                **served.headers(),
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)
        await _forward(response, held, reads)
        return response
    finally:
        # On success the body is fully read and this returns the connection to the pool;
        # on cancellation (the client left) or failure it closes it, so the upstream sees
        # the disconnect and stops generating.
        if not upstream.closed and upstream.content.at_eof():
            upstream.release()
        else:
            upstream.close()


async def _reads(
    upstream: aiohttp.ClientResponse, ctx: RelayContext, attempt: Attempt
) -> AsyncIterator[list[Event | Chunk]]:
    """Per network read, the complete events it finished: comment and [DONE] events as
    they are, data events decoded. Malformed events are skipped and counted (SPEC E4)."""
    framer = EventFramer()
    async for data in upstream.content.iter_any():
        items: list[Event | Chunk] = []
        for event in framer.feed(data):
            if event.is_comment or event.is_done:
                items.append(event)
                continue
            try:
                payload = decode_event_json(event)
            except MalformedEvent:
                ctx.metrics.malformed_events.labels(attempt.provider.name).inc()
                continue
            items.append(Chunk(payload, event.raw))
        if items:
            yield items


def _has_content(payload: dict[str, Any]) -> bool:
    for choice in payload.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if choice.get("finish_reason"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and (
            delta.get("content") or delta.get("tool_calls") or delta.get("reasoning")
        ):
            return True
    return False


async def _hold_until_content(
    reads: AsyncIterator[list[Event | Chunk]], attempt: Attempt
) -> tuple[list[Event | Chunk], Served]:
    """Everything up to and including the first content (or [DONE]), plus whatever else
    arrived in the same read; raises UpstreamFailure if the attempt fails before that."""
    held: list[Event | Chunk] = []
    served: Served | None = None
    try:
        async for items in reads:
            for index, item in enumerate(items):
                if isinstance(item, Event):
                    if item.is_done:
                        held.extend(items[index:])
                        break
                    continue  # keep-alive comments before content mean nothing to a client
                if _is_error(item.payload):
                    raise UpstreamFailure(
                        attempt, f"error event before any content: {_error_text(item.payload)}"
                    )
                if served is None:
                    served = _served_from(item.payload, attempt)
                if _has_content(item.payload):
                    held.extend(items[index:])
                    break
                held.append(item)
            else:
                continue
            break
        else:
            raise UpstreamFailure(attempt, "the stream ended before any content or [DONE]")
    except TRANSPORT_ERRORS as exc:
        raise UpstreamFailure(attempt, describe_client_error(exc)) from None
    if served is None:
        raise UpstreamFailure(attempt, "the stream carried no chunk before [DONE]")
    return held, served


class _Forwarding:
    """What has been relayed so far: whether the answer finished and how it ended."""

    __slots__ = ("done", "finished", "problem")

    def __init__(self) -> None:
        self.done = False
        self.finished = False
        self.problem: str | None = None

    def take(self, items: list[Event | Chunk]) -> bytes:
        """The bytes to send for one read's events: one write per read, not per event,
        so a burst of tokens costs one system call while each still leaves at once."""
        out = bytearray()
        for item in items:
            if isinstance(item, Event):
                out += item.raw
                if item.is_done:
                    self.done = True
                    break
                continue
            if _is_error(item.payload):
                self.problem = (
                    f"the upstream reported an error mid-stream: {_error_text(item.payload)}"
                )
                break
            self.finished = self.finished or _has_finish_reason(item.payload)
            out += item.raw
        return bytes(out)

    @property
    def over(self) -> bool:
        return self.done or self.problem is not None


async def _forward(
    response: web.StreamResponse,
    held: list[Event | Chunk],
    reads: AsyncIterator[list[Event | Chunk]],
) -> None:
    state = _Forwarding()
    await response.write(state.take(held))
    try:
        async for items in reads:
            if state.over:
                break
            data = state.take(items)
            if data:
                await response.write(data)
    except TRANSPORT_ERRORS as exc:
        state.problem = f"the upstream stream broke: {describe_client_error(exc)}"
    if state.done:
        return
    problem = state.problem or (
        "the upstream stream ended without its terminating [DONE] event"
        if state.finished
        else "the upstream stream was cut before the answer finished"
    )
    # Never a truncated answer presented as complete (SPEC E4): end with an error event.
    await response.write(
        encode_event(
            {
                "error": {
                    "message": problem + "; the answer above is incomplete, retry the request",
                    "type": "upstream_error",
                    "code": "stream_incomplete",
                }
            }
        )
    )


def _is_error(payload: dict[str, Any]) -> bool:
    return isinstance(payload.get("error"), (dict, str))


def _has_finish_reason(payload: dict[str, Any]) -> bool:
    return any(
        isinstance(choice, dict) and bool(choice.get("finish_reason"))
        for choice in payload.get("choices") or ()
    )


def _served_from(payload: dict[str, Any], attempt: Attempt) -> Served:
    machine = payload.get("provider")
    model = payload.get("model")
    return Served(
        provider=attempt.provider.name,
        model=model if isinstance(model, str) and model else attempt.model.name,
        machine=machine if isinstance(machine, str) and machine else attempt.single_machine,
    )


def _error_text(payload: dict[str, Any]) -> str:
    error = payload.get("error")
    if isinstance(error, dict):
        return str(error.get("message", "unspecified"))[:300]
    return str(error)[:300]


def _failure_kind(failure: UpstreamFailure) -> str:
    if failure.status is not None:
        return f"http_{failure.status}"
    return "transport"


def _exhausted(
    chat: ChatRequest, attempts: Sequence[Attempt], failures: list[UpstreamFailure]
) -> ProxyError:
    role = chat.role.name
    if not attempts:
        return ProxyError(
            503,
            f"Role {role!r} has no accepted provider serving any of its models "
            f"({', '.join(chat.role.models)}); add or fix a ProviderPolicy that serves one.",
            error_type="service_unavailable",
            code="no_provider",
        )
    last = failures[-1]
    if not last.retryable and last.status is not None:
        # The upstream refused the request itself (e.g. 400): say so, with its words.
        return ProxyError(
            last.status,
            f"Provider {last.attempt.provider.name!r} rejected the request for model "
            f"{last.attempt.model.name!r}: {last.detail}",
            error_type="invalid_request_error" if last.status < 500 else "upstream_error",
            code="upstream_rejected",
        )
    if all(f.status == 429 for f in failures):
        retry_after = [f.retry_after for f in failures if f.retry_after]
        return ProxyError(
            429,
            f"Every upstream for role {role!r} is rate limited: "
            + "; ".join(f.describe() for f in failures)
            + ". Retry after the time in the Retry-After header.",
            error_type="rate_limit_error",
            code="upstream_rate_limited",
            headers={"Retry-After": min(retry_after, key=_seconds)} if retry_after else None,
        )
    return ProxyError(
        502,
        f"No upstream could serve role {role!r}: "
        + "; ".join(f.describe() for f in failures)
        + ". Check that each ProviderPolicy endpoint is reachable and its API key is set.",
        error_type="upstream_error",
        code="upstream_unavailable",
    )


def _seconds(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return float("inf")
