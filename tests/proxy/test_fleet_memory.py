"""A fleet of proxy pods as one memory, in the pure core: each pod hears the others'
evidence (weighted by its age), never its own twice and never passes on what it heard."""

from __future__ import annotations

import pytest

from rolegate_policy.model import BreakerSpec
from rolegate_policy.status import TripReason
from rolegate_proxy.core.beliefs import MachineKey
from rolegate_proxy.core.breaker import Attempted, Breakers
from rolegate_proxy.core.exclusions import BreakerKey, Transition, Trigger
from rolegate_proxy.core.fleet import PodMemory, hear_fleet, remember, restore
from rolegate_proxy.core.score import ObservationKind, Scoreboard, ScoreEvidence
from rolegate_proxy.wire.pod_memory import decode, encode

from .test_beliefs import AGG, HOUR, MODEL, ledger, seen
from .test_breaker import clean, empty, make, open_breaker

SLOW = MachineKey(AGG, MODEL, "slow")
SHEET = (("fast", 2.0, 50.0), ("slow", 2.0, 50.0))


def pod(name: str, failures: int, *, wall: float = 1000.0) -> PodMemory:
    """The memory of a pod that saw `slow` fail `failures` times, slowly."""
    book, scores = ledger(*SHEET), Scoreboard()
    for i in range(failures):
        book.file(seen("slow", 90.0 + i * 0.1, ttft=8.0))
        scores.observe(SLOW, ObservationKind.EMPTY_SUCCESS, 90.0 + i * 0.1)
    return remember(name, book, scores, 100.0, wall)


def test_three_pods_count_as_one_memory_and_none_counts_itself_twice() -> None:
    a, b, c = pod("a", 10), pod("b", 10), pod("c", 10)
    book, scores = ledger(*SHEET), Scoreboard()
    for i in range(10):  # pod a's own ten, as its ledger and scoreboard hold them
        book.file(seen("slow", 90.0 + i * 0.1, ttft=8.0))
        scores.observe(SLOW, ObservationKind.EMPTY_SUCCESS, 90.0 + i * 0.1)
    hear_fleet([a, b, c], "a", book, scores, 100.0, 1000.0)
    view = scores.operational(SLOW)
    assert view.n == 30  # its own ten and its two peers' twenty: a's own not again
    assert view.observed == pytest.approx(0.0)
    assert view.confidence == pytest.approx(30 / 50)
    # What it shares is still its own ten only.
    mine = remember("a", book, scores, 100.0, 1000.0)
    assert [evidence.n for _, evidence in mine.scores] == [10]
    belief = book.belief_of(SLOW, 100.0)
    alone = ledger(*SHEET)
    for i in range(10):
        alone.file(seen("slow", 90.0 + i * 0.1, ttft=8.0))
    lonely = alone.belief_of(SLOW, 100.0)
    assert belief is not None
    assert lonely is not None
    assert belief.ttft is not None
    assert lonely.ttft is not None
    assert belief.ttft.weight > lonely.ttft.weight


def test_an_old_report_counts_for_less_and_silence_forgets_it() -> None:
    book, scores = ledger(*SHEET), Scoreboard()
    fresh, stale = pod("b", 10, wall=1000.0), pod("c", 10, wall=1000.0 - HOUR)
    hear_fleet([fresh, stale], "a", book, scores, 100.0, 1000.0)
    assert scores.operational(SLOW).n == 10 + round(10 * 0.25)  # an hour: two half-lives
    hear_fleet([], "a", book, scores, 100.0, 1000.0)
    assert scores.operational(SLOW).n == 0
    assert book.belief_of(SLOW, 100.0) == ledger(*SHEET).belief_of(SLOW, 100.0)


def test_a_machine_only_a_peer_has_scored_is_scored_here_too() -> None:
    scores = Scoreboard()
    hear_fleet([pod("b", 60)], "a", ledger(*SHEET), scores, 100.0, 1000.0)
    view = scores.operational(SLOW)
    assert (view.n, view.confidence) == (60, 1.0)
    assert view.score == pytest.approx(0.0)
    # Its own observations then add to the fleet's.
    scores.observe(SLOW, ObservationKind.OK, 101.0)
    assert scores.operational(SLOW).n == 61


