"""Rankings kept between requests (Chooser._standing): a decision over a thousand machines
costs what one over a single machine does, and still sees every change it must: an
exclusion at once, a probe slot taken, an exclusion ending, a sighting or a score within
the ledger's coalescing window, a new configuration."""

from __future__ import annotations

import random

import pytest

from rolegate_policy.config import CompiledRole, ProxyConfig
from rolegate_policy.model import BreakerSpec
from rolegate_proxy.core.beliefs import (
    BELIEF_COALESCE_SECONDS,
    GapStats,
    Ledger,
    MachineKey,
    Sighting,
)
from rolegate_proxy.core.breaker import Attempted, Breakers
from rolegate_proxy.core.choice import Choice, Fate
from rolegate_proxy.core.chooser import Chooser
from rolegate_proxy.core.score import ObservationKind, Scoreboard
from rolegate_proxy.core.verdicts import OK

from .test_chooser import AGG, CODER, CODERS, candidate, provider, role

LATER = BELIEF_COALESCE_SECONDS * 1.2


def world(
    machines: int = 0,
) -> tuple[ProxyConfig, Ledger, Scoreboard, Breakers, Chooser, Chooser]:
    """One ledger, scoreboard and breakers; a chooser that keeps rankings and one that
    never does (the reference)."""
    extra = tuple((f"m{i:03d}", 0.3 + (i % 7) / 10, 40.0 + i % 50) for i in range(machines))
    config = ProxyConfig(providers=(provider(AGG, {CODER: (*CODERS, *extra)}),))
    ledger = Ledger()
    ledger.load_sheet(config)
    scores = Scoreboard()
    breakers = Breakers(lambda _p: BreakerSpec(jitter_fraction=0.0), random.Random(0))
    kept = Chooser(ledger, scores=scores, draw=lambda: 0.0, exclusions_epoch=lambda: breakers.epoch)
    fresh = Chooser(ledger, scores=scores, draw=lambda: 0.0)
    return config, ledger, scores, breakers, kept, fresh


def same(a: Choice, b: Choice) -> None:
    assert [(f.machine, f.fate, f.reason) for f in a.fates] == [
        (f.machine, f.fate, f.reason) for f in b.fates
    ]
    assert a.routing == b.routing
    assert a.skip_reason == b.skip_reason


def test_a_kept_ranking_is_served_without_judging_a_machine_again() -> None:
    config, _, _, breakers, kept, _ = world(200)
    agent = role()
    first = kept.choose(agent, candidate(config, AGG, CODER), breakers.exclusion, 10.0)
    calls = 0

    def counting(p: str, m: str, machine: str | None, now: float) -> object:
        nonlocal calls
        calls += 1
        return breakers.exclusion(p, m, machine, now)

    again = kept.choose(agent, candidate(config, AGG, CODER), counting, 10.5)  # type: ignore[arg-type]
    assert calls == 0
    same(again, first)
    # A second later the beliefs have been forgotten a little: judged again.
    kept.choose(agent, candidate(config, AGG, CODER), counting, 11.0)  # type: ignore[arg-type]
    assert calls == 203


def test_a_trip_is_seen_at_once_and_its_end_when_the_cooldown_is_over() -> None:
    config, _, _, breakers, kept, fresh = world()
    agent, fast = role(), candidate(config, AGG, CODER)
    assert kept.choose(agent, fast, breakers.exclusion, 10.0).admitted[0] == "fast"
    for at in (10.001, 10.002):
        breakers.record(Attempted.http_error(AGG, CODER, 503, machine="fast"), at)
    # The same instant: no coalescing for an exclusion.
    tripped = kept.choose(agent, fast, breakers.exclusion, 10.002)
    assert tripped.fate("fast") is not None
    assert tripped.fate("fast").fate is Fate.EXCLUDED  # type: ignore[union-attr]
    same(tripped, fresh.choose(agent, fast, breakers.exclusion, 10.002))
    exclusion = tripped.fate("fast").exclusion  # type: ignore[union-attr]
    assert exclusion is not None
    assert exclusion.until is not None
    after = kept.choose(agent, fast, breakers.exclusion, exclusion.until + 1e-6)
    assert "fast" in after.admitted
    same(after, fresh.choose(agent, fast, breakers.exclusion, exclusion.until + 1e-6))


