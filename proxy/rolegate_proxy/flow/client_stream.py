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

from dataclasses import dataclass, field

from aiohttp import web

from ..wire.answers import Chunk
from ..wire.chat_request import ChatRequest
from ..wire.client import DONE, estimated_usage_event, incomplete_event

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
    """One client's streamed response."""

    def __init__(self, request: web.Request, headers: dict[str, str], chat: ChatRequest) -> None:
        self._request = request
        self._headers = headers
        self._chat = chat
        self.response: web.StreamResponse | None = None
        self.delivered = Delivered()
        # The complete answer, ended by [DONE], has been written.
        self.complete = False

    @property
    def started(self) -> bool:
        return self.response is not None

    async def start(self, served_headers: dict[str, str]) -> None:
        """Commit to the client: the status line and headers go out."""
        response = web.StreamResponse(
            headers={**self._headers, **served_headers, **_STREAM_HEADERS}
        )
        self.response = response
        await self._guarded(response.prepare(self._request))

    async def write(self, data: bytes) -> None:
        assert self.response is not None, "start() commits the stream first"
        if data:
            await self._guarded(self.response.write(data))

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

    async def _guarded(self, write: object) -> None:
        try:
            await write  # type: ignore[misc]
        except (ConnectionError, RuntimeError) as error:
            # aiohttp raises ConnectionResetError (and ClientConnectionResetError, one of
            # its subclasses) writing to a closed connection, RuntimeError on a closing one.
            raise ClientGone(type(error).__name__) from None
