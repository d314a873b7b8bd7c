"""Putting a completion on the wire: SSE events, JSON bodies, split writes, and the two
ways of dropping a connection on purpose.

The per-token path is one bytes concatenation: the event's fixed head (`id`, `model`,
`provider`, ...) is encoded once per request, each token's JSON string once per scenario,
and events that are due together leave in a single write.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import struct
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from aiohttp import web

from rolegate_sim.scenario import SplitWritesFault

DONE_EVENT = b"data: [DONE]\n\n"
# The malformedEvent fault's event: a chunk cut short, so its data is not JSON. The spaces
# (the simulator's own JSON has none) make it recognisable in whatever a client received.
MALFORMED_EVENT = b'data: {"choices": [\n\n'
_ROLE_DELTA = b'{"role":"assistant","content":""}'
_EMPTY_CONTENT_DELTA = b'{"content":""}'
_NO_DELTA = b"{}"
_MULTIBYTE_LEAD = re.compile(rb"[\xc0-\xff]")

# After closing or aborting the transport on purpose, aiohttp cancels the handler as soon
# as the loop reports the connection lost (handler_cancellation=True). This bounds the wait
# should that notification never come.
_CONNECTION_LOST_GRACE_SECONDS = 5.0


def dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


class ChunkEncoder:
    """Encodes `chat.completion.chunk` events for one response."""

    __slots__ = ("_break", "_head", "_identity")

    def __init__(
        self,
        *,
        gen_id: str,
        created: int,
        model: tuple[str, bytes],
        provider: tuple[str, bytes],
        multi_line: bool = False,
    ) -> None:
        """`model` and `provider` are each (name, name as a JSON string). `multi_line`
        writes each event's JSON over two `data:` lines (the multiLineEvents fault)."""
        (model_name, model_json), (provider_name, provider_json) = model, provider
        self._identity: dict[str, Any] = {
            "id": gen_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model_name,
            "provider": provider_name,
        }
        # Where a multi-line event breaks its JSON: between two members, where a newline
        # is whitespace to a JSON reader.
        self._break = b",\ndata: " if multi_line else b","
        self._head = b"".join(
            (
                b'data: {"id":"',
                gen_id.encode("ascii"),
                b'","object":"chat.completion.chunk","created":',
                str(created).encode("ascii"),
                b',"model":',
                model_json,
                b',"provider":',
                provider_json,
                self._break,
                b'"choices":[{"index":0,"delta":',
            )
        )

    def role(self) -> bytes:
        return self._head + _ROLE_DELTA + b',"finish_reason":null}]}\n\n'

    def content(self, token_json: bytes) -> bytes:
        return self._head + b'{"content":' + token_json + b'},"finish_reason":null}]}\n\n'

    def delta(self, delta_json: bytes) -> bytes:
        """An event carrying any delta (reasoning, a tool call), given as its JSON object."""
        return self._head + delta_json + b',"finish_reason":null}]}\n\n'

    def finish(self, reason: str, *, empty_content: bool = False) -> bytes:
        delta = _EMPTY_CONTENT_DELTA if empty_content else _NO_DELTA
        return self._head + delta + b',"finish_reason":"' + reason.encode("ascii") + b'"}]}\n\n'

    def usage(self, usage: Mapping[str, int]) -> bytes:
        body = dumps({**self._identity, "choices": [], "usage": dict(usage)})
        head, _, rest = body.partition(b',"choices":')
        return b"data: " + head + self._break + b'"choices":' + rest + b"\n\n"


def error_event(message: str, code: int | str, error_type: str | None = None) -> bytes:
    # OpenRouter's mid-stream error shape: the HTTP status is already 200, so the error
    # travels as a data event and the stream simply ends after it.
    error: dict[str, object] = {"message": message, "code": code}
    if error_type is not None:
        error["type"] = error_type
    return b"data: " + dumps({"error": error}) + b"\n\n"


def error_body(
    status: int,
    message: str,
    error_type: str,
    *,
    provider: str | None,
    code: str | None = None,
) -> bytes:
    """OpenAI's error shape; `code` carries the HTTP status as OpenRouter's does, unless a
    fault names its own (`invalid_api_key`, as OpenAI's does)."""
    error = {
        "message": message,
        "type": error_type,
        "param": None,
        "code": status if code is None else code,
    }
    if provider is None:
        return dumps({"error": error})
    return dumps({"error": error, "provider": provider})


