"""A ledger's evidence as a proxy pod shares it: taken back after a restart, heard from the
fleet's other pods, never counted twice (the summary's wire format: test_fleet_summary)."""

from __future__ import annotations

import math

import pytest

from rolegate_proxy.core.beliefs import Evidence, LogNormal, MachineEvidence, MachineKey

from .test_beliefs import AGG, HOUR, MODEL, ledger, seen

FAST, SLOW = MachineKey(AGG, MODEL, "fast"), MachineKey(AGG, MODEL, "slow")
SHEET = (("fast", 2.0, 50.0), ("slow", 2.0, 50.0))


def taught(*, now: float = 100.0) -> list[MachineEvidence]:
    """What a pod that saw `slow` answer slowly ten times shares."""
    book = ledger(*SHEET)
    for i in range(10):
        book.file(seen("slow", now - 10 + i, ttft=8.0, rate=10.0))
    return book.evidence(now)


def test_a_restarted_ledger_believes_what_it_believed_before() -> None:
    before = ledger(*SHEET)
    for i in range(10):
        before.file(seen("slow", 90.0 + i, ttft=8.0, rate=10.0))
    after = ledger(*SHEET)
    after.restore(before.evidence(100.0), age=0.0, now=5.0)  # a new process, a new clock
    was, now = before.belief_of(SLOW, 100.0), after.belief_of(SLOW, 5.0)
    assert was is not None
    assert now is not None
    assert now.expected_ttft == pytest.approx(was.expected_ttft, rel=1e-9)
    assert now.expected_rate == pytest.approx(was.expected_rate, rel=1e-9)
    assert now.sightings == 10
    # Untouched machines stay on the sheet.
    assert after.belief_of(FAST, 5.0) == ledger(*SHEET).belief_of(FAST, 5.0)


def test_evidence_kept_on_the_shelf_is_forgotten_for_the_time_it_spent_there() -> None:
    (kept,) = taught()
    assert kept.ttft is not None
    fresh, shelved = ledger(*SHEET), ledger(*SHEET)
    fresh.restore([kept], age=0.0, now=0.0)
    shelved.restore([kept], age=1800.0, now=0.0)  # one half-life
    (a,), (b,) = fresh.evidence(0.0), shelved.evidence(0.0)
    assert a.ttft is not None
    assert b.ttft is not None
    assert b.ttft.n == pytest.approx(a.ttft.n / 2)


def test_a_peer_s_evidence_moves_the_belief_as_if_seen_here_and_is_never_shared_again() -> None:
    told, saw = ledger(*SHEET), ledger(*SHEET)
    for i in range(10):
        saw.file(seen("slow", 90.0 + i, ttft=8.0, rate=10.0))
    told.hear([(item, 1.0) for item in saw.evidence(100.0)], now=100.0)
    heard, own = told.belief_of(SLOW, 100.0), saw.belief_of(SLOW, 100.0)
    assert heard is not None
    assert own is not None
    assert heard.expected_ttft == pytest.approx(own.expected_ttft, rel=1e-6)
    # It shares only what it saw itself: a peer hearing it back counts nothing twice.
    assert told.evidence(100.0) == []
    # A new report replaces the last one (not added to it).
    told.hear([(item, 1.0) for item in saw.evidence(100.0)], now=100.0)
    again = told.belief_of(SLOW, 100.0)
    assert again is not None
    assert again.expected_ttft == pytest.approx(heard.expected_ttft, rel=1e-9)
    # Silence from the fleet: back to the sheet.
    told.hear([], now=100.0)
    assert told.belief_of(SLOW, 100.0) == ledger(*SHEET).belief_of(SLOW, 100.0)


def test_own_and_heard_evidence_add_up_and_stay_within_the_cap() -> None:
    book = ledger(*SHEET)
    book.file(seen("slow", 99.0, ttft=8.0))
    loud = MachineEvidence(SLOW, Evidence(n=500.0, s1=500.0 * 2.0, s2=500.0 * 4.0), None)
    book.hear([(loud, 1.0)], now=100.0)
    belief = book.belief_of(SLOW, 100.0)
    assert belief is not None
    assert belief.ttft is not None
    assert belief.ttft.weight == pytest.approx(book.settings.max_weight)