def test_a_signature_seen_before_a_restart_is_familiar_after_it() -> None:
    """One empty answer on the old process, twenty minutes before: after the restart two
    more are a familiar signature (five needed), not a novel burst (two trip)."""
    before = make()
    before.record(empty(), 0.0)
    kept = remember("a", ledger(*SHEET), Scoreboard(), 10.0, 1000.0, breakers=before)
    (marks,) = decode(encode(kept)).faults
    assert (marks.key, marks.signature, marks.ages) == (
        BreakerKey("p", "m"),
        "empty_response",
        (10.0,),
    )

    restarted, forgetful = make(), make()
    restore(decode(encode(kept)), ledger(*SHEET), Scoreboard(), 5.0, 2200.0, breakers=restarted)
    for breakers in (restarted, forgetful):
        breakers.record(empty(), 6.0)
    assert restarted.record(empty(), 7.0) == []
    (trip,) = forgetful.record(empty(), 7.0)
    assert trip.trigger is Trigger.NOVELTY
    # A baseline older than the novelty window is not taken back.
    stale = make(BreakerSpec(jitter_fraction=0, novelty_window_seconds=30))
    restore(decode(encode(kept)), ledger(*SHEET), Scoreboard(), 5.0, 2200.0, breakers=stale)
    stale.record(empty(), 6.0)
    assert stale.record(empty(), 7.0) != []


def test_a_breaker_one_pod_holds_open_keeps_the_key_out_on_every_pod_until_it_closes() -> None:
    a, c = make(), make()
    open_breaker(a, lambda: Attempted.http_error("p", "m", 503, machine="bad"), 0.0, times=10)
    said = decode(encode(remember("a", ledger(*SHEET), Scoreboard(), 2.0, 1000.0, breakers=a)))
    assert said.trips == ((BreakerKey("p", "m", "bad"), TripReason.UPSTREAM_ERRORS),)

    hear_fleet([said], "c", ledger(*SHEET), Scoreboard(), 50.0, 1001.0, breakers=c, trip_expiry=90)
    refusal = c.exclusion("p", "m", "bad", 50.0)
    assert refusal is not None
    assert refusal.trigger is Trigger.FLEET
    assert "proxy pod a" in refusal.detail
    assert c.exclusion("p", "m", "good", 50.0) is None
    # An aggregator attempt leaves the machine out; a probe is never c's to send.
    attempt = c.admit_attempt("p", "m", ["bad", "good"], 50.0)
    assert attempt.allowed
    assert attempt.refused == ("bad",)
    assert attempt.probes == ()
    # A memory that stops coming stops excluding at the expiry (90 s after it was written,
    # heard a second later)...
    assert c.exclusion("p", "m", "bad", 50.0 + 88.9) is not None
    assert c.exclusion("p", "m", "bad", 50.0 + 89.0) is None
    # ...and a's next memory without the trip lifts it at once.
    hear_fleet([said], "c", ledger(*SHEET), Scoreboard(), 60.0, 1001.0, breakers=c, trip_expiry=90)
    closed = PodMemory("a", 1010.0)
    hear_fleet(
        [closed], "c", ledger(*SHEET), Scoreboard(), 61.0, 1011.0, breakers=c, trip_expiry=90
    )
    assert c.exclusion("p", "m", "bad", 61.0) is None


def test_a_pod_s_own_trips_are_never_heard_back_and_a_wide_key_refuses_the_whole_model() -> None:
    a = make()
    open_breaker(a, empty, 0.0)  # model-wide
    said = remember("a", ledger(*SHEET), Scoreboard(), 2.0, 1000.0, breakers=a)
    itself = make()
    hear_fleet(
        [said], "a", ledger(*SHEET), Scoreboard(), 3.0, 1000.0, breakers=itself, trip_expiry=90
    )
    assert itself.exclusion("p", "m", None, 3.0) is None
    other = make()
    hear_fleet(
        [said], "b", ledger(*SHEET), Scoreboard(), 3.0, 1000.0, breakers=other, trip_expiry=90
    )
    assert not other.admit("p", "m", "any", 3.0).allowed


# Only the rate arm: 35 % empty, the measured incident's rate, never a count burst.
RATE_ONLY = BreakerSpec(
    jitter_fraction=0,
    novel_signature_count=10_000,
    familiar_signature_count=10_000,
    rate_min_samples=20,
    rate_window=40,
    rate_threshold=0.25,
)


