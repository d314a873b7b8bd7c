"""Which alternatives can finish a stream soonest (SPEC B5, B6), out of many.

An alternative's expected time for `t` remaining tokens is `TTFT + t x gap`, a line in `t`,
and the mid-stream rate test asks on every content event for the one finishing soonest
(the smaller key on a tie). Over a thousand admitted machines that would be a thousand
lines per chunk, yet few can ever be that one: an alternative whose TTFT and gap are both
no better than another's, with any tie going to the other, never is. `undominated` keeps
the rest (the Pareto front in TTFT and gap), exactly the alternatives that are soonest for
some `t >= 0` or tie with one that is; `contenders` keeps two layers of it, so the answer
stays exact when any one alternative (the machine serving the stream) is left out: an
alternative soonest once another is removed is either on the front or dominated only by
the removed one, which puts it on the second layer.

Pure, and generic over what carries the two figures and the key.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar

from .beliefs import MachineKey


class Line(Protocol):
    @property
    def key(self) -> MachineKey: ...

    @property
    def expected_ttft(self) -> float: ...

    @property
    def expected_gap(self) -> float: ...


L = TypeVar("L", bound=Line)


def _by_ttft(line: Line) -> tuple[float, MachineKey]:
    return line.expected_ttft, line.key


def undominated(lines: Iterable[L]) -> list[L]:
    """The lines no other line beats (or ties with a smaller key) at every `t >= 0`, by
    TTFT then key. Sorted by (TTFT, key), a line is dominated exactly when one before it
    has a gap no larger: its TTFT is then no larger too, and equal only with a smaller key."""
    kept: list[L] = []
    best_gap = math.inf
    for line in sorted(lines, key=_by_ttft):
        if line.expected_gap < best_gap:
            kept.append(line)
            best_gap = line.expected_gap
    return kept


def contenders(lines: Sequence[L]) -> list[L]:
    """The front and its second layer (see the module docstring)."""
    first = undominated(lines)
    if len(first) == len(lines):
        return first
    taken = {id(line) for line in first}
    return first + undominated(line for line in lines if id(line) not in taken)
