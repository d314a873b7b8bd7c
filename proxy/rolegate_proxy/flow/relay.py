"""Relaying one chat request upstream and the answer back, streaming or not.

Streaming is committed lazily: events are held back until the first one that carries
content (or the end of the stream), so an upstream that fails before producing anything
is replaced by the next attempt and the client never sees it. Once committed, each event's
original bytes are written and flushed as they arrive. A stream that ends without its
terminating `[DONE]`, breaks, or carries an error event is never presented as complete:
the client receives an error event instead (SPEC E4).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from ..core.beliefs import GapStats
from ..core.breaker import TransportFault
from ..core.routing import Attempt
from ..core.verdicts import judge
from ..core.watch import Act, Watch
from ..wire.chat_request import ChatRequest
from ..wire.sse import Event, EventFramer, MalformedEvent, decode_event_json, encode_event
from .credentials import KeyStore
from .metrics import ProxyMetrics
from .upstream import (
    UpstreamFailure,
    chat_url,
    describe_client_error,
    failure_from_status,
    machine_named_in,
    timeouts,
    transport_failure,
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


@dataclass(slots=True)
class Answer:
    """What an attempt produced, for the verdict; the text lives only until it is judged."""

    served: Served
    text: str
    finish_reason: str | None
    has_tool_calls: bool
    # The upstream's `usage`, when it sent one (counts only, for the outcome record).
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # Content deltas relayed: the token estimate when a stream carries no usage.
    content_deltas: int = 0


@dataclass(slots=True)
class Completed:
    response: web.Response
    answer: Answer


async def complete_once(
    chat: ChatRequest, attempt: Attempt, ctx: RelayContext, budget: float
) -> Completed:
    """One non-streamed attempt; raises UpstreamFailure when it produced nothing usable."""
    headers = upstream_headers(attempt, ctx.keys, stream=False)
    try:
        async with ctx.session.post(
            chat_url(attempt),
            data=upstream_body(chat.body, attempt),
            headers=headers,
            timeout=timeouts(attempt, stream=False, budget=budget),
        ) as upstream:
            raw = await upstream.read()
            if upstream.status != 200:
                raise failure_from_status(attempt, upstream.status, raw, upstream.headers)
    except TRANSPORT_ERRORS as exc:
        raise transport_failure(attempt, exc, during_stream=False) from None
    try:
        # Decoded as UTF-8 whatever the Content-Type says (SPEC A1); we forward `raw`.
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise UpstreamFailure(
            attempt,
            "answered 200 with a body that is not UTF-8 JSON",
            transport=TransportFault.BROKEN_STREAM,
            unparsable=True,
        ) from None
    if not isinstance(payload, dict) or not isinstance(payload.get("choices"), list):
        detail = "answered 200 without `choices`"
        if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
            detail = "answered 200 with an error object"
        raise UpstreamFailure(
            attempt,
            detail,
            transport=TransportFault.STREAM_ERROR,
            machine=machine_named_in(payload if isinstance(payload, dict) else None),
        )
    served = _served_from(payload, attempt)
    message = _first_message(payload)
    answer = Answer(
        served=served,
        text=content if isinstance(content := message.get("content"), str) else "",
        finish_reason=_first_finish_reason(payload),
        has_tool_calls=bool(message.get("tool_calls")),
        prompt_tokens=_usage_count(payload, "prompt_tokens"),
        completion_tokens=_usage_count(payload, "completion_tokens"),
    )
    response = web.Response(
        body=raw,
        content_type="application/json",
        charset="utf-8",
        headers={**ctx.base_headers, **served.headers()},
    )
    return Completed(response, answer)


@dataclass(slots=True)
class OpenStream:
    """A stream that has produced its first content, not yet committed to the client."""

    attempt: Attempt
    upstream: aiohttp.ClientResponse
    held: list[Event | Chunk]
    reads: AsyncIterator[list[Event | Chunk]]
    served: Served
    # When the first content arrived (time.monotonic()), for the ledger (SPEC B7).
    first_at: float = 0.0

    def close(self) -> None:
        # Fully read: the connection goes back to the pool. Otherwise (the client left,
        # the stream broke) it is closed, so the upstream sees it and stops generating.
        if not self.upstream.closed and self.upstream.content.at_eof():
            self.upstream.release()
        else:
            self.upstream.close()


async def open_stream(
    chat: ChatRequest,
    attempt: Attempt,
    ctx: RelayContext,
    budget: float,
    on_served: Callable[[Served], None] | None = None,
) -> OpenStream:
    """Send one streamed attempt and wait for its first content (or its end): until then a
    failure is invisible to the client and raises UpstreamFailure."""
    headers = upstream_headers(attempt, ctx.keys, stream=True)
    try:
        upstream = await ctx.session.post(
            chat_url(attempt),
            data=upstream_body(chat.body, attempt),
            headers=headers,
            timeout=timeouts(attempt, stream=True, budget=budget),
        )
    except TRANSPORT_ERRORS as exc:
        raise transport_failure(attempt, exc, during_stream=False) from None
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
        held = await _hold_until_content(reads, attempt, on_served)
        if held.empty:
            verdict = judge(
                "",
                finish_reason=held.finish_reason,
                has_tool_calls=False,
                status=200,
                prompt=chat.prompt,
                client_capped=chat.client_capped(held.finish_reason),
            )
            if verdict.counts(attempt.provider.degraded_output):
                # Empty on 200 before anything reached the client: another machine or
                # model may still answer (SPEC A2, E4).
                raise UpstreamFailure(
                    attempt,
                    "answered 200 with an empty completion",
                    status=200,
                    machine=held.served.machine if attempt.is_aggregator else None,
                    verdict=verdict,
                )
    except BaseException:
        upstream.close()
        raise
    return OpenStream(attempt, upstream, held.items, reads, held.served, time.monotonic())


@dataclass(slots=True)
class StreamEnd:
    response: web.StreamResponse
    answer: Answer
    # Set when the stream did not end with [DONE]: how it failed, for the breaker.
    fault: TransportFault | None = None
    detail: str = ""
    # The per-token gaps after the first content, for the ledger.
    gaps: GapStats = field(default_factory=GapStats)
    # Set when the rate test decided to move the stream (SPEC B5, B6): the client's stream
    # is still open, and the slow upstream too, until the dispatcher continues elsewhere
    # (`continue_stream`) or keeps the slow one (`resume_stream`).
    moved: Act | None = None
    opened: OpenStream | None = None
    state: _Forwarding | None = None
    # The attempt that finished the answer (the continuation's, after a move).
    attempt: Attempt | None = None


async def relay_stream(
    request: web.Request, opened: OpenStream, ctx: RelayContext, watch: Watch | None = None
) -> StreamEnd:
    """Commit to the client and forward the rest; never a truncated answer as complete.
    With a `watch`, a rate act on a movable alternative pauses the relay (`moved`)."""
    response = web.StreamResponse(
        headers={
            **ctx.base_headers,
            **opened.served.headers(),
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )
    state = _Forwarding(opened.first_at, watch)
    try:
        await response.prepare(request)
        await _forward(response, opened.held, opened.reads, state)
    except BaseException:
        opened.close()
        raise
    if state.moved is None:
        opened.close()
    return _end(response, opened, state)


def _end(response: web.StreamResponse, opened: OpenStream, state: _Forwarding) -> StreamEnd:
    answer = Answer(
        served=opened.served,
        text="".join(state.text),
        finish_reason=state.finish_reason,
        has_tool_calls=state.tool_calls,
        prompt_tokens=state.prompt_tokens,
        completion_tokens=state.completion_tokens,
        content_deltas=len(state.text),
    )
    end = StreamEnd(response, answer, state.fault, state.problem or "", state.gaps)
    if state.moved is not None:
        end.moved, end.opened, end.state = state.moved, opened, state
    return end


async def resume_stream(end: StreamEnd) -> StreamEnd:
    """Keep the slow stream after all (nothing could continue it): forward the rest."""
    assert end.opened is not None
    assert end.state is not None
    state = end.state
    state.moved, state.watch = None, None
    try:
        await _forward(end.response, [], end.opened.reads, state)
    finally:
        end.opened.close()
    return _end(end.response, end.opened, state)


async def continue_stream(end: StreamEnd, continuation: OpenStream) -> StreamEnd:
    """Splice a continuation of the delivered text into the same client stream (SPEC B6):
    the slow upstream is closed, the new one's events follow the delivered ones."""
    assert end.opened is not None
    assert end.state is not None
    end.opened.close()
    state = end.state
    state.moved, state.watch = None, None
    state.gaps, state.last_at = GapStats(), continuation.first_at
    try:
        await _forward(end.response, continuation.held, continuation.reads, state, first=True)
    finally:
        continuation.close()
    return _end(end.response, continuation, state)


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


