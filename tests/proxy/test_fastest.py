"""Which alternatives can finish a stream soonest (core/fastest.py): the rate test's
answer over the contenders is its answer over every alternative, with any one left out."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from rolegate_proxy.core.beliefs import MachineKey
from rolegate_proxy.core.fastest import contenders, undominated


@dataclass(frozen=True)
class Line:
    key: MachineKey
    expected_ttft: float
    expected_gap: float

    def at(self, tokens: float) -> tuple[float, MachineKey]:
        return self.expected_ttft + tokens * self.expected_gap, self.key


def soonest(lines: list[Line], tokens: float) -> Line:
    return min(lines, key=lambda line: line.at(tokens))


def lines(rng: random.Random, count: int) -> list[Line]:
    # Few distinct figures, so ties (equal TTFTs, gaps, whole lines) are common.
    return [
        Line(
            MachineKey("p", "m", f"m{rng.randrange(10_000):04d}-{i}"),
            rng.choice([0.1, 0.2, 0.5, 1.0, rng.uniform(0.05, 3.0)]),
            rng.choice([0.005, 0.01, 0.02, rng.uniform(0.001, 0.1)]),
        )
        for i in range(count)
    ]


LENGTHS = (0.0, 1.0, 7.0, 50.0, 100.0, 333.0, 600.0, 5_000.0, 1e6)


@pytest.mark.parametrize("seed", range(40))
def test_the_soonest_is_always_among_the_undominated(seed: int) -> None:
    rng = random.Random(seed)
    every = lines(rng, rng.randrange(1, 120))
    kept = undominated(every)
    for tokens in LENGTHS:
        assert soonest(kept, tokens) == soonest(every, tokens)


@pytest.mark.parametrize("seed", range(40))
def test_with_any_one_left_out_the_soonest_is_among_the_contenders(seed: int) -> None:
    rng = random.Random(seed)
    every = lines(rng, rng.randrange(2, 80))
    kept = contenders(every)
    for left_out in every:
        rest = [line for line in every if line is not left_out]
        pool = [line for line in kept if line is not left_out]
        for tokens in LENGTHS:
            assert soonest(pool, tokens) == soonest(rest, tokens)


def test_a_thousand_alternatives_leave_a_handful() -> None:
    rng = random.Random(1)
    # Fast starters are often slow streamers, and the other way round: the worst case
    # for a front is figures that trade off; random ones leave a few dozen at most.
    every = lines(rng, 1000)
    assert len(contenders(every)) < 40


def test_a_dominated_line_is_dropped_and_a_tie_goes_to_the_smaller_key() -> None:
    a = Line(MachineKey("p", "m", "a"), 0.5, 0.01)
    b = Line(MachineKey("p", "m", "b"), 0.5, 0.01)  # the same figures, a larger key
    slow = Line(MachineKey("p", "m", "c"), 0.6, 0.02)
    assert undominated([slow, b, a]) == [a]
    assert contenders([slow, b, a]) == [a, b]
