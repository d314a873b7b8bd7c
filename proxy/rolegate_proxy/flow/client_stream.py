"""The response to the client: started once, fed by whichever upstream arm is serving,
ended once (SPEC E4, B6).

It owns what the client has been sent: the first bytes commit the stream (its headers name
the machine serving then), content from a later arm is spliced after what was delivered,
and it remembers the text delivered so far (a continuation is asked to go on from it; the
verdict judges it; both drop it after the request), the finish reason and the usage. A
write that fails is the client leaving (`ClientGone`), never an upstream's fault. The
request is answered the moment the client has the complete answer (`complete`), whatever
an upstream does afterwards.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Final

from aiohttp import web

from ..wire.answers import Chunk
from ..wire.chat_request import ChatRequest
from ..wire.client import DONE, KEEPALIVE, estimated_usage_event, incomplete_event
from ..wire.errors import ProxyError
from ..wire.sse import encode_event

# How often a buffered stream tells its caller it is still being worked on.
KEEPALIVE_SECONDS: Final = 5.0

_STREAM_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


class ClientGone(Exception):
    """The client's connection is gone: a write to it failed."""


@dataclass(slots=True)
class Delivered:
    """What the client has received of the answer (no text kept beyond the request)."""

    texts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    has_tool_calls: bool = False
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
    def content_deltas(self) -> int:
        return len(self.texts)

    @property
    def spliced(self) -> bool:
        return self.legs > 1

    def note(self, chunk: Chunk) -> bool:
        """Take in a chunk about to be forwarded; False when it must not be (the usage of
        one leg of a spliced answer, which counts only that leg: rolegate sends its own)."""
        if chunk.content:
            self.texts.append(chunk.content)
        self.has_tool_calls = self.has_tool_calls or chunk.has_tool_calls
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.model = self.model or chunk.model
        if chunk.has_usage:
            if self.spliced:
                return chunk.has_content  # a usage-only chunk of one leg is dropped
            self.prompt_tokens = chunk.prompt_tokens
            self.completion_tokens = chunk.completion_tokens
            self.usage_sent = True
        return True


class ClientStream:
    """One client's streamed response, live or buffered (SPEC E5).

    Live: `start` commits the stream and every write goes out. Buffered (a role nobody
    watches): writes are held until the answer is complete and judged, then `release`d
    whole; a failed attempt's are `discard`ed unseen. Meanwhile `keep_alive` sends SSE
    comments (every KEEPALIVE_SECONDS by default), committing the stream (without the
    served headers, not yet known) the first time, so the caller's idle timers never
    fire."""

    def __init__(
        self,
        request: web.Request,
        headers: dict[str, str],
        chat: ChatRequest,
        *,
        keepalive_seconds: float | None = None,
    ) -> None:
        """`keepalive_seconds`: buffered, with a comment this often; None: live."""
        self._request = request
        self._headers = headers
        self._chat = chat
        self.buffered = keepalive_seconds is not None
        self._keepalive = KEEPALIVE_SECONDS if keepalive_seconds is None else keepalive_seconds
        self.response: web.StreamResponse | None = None
        self.delivered = Delivered()
        # The complete answer, ended by [DONE], has been written.
        self.complete = False
        # Buffered: the attempt's bytes so far, and the headers naming who served it.
        self._held = bytearray()
        self._served: dict[str, str] = {}
        self._released = False

    @property
    def started(self) -> bool:
        return self.response is not None

    async def start(self, served_headers: dict[str, str]) -> None:
        """Commit to the client: the status line and headers go out (buffered: when the
        answer is released, unless keep-alives committed the stream before)."""
        if self.buffered:
            self._served = served_headers
            return
        await self._commit(served_headers)

    async def _commit(self, served_headers: dict[str, str]) -> None:
        response = web.StreamResponse(
            headers={**self._headers, **served_headers, **_STREAM_HEADERS}
        )
        self.response = response
        await self._guarded(response.prepare(self._request))

    async def write(self, data: bytes) -> None:
        if self.buffered and not self._released:
            self._held += data
            return
        assert self.response is not None, "start() commits the stream first"
        if data:
            # As `_guarded` does, inline: this runs once per network read of a stream.
            try:
                await self.response.write(data)
            except (ConnectionError, RuntimeError) as error:
                raise ClientGone(type(error).__name__) from None

    async def keep_alive(self) -> None:
        """Buffered: an SSE comment every so often until the answer is released."""
        while not self._released:
            await asyncio.sleep(self._keepalive)
            if self._released:
                return
            if self.response is None:
                await self._commit({})
            assert self.response is not None
            await self._guarded(self.response.write(KEEPALIVE))

    async def release(self) -> None:
        """Buffered: the complete, judged answer goes out whole."""
        self._released = True
        if self.response is None:
            await self._commit(self._served)
        held, self._held = bytes(self._held), bytearray()
        await self.write(held)

    def discard(self) -> None:
        """Buffered: a failed attempt's answer is dropped unseen; the next starts afresh."""
        self._held = bytearray()
        self.delivered = Delivered()
        self.complete = False

    @property
    def holding(self) -> bool:
        """An attempt's answer is being held (buffered, not yet released)."""
        return self.buffered and not self._released

    def splice(self) -> None:
        """A continuation takes over from what was delivered (SPEC B6, E5)."""
        self.delivered.legs += 1

    async def finish(self, data: bytes) -> bool:
        """The last bytes of the complete answer, then the usage chunk the caller asked for
        if no upstream sent it (or the answer was spliced), then `[DONE]`, which rolegate
        writes whether or not the upstream sent one. True when the usage was estimated."""
        delivered = self.delivered
        estimate = self._chat.wants_usage and not delivered.usage_sent
        if estimate:
            data += estimated_usage_event(
                self._headers.get("X-Request-Id", ""),
                delivered.model,
                delivered.prompt_tokens or self._chat.prompt_tokens,
                delivered.content_deltas,
            )
            delivered.usage_sent = True
        await self.write(data + DONE)
        self.complete = True
        return estimate

    async def fail(self, message: str) -> None:
        """End a stream that broke after content reached the client: never a truncated answer
        presented as complete, an error event instead (SPEC E4)."""
        await self.write(incomplete_event(message))

    async def refuse(self, error: ProxyError) -> None:
        """End a stream committed by keep-alives with rolegate's error, as an event (its
        status line, 200, is long gone)."""
        self._released = True
        assert self.response is not None
        await self.write(encode_event(error.payload()))

    async def _guarded(self, write: object) -> None:
        try:
            await write  # type: ignore[misc]
        except (ConnectionError, RuntimeError) as error:
            # aiohttp raises ConnectionResetError (and ClientConnectionResetError, one of
            # its subclasses) writing to a closed connection, RuntimeError on a closing one.
            raise ClientGone(type(error).__name__) from None
