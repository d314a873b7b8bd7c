"""The order of one request's admitted machines: quality first, cost breaks ties inside the
role's quality tolerance (SPEC C4, C5).

`rank` only orders. Every entry it is given comes back: hard exclusions (breakers, rate
limits, auth, quota, patience) are applied by the caller before it, so no score, however
good, can override one.

* **Quality tiers.** With `best` the highest operational score, an entry is `behind =
  best - score`, and its tier is `floor(behind / tolerance + u)`, `u` uniform on [0, 1)
  drawn once per entry. Dithering the tier boundary makes preference fade linearly: an
  entry behind by a fraction f of the tolerance is in the top tier with probability 1 - f,
  so its share of first attempts falls gradually as its score drifts down, instead of
  flipping when it crosses a threshold. The best entry is always tier 0. With a tolerance
  of 0 the tiers are the distinct scores, best first (no dither).
* **Semantic demotion.** Inside a tier, an entry whose semantic score is more than the
  tolerance below the best semantic score in that tier goes after the others. The semantic
  score can only lower preference, and only inside a tier; an unknown (None) semantic score
  is never demoted and never promotes: unknown is not a value.
* **Speed (B3, B8).** An entry whose expected time to a usable answer is more than the
  role's speed tolerance (default 1.5x, and at least SPEED_MARGIN_SECONDS) behind the
  fastest entry of equal quality (a score no more than the quality tolerance below its
  own, whatever tier the dither drew for it) is *slow*: it goes after the others of the
  fastest one's tier, before cost is compared. So a machine a hundred times slower never
  leads on a score a few answers higher, nor on a lucky draw, nor on cost.
* **Then** the cheaper expected cost (an unpriced machine never wins a cost tie), then the
  shorter expected time to a usable answer (unknown last), then the key, so the order is
  deterministic given the draws.

Pure: the randomness is an argument (`draw`, called exactly once per entry in input
order).
"""

from __future__ import annotations

import math
import sys
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Generic, Protocol, TypeVar

from .beliefs import MachineKey


class Rankable(Protocol):
    """What `rank` reads of each machine (see `Entry`): the chooser ranks its own per-machine
    records directly rather than copying them into entries on every decision."""

    @property
    def key(self) -> MachineKey: ...

    @property
    def score(self) -> float: ...

    @property
    def semantic(self) -> float | None: ...

    @property
    def cost(self) -> float | None: ...

    @property
    def expected_seconds(self) -> float | None: ...


R = TypeVar("R", bound=Rankable)

# How much slower than the fastest machine of equal quality a machine must also be, in
# seconds, to count as slow: below it a faster machine is not worth a higher price.
SPEED_MARGIN_SECONDS: Final = 0.05


@dataclass(slots=True)
class Entry:
    """One admitted machine for one request. `score` is its shrunk operational score and
    `semantic` its shrunk semantic score (both on [0, 1]; semantic None when no evaluator
    has judged it), `cost` the expected USD of this request on it (None: no published
    price), `expected_seconds` its expected time to a usable answer (None: unknown).
    `rank` refuses one that would sort arbitrarily (a NaN, a score outside [0, 1])."""

    key: MachineKey
    score: float
    semantic: float | None
    cost: float | None
    expected_seconds: float | None


@dataclass(slots=True)
class Placed(Generic[R]):
    """An entry and where it was placed: its quality `tier` (0 is the top), how far
    `behind` the best score it is, whether its semantic score demoted it in its tier, and
    whether it is `slow` (see the module docstring), placed in the tier `placed_tier` of
    the faster machine it goes after (its own tier otherwise)."""

    entry: R
    tier: int
    behind: float
    semantic_demoted: bool
    slow: bool = False
    placed_tier: int = -1
    # No expected time while others have one: it goes with the slow.
    untimed: bool = False

    def __post_init__(self) -> None:
        if self.placed_tier < 0:
            self.placed_tier = self.tier

    @property
    def reason(self) -> str:
        """A short line for the decision log."""
        return describe_place(
            self.tier,
            self.behind,
            self.semantic_demoted,
            self.entry.cost,
            self.entry.expected_seconds,
            slow=self.slow,
        )


def describe_place(
    tier: int,
    behind: float,
    demoted: bool,
    cost: float | None,
    seconds: float | None,
    *,
    slow: bool = False,
) -> str:
    """Where a machine was placed, for a person: tier, distance, demotion, speed, cost,
    time."""
    standing = "the best" if behind == 0 else f"{behind:.3f} behind the best"
    parts = [f"quality tier {tier} ({standing})"]
    if demoted:
        parts.append("semantic score demoted it")
    if slow:
        parts.append("far slower than a machine of equal quality: it does not lead")
    parts.append("no published price" if cost is None else f"cost ${cost:.6f}")
    if seconds is not None:
        parts.append(f"expected {seconds:.1f} s")
    return ", ".join(parts)


def _refuse(entry: Rankable) -> None:
    """Raise for an entry that would sort arbitrarily (a NaN) or is not a score."""
    key = entry.key.describe()
    if not 0.0 <= entry.score <= 1.0:
        raise ValueError(f"{key}: score {entry.score} is outside [0, 1]")
    if entry.semantic is not None and not 0.0 <= entry.semantic <= 1.0:
        raise ValueError(f"{key}: semantic score {entry.semantic} is outside [0, 1]")
    if entry.cost is not None and not entry.cost >= 0.0:
        raise ValueError(f"{key}: cost {entry.cost} is not >= 0")
    raise ValueError(f"{key}: expected_seconds {entry.expected_seconds} is not >= 0")


