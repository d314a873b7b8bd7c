"""The small bounded windows the breaker keeps per key: pure, O(1) or O(bounded) per call.

`RateWindow` is the rate arm's last N outcomes, `CallBuckets` the count arms' calls within
the burst window, `SignatureHistory` when one fault signature was seen (the novelty
baseline). None of them holds anything but bits, counts and times.
"""

from __future__ import annotations

from collections import deque
from typing import Final

# Resolution of the count arms' call counter: the burst window in this many buckets.
BUCKETS: Final = 60
# Novelty marks kept per signature over the novelty window, at most.
MARKS: Final = 256


class RateWindow:
    """The last `size` eligible outcomes as a ring of bits, with a running fault count."""

    __slots__ = ("_count", "_faults", "_next", "_ring")

    def __init__(self, size: int) -> None:
        self._ring = bytearray(max(1, size))
        self._next = 0
        self._count = 0
        self._faults = 0

    @property
    def size(self) -> int:
        return len(self._ring)

    @property
    def count(self) -> int:
        return self._count

    @property
    def faults(self) -> int:
        return self._faults

    def add(self, fault: bool) -> None:
        if self._count == len(self._ring):
            self._faults -= self._ring[self._next]
        else:
            self._count += 1
        bit = 1 if fault else 0
        self._ring[self._next] = bit
        self._faults += bit
        self._next = (self._next + 1) % len(self._ring)

    def resized(self, size: int) -> RateWindow:
        """A window of another size holding the most recent outcomes of this one."""
        ring = RateWindow(size)
        start = (self._next - self._count) % len(self._ring)
        kept = min(self._count, ring.size)
        for offset in range(self._count - kept, self._count):
            ring.add(bool(self._ring[(start + offset) % len(self._ring)]))
        return ring


class CallBuckets:
    """Eligible outcomes per time bucket over the burst window (bounded, approximate at the
    window's oldest edge, where it over-counts: the dilution guard errs towards not tripping)."""

    __slots__ = ("_buckets", "_span", "_width")

    def __init__(self, span: float) -> None:
        self._span = span
        self._width = span / BUCKETS
        self._buckets: deque[list[int]] = deque()

    def add(self, now: float) -> None:
        index = int(now // self._width)
        if self._buckets and self._buckets[-1][0] == index:
            self._buckets[-1][1] += 1
        else:
            self._buckets.append([index, 1])
        oldest = int((now - self._span) // self._width)
        while self._buckets and self._buckets[0][0] < oldest:
            self._buckets.popleft()

    @property
    def span(self) -> float:
        return self._span

    def count_since(self, start: float) -> int:
        return sum(count for index, count in self._buckets if (index + 1) * self._width > start)


class SignatureHistory:
    """When one signature was seen on one key.

    `recent` holds the newest fault times, enough for the count arms (a count at or above
    its length is at least every threshold). `marks` is the novelty baseline: the first
    fault of each `spacing` seconds over the novelty window, so "seen between" is exact on
    the side that matters (a mark is a real fault) and at most `spacing` lenient at the old
    edge of the window, in bounded memory whatever the fault rate.
    """

    __slots__ = ("marks", "recent", "spacing", "window")

    def __init__(self, count: int, window: float, spacing: float) -> None:
        self.recent: deque[float] = deque(maxlen=max(1, count))
        self.window = window
        self.spacing = max(spacing, window / MARKS)
        self.marks: deque[float] = deque(maxlen=MARKS + 2)

    def add(self, at: float) -> None:
        self.recent.append(at)
        if not self.marks or at - self.marks[-1] >= self.spacing:
            self.marks.append(at)
        while self.marks and self.marks[0] < at - self.window - self.spacing:
            self.marks.popleft()

    def ensure(self, count: int, window: float, spacing: float) -> None:
        """Follow a reloaded configuration."""
        if self.recent.maxlen is not None and self.recent.maxlen < count:
            self.recent = deque(self.recent, maxlen=count)
        self.window = window
        self.spacing = max(spacing, window / MARKS)

    def count_after(self, start: float) -> int:
        """Faults after `start`, up to the length of `recent`."""
        count = 0
        for at in reversed(self.recent):
            if at <= start:
                break
            count += 1
        return count

    def seen_between(self, low: float, high: float) -> bool:
        """Whether the signature was seen at some time in [low, high)."""
        for at in reversed(self.marks):
            if at < high:
                return at >= low
        return False

    @property
    def last(self) -> float:
        return self.recent[-1] if self.recent else float("-inf")