def test_a_probe_slot_taken_is_seen_by_the_next_decision() -> None:
    config, _, _, breakers, kept, fresh = world()
    agent, fast = role(), candidate(config, AGG, CODER)
    for at in (1.0, 1.001):
        breakers.record(Attempted.http_error(AGG, CODER, 503, machine="fast"), at)
    cooled = kept.choose(agent, fast, breakers.exclusion, 1.002)
    until = cooled.fate("fast").exclusion.until  # type: ignore[union-attr]
    assert until is not None
    half_open = kept.choose(agent, fast, breakers.exclusion, until + 0.001)
    assert "fast" in half_open.admitted
    admission = breakers.admit_attempt(AGG, CODER, ("fast",), until + 0.001)
    assert admission.probes
    probing = kept.choose(agent, fast, breakers.exclusion, until + 0.001)
    assert "fast" not in probing.admitted
    same(probing, fresh.choose(agent, fast, breakers.exclusion, until + 0.001))
    breakers.release(admission)
    assert "fast" in kept.choose(agent, fast, breakers.exclusion, until + 0.001).admitted


def test_a_sighting_is_seen_within_the_coalescing_window() -> None:
    config, ledger, _, breakers, kept, fresh = world()
    agent, pool = role(patience=30.0), candidate(config, AGG, CODER)
    assert kept.choose(agent, pool, breakers.exclusion, 100.0).admitted[0] == "fast"
    # fast turns out to crawl: 600 tokens at 2 tok/s is far past a 30 s patience.
    for i in range(40):
        gaps = GapStats.of([0.5] * 300)
        ledger.note(Sighting(AGG, CODER, "fast", 100.0 + i * 1e-4, ttft=0.4, gaps=gaps))
    later = 100.0 + 40e-4 + LATER
    seen = kept.choose(agent, pool, breakers.exclusion, later)
    assert seen.fate("fast").fate is Fate.PATIENCE  # type: ignore[union-attr]
    same(seen, fresh.choose(agent, pool, breakers.exclusion, later))


def test_a_score_is_seen_within_the_coalescing_window() -> None:
    config, _, scores, breakers, kept, fresh = world()
    agent, pool = role(), candidate(config, AGG, CODER)
    assert kept.choose(agent, pool, breakers.exclusion, 5.0).admitted[0] == "fast"
    for _ in range(60):
        scores.observe(MachineKey(AGG, CODER, "fast"), ObservationKind.SERVER_ERROR, 5.0)
        scores.observe(MachineKey(AGG, CODER, "steady"), ObservationKind.OK, 5.0)
    seen = kept.choose(agent, pool, breakers.exclusion, 5.0 + LATER)
    assert seen.admitted[0] == "steady"
    same(seen, fresh.choose(agent, pool, breakers.exclusion, 5.0 + LATER))


def test_a_new_configuration_or_role_is_ranked_afresh() -> None:
    config, ledger, _, breakers, kept, _ = world()
    agent = role(patience=200.0)
    assert (
        "crawler"
        in kept.choose(agent, candidate(config, AGG, CODER), breakers.exclusion, 1.0).admitted
    )
    impatient = role(patience=60.0)
    choice = kept.choose(impatient, candidate(config, AGG, CODER), breakers.exclusion, 1.0)
    assert "crawler" not in choice.admitted
    reloaded = ProxyConfig(providers=(provider(AGG, {CODER: CODERS[:2]}),))
    ledger.load_sheet(reloaded)
    choice = kept.choose(impatient, candidate(reloaded, AGG, CODER), breakers.exclusion, 1.0)
    assert [f.machine for f in choice.fates] == ["fast", "steady"]


