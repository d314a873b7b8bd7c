"""The response to the client: started once, fed by whichever upstream arm is serving,
ended once (SPEC E4, B6, E7).

It owns what the client has been sent and what is held back from it. The first bytes
that go out commit the stream (its headers name the machine serving then); content from a
later arm is spliced after what was delivered; and it remembers the answer so far (the
text, which a continuation goes on from and the verdict judges, both dropped after the
request; the tool calls; the finish; the usage). What is held is either the whole answer
(a buffered role's, released once complete and judged) or, in a live answer, everything
from its first tool call on: a tool call reaches the client only whole, judged, and from
one machine. A write that fails is the client leaving (`ClientGone`), never an upstream's
fault. The request is answered the moment the client has the complete answer
(`complete`), whatever an upstream does afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Final

from aiohttp import web

from ..core.tokens import wide_bytes
from ..core.tool_calls import ToolCalls
from ..wire.answers import Chunk
from ..wire.chat_request import ChatRequest
from ..wire.chat_writer import DONE, KEEPALIVE, ChatWriter, incomplete_event
from ..wire.errors import ProxyError
from ..wire.sse import encode_event

# How often a held answer tells its caller it is still being worked on.
KEEPALIVE_SECONDS: Final = 5.0
# A write that took longer than this waited for the client to read (a write that does not
# wait takes microseconds).
WRITE_WAIT_FLOOR_SECONDS: Final = 0.002

_STREAM_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


class ClientGone(Exception):
    """The client's connection is gone: a write to it failed."""


@dataclass(slots=True)
class Delivered:
    """The answer so far, as the client has it or will have it once released (no text
    kept beyond the request)."""

    # Its text, one entry a content piece (the relay appends text alone here directly).
    texts: list[str] = field(default_factory=list)
    # Its pieces of output other than text (reasoning, refusal, tool-call pieces), and
    # their wide bytes (`core.tokens`).
    others: int = 0
    others_wide: int = 0
    # The pieces of the legs before the one serving (a spliced answer).
    spent: int = 0
    # The serving leg's own completion tokens, when it reported them.
    leg_tokens: int | None = None
    tools: ToolCalls | None = None
    refused: bool = False
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # The model the chunks named.
    model: str | None = None
    # Arms whose content reached the client: more than one once a continuation spliced in.
    legs: int = 1
    # A usage chunk went to the client (the upstream's own, or rolegate's estimate).
    usage_sent: bool = False

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def pieces(self) -> int:
        """Its pieces of output of every kind: the likely token count when no upstream
        reports one (`core.tokens`)."""
        return len(self.texts) + self.others

    @property
    def most_tokens(self) -> int:
        """The most tokens its output can have been (`core.tokens`): what a handover takes
        off the caller's limit, so that the answer never goes past it."""
        return self.pieces + wide_bytes(self.text) + self.others_wide

    @property
    def spliced(self) -> bool:
        return self.legs > 1

    def note(self, chunk: Chunk) -> bool:
        """Take in a chunk about to be forwarded; False when it must not be (the usage of
        one leg of a spliced answer, which counts only that leg: rolegate sends its own)."""
        if chunk.content:
            self.texts.append(chunk.content)
        if chunk.outputs > bool(chunk.content):
            self.others += chunk.outputs - bool(chunk.content)
            self.others_wide += _other_wide_bytes(chunk)
        if chunk.tool_calls:
            tools = self.tools
            if tools is None:
                tools = self.tools = ToolCalls()
            for piece in chunk.tool_calls:
                tools.add(piece)
        if chunk.refusal:
            self.refused = True
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.model = self.model or chunk.model
        if chunk.has_usage:
            if self.spliced:
                self.leg_tokens = chunk.completion_tokens
                return chunk.has_content  # a usage-only chunk of one leg is dropped
            self.prompt_tokens = chunk.prompt_tokens
            self.completion_tokens = chunk.completion_tokens
            self.usage_sent = True
        return True

    def usage(self, prompt_estimate: int) -> tuple[int, int]:
        """The prompt and completion tokens rolegate reports when no upstream's usage can
        be forwarded: the upstream's prompt count or the estimate, and the legs' tokens
        summed (the serving leg's own count when it gave one)."""
        leg = self.pieces - self.spent if self.leg_tokens is None else self.leg_tokens
        return self.prompt_tokens or prompt_estimate, self.spent + leg

    def snapshot(self) -> Delivered:
        """A copy to go back to (the lists copied where they grow)."""
        return replace(self, texts=list(self.texts), tools=None)


