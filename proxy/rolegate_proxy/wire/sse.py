"""Server-sent events framed on bytes, decoded as UTF-8 whatever the Content-Type says.

Why bytes first: providers send `text/event-stream` without a charset, and an HTTP
library's text mode then falls back to latin-1 and double-encodes every non-ASCII
character (SPEC A1, the measured cause of mojibake in the system this replaces). Event
delimiters are ASCII, and no byte of a multi-byte UTF-8 sequence is below 0x80, so
splitting the byte stream at blank lines can never cut a character in half: a character
split across two network reads simply waits in the buffer until its event is complete.
Each complete event is then decoded strictly as UTF-8, and its original bytes are what we
forward, so text round-trips byte-exact.

Framing runs once per token, so an event is not an object: the framer hands out each
complete event as where its bytes lie in the buffer it holds, beside what its `data` reads
as, one event at a time as the consumer asks (a read of a thousand events is never a list
of a thousand of anything). Nearly every provider sends each event as one `data: ` line,
whose data is a slice of the buffer; anything else is parsed line by line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from enum import Enum
from typing import Any, Final, TypeVar

import orjson

DONE = b"[DONE]"
_DATA_LINE = b"data: "
_LF = 0x0A


class Kind(Enum):
    DATA = "data"
    # A comment (a keep-alive): forwarded as it is, nothing in it is read.
    COMMENT = "comment"
    # The `[DONE]` that ends an OpenAI stream.
    DONE = "done"


T = TypeVar("T")
# One complete event: a data event as its data reads (a comment or `[DONE]` as its kind),
# the buffer holding it, and where its bytes (its own lines and the blank line ending it)
# start and end there.
Frame = tuple[T | Kind, bytes, int, int]


class EventTooLarge(ValueError):
    """An event that grew past the framer's bound before it ended: an upstream fault,
    refused before it can hold memory or the loop (SPEC E8)."""

    def __init__(self, bound: int) -> None:
        super().__init__(f"an event grew past the {bound:,}-byte bound before it ended")


# An event bigger than this is refused (`--max-event-bytes`). A provider's events are
# one token's delta, a few hundred bytes; the largest real ones (a whole tool call or a
# non-streamed answer sent as one event) are tens of kilobytes.
DEFAULT_MAX_EVENT_BYTES: Final = 4 * 1024 * 1024


class EventFramer:
    """Incrementally splits an SSE byte stream into complete events.

    Linear in bytes (SPEC E8): each read is searched once for the blank line that ends an
    event, and an event still incomplete is kept as the reads that brought it, joined only
    when it ends. Rescanning the whole buffer on every read made an event's cost grow with
    the square of its size: a 0.2 MB gzip answer held the loop for 47 s."""

    __slots__ = (
        "_buffer",
        "_cr",
        "_last_lf",
        "_max_event",
        "_start",
        "_tail",
        "_tail_size",
        "_waiting",
    )

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self._buffer = b""
        # Where the bytes not yet handed out as events start in `_buffer`.
        self._start = 0
        # The reads since the last one that ended an event (none of them ends one).
        self._tail: list[bytes] = []
        self._tail_size = 0
        # Whether the last byte fed (line endings normalised) is a line feed, so a read
        # that starts with one ends an event.
        self._last_lf = False
        # A CR ended the last read: the first half of a CRLF pair, perhaps.
        self._cr = False
        # `_buffer` may hold complete events not yet handed out.
        self._waiting = False
        self._max_event = max_event_bytes

    def feed(self, chunk: bytes) -> bool:
        """Take in one network read; True when a complete event block is waiting (it may
        turn out to be no event: a block of `id:` or `event:` lines only). Raises
        EventTooLarge when the event being read has passed the bound."""
        if self._cr:
            chunk = b"\r" + chunk
            self._cr = False
        if b"\r" in chunk:
            # CRLF (or lone CR) line endings are legal SSE; a CR at the very end may be
            # the first half of a CRLF pair, so it waits for the next read.
            if chunk.endswith(b"\r"):
                chunk = chunk[:-1]
                self._cr = True
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if not chunk:
            return self._waiting
        ends = self._waiting or b"\n\n" in chunk or (self._last_lf and chunk[0] == _LF)
        self._last_lf = chunk[-1] == _LF
        rest = len(self._buffer) - self._start
        if not ends:
            self._tail_size += len(chunk)
            if rest + self._tail_size > self._max_event:
                raise EventTooLarge(self._max_event)
            self._tail.append(chunk)
            return False
        if self._tail:
            parts, self._tail, self._tail_size = self._tail, [], 0
            buffer = b"".join((self._buffer[self._start :], *parts, chunk))
        elif rest:
            buffer = self._buffer[self._start :] + chunk
        else:
            buffer = chunk
        self._buffer, self._start, self._waiting = buffer, 0, True
        return True

    def events(
        self, read: Callable[[bytes], T], on_malformed: Callable[[], None]
    ) -> Iterator[Frame[T]]:
        """The complete events fed so far and not yet handed out, in order, each data
        event's `data` (lines joined by LF) read by `read`; one it raises MalformedEvent
        for is skipped, and `on_malformed` told. Each is consumed as it is yielded: an
        iteration left unfinished leaves the rest for the next one, and one overtaken by
        `feed` yields nothing more."""
        buffer = self._buffer
        size = len(buffer)
        while self._buffer is buffer:  # (not overtaken by a feed)
            start = self._start
            newline = buffer.find(b"\n", start)
            if newline < 0 or newline + 1 >= size:
                self._waiting = False
                return
            if buffer[newline + 1] == _LF:
                end = newline  # a one-line block: the common case, one search per event
            else:
                end = buffer.find(b"\n\n", newline + 1)
                if end < 0:
                    self._waiting = False
                    return
            self._start = after = end + 2
            if end == newline and buffer.startswith(_DATA_LINE, start):
                data = buffer[start + 6 : end]
                kind = Kind.DONE if data[:1] != b"{" and data.strip() == DONE else Kind.DATA
            else:
                parsed = _parse_block(buffer[start:end])
                if parsed is None:
                    continue
                kind, data = parsed
            if kind is not Kind.DATA:
                yield kind, buffer, start, after
                continue
            try:
                value = read(data)
            except MalformedEvent:
                on_malformed()
                continue
            yield value, buffer, start, after

    @property
    def pending(self) -> bytes:
        """Bytes fed and not yet handed out as events (an incomplete event among them)."""
        return b"".join((self._buffer[self._start :], *self._tail))


def _parse_block(block: bytes) -> tuple[Kind, bytes] | None:
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
        data = b"\n".join(data_lines)
        return (Kind.DONE if data.strip() == DONE else Kind.DATA), data
    if comment:
        return Kind.COMMENT, b""
    return None


def event_data(block: bytes) -> bytes:
    """The data of one complete event block as the framer handed it out (its lines and
    the blank line ending it): its `data:` lines joined by LF."""
    block = block.rstrip(b"\n")
    if block.startswith(_DATA_LINE) and b"\n" not in block:
        return block[6:]
    parsed = _parse_block(block)
    return b"" if parsed is None else parsed[1]


class MalformedEvent(ValueError):
    """An event whose data is not UTF-8 JSON; skipped and counted, never fatal (E4)."""


def decode_event_json(data: bytes) -> dict[str, Any]:
    # orjson parses bytes as strict UTF-8 in one pass, four times faster than
    # decode-then-json.loads; this runs once per token, so it is the hot loop.
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MalformedEvent(f"event data is not UTF-8: {exc.reason}") from None
        raise MalformedEvent("event data is not JSON") from None
    if not isinstance(value, dict):
        raise MalformedEvent("event data is not a JSON object")
    return value


def encode_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"