@pytest.mark.parametrize("seed", range(12))
def test_kept_rankings_decide_as_fresh_ones_through_any_history(seed: int) -> None:
    """Random histories of answers, failures, trips, rate limits, probes and pins: after
    the coalescing window, a kept ranking decides exactly as one made afresh."""
    rng = random.Random(seed)
    config, ledger, scores, breakers, kept, fresh = world(30)
    roles: list[CompiledRole] = [role(), role("batch", patience=25.0, tokens=300)]
    pool = candidate(config, AGG, CODER)
    names = [m.name for m in pool.model.machines]
    now = 1000.0
    for _ in range(150):
        machine = rng.choice(names)
        event = rng.random()
        if event < 0.4:
            rate = rng.choice([2.0, 30.0, 90.0])
            gaps = GapStats.of([1.0 / rate] * 50)
            ledger.note(Sighting(AGG, CODER, machine, now, ttft=rng.uniform(0.1, 3), gaps=gaps))
            scores.observe(MachineKey(AGG, CODER, machine), ObservationKind.OK, now)
            breakers.record(Attempted.answered(AGG, CODER, OK, machine=machine), now)
        elif event < 0.6:
            scores.observe(MachineKey(AGG, CODER, machine), ObservationKind.SERVER_ERROR, now)
            breakers.record(Attempted.http_error(AGG, CODER, 503, machine=machine), now)
        elif event < 0.7:
            breakers.record(
                Attempted.http_error(AGG, CODER, 429, machine=machine, retry_after=2.0), now
            )
        elif event < 0.8:
            breakers.admit_attempt(AGG, CODER, tuple(names), now)
        else:
            pinned = rng.choice(roles).name
            for chooser in (kept, fresh):
                chooser.affinity.answered(pinned, MachineKey(AGG, CODER, machine))
        # Time only moves on: the decisions come a coalescing window after the event.
        decided = now + LATER
        now = decided + rng.choice([0.0, 0.01, LATER, 0.5, 3.0])
        for agent in roles:
            # Costs are compared at the prompt's size class: 1,100 and 2,000 are 1,536.
            prompt = rng.choice([0, 1100, 2000])
            a = kept.choose(agent, pool, breakers.exclusion, decided, prompt_tokens=prompt)
            b = fresh.choose(
                agent, pool, breakers.exclusion, decided, prompt_tokens=1536 if prompt else 0
            )
            same(a, b)
            assert kept.affinity.pinned(agent.name) == fresh.affinity.pinned(agent.name)


def test_a_machine_first_heard_of_is_a_candidate_at_once() -> None:
    config, ledger, _, breakers, kept, _ = world()
    agent, pool = role(), candidate(config, AGG, CODER)
    assert kept.choose(agent, pool, breakers.exclusion, 7.0).fate("hidden") is None
    ledger.note(Sighting(AGG, CODER, "hidden", 7.0001, ttft=0.2, gaps=GapStats.of([0.01] * 50)))
    # Well inside the coalescing window: a new machine is not a change that waits.
    choice = kept.choose(agent, pool, breakers.exclusion, 7.0002)
    assert "hidden" in choice.admitted


def test_a_kept_frontier_is_the_fresh_one_and_loses_a_tripped_machine_at_once() -> None:
    config, _, _, breakers, kept, fresh = world(200)
    agent = role()
    candidates = (candidate(config, AGG, CODER),)
    frontier = kept.frontier(agent, candidates, breakers.exclusion, 3.0)
    assert frontier == fresh.frontier(agent, candidates, breakers.exclusion, 3.0)
    # A handful of the 203, and the soonest for any length among them.
    assert 0 < len(frontier) < 20
    everyone = fresh.plan(agent, candidates, breakers.exclusion, 3.0).choices[0]
    admitted = [f for f in everyone.fates if f.admitted and f.belief is not None and f.belief.gap]
    for tokens in (1, 100, 600, 10_000):
        soonest = min(admitted, key=lambda f: (f.belief.expected_seconds(tokens), f.machine))  # type: ignore[union-attr]
        assert soonest.machine in {a.key.machine for a in frontier}
    leader = min(frontier, key=lambda a: (a.expected_seconds(600), a.key))
    for at in (3.001, 3.002):
        breakers.record(Attempted.http_error(AGG, CODER, 503, machine=leader.key.machine), at)
    after = kept.frontier(agent, candidates, breakers.exclusion, 3.002)
    assert leader.key not in {a.key for a in after}
    assert after == fresh.frontier(agent, candidates, breakers.exclusion, 3.002)
