"""Ranking one request's admitted machines: quality first, cost breaks ties inside the role's
quality tolerance, dithered tiers, semantic demotion (SPEC C4, C5). Pure: every draw here
is seeded or fixed."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rolegate_proxy.core.beliefs import MachineKey
from rolegate_proxy.core.ranking import Entry, Placed, expected_cost, rank

AGG, MODEL = "openrouter", "qwen/qwen3-coder"
# Dyadic, so every `behind / tolerance` below is exact in binary.
TOLERANCE = 0.125


def key(machine: str) -> MachineKey:
    return MachineKey(AGG, MODEL, machine)


def entry(
    machine: str,
    score: float,
    *,
    semantic: float | None = None,
    cost: float | None = None,
    seconds: float | None = None,
) -> Entry:
    return Entry(key(machine), score, semantic, cost, seconds)


def never() -> float:
    """The undithered ranking: u = 0 for every entry."""
    return 0.0


def order(placed: Sequence[Placed[Entry]]) -> list[str]:
    return [p.entry.key.machine for p in placed]


def reference(entries: Sequence[Entry], tolerance: float, seed: int) -> list[str]:
    """The ranking as if there were no semantic score at all, written out independently:
    the same dithered tiers, then cost (unpriced last), then time (unknown last), then key."""
    draw = random.Random(seed).random
    best = max(e.score for e in entries)
    keyed = []
    for e in entries:
        tier = math.floor((best - e.score) / tolerance + draw())
        keyed.append(
            (
                tier,
                math.inf if e.cost is None else e.cost,
                math.inf if e.expected_seconds is None else e.expected_seconds,
                e.key,
            )
        )
    return [k[-1].machine for k in sorted(keyed)]


# --- quality first, then cost ---------------------------------------------------------------


def test_a_clearly_better_machine_leads_whatever_it_costs() -> None:
    entries = [
        entry("cheap", 0.5, cost=0.0001, seconds=1.0),
        entry("good", 0.95, cost=0.05, seconds=9.0),
    ]
    for seed in range(100):
        assert order(rank(entries, TOLERANCE, random.Random(seed).random))[0] == "good"


def test_inside_the_tolerance_the_cheaper_leads() -> None:
    entries = [entry("best", 0.9, cost=0.002), entry("close", 0.89, cost=0.001)]
    placed = rank(entries, TOLERANCE, never)
    assert order(placed) == ["close", "best"]
    assert [p.tier for p in placed] == [0, 0]


def test_an_unpriced_machine_loses_a_cost_tie() -> None:
    entries = [entry("a-unpriced", 0.9), entry("b-priced", 0.9, cost=0.5)]
    assert order(rank(entries, TOLERANCE, never)) == ["b-priced", "a-unpriced"]


def test_expected_time_breaks_a_cost_tie_and_unknown_time_is_last() -> None:
    entries = [
        entry("a-unknown", 0.9, cost=0.001),
        entry("b-slow", 0.9, cost=0.001, seconds=8.0),
        entry("c-fast", 0.9, cost=0.001, seconds=2.0),
    ]
    assert order(rank(entries, TOLERANCE, never)) == ["c-fast", "b-slow", "a-unknown"]


def test_the_key_breaks_a_full_tie() -> None:
    entries = [entry("b", 0.9, cost=0.1, seconds=1.0), entry("a", 0.9, cost=0.1, seconds=1.0)]
    assert order(rank(entries, TOLERANCE, never)) == ["a", "b"]


def test_the_reason_says_tier_distance_and_cost() -> None:
    placed = rank([entry("best", 0.9, cost=0.00012, seconds=2.5), entry("next", 0.888)], 0.1, never)
    assert placed[0].reason == "quality tier 0 (the best), cost $0.000120, expected 2.5 s"
    assert placed[1].reason == "quality tier 0 (0.012 behind the best), no published price"


# --- never excludes, draws once per entry ------------------------------------------------------

entries_strategy = st.lists(
    st.builds(
        Entry,
        st.builds(MachineKey, st.just(AGG), st.just(MODEL), st.text("abcdef", min_size=1)),
        st.floats(0.0, 1.0),
        st.none() | st.floats(0.0, 1.0),
        st.none() | st.floats(0.0, 1.0),
        st.none() | st.floats(0.0, 60.0),
    ),
    max_size=20,
)


@given(entries_strategy, st.sampled_from([0.0, 0.01, 0.05, TOLERANCE, 1.0]), st.integers(0, 999))
def test_every_entry_comes_back_in_tier_order_and_draw_is_called_once_each(
    entries: list[Entry], tolerance: float, seed: int
) -> None:
    rng = random.Random(seed)
    calls = 0

    def draw() -> float:
        nonlocal calls
        calls += 1
        return rng.random()

    placed = rank(entries, tolerance, draw)
    assert calls == len(entries)
    assert sorted((p.entry for p in placed), key=id) == sorted(entries, key=id)
    assert [p.tier for p in placed] == sorted(p.tier for p in placed)
    if entries:
        best = max(e.score for e in entries)
        assert all(p.tier == 0 for p in placed if p.entry.score == best)
        assert all(p.behind == best - p.entry.score for p in placed)


# --- the dither -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fraction", "share"), [(0.25, 0.75), (0.5, 0.5), (0.75, 0.25), (1.0, 0.0), (3.0, 0.0)]
)
def test_a_cheaper_machine_behind_leads_in_proportion_to_how_far_behind(
    fraction: float, share: float
) -> None:
    """Over 10,000 seeded rankings of two entries (the one behind is cheaper, so it leads
    exactly when it is in tier 0), it leads a share 1 - f of the time when it is behind by
    a fraction f of the tolerance: within 0.03 (the binomial standard error is at most
    0.005, so this is 6 sigma), and exactly never when behind by one tolerance or more."""
    best = 0.875
    behind = entry("behind", best - fraction * TOLERANCE, cost=0.001)
    entries = [entry("best", best, cost=0.002), behind]
    rng = random.Random(20240607)
    leads = sum(order(rank(entries, TOLERANCE, rng.random))[0] == "behind" for _ in range(10_000))
    if share == 0.0:
        assert leads == 0
    else:
        assert abs(leads / 10_000 - share) <= 0.03


def test_the_tier_is_the_floor_of_the_dithered_distance() -> None:
    """Exact: with u fixed, tier = floor(behind / tolerance + u)."""
    names = ["best", "quarter", "one-and-a-half"]
    entries = [entry(names[0], 0.875), entry(names[1], 0.84375), entry(names[2], 0.6875)]
    cases = [
        (0.0, [0, 0, 1]),
        (0.49, [0, 0, 1]),
        (0.5, [0, 0, 2]),
        (0.74, [0, 0, 2]),
        (0.75, [0, 1, 2]),
        (0.99, [0, 1, 2]),
    ]
    for u, tiers in cases:
        placed = rank(entries, TOLERANCE, itertools.repeat(u).__next__)
        assert {p.entry.key.machine: p.tier for p in placed} == dict(
            zip(names, tiers, strict=True)
        ), u


def test_a_draw_outside_the_unit_interval_is_refused() -> None:
    with pytest.raises(ValueError, match=r"draw\(\) must return a value in \[0, 1\)"):
        rank([entry("a", 0.5)], TOLERANCE, lambda: 1.0)


@pytest.mark.parametrize("bad", [-0.1, math.inf, math.nan])
def test_a_tolerance_must_be_finite_and_not_negative(bad: float) -> None:
    with pytest.raises(ValueError, match="tolerance must be finite and >= 0"):
        rank([entry("a", 0.5)], bad, never)


def test_tolerance_zero_ranks_strictly_by_score_and_cost_breaks_only_exact_ties() -> None:
    entries = [
        entry("c", 0.8, cost=0.001),
        entry("a", 0.9, cost=0.003),
        entry("b", 0.9, cost=0.002),
        entry("d", 0.1, cost=0.0),
    ]
    for seed in range(20):
        placed = rank(entries, 0.0, random.Random(seed).random)
        assert order(placed) == ["b", "a", "c", "d"]
        assert [p.tier for p in placed] == [0, 0, 1, 2]


def test_no_entries_no_draws() -> None:
    def draw() -> float:
        raise AssertionError("drawn")

    assert rank([], TOLERANCE, draw) == []


# --- the semantic score only demotes, inside a tier -------------------------------------------


@given(entries_strategy, st.integers(0, 999))
def test_no_semantic_anywhere_ranks_as_if_there_were_no_semantic_score(
    entries: list[Entry], seed: int
) -> None:
    """Same seeds, same order: against an independent ranking that knows nothing of the
    semantic score, and against every entry having the same semantic score."""
    if not entries:
        return
    unknown = [Entry(e.key, e.score, None, e.cost, e.expected_seconds) for e in entries]
    equal = [Entry(e.key, e.score, 0.7, e.cost, e.expected_seconds) for e in entries]
    ranked = order(rank(unknown, TOLERANCE, random.Random(seed).random))
    assert ranked == reference(entries, TOLERANCE, seed)
    assert order(rank(equal, TOLERANCE, random.Random(seed).random)) == ranked
    assert not any(p.semantic_demoted for p in rank(unknown, TOLERANCE, never))


def test_a_poor_semantic_score_demotes_inside_its_tier() -> None:
    entries = [
        entry("good-sense", 0.9, semantic=0.9, cost=0.002),
        entry("cheap-nonsense", 0.9, semantic=0.5, cost=0.001),
    ]
    placed = rank(entries, TOLERANCE, never)
    assert order(placed) == ["good-sense", "cheap-nonsense"]
    assert [p.semantic_demoted for p in placed] == [False, True]
    assert "semantic score demoted it" in placed[1].reason


def test_a_semantic_score_within_the_tolerance_does_not_demote() -> None:
    entries = [
        entry("better-sense", 0.9, semantic=0.9, cost=0.002),
        entry("cheap", 0.9, semantic=0.9 - TOLERANCE / 2, cost=0.001),
    ]
    assert order(rank(entries, TOLERANCE, never)) == ["cheap", "better-sense"]


def test_a_semantic_score_never_crosses_a_tier() -> None:
    """A lower tier's excellent semantic score does not lift it above a higher tier with a
    poor one."""
    entries = [
        entry("top-poor-sense", 0.9, semantic=0.1, cost=0.002),
        entry("low-great-sense", 0.9 - 2 * TOLERANCE, semantic=1.0, cost=0.001),
    ]
    placed = rank(entries, TOLERANCE, never)
    assert order(placed) == ["top-poor-sense", "low-great-sense"]
    assert [p.tier for p in placed] == [0, 2]
    # Alone in its tier, the poor one has nobody to be compared with.
    assert not any(p.semantic_demoted for p in placed)


def test_an_unknown_semantic_score_is_neither_demoted_nor_outranked_by_a_known_one() -> None:
    entries = [
        entry("known-great", 0.9, semantic=1.0, cost=0.002),
        entry("unknown", 0.9, cost=0.001),
        entry("known-poor", 0.9, semantic=0.2, cost=0.0005),
    ]
    placed = rank(entries, TOLERANCE, never)
    # "unknown" keeps its cost place ahead of "known-great" (no promotion); "known-poor"
    # is demoted behind both, though it is the cheapest.
    assert order(placed) == ["unknown", "known-great", "known-poor"]
    assert {p.entry.key.machine: p.semantic_demoted for p in placed} == {
        "known-great": False,
        "unknown": False,
        "known-poor": True,
    }


def test_demotion_compares_with_the_best_semantic_score_of_the_same_tier() -> None:
    """The tier-1 entries are compared with each other (0.5 vs 0.45: within tolerance), not
    with tier 0's 1.0."""
    entries = [
        entry("top", 0.9, semantic=1.0, cost=0.003),
        entry("second-a", 0.9 - 1.5 * TOLERANCE, semantic=0.5, cost=0.002),
        entry("second-b", 0.9 - 1.5 * TOLERANCE, semantic=0.45, cost=0.001),
    ]
    placed = rank(entries, TOLERANCE, never)
    assert order(placed) == ["top", "second-b", "second-a"]
    assert not any(p.semantic_demoted for p in placed)


