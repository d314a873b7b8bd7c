"""How much of an upstream's answer rolegate will read (SPEC E8), and the meter that holds
an answer to it as it is read.

An upstream's answer is untrusted input like a caller's request: without a bound, one
answer could hold the event loop or the process's memory for every caller of the pod. An
answer past a bound is that arm's fault (`AnswerOverBound`, which the arm reads as
`Cause.MALFORMED`), rescued like a cut.

- An event: `EventFramer` refuses one past `max_event_bytes` while it grows, so it never
  holds more than that plus one network read (aiohttp hands the body out at most 256 KiB
  at a time, decompressed in steps of that size, so one read is never a bomb's worth).
- An answer (streamed or not): at most `max_answer_bytes`, counted after decompression.
- Decompression: once an answer has passed `RATIO_FLOOR_BYTES`, its decompressed bytes may
  be at most `max_decompression_ratio` times the bytes that came over the wire. Text and
  JSON compress by less than 20 to 1; a ratio of hundreds is a bomb, refused long before
  the absolute bound would stop it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import aiohttp

from ..wire.sse import DEFAULT_MAX_EVENT_BYTES

DEFAULT_MAX_ANSWER_BYTES: Final = 64 * 1024 * 1024
DEFAULT_MAX_DECOMPRESSION_RATIO: Final = 200.0
# Below this many decompressed bytes no ratio is judged: a small body's ratio means
# nothing (a few kilobytes of repeated JSON keys compress by 50 to 1), and costs nothing.
RATIO_FLOOR_BYTES: Final = 1024 * 1024


@dataclass(frozen=True, slots=True)
class AnswerBounds:
    """The bounds every arm's answer is read within (`--max-event-bytes`,
    `--max-answer-bytes`, `--max-decompression-ratio`)."""

    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES
    max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES
    max_decompression_ratio: float = DEFAULT_MAX_DECOMPRESSION_RATIO


class AnswerOverBound(ValueError):
    """An answer past one of its bounds; the message says which, and its flag."""


class AnswerMeter:
    """Counts one answer's bytes as they are read; `count` raises AnswerOverBound at a bound."""

    __slots__ = ("_bounds", "_content", "_judged_below", "_left")

    def __init__(self, content: aiohttp.StreamReader, bounds: AnswerBounds) -> None:
        self._content = content
        self._bounds = bounds
        self._left = bounds.max_answer_bytes
        # The ratio is judged once fewer bytes than this are left (past the floor).
        self._judged_below = bounds.max_answer_bytes - RATIO_FLOOR_BYTES

    def count(self, size: int) -> None:
        """One read of `size` decompressed bytes (once per network read: two compares
        until the answer passes the floor)."""
        left = self._left = self._left - size
        if left >= self._judged_below:
            return
        bounds = self._bounds
        if left < 0:
            raise AnswerOverBound(
                f"answered more than the {bounds.max_answer_bytes:,}-byte bound "
                "(--max-answer-bytes)",
            )
        read = bounds.max_answer_bytes - left
        wire = self._content.total_raw_bytes
        if wire and read > bounds.max_decompression_ratio * wire:
            raise AnswerOverBound(
                f"answered a body that decompresses by more than "
                f"{bounds.max_decompression_ratio:g} to 1 (--max-decompression-ratio)",
            )


async def read_whole(response: aiohttp.ClientResponse, bounds: AnswerBounds) -> bytes:
    """A non-streamed answer's body, read within the bounds: one that says it is longer
    than the bound is refused before any of it is read."""
    length = response.content_length
    if length is not None and length > bounds.max_answer_bytes:
        raise AnswerOverBound(
            f"announced a body of more than the {bounds.max_answer_bytes:,}-byte bound "
            "(--max-answer-bytes)",
        )
    meter = AnswerMeter(response.content, bounds)
    parts: list[bytes] = []
    while data := await response.content.readany():
        meter.count(len(data))
        parts.append(data)
    return b"".join(parts)