def rank(
    entries: Sequence[R],
    tolerance: float,
    draw: Callable[[], float],
    speed_tolerance: float = math.inf,
) -> list[Placed[R]]:
    """Every entry, best first (see the module docstring). `tolerance` is the role's
    quality tolerance on the score scale; `draw` returns a uniform value in [0, 1) and is
    called once per entry in input order, whatever the tolerance (so a seeded stream stays
    aligned); `lambda: 0.0` gives the undithered ranking. `speed_tolerance` is the role's
    (inf: speed never overrides cost).

    Runs for every request over every admitted machine: one pass computes the tiers."""
    if not 0.0 <= tolerance < math.inf:
        raise ValueError(f"tolerance must be finite and >= 0, got {tolerance}")
    if not entries:
        return []
    for entry in entries:
        # Checked here, not when an entry is built: one pass over what rank reads anyway.
        semantic, cost, seconds = entry.semantic, entry.cost, entry.expected_seconds
        if not (
            0.0 <= entry.score <= 1.0
            and (semantic is None or 0.0 <= semantic <= 1.0)
            and (cost is None or cost >= 0.0)
            and (seconds is None or seconds >= 0.0)
        ):
            _refuse(entry)
    best = max(entry.score for entry in entries)
    tiers: list[int] = []
    if tolerance == 0.0:
        # With no tolerance, a tier is a distinct score (rank of the score, best first).
        strict = {
            score: i for i, score in enumerate(sorted({e.score for e in entries}, reverse=True))
        }
        for entry in entries:
            _checked(draw())
            tiers.append(strict[entry.score])
    else:
        scale = 1.0 / tolerance
        for entry in entries:
            u = draw()
            if not 0.0 <= u < 1.0:
                _checked(u)
            q = (best - entry.score) * scale + u
            # q >= 0, so int() floors; a tiny tolerance can make it overflow.
            tiers.append(int(q) if q < sys.maxsize else sys.maxsize)

    best_semantic: dict[int, float] = {}
    for entry, tier in zip(entries, tiers, strict=True):
        semantic = entry.semantic
        if semantic is not None and (tier not in best_semantic or semantic > best_semantic[tier]):
            best_semantic[tier] = semantic

    placed = [
        Placed(
            entry,
            tier,
            best - entry.score,
            entry.semantic is not None and best_semantic[tier] - entry.semantic > tolerance,
        )
        for entry, tier in zip(entries, tiers, strict=True)
    ]
    reorder(placed, tolerance, speed_tolerance)
    return placed


def reorder(placed: list[Placed[R]], tolerance: float, speed_tolerance: float) -> None:
    """Sort placed entries best first, their tiers as drawn, after judging which are slow
    from their expected times as they stand now: the chooser calls it again, with the same
    tiers, when requests in flight lengthen some machines' expected times (SPEC B8)."""
    if speed_tolerance < math.inf:
        _mark_slow(placed, tolerance, speed_tolerance)
    placed.sort(key=_order)


def _mark_slow(placed: Sequence[Placed[R]], tolerance: float, speed_tolerance: float) -> None:
    """Mark the slow entries (see the module docstring). Walking the entries by score, best
    first, the fastest so far is the fastest of every score at least as good; the equal
    quality of an entry reaches `tolerance` below its own score, which bisection finds."""
    timed = sorted(
        (p for p in placed if p.entry.expected_seconds is not None),
        key=lambda p: -p.entry.score,
    )
    if not timed:
        return
    for p in placed:
        # Unknown time goes with the slow (an untimed machine is ranked last: SPEC B2),
        # without being called slow: it has shown nothing.
        p.untimed = p.entry.expected_seconds is None
    descending = [-p.entry.score for p in timed]
    fastest_so_far: list[Placed[R]] = []
    fastest: Placed[R] | None = None
    for p in timed:
        p.slow, p.placed_tier = False, p.tier
        if fastest is None or _seconds(p) < _seconds(fastest):
            fastest = p
        fastest_so_far.append(fastest)
    for p in timed:
        reach = bisect_right(descending, -p.entry.score + tolerance) - 1
        quick = fastest_so_far[reach]
        seconds, best = _seconds(p), _seconds(quick)
        if seconds > speed_tolerance * best and seconds - best > SPEED_MARGIN_SECONDS:
            p.slow = True
            p.placed_tier = max(p.tier, quick.tier)


def _seconds(p: Placed[R]) -> float:
    seconds = p.entry.expected_seconds
    assert seconds is not None  # only timed entries are compared
    return seconds


def _checked(u: float) -> float:
    if not 0.0 <= u < 1.0:
        raise ValueError(f"draw() must return a value in [0, 1), got {u}")
    return u


_SortKey = tuple[int, bool, bool, bool, float, bool, float, MachineKey]


def _order(p: Placed[R]) -> _SortKey:
    cost, seconds = p.entry.cost, p.entry.expected_seconds
    return (
        p.placed_tier,
        p.semantic_demoted,
        p.slow or p.untimed,
        cost is None,
        0.0 if cost is None else cost,
        seconds is None,
        0.0 if seconds is None else seconds,
        p.entry.key,
    )


def expected_cost(
    price_in_per_mtok: float | None,
    price_out_per_mtok: float | None,
    prompt_tokens: int,
    output_tokens: int,
) -> float | None:
    """Expected USD for a request of `prompt_tokens` in and `output_tokens` out at prices
    per million tokens; None when either price is unpublished (half a price is not one)."""
    if price_in_per_mtok is None or price_out_per_mtok is None:
        return None
    if prompt_tokens < 0 or output_tokens < 0:
        raise ValueError(f"token counts must be >= 0, got {prompt_tokens}, {output_tokens}")
    return (price_in_per_mtok * prompt_tokens + price_out_per_mtok * output_tokens) / 1e6