def test_semantic_demotion_with_tolerance_zero_demotes_any_lower_semantic() -> None:
    entries = [
        entry("a", 0.9, semantic=0.8, cost=0.001),
        entry("b", 0.9, semantic=0.81, cost=0.002),
    ]
    assert order(rank(entries, 0.0, never)) == ["b", "a"]


# --- entries and cost -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("score", {"score": 1.5}),
        ("score", {"score": math.nan}),
        ("semantic score", {"semantic": -0.1}),
        ("cost", {"cost": -1.0}),
        ("expected_seconds", {"seconds": math.nan}),
    ],
)
def test_rank_refuses_an_entry_that_would_sort_arbitrarily(
    field: str, kwargs: dict[str, float]
) -> None:
    score = kwargs.pop("score", 0.5)
    with pytest.raises(ValueError, match=field):
        rank([entry("b", 0.5), entry("a", score, **kwargs)], 0.05, lambda: 0.0)


def test_expected_cost() -> None:
    """Relative tolerance 1e-12 (float arithmetic)."""
    assert expected_cost(3.0, 15.0, 1000, 200) == pytest.approx(0.006, rel=1e-12)
    assert expected_cost(0.0, 0.0, 1000, 200) == 0.0
    assert expected_cost(None, 15.0, 1000, 200) is None
    assert expected_cost(3.0, None, 1000, 200) is None
    with pytest.raises(ValueError, match="token counts must be >= 0"):
        expected_cost(3.0, 15.0, -1, 200)