def split_pieces(data: bytes, piece_bytes: int | None) -> list[bytes]:
    if piece_bytes is not None:
        return [data[i : i + piece_bytes] for i in range(0, len(data), piece_bytes)]
    # Cut right after every lead byte of a multi-byte UTF-8 sequence: each non-ASCII
    # character then straddles two writes, and ASCII-only data goes out in one piece.
    pieces: list[bytes] = []
    start = 0
    for match in _MULTIBYTE_LEAD.finditer(data):
        cut = match.end()
        pieces.append(data[start:cut])
        start = cut
    if start < len(data):
        pieces.append(data[start:])
    return pieces


async def write_split(response: web.StreamResponse, data: bytes, split: SplitWritesFault) -> None:
    pieces = split_pieces(data, split.piece_bytes)
    last = len(pieces) - 1
    for i, piece in enumerate(pieces):
        # One write per piece: asyncio sends to the socket at once when nothing is queued,
        # and `write` waits for the buffer to drain under backpressure. The pause keeps
        # the client from receiving consecutive pieces in a single read.
        await response.write(piece)
        if split.pause_seconds and i < last:
            await asyncio.sleep(split.pause_seconds)


class EventWriter:
    """Writes SSE events, in pieces when splitWrites fired.

    Events that are due at the same moment are queued with `add` and leave in one write at
    the next `flush`; the stream flushes before every wait, so no event is ever held back,
    and an instant machine costs one syscall per burst instead of one per token.
    """

    __slots__ = ("_pending", "_pending_bytes", "_response", "_split")

    def __init__(self, response: web.StreamResponse, split: SplitWritesFault | None) -> None:
        self._response = response
        self._split = split
        self._pending: list[bytes] = []
        self._pending_bytes = 0

    def add(self, event: bytes) -> None:
        self._pending.append(event)
        self._pending_bytes += len(event)

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    async def send(self, event: bytes) -> None:
        self.add(event)
        await self.flush()

    async def flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        if self._split is None:
            await self._response.write(b"".join(pending))
            return
        # Split per event, so every event is cut the same way however they were batched.
        for event in pending:
            await write_split(self._response, event, self._split)

    async def finish(self) -> None:
        """Flush and end the body; unsplit, the last events share the final write."""
        if self._split is None and self._pending:
            pending, self._pending, self._pending_bytes = self._pending, [], 0
            await self._response.write_eof(b"".join(pending))
            return
        await self.flush()
        await self._response.write_eof()


async def send_body(
    request: web.Request,
    *,
    status: int,
    body: bytes,
    content_type: str,
    split: SplitWritesFault | None,
    headers: Sequence[tuple[str, str]] = (),
) -> web.StreamResponse:
    """Send a complete (non-streaming) body now, so a failed write surfaces here as a
    ConnectionError rather than after the handler has already recorded success."""
    response: web.StreamResponse
    if split is None:
        response = web.Response(status=status, body=body)
    else:
        response = web.StreamResponse(status=status)
        response.content_length = len(body)
    response.headers["Content-Type"] = content_type
    for name, value in headers:
        response.headers[name] = value
    await response.prepare(request)
    if split is not None:
        await write_split(response, body, split)
    await response.write_eof()
    return response


def reset_connection(request: web.Request) -> None:
    """Abort with SO_LINGER 0 so the kernel sends RST: the client sees a connection reset,
    not a clean close, and not a single HTTP byte."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def close_connection(request: web.Request) -> None:
    """Flush what was written, then FIN: the body simply stops where it was."""
    transport = request.transport
    if transport is not None:
        transport.close()


async def await_cancellation() -> NoReturn:
    """Park the handler after dropping the connection on purpose.

    Returning a response would make aiohttp try to finish it on a closed transport;
    the lost connection cancels this handler instead (handler_cancellation=True).
    """
    await asyncio.sleep(_CONNECTION_LOST_GRACE_SECONDS)
    raise asyncio.CancelledError
