"""Server-sent events framed on bytes, decoded as UTF-8 whatever the Content-Type says.

Why bytes first: providers send `text/event-stream` without a charset, and an HTTP
library's text mode then falls back to latin-1 and double-encodes every non-ASCII
character (SPEC A1, the measured cause of mojibake in the system this replaces). Event
delimiters are ASCII, and no byte of a multi-byte UTF-8 sequence is below 0x80, so
splitting the byte stream at blank lines can never cut a character in half: a character
split across two network reads simply waits in the buffer until its event is complete.
Each complete event is then decoded strictly as UTF-8, and its original bytes are what we
forward, so text round-trips byte-exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

DONE = b"[DONE]"


@dataclass(frozen=True, slots=True)
class Event:
    """One complete event: its `data` payload (lines joined by LF) and the bytes that are
    forwarded for it (the event's own lines)."""

    data: bytes
    raw: bytes
    is_comment: bool = False

    @property
    def is_done(self) -> bool:
        return self.data.strip() == DONE


class EventFramer:
    """Incrementally splits an SSE byte stream into complete events."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[Event]:
        buffer = self._buffer + chunk
        if b"\r" in buffer:
            # CRLF (or lone CR) line endings are legal SSE; a CR at the very end may be
            # the first half of a CRLF pair, so it waits for the next read.
            keep_cr = buffer.endswith(b"\r")
            if keep_cr:
                buffer = buffer[:-1]
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            if keep_cr:
                buffer += b"\r"
        events: list[Event] = []
        start = 0
        while True:
            end = buffer.find(b"\n\n", start)
            if end < 0:
                break
            block = buffer[start:end]
            start = end + 2
            event = _parse_block(block)
            if event is not None:
                events.append(event)
        self._buffer = buffer[start:]
        return events

    @property
    def pending(self) -> bytes:
        """Bytes of an incomplete event still waiting for its end."""
        return self._buffer


def _parse_block(block: bytes) -> Event | None:
    data_lines: list[bytes] = []
    comment = False
    for line in block.split(b"\n"):
        if not line:
            continue
        if line.startswith(b":"):
            comment = True
            continue
        field, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if field == b"data":
            data_lines.append(value)
        # `event:`, `id:` and `retry:` carry nothing the chat-completions protocol uses.
    if data_lines:
        # Forwarded as it came (line endings normalised): an event whose data spans several
        # `data:` lines keeps each line's field name, which re-framing it would lose.
        return Event(data=b"\n".join(data_lines), raw=block + b"\n\n")
    if comment:
        return Event(data=b"", raw=block + b"\n\n", is_comment=True)
    return None


class MalformedEvent(ValueError):
    """An event whose data is not UTF-8 JSON; skipped and counted, never fatal (E4)."""


def decode_event_json(event: Event) -> dict[str, Any]:
    # orjson parses bytes as strict UTF-8 in one pass, four times faster than
    # decode-then-json.loads; this runs once per token, so it is the hot loop.
    try:
        value = orjson.loads(event.data)
    except orjson.JSONDecodeError:
        try:
            event.data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MalformedEvent(f"event data is not UTF-8: {exc.reason}") from None
        raise MalformedEvent("event data is not JSON") from None
    if not isinstance(value, dict):
        raise MalformedEvent("event data is not a JSON object")
    return value


def encode_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"
