"""Sending a successful completion, streaming or not, with the in-band faults applied.

The faults that decide whether there is a completion at all (rate limits, server errors,
resets, no response, down) are handled in `chat`; this module gets a `Plan` and only
deals with what happens once generation "starts": timing, stalls, cuts, mid-stream errors,
missing `[DONE]`, empty replies.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from rolegate_sim.answer import RichAnswer
from rolegate_sim.pacing import Pacer
from rolegate_sim.scenario import (
    CutFault,
    EmptyFault,
    Fault,
    KeepAliveCommentsFault,
    LingerAfterDoneFault,
    MalformedEventFault,
    MultiLineEventsFault,
    NoDoneFault,
    SplitWritesFault,
    StallFault,
    StreamErrorFault,
)
from rolegate_sim.state import Outcome, RequestRecord
from rolegate_sim.stream import (
    DONE_EVENT,
    MALFORMED_EVENT,
    ChunkEncoder,
    EventWriter,
    await_cancellation,
    close_connection,
    dumps,
    error_body,
    error_event,
    send_body,
)
from rolegate_sim.text import encode_json_string

# Upper bound on events coalesced into one write when a machine produces them instantly.
_MAX_BATCH_BYTES = 32 * 1024


@dataclass(slots=True)
class Plan:
    gen_id: str
    created: int
    model: tuple[str, bytes]  # (name, JSON-encoded name)
    provider: tuple[str, bytes]
    # A plain text answer's tokens, each one piece; empty when the answer is `rich`.
    tokens: Sequence[str]
    # Precomputed JSON strings of `tokens` when the reply is the scenario's unmodified one.
    token_json: Sequence[bytes] | None
    # An answer with reasoning or tool calls, in pieces; None for plain text.
    rich: RichAnswer | None
    finish_reason: str
    prompt_tokens: int
    include_usage: bool
    fault: Fault | None
    split: SplitWritesFault | None
    pacer: Pacer
    content_type: str

    def encoded_tokens(self) -> Sequence[bytes]:
        if self.token_json is None:
            self.token_json = tuple(encode_json_string(t) for t in self.tokens)
        return self.token_json

    def piece_count(self) -> int:
        """How many pieces the answer has: tokens, or reasoning pieces, tokens and tool call
        events. Faults' positions, `max_tokens` and usage all count these."""
        return len(self.tokens) if self.rich is None else len(self.rich.pieces)

    def stop_index(self) -> int:
        """How many pieces are generated before a cut or mid-stream error interrupts."""
        fault = self.fault
        n = self.piece_count()
        if isinstance(fault, CutFault | StreamErrorFault):
            return min(fault.after_tokens, n)
        return n

    def stall_index(self) -> int | None:
        """Before which piece the stall happens; piece_count() means before the finish."""
        fault = self.fault
        if isinstance(fault, StallFault):
            return min(fault.after_tokens, self.piece_count())
        return None

    def malformed_index(self) -> int | None:
        """Before which piece the malformed event goes; piece_count() means before the
        finish."""
        fault = self.fault
        if isinstance(fault, MalformedEventFault):
            return min(fault.at_event - 1, self.piece_count())
        return None

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }


async def send_stream(
    request: web.Request, plan: Plan, record: RequestRecord
) -> web.StreamResponse:
    response = web.StreamResponse(status=200)
    response.headers["Content-Type"] = plan.content_type
    response.headers["Cache-Control"] = "no-cache"
    record.status = 200
    encoder = ChunkEncoder(
        gen_id=plan.gen_id,
        created=plan.created,
        model=plan.model,
        provider=plan.provider,
        multi_line=isinstance(plan.fault, MultiLineEventsFault),
    )
    writer = EventWriter(response, plan.split)
    fault = plan.fault
    pacer = plan.pacer
    loop = asyncio.get_running_loop()
    stop = plan.stop_index()
    stall_at = plan.stall_index()
    malformed_at = plan.malformed_index()
    try:
        await response.prepare(request)
        # Headers and the role chunk go out at once, as OpenRouter does; TTFT is the wait
        # for the first piece's event after them (reasoning, content or a tool call).
        await writer.send(encoder.role())
        piece_json: Sequence[bytes]
        event: Callable[[bytes], bytes]
        if plan.rich is None:
            # Plain text, the benchmarks' path: one concatenation per token.
            piece_json, event = plan.encoded_tokens(), encoder.content
        else:
            piece_json, event = plan.rich.deltas(), encoder.delta
        for i in range(stop):
            if i == stall_at:
                assert isinstance(fault, StallFault)
                pacer.delay(fault.seconds)
            due = pacer.next_due()
            if due > loop.time():
                await writer.flush()
                record.tokens_sent = i
                if i == 0 and isinstance(fault, KeepAliveCommentsFault):
                    await _comment_until(writer, fault, due)
                else:
                    await asyncio.sleep(due - loop.time())
                if i == stall_at and isinstance(fault, StallFault) and fault.then_close:
                    record.finish(Outcome.CUT)
                    close_connection(request)
                    await await_cancellation()
            if i == malformed_at:
                writer.add(MALFORMED_EVENT)
            writer.add(event(piece_json[i]))
            if writer.pending_bytes >= _MAX_BATCH_BYTES:
                await writer.flush()
                record.tokens_sent = i + 1
        await writer.flush()
        record.tokens_sent = stop

        if isinstance(fault, CutFault):
            record.finish(Outcome.CUT)
            close_connection(request)
            await await_cancellation()
        if isinstance(fault, StreamErrorFault):
            code = fault.code if fault.error_code is None else fault.error_code
            writer.add(error_event(fault.message, code, fault.error_type))
            await writer.finish()
            record.finish(Outcome.STREAM_ERROR)
            return response

        if stall_at is not None and stall_at == stop:
            assert isinstance(fault, StallFault)
            await asyncio.sleep(fault.seconds)
            if fault.then_close:
                record.finish(Outcome.CUT)
                close_connection(request)
                await await_cancellation()
        if stop == 0:
            # No piece carried the first content: the finish event is what TTFT delays.
            due = pacer.next_due()
            if isinstance(fault, KeepAliveCommentsFault):
                await _comment_until(writer, fault, due)
            elif due > loop.time():
                await asyncio.sleep(due - loop.time())
        if malformed_at is not None and malformed_at == stop:
            writer.add(MALFORMED_EVENT)
        writer.add(encoder.finish(plan.finish_reason, empty_content=isinstance(fault, EmptyFault)))
        if plan.include_usage:
            writer.add(encoder.usage(plan.usage(record.tokens_sent)))
        if not isinstance(fault, NoDoneFault):
            writer.add(DONE_EVENT)
        if isinstance(fault, LingerAfterDoneFault):
            # The answer is complete on the wire; the body ends only later.
            await writer.flush()
            record.tokens_sent = stop
            await asyncio.sleep(fault.seconds)
        await writer.finish()
    except ConnectionError:
        record.finish(Outcome.CLIENT_DISCONNECTED)
        return response
    record.finish(Outcome.COMPLETED)
    return response


async def _comment_until(writer: EventWriter, fault: KeepAliveCommentsFault, due: float) -> None:
    """SSE comments every `every_seconds` until the loop time `due` (the first piece)."""
    loop = asyncio.get_running_loop()
    comment = b": " + fault.text.encode("utf-8") + b"\n\n"
    while (left := due - loop.time()) > 0:
        writer.add(comment)
        await writer.flush()
        await asyncio.sleep(min(fault.every_seconds, left))


async def send_completion(
    request: web.Request, plan: Plan, record: RequestRecord
) -> web.StreamResponse:
    """Non-streaming: wait as long as generating the pieces would take, then answer at once.

    cut closes the connection with no response; streamError answers with an HTTP error.
    """
    fault = plan.fault
    stall_at = plan.stall_index()
    interrupted = isinstance(fault, CutFault | StreamErrorFault)
    # An empty answer still waits for its TTFT, hence at least one deadline.
    pieces = plan.piece_count()
    generated = plan.stop_index() if interrupted else max(pieces, 1)
    due: float | None = None
    for i in range(generated):
        if i == stall_at:
            assert isinstance(fault, StallFault)
            plan.pacer.delay(fault.seconds)
        due = plan.pacer.next_due()
    if isinstance(fault, StallFault) and stall_at is not None and stall_at >= generated:
        # Stalled after the last piece, before the answer is complete.
        due = (due or 0.0) + fault.seconds
    if due is not None:
        wait = due - asyncio.get_running_loop().time()
        if wait > 0:
            await asyncio.sleep(wait)

    try:
        if isinstance(fault, CutFault) or (isinstance(fault, StallFault) and fault.then_close):
            record.finish(Outcome.CUT)
            close_connection(request)
            await await_cancellation()
        if isinstance(fault, StreamErrorFault):
            status = fault.code if 400 <= fault.code <= 599 else 502
            record.status = status
            body = error_body(
                status,
                fault.message,
                fault.error_type or "server_error",
                provider=plan.provider[0],
                code=fault.error_code,
            )
            response = await send_body(
                request, status=status, body=body, content_type=plan.content_type, split=plan.split
            )
            record.finish(Outcome.STREAM_ERROR)
            return response

        if plan.rich is None:
            message: dict[str, Any] = {"role": "assistant", "content": "".join(plan.tokens)}
        else:
            message = plan.rich.message()
        body = dumps(
            {
                "id": plan.gen_id,
                "object": "chat.completion",
                "created": plan.created,
                "model": plan.model[0],
                "provider": plan.provider[0],
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "finish_reason": plan.finish_reason,
                    }
                ],
                "usage": plan.usage(pieces),
            }
        )
        record.status = 200
        response = await send_body(
            request, status=200, body=body, content_type=plan.content_type, split=plan.split
        )
    except ConnectionError:
        record.finish(Outcome.CLIENT_DISCONNECTED)
        await await_cancellation()
    record.tokens_sent = pieces
    record.finish(Outcome.COMPLETED)
    return response