@dataclass(slots=True)
class _Held:
    items: list[Event | Chunk]
    served: Served
    # The stream reached its finish (or [DONE]) without any content or tool call.
    empty: bool
    finish_reason: str | None


async def _hold_until_content(
    reads: AsyncIterator[list[Event | Chunk]],
    attempt: Attempt,
    on_served: Callable[[Served], None] | None = None,
) -> _Held:
    """Everything up to and including the first content (or the finish, or [DONE]), plus
    whatever else arrived in the same read; raises UpstreamFailure if the attempt fails
    before that."""
    held: list[Event | Chunk] = []
    served: Served | None = None
    empty = False
    finish_reason: str | None = None
    try:
        async for items in reads:
            for index, item in enumerate(items):
                if isinstance(item, Event):
                    if item.is_done:
                        held.extend(items[index:])
                        empty = True
                        break
                    continue  # keep-alive comments before content mean nothing to a client
                if _is_error(item.payload):
                    raise UpstreamFailure(
                        attempt,
                        f"error event before any content: {_error_text(item.payload)}",
                        transport=TransportFault.STREAM_ERROR,
                        machine=machine_named_in(item.payload) if attempt.is_aggregator else None,
                    )
                if served is None:
                    served = _served_from(item.payload, attempt)
                    if on_served is not None:
                        # The answer names its machine before its first token: the rate
                        # test can judge the wait against the right belief.
                        on_served(served)
                if _has_content(item.payload):
                    held.extend(items[index:])
                    finish_reason = _first_finish_reason(item.payload)
                    empty = finish_reason is not None and not _has_output(item.payload)
                    break
                held.append(item)
            else:
                continue
            break
        else:
            raise UpstreamFailure(
                attempt,
                "the stream ended before any content or [DONE]",
                transport=TransportFault.BROKEN_STREAM,
                machine=served.machine if served and attempt.is_aggregator else None,
            )
    except TRANSPORT_ERRORS as exc:
        failure = transport_failure(attempt, exc, during_stream=True)
        failure.machine = served.machine if served and attempt.is_aggregator else None
        raise failure from None
    if served is None:
        raise UpstreamFailure(
            attempt,
            "the stream carried no chunk before [DONE]",
            transport=TransportFault.BROKEN_STREAM,
        )
    return _Held(held, served, empty, finish_reason)