# --- speed (SPEC B3, B8) --------------------------------------------------------------------


def draws(*values: float) -> Callable[[], float]:
    """The given draws, in order (one per entry)."""
    it = iter(values)
    return lambda: next(it)


def test_a_far_slower_machine_never_leads_on_a_lucky_draw() -> None:
    # `slow` is a little better on score; the dither put `quick` a tier below it.
    entries = [entry("slow", 1.0, seconds=10.0), entry("quick", 0.9375, seconds=0.1)]
    undrawn = rank(entries, TOLERANCE, draws(0.0, 0.9))
    assert [p.tier for p in undrawn] == [0, 1]
    placed = rank(entries, TOLERANCE, draws(0.0, 0.9), speed_tolerance=1.5)
    assert order(placed) == ["quick", "slow"]
    slow = placed[1]
    assert slow.slow
    assert slow.placed_tier == 1
    assert "far slower than a machine of equal quality" in slow.reason


def test_speed_comes_before_cost_only_past_the_speed_tolerance() -> None:
    cheap = entry("cheap", 1.0, cost=0.001, seconds=3.0)
    dear = entry("dear", 1.0, cost=0.002, seconds=1.0)
    assert order(rank([cheap, dear], TOLERANCE, never, speed_tolerance=1.5)) == ["dear", "cheap"]
    # Within 4x the cheaper one is comparable, and cost decides.
    assert order(rank([cheap, dear], TOLERANCE, never, speed_tolerance=4.0)) == ["cheap", "dear"]
    # Without a speed tolerance (the pure ranking's default) cost decides as before.
    assert order(rank([cheap, dear], TOLERANCE, never)) == ["cheap", "dear"]


def test_a_faster_machine_of_lower_quality_does_not_overtake() -> None:
    # Behind by twice the tolerance: not equal quality, so its speed does not count.
    entries = [entry("good", 1.0, seconds=10.0), entry("poor", 0.75, seconds=0.1)]
    assert order(rank(entries, TOLERANCE, never, speed_tolerance=1.5)) == ["good", "poor"]


def test_a_few_milliseconds_are_not_slow_whatever_the_ratio() -> None:
    entries = [
        entry("a", 1.0, cost=0.001, seconds=0.02),
        entry("b", 1.0, cost=0.002, seconds=0.005),
    ]
    assert order(rank(entries, TOLERANCE, never, speed_tolerance=1.5)) == ["a", "b"]