def serve(breakers: Breakers, calls: int, start: float) -> list[Transition]:
    """`calls` answers of model m, about 35 % of them empty (every third, and the first)."""
    found: list[Transition] = []
    for i in range(calls):
        outcome = empty() if i % 3 == 0 else clean()
        found.extend(breakers.record(outcome, start + i * 0.01))
    return found


def test_a_fault_rate_spread_over_three_pods_trips_at_the_fleet_s_minimum_sample() -> None:
    a, b, c, alone = (make(RATE_ONLY) for _ in range(4))
    assert serve(a, 9, 0.0) == []  # nine calls each: under the minimum sample of 20
    assert serve(b, 9, 0.0) == []
    memories = [
        remember(name, ledger(*SHEET), Scoreboard(), 1.0, 1000.0, breakers=pod)
        for name, pod in (("a", a), ("b", b))
    ]
    said = [decode(encode(memory)) for memory in memories]
    hear_fleet(said, "c", ledger(*SHEET), Scoreboard(), 1.0, 1000.0, breakers=c, trip_expiry=90)
    (trip,) = serve(c, 3, 2.0)  # 18 heard: its own second answer is the fleet's 20th
    assert trip.trigger is Trigger.RATE
    assert "across the fleet" in trip.detail
    assert serve(alone, 9, 2.0) == []  # the same nine alone never reach the sample


def test_two_pods_that_both_tripped_a_key_each_probe_it_and_recover() -> None:
    """Each hears the other's trip; neither may keep the other from its own probe (they
    would hold the key out forever), and once both probes succeed it is back on both."""
    a, b = make(), make()
    open_breaker(a, empty, 0.0)
    open_breaker(b, empty, 0.0)
    said_a = remember("a", ledger(*SHEET), Scoreboard(), 2.0, 1000.0, breakers=a)
    said_b = remember("b", ledger(*SHEET), Scoreboard(), 2.0, 1000.0, breakers=b)
    hear_fleet([said_b], "a", ledger(*SHEET), Scoreboard(), 2.0, 1000.0, breakers=a, trip_expiry=90)
    hear_fleet([said_a], "b", ledger(*SHEET), Scoreboard(), 2.0, 1000.0, breakers=b, trip_expiry=90)
    after_cooldown = 2.0 + 60.0
    for pod in (a, b):
        probe = pod.admit("p", "m", None, after_cooldown)
        assert probe.allowed
        assert probe.is_probe
        pod.record(clean(), after_cooldown)
    # A recovered: B's trip, heard before, still keeps the key out on A until B's next word.
    assert a.exclusion("p", "m", None, 63.0) is not None
    recovered_b = remember("b", ledger(*SHEET), Scoreboard(), 63.0, 1061.0, breakers=b)
    hear_fleet(
        [recovered_b], "a", ledger(*SHEET), Scoreboard(), 63.0, 1061.0, breakers=a, trip_expiry=90
    )
    assert a.exclusion("p", "m", None, 63.0) is None


def test_a_peer_s_score_weighs_no_more_than_a_long_record_whatever_it_claims() -> None:
    """A record's weight is at most 1 / alpha (a long history's): a peer claiming a weight
    of a million moves this pod's score exactly as far as one claiming that much."""
    found = []
    for claimed in (None, 1e6):
        scores = Scoreboard()
        most = 1.0 / scores.settings.alpha
        for i in range(10):
            scores.observe(SLOW, ObservationKind.OK, 90.0 + i)
        peer = ScoreEvidence(10**6, 0.0, most if claimed is None else claimed)
        scores.hear([(SLOW, peer, 1.0)], 100.0)
        found.append(scores.operational(SLOW).observed)
    long_record, loud = found
    assert loud == pytest.approx(long_record)
    assert loud is not None
    assert loud > 0.1  # this pod's ten good answers still count


def test_a_restored_score_weighs_no_more_than_a_long_record_whatever_it_claims() -> None:
    found = []
    for claimed in (None, 1e6):
        scores = Scoreboard()
        most = 1.0 / scores.settings.alpha
        kept = ScoreEvidence(10**6, 0.0, most if claimed is None else claimed)
        restore(PodMemory("a", 1000.0, scores=((SLOW, kept),)), ledger(*SHEET), scores, 0.0, 1000.0)
        for i in range(10):
            scores.observe(SLOW, ObservationKind.OK, 1.0 + i)
        found.append(scores.operational(SLOW).observed)
    long_record, loud = found
    assert loud == pytest.approx(long_record)
    assert loud is not None
    assert loud > 0.1
