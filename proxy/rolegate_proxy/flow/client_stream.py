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
from ..wire.sse import encode_event

DONE = b"data: [DONE]\n\n"
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

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def content_deltas(self) -> int:
        return len(self.texts)

    def note(self, chunk: Chunk) -> None:
        if chunk.content:
            self.texts.append(chunk.content)
        self.has_tool_calls = self.has_tool_calls or chunk.has_tool_calls
        self.finish_reason = chunk.finish_reason or self.finish_reason
        if chunk.has_usage:
            self.prompt_tokens = chunk.prompt_tokens
            self.completion_tokens = chunk.completion_tokens


class ClientStream:
    """One client's streamed response."""

    def __init__(self, request: web.Request, headers: dict[str, str]) -> None:
        self._request = request
        self._headers = headers
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

    async def finish(self, data: bytes) -> None:
        """The last bytes of the complete answer (its [DONE] among them)."""
        await self.write(data)
        self.complete = True

    async def fail(self, message: str) -> None:
        """End a stream that broke after content reached the client: never a truncated answer
        presented as complete, an error event instead (SPEC E4)."""
        event = {
            "error": {
                "message": message + "; the answer above is incomplete, retry the request",
                "type": "upstream_error",
                "code": "stream_incomplete",
            }
        }
        await self.write(encode_event(event))

    async def _guarded(self, write: object) -> None:
        try:
            await write  # type: ignore[misc]
        except (ConnectionError, RuntimeError) as error:
            # aiohttp raises ConnectionResetError (and ClientConnectionResetError, one of
            # its subclasses) writing to a closed connection, RuntimeError on a closing one.
            raise ClientGone(type(error).__name__) from None