def _has_output(payload: dict[str, Any]) -> bool:
    for choice in payload.get("choices") or ():
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls")):
            return True
    return False


class _Forwarding:
    """What has been relayed so far: the answer's text (for its verdict, then dropped),
    whether it finished, and how it ended."""

    __slots__ = (
        "completion_tokens",
        "done",
        "fault",
        "finish_reason",
        "gaps",
        "last_at",
        "moved",
        "problem",
        "prompt_tokens",
        "text",
        "tool_calls",
        "watch",
    )

    def __init__(self, first_at: float, watch: Watch | None = None) -> None:
        self.gaps = GapStats()
        self.last_at = first_at
        self.watch = watch
        self.moved: Act | None = None
        self.done = False
        self.finish_reason: str | None = None
        self.problem: str | None = None
        self.fault: TransportFault | None = None
        self.text: list[str] = []
        self.tool_calls = False
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None

    def take(self, items: list[Event | Chunk]) -> bytes:
        """The bytes to send for one read's events: one write per read, not per event,
        so a burst of tokens costs one system call while each still leaves at once."""
        out = bytearray()
        tokens_before = len(self.text)
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
                self.fault = TransportFault.STREAM_ERROR
                break
            self._note(item.payload)
            out += item.raw
        tokens = len(self.text) - tokens_before
        if tokens:
            # One read's content deltas, arrived this long after the previous content.
            now = time.monotonic()
            self.gaps = self.gaps.add(tokens, now - self.last_at)
            self.last_at = now
            if self.watch is not None and not self.done:
                act = self.watch.observe(now, tokens=tokens)
                if act is not None and act.movable and act.alternative is not None:
                    self.moved = act
        return bytes(out)

    def _note(self, payload: dict[str, Any]) -> None:
        if "usage" in payload:
            self.prompt_tokens = _usage_count(payload, "prompt_tokens")
            self.completion_tokens = _usage_count(payload, "completion_tokens")
        for choice in payload.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
            delta = choice.get("delta")
            if isinstance(delta, dict):
                content = delta.get("content")
                if isinstance(content, str) and content:
                    self.text.append(content)
                if delta.get("tool_calls"):
                    self.tool_calls = True

    @property
    def over(self) -> bool:
        return self.done or self.problem is not None or self.moved is not None