def test_a_machine_only_peers_have_seen_is_a_candidate_here_too() -> None:
    book = ledger(*SHEET)
    stranger = MachineKey(AGG, MODEL, "new-sub-provider")
    evidence = MachineEvidence(stranger, Evidence(4.0, 4.0 * 0.5, 4.0 * 0.25), None)
    book.hear([(evidence, 0.5)], now=10.0)
    assert "new-sub-provider" in book.machines(AGG, MODEL)
    belief = book.belief_of(stranger, 10.0)
    assert belief is not None
    assert belief.ttft is not None
    assert belief.ttft.weight == pytest.approx(2.0)
    book.hear([], now=11.0)
    assert "new-sub-provider" not in book.machines(AGG, MODEL)


def test_what_a_ledger_shares_is_forgotten_like_its_beliefs() -> None:
    book = ledger(*SHEET)
    book.file(seen("slow", 100.0, ttft=8.0, rate=10.0))
    (now,), (later,) = book.evidence(100.0), book.evidence(100.0 + HOUR)
    assert now.ttft is not None
    assert later.ttft is not None
    assert later.ttft.n == pytest.approx(now.ttft.n / 4)  # two half-lives


# Bounded (SPEC E8): what a peer or a file claims moves a belief only so far --------------

FAST_TTFT = math.log(0.3)


def claiming(n: float, mean: float = FAST_TTFT) -> MachineEvidence:
    """A peer's evidence that `slow` answers its first token in 0.3 s, `n` times over."""
    return MachineEvidence(SLOW, Evidence(n, n * mean, n * mean * mean), None)


def test_a_peer_claiming_a_billion_observations_weighs_no_more_than_the_ledger_s_cap() -> None:
    """Each peer's pseudo-count is capped at the ledger's own cap (40): a claim of a billion
    moves the belief exactly as far as a claim of forty, and this pod's own sighting keeps
    its share."""
    beliefs = []
    for n in (40.0, 1e9):
        book = ledger(*SHEET)
        book.file(seen("slow", 99.0, ttft=8.0))
        book.hear([(claiming(n), 1.0)], now=100.0)
        belief = book.belief_of(SLOW, 100.0)
        assert belief is not None
        assert belief.ttft is not None
        beliefs.append(belief.ttft)
    capped, loud = beliefs
    assert loud.weight == pytest.approx(capped.weight)
    assert loud.mean() == pytest.approx(capped.mean(), rel=1e-9)
    assert loud.mean() > 0.3 * 1.05  # the own 8 s sighting still pulls it up


def test_restored_evidence_weighs_no_more_than_the_ledger_s_cap() -> None:
    book = ledger(*SHEET)
    book.restore([claiming(1e9)], age=0.0, now=0.0)
    belief = book.belief_of(SLOW, 0.0)
    assert belief is not None
    assert belief.ttft is not None
    assert belief.ttft.weight == pytest.approx(book.settings.max_weight)


def test_evidence_past_every_bound_still_gives_a_belief_that_answers() -> None:
    """Defence in depth: evidence the decoder would refuse, handed to the ledger anyway (a
    log-sum of 1e5, a mean log of -1e5, a spread of 1e300), gives beliefs whose every
    number is finite: a routing decision and the state endpoint never raise."""
    for n, s1, s2 in ((1.0, 1e5, 1e10), (1.0, -1e5, 1e10), (2.0, 0.0, 1e300)):
        book = ledger(*SHEET)
        book.hear([(MachineEvidence(SLOW, Evidence(n, s1, s2), Evidence(n, s1, s2)), 1.0)], 1.0)
        (belief,) = [b for b in book.beliefs(1.0) if b.key == SLOW]
        assert belief.ttft is not None
        for value in (
            belief.expected_ttft,
            belief.expected_rate,
            belief.expected_seconds(1000),
            belief.ttft.median(),
            belief.ttft.upper(2.0),
            belief.ttft.residual(5.0),
        ):
            assert value is not None
            assert math.isfinite(value), (n, s1, s2)


@pytest.mark.parametrize("m", [1e5, -1e5, math.inf, -math.inf, math.nan])
def test_a_log_normal_never_overflows(m: float) -> None:
    belief = LogNormal(m, 1.0, 2.0, 1.0)
    for value in (belief.mean(), belief.median(), belief.upper(2.0), belief.upper(-2.0)):
        assert 1e-9 <= value <= 1e9