def _other_wide_bytes(chunk: Chunk) -> int:
    """The wide bytes of a chunk's output other than its text."""
    arguments = "".join(piece.arguments for piece in chunk.tool_calls)
    return wide_bytes(chunk.reasoning + chunk.refusal + arguments)


@dataclass(slots=True)
class _Mark:
    """Where the answer stood at its first tool call: what was held then, and the answer."""

    held: int
    delivered: Delivered


class ClientStream:
    """One client's streamed response (SPEC E5, E7).

    `start` names who serves; the stream is committed (status line and headers) by the
    first bytes that reach the client. What is held is written to a buffer instead: a
    buffered role's whole answer (released once complete and judged, or discarded unseen),
    and a live answer's part from its first tool call (`hold_tools`; released with the
    answer, or dropped back to the mark when it broke or moved). While something is held,
    or once a keep-alive committed the stream and nothing was shown, an SSE comment goes
    out every `keepalive_seconds` without another write, so the caller's idle timers
    never fire."""

    def __init__(
        self,
        request: web.Request,
        headers: dict[str, str],
        chat: ChatRequest,
        clock: Callable[[], float],
        *,
        buffered: bool = False,
        keepalive_seconds: float = KEEPALIVE_SECONDS,
    ) -> None:
        self._request = request
        self._headers = headers
        self._chat = chat
        self._clock = clock
        self.writer = ChatWriter(headers.get("X-Request-Id", ""))
        self.buffered = buffered
        self._keepalive = keepalive_seconds
        self.response: web.StreamResponse | None = None
        self.delivered = Delivered()
        # The complete answer, ended by [DONE], has been written.
        self.complete = False
        # When answer bytes first reached the client (None: not yet).
        self.shown_at: float | None = None
        # What is held back, and from where the tool calls are.
        self._held = bytearray()
        self.holding = buffered
        self._mark: _Mark | None = None
        self._served: dict[str, str] = {}
        # Bytes went to the client since the keep-alive last looked (it looks only while
        # something is held, or nothing was shown yet).
        self._wrote = False
        # The response writes go straight to while the answer flows (shown, nothing held).
        self._live: web.StreamResponse | None = None
        self._keepalive_task: asyncio.Task[None] | None = None
        # Seconds the answer's writes waited for the client to read (each wait past
        # WRITE_WAIT_FLOOR_SECONDS): time a slow reader held the stream, which is not the
        # serving machine's (SPEC E8).
        self.client_held = 0.0

    @property
    def started(self) -> bool:
        return self.response is not None

    @property
    def shown(self) -> bool:
        """Some of the answer reached the client: what follows must continue it."""
        return self.shown_at is not None

    @property
    def holds_tools(self) -> bool:
        return self._mark is not None

    @property
    def continuable(self) -> Delivered:
        """The answer as another machine may go on from it: without the tool calls held
        (those are replaced, never continued)."""
        return self.delivered if self._mark is None else self._mark.delivered

    async def start(self, served_headers: dict[str, str]) -> None:
        """Name who serves: the headers the stream is committed with when its first bytes
        go out (a keep-alive that committed it earlier could not name anyone)."""
        self._served = served_headers

    async def write(self, data: bytes) -> None:
        live = self._live
        if live is not None:
            # As `_guarded` does, inline: this runs once per network read of a stream.
            if data:
                before = self._clock()
                try:
                    await live.write(data)
                except (ConnectionError, RuntimeError) as error:
                    raise ClientGone(type(error).__name__) from None
                waited = self._clock() - before
                if waited > WRITE_WAIT_FLOOR_SECONDS:
                    self.client_held += waited
            return
        if self.holding:
            self._held += data
        elif data:
            await self._first(data)

    def _flow(self) -> None:
        """Writes go straight out from now on when the answer is shown and nothing held."""
        self._live = self.response if self.shown_at is not None and not self.holding else None

    async def _first(self, data: bytes) -> None:
        """The answer's first bytes to reach the client (the stream is committed first, if
        no keep-alive did)."""
        if self.response is None:
            await self._commit(self._served)
        assert self.response is not None
        before = self.shown_at = self._clock()
        self._wrote = True
        self._flow()
        await self._guarded(self.response.write(data))
        waited = self._clock() - before
        if waited > WRITE_WAIT_FLOOR_SECONDS:
            self.client_held += waited

    async def _commit(self, served_headers: dict[str, str]) -> None:
        response = web.StreamResponse(
            headers={**self._headers, **served_headers, **_STREAM_HEADERS}
        )
        self.response = response
        await self._guarded(response.prepare(self._request))

    # -- holding --------------------------------------------------------------------------

    def hold_tools(self) -> None:
        """The answer's first tool call is about to be written: from here on the answer
        is held until it is complete and judged (a live answer's keep-alives start)."""
        if self._mark is not None:
            return
        self._mark = _Mark(len(self._held), self.delivered.snapshot())
        self.holding = True
        self._flow()
        self.keep_alive()

    def back_to_mark(self) -> None:
        """The held tool calls are dropped (their arm broke or moved): the answer is what
        it was before them, and a live one streams again."""
        mark = self._mark
        if mark is None:
            return
        del self._held[mark.held :]
        self.delivered = mark.delivered
        self._mark = None
        self.complete = False
        self.holding = self.buffered
        self._flow()

    async def release(self) -> None:
        """The complete, judged answer: what was held goes out."""
        self.holding = False
        self._mark = None
        self._flow()
        held, self._held = bytes(self._held), bytearray()
        await self.write(held)
        if self.response is None:
            # A complete answer of no bytes at all was nothing to show: commit it anyway.
            await self._commit(self._served)

    def discard(self) -> None:
        """A failed attempt that showed the client nothing is dropped unseen; the next
        starts afresh."""
        self._held = bytearray()
        self._mark = None
        self.delivered = Delivered()
        self.complete = False
        self.holding = self.buffered
        self._flow()

    def splice(self) -> None:
        """A continuation takes over from what was delivered (SPEC B6, E5)."""
        delivered = self.delivered
        delivered.legs += 1
        delivered.spent = delivered.pieces
        delivered.leg_tokens = None

    # -- keep-alives ----------------------------------------------------------------------

    def keep_alive(self) -> None:
        """Keep the caller's idle timers from firing while its answer is held (from now
        until the request ends)."""
        if self._keepalive_task is None:
            self._keepalive_task = asyncio.create_task(self._keep_alive())

    async def _keep_alive(self) -> None:
        try:
            while True:  # until `close`: an answer judged complete may yet be replaced
                self._wrote = False
                await asyncio.sleep(self._keepalive)
                waiting = self.holding or (self.response is not None and not self.shown)
                if self._wrote or self.complete or not waiting:
                    continue
                if self.response is None:
                    await self._commit({})
                assert self.response is not None
                await self._guarded(self.response.write(KEEPALIVE))
        except ClientGone:
            return  # the request's own writes say so

    def close(self) -> None:
        """The request is over: no more keep-alives."""
        if self._keepalive_task is not None:
            self._keepalive_task.cancel()
            self._keepalive_task = None

    # -- the end --------------------------------------------------------------------------

    async def finish(self, data: bytes, reason: str | None = None) -> bool:
        """The last bytes of the complete answer (`reason`: a final chunk rolegate writes
        itself, the answer ending at a seam), then the usage chunk the caller asked for if
        no upstream sent it (or the answer was spliced), then `[DONE]`, which rolegate
        writes whether or not the upstream sent one. True when the usage was estimated."""
        delivered = self.delivered
        if reason is not None:
            delivered.finish_reason = reason
            data += self.writer.finish(delivered.model, reason)
        estimate = self._chat.wants_usage and not delivered.usage_sent
        if estimate:
            prompt, completion = delivered.usage(self._chat.prompt_tokens)
            data += self.writer.usage(delivered.model, prompt, completion)
            delivered.usage_sent = True
        await self.write(data + DONE)
        self.complete = True
        return estimate

    async def fail(self, message: str) -> None:
        """End a stream that broke after content reached the client: never a truncated answer
        presented as complete, an error event instead (SPEC E4)."""
        self.holding = False
        self._flow()
        self._held = bytearray()
        await self.write(incomplete_event(message))

    async def refuse(self, error: ProxyError) -> None:
        """End a stream committed by keep-alives with rolegate's error, as an event (its
        status line, 200, is long gone)."""
        self.holding = False
        self._flow()
        self._held = bytearray()
        assert self.response is not None
        await self.write(encode_event(error.payload()))

    async def _guarded(self, write: object) -> None:
        try:
            await write  # type: ignore[misc]
        except (ConnectionError, RuntimeError) as error:
            # aiohttp raises ConnectionResetError (and ClientConnectionResetError, one of
            # its subclasses) writing to a closed connection, RuntimeError on a closing one.
            raise ClientGone(type(error).__name__) from None