async def _forward(
    response: web.StreamResponse,
    held: list[Event | Chunk],
    reads: AsyncIterator[list[Event | Chunk]],
    state: _Forwarding,
    *,
    first: bool = True,
) -> _Forwarding:
    if held:
        # The held events end with the first content: its gap is the TTFT, not a token gap.
        watch, state.watch = state.watch, None
        await response.write(state.take(held))
        state.watch = watch
        if first:
            state.gaps = GapStats()
    try:
        async for items in reads:
            if state.over:
                break
            data = state.take(items)
            if data:
                await response.write(data)
    except TRANSPORT_ERRORS as exc:
        state.problem = f"the upstream stream broke: {describe_client_error(exc)}"
        state.fault = (
            TransportFault.TIMEOUT
            if isinstance(exc, TimeoutError)
            else TransportFault.BROKEN_STREAM
        )
    if state.done or state.moved is not None:
        return state
    if state.problem is None:
        state.fault = TransportFault.BROKEN_STREAM
        state.problem = (
            "the upstream stream ended without its terminating [DONE] event"
            if state.finish_reason
            else "the upstream stream was cut before the answer finished"
        )
    problem = state.problem
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
    return state


def _is_error(payload: dict[str, Any]) -> bool:
    return isinstance(payload.get("error"), (dict, str))


def _served_from(payload: dict[str, Any], attempt: Attempt) -> Served:
    """Who served: a direct provider's own machine (whatever its answer says), or the
    machine an aggregator's answer names in `provider`."""
    machine = attempt.single_machine
    if machine is None:
        named = payload.get("provider")
        machine = named if isinstance(named, str) and named else None
    model = payload.get("model")
    return Served(
        provider=attempt.provider.name,
        model=model if isinstance(model, str) and model else attempt.model.name,
        machine=machine,
    )


def _error_text(payload: dict[str, Any]) -> str:
    error = payload.get("error")
    if isinstance(error, dict):
        return str(error.get("message", "unspecified"))[:300]
    return str(error)[:300]


def _first_message(payload: dict[str, Any]) -> dict[str, Any]:
    choices = payload.get("choices") or []
    first = choices[0] if choices and isinstance(choices[0], dict) else {}
    message = first.get("message")
    return message if isinstance(message, dict) else {}


def _usage_count(payload: dict[str, Any], name: str) -> int | None:
    usage = payload.get("usage")
    count = usage.get(name) if isinstance(usage, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else None


def _first_finish_reason(payload: dict[str, Any]) -> str | None:
    choices = payload.get("choices") or []
    if choices and isinstance(choices[0], dict) and choices[0].get("finish_reason"):
        return str(choices[0]["finish_reason"])
    return None
