"""What the ranking reads of each admitted machine beyond its belief: its operational score
shrunk towards its field's target, its semantic score, its expected cost (SPEC C2-C5,
G3), and its queue (SPEC B8); and which machine an exploring decision puts first.

Pure: the clock is an argument.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

from rolegate_policy.config import CompiledMachine, CompiledRole

from .choice import MachineFate
from .load import Load
from .ranking import Placed, reorder
from .score import UNIT_SCALE, Scoreboard


def score_field(
    scores: Scoreboard,
    role: CompiledRole,
    fates: Sequence[MachineFate],
    sheet: dict[str, CompiledMachine] | None,
    prompt_tokens: int,
) -> float:
    """Fill in what the ranking reads of each machine it ranks: its semantic score, its
    expected cost (from `sheet`; None leaves the cost as it is) and its operational score
    shrunk towards the target of this field of machines, which it returns.

    The target is `score.field_target` and each score `ScoreView.toward(target)`, written
    out in two loops rather than called per machine: this runs for every admitted machine
    of every decision (tests/proxy/test_chooser.py holds the two to the same numbers)."""
    evidence_of = scores.evidence
    out_tokens = role.expected_output_tokens
    weight = weighted = 0.0
    low, high = math.inf, -math.inf
    for fate in fates:
        view, fate.semantic = evidence_of(fate.key)
        fate.view = view
        observed = view.observed
        if observed is not None:
            confidence = view.confidence
            weight += confidence
            weighted += confidence * observed
            if observed < low:
                low = observed
            if observed > high:
                high = observed
        if sheet is None:
            continue
        compiled = sheet.get(fate.machine)
        if compiled is not None:
            price_in = compiled.price_input_per_mtok
            price_out = compiled.price_output_per_mtok
            if price_in is not None and price_out is not None:
                fate.cost = (prompt_tokens * price_in + out_tokens * price_out) / 1e6
    target = UNIT_SCALE.neutral if weight == 0.0 else min(high, max(low, weighted / weight))
    for fate in fates:
        held = fate.view
        assert held is not None  # read in the loop above
        observed = held.observed
        if observed is None:
            fate.score = target
        elif held.confidence >= 1.0:
            fate.score = observed
        else:
            fate.score = target + held.confidence * (observed - target)
    return target


def queued_order(
    load: Load,
    role: CompiledRole,
    sheet: dict[str, CompiledMachine],
    admitted: Sequence[MachineFate],
    now: float,
) -> list[MachineFate] | None:
    """The admitted machines reordered with each one's queue in its expected time, the
    tiers as ranked (`ranking.reorder`); None when no machine waits (nothing would
    change). The fates it changes are copies: the ranking it came from is kept."""
    placed: list[Placed[MachineFate]] = []
    waiting = False
    for fate in admitted:
        queued = with_queue(load, fate, sheet, now)
        waiting = waiting or queued is not fate
        tier, behind, demoted, _ = queued.placement or (0, 0.0, False, False)
        placed.append(Placed(queued, tier, behind, demoted))
    if not waiting:
        return None
    reorder(placed, role.quality_tolerance, role.speed_tolerance)
    order = []
    for place in placed:
        fate, placement = place.entry, place.entry.placement
        if placement is not None and placement[3] != place.slow:
            fate = fate if fate.queue_seconds > 0 else copy.copy(fate)
            fate.placement = (*placement[:3], place.slow)
        order.append(fate)
    return order


def with_queue(
    load: Load, fate: MachineFate, sheet: dict[str, CompiledMachine], now: float
) -> MachineFate:
    """`fate`, or a copy whose expected time includes the wait in its machine's queue."""
    seconds = fate.expected_seconds
    if seconds is None:
        return fate
    compiled = sheet.get(fate.machine)
    published = None if compiled is None else compiled.max_concurrency
    wait = load.wait_seconds(fate.key, seconds, published, now)
    if wait <= 0:
        return fate
    queued = copy.copy(fate)
    queued.expected_seconds = seconds + wait
    queued.queue_seconds = wait
    return queued


def least_observed(
    scores: Scoreboard, ranked: Sequence[MachineFate], slow: Callable[[MachineFate], bool]
) -> int | None:
    """The position, other than the first, of the machine to explore: the least evidence
    (lowest confidence: an untried machine first), then the longest since it was last
    observed (full-confidence machines take their turns), then the best ranked; never one
    the ranking marked `slow` that has a record (a machine seen to be far slower than one
    of equal quality is not sent traffic to keep its score current: its belief drifting
    back to its sheet brings it back; an untried one published slow is explored, so that
    figures which undersell it cannot starve it). None: nothing may be explored. Called
    only for a decision that explores, on scored machines."""
    last_observed = scores.last_observed

    def evidence(index: int) -> tuple[float, float, int]:
        fate = ranked[index]
        confidence = 0.0 if fate.view is None else fate.view.confidence
        seen = last_observed(fate.key)
        return (confidence, -math.inf if seen is None else seen, index)

    def known_slow(fate: MachineFate) -> bool:
        return slow(fate) and fate.view is not None and fate.view.confidence > 0

    eligible = [index for index in range(1, len(ranked)) if not known_slow(ranked[index])]
    return min(eligible, key=evidence) if eligible else None
