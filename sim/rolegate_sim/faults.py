"""Deciding which fault, if any, hits the n-th request on a machine.

Determinism: every random draw for request n on a machine comes from an RNG seeded by
(scenario seed, model, machine, n). The outcome of a request therefore depends only on its
number on that machine, never on how concurrent requests interleave, and `POST
/_sim/reset` (which zeroes the counters) replays the same sequence.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from rolegate_sim.scenario import DownFault, Fault, SplitWritesFault


@dataclass(frozen=True, slots=True)
class FaultDecision:
    # The first fault that fired, splitWrites excepted (see below).
    fault: Fault | None
    # splitWrites only shapes the transport, so it is decided on its own and combines with
    # whichever other fault fired.
    split: SplitWritesFault | None

    @property
    def down(self) -> bool:
        return isinstance(self.fault, DownFault)


NO_FAULT = FaultDecision(fault=None, split=None)


def request_rng(seed: int, model: str, machine: str, number: int) -> random.Random:
    # A str seed is hashed with SHA-512 by `random`, so this is stable across processes
    # and Python builds (unlike hash()).
    return random.Random(f"{seed}/{model}/{machine}/{number}")


def needs_rng(faults: Sequence[Fault]) -> bool:
    return any(f.probability is not None for f in faults)


def decide(
    faults: Sequence[Fault],
    number: int,
    rng: random.Random | None,
    elapsed: float = 0.0,
    *,
    prefilled: bool = False,
) -> FaultDecision:
    """Evaluate triggers in scenario order; `rng` is required iff `needs_rng(faults)`;
    `elapsed` is the seconds since the machine's faults were set (`duringSeconds`);
    `prefilled`: the request continues a prefilled assistant message (a fault's
    `requests`)."""
    if not faults:
        return NO_FAULT
    chosen: Fault | None = None
    split: SplitWritesFault | None = None
    for fault in faults:
        is_split = isinstance(fault, SplitWritesFault)
        if (split if is_split else chosen) is not None:
            continue
        if fault.requests != "all" and (fault.requests == "continuations") != prefilled:
            continue
        if not _fires(fault, number, rng, elapsed):
            continue
        if isinstance(fault, SplitWritesFault):
            split = fault
        else:
            chosen = fault
        if chosen is not None and split is not None:
            break
    return FaultDecision(fault=chosen, split=split)


def _fires(fault: Fault, number: int, rng: random.Random | None, elapsed: float) -> bool:
    if fault.always:
        return True
    if fault.schedule is not None:
        return number in fault.schedule
    if fault.during_seconds is not None:
        start, until = fault.during_seconds
        return start <= elapsed < until
    assert fault.probability is not None
    assert rng is not None
    return rng.random() < fault.probability
