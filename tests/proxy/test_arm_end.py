"""How an arm ended, and what each consumer makes of it: pure (core/arm_end.py)."""

from __future__ import annotations

import dataclasses

import pytest

from rolegate_proxy.core.arm_end import (
    CLIENT_HOLD_TOLERANCE,
    UPSTREAM_FAULTS,
    Answered,
    ArmEnd,
    Cause,
    arm_result,
    breaker_input,
    sighting,
)
from rolegate_proxy.core.beliefs import (
    NO_GAPS,
    REFERENCE_SHAPE,
    Completed,
    GapStats,
    Ledger,
    MachineKey,
    Sighting,
)
from rolegate_proxy.core.breaker import TransportFault
from rolegate_proxy.core.outcomes import ArmAct, ArmResult
from rolegate_proxy.core.routing import Attempt, MachineRouting
from rolegate_proxy.core.verdicts import OK, Verdict, VerdictKind
from rolegate_proxy.flow.arms import ArmRun
from rolegate_proxy.flow.upstream import Silence

from ..support import published_sheet

KEY = MachineKey("agg", "vendor/model", "m1")


def end(cause: Cause, **facts: object) -> ArmEnd:
    fields: dict[str, object] = {
        "provider": KEY.provider, "model": KEY.model, "machine": KEY.machine, "cause": cause,
        "started_at": 10.0, "ended_at": 12.0, "streamed": True,
    }  # fmt: skip
    fields.update(facts)
    return ArmEnd(**fields)  # type: ignore[arg-type]


NOT_THE_UPSTREAMS = [c for c in Cause if c not in UPSTREAM_FAULTS and c is not Cause.ANSWERED]


@pytest.mark.parametrize("cause", NOT_THE_UPSTREAMS)
def test_what_is_not_the_upstreams_doing_never_reaches_the_breaker(cause: Cause) -> None:
    assert breaker_input(end(cause, status=503, verdict=OK)) is None


@pytest.mark.parametrize(
    ("cause", "fault"),
    [
        (Cause.REFUSED, TransportFault.CONNECTION_FAILED),
        (Cause.CUT, TransportFault.BROKEN_STREAM),
        (Cause.MALFORMED, TransportFault.BROKEN_STREAM),
        (Cause.STALL, TransportFault.TIMEOUT),
        (Cause.IN_BAND_ERROR, TransportFault.STREAM_ERROR),
    ],
)
def test_the_upstreams_transport_faults_reach_the_breaker(
    cause: Cause, fault: TransportFault
) -> None:
    told = breaker_input(end(cause, started_at=3.0))
    assert told is not None
    assert (told.transport, told.started_at, told.machine) == (fault, 3.0, "m1")


def test_a_direct_providers_failure_is_keyed_by_the_provider_not_a_machine() -> None:
    told = breaker_input(end(Cause.HTTP_ERROR, status=503, direct=True))
    assert told is not None
    assert (told.status, told.machine) == (503, None)


def test_answers_reach_the_breaker_with_their_verdict() -> None:
    empty = Verdict(VerdictKind.MALFORMED, attributable=True)
    for cause, verdict in ((Cause.ANSWERED, OK), (Cause.DEGRADED, empty)):
        told = breaker_input(end(cause, verdict=verdict))
        assert told is not None
        assert told.verdict is verdict


def test_a_streamed_arm_teaches_its_first_token_and_gaps_however_it_ended() -> None:
    gaps = GapStats.of([0.1, 0.1])
    for cause in (Cause.ANSWERED, Cause.CUT, Cause.MOVED, Cause.CLIENT_LEFT):
        taught = sighting(end(cause, first_at=10.5, gaps=gaps), None)
        assert taught is not None
        assert (taught.ttft, taught.gaps, taught.cut) == (0.5, gaps, cause is not Cause.ANSWERED)


def test_what_a_slow_client_held_is_not_the_machines() -> None:
    """A client that reads slowly holds the stream by back-pressure (SPEC E8): the arm's
    seconds leave that out, and past a few writes' worth its gaps are not taught."""
    gaps = GapStats.of([0.1, 0.1])
    briefly = end(Cause.ANSWERED, first_at=10.5, gaps=gaps, client_held=CLIENT_HOLD_TOLERANCE)
    assert briefly.seconds == pytest.approx(2.0 - CLIENT_HOLD_TOLERANCE)
    taught = sighting(briefly, None)
    assert taught is not None
    assert taught.gaps == gaps
    held = end(Cause.ANSWERED, first_at=10.5, gaps=gaps, client_held=1.5)
    assert held.seconds == pytest.approx(0.5)
    assert arm_result(held, patience=1.0) is ArmResult.OK  # 2 s in all, 0.5 s the machine's
    taught = sighting(held, None)
    assert taught is not None
    assert (taught.ttft, taught.gaps) == (0.5, NO_GAPS)


@pytest.mark.parametrize("cause", [Cause.CLIENT_LEFT, Cause.RACE_LOST, Cause.DEADLINE, Cause.STALL])
def test_a_wait_we_or_the_client_ended_teaches_a_lower_bound(cause: Cause) -> None:
    taught = sighting(end(cause), None)
    assert taught is not None
    assert (taught.ttft, taught.waited) == (None, 2.0)


@pytest.mark.parametrize(
    "cause", [Cause.HTTP_ERROR, Cause.REFUSED, Cause.STALE_CONNECTION, Cause.NO_CREDENTIALS]
)
def test_a_failure_before_any_token_says_nothing_about_when_one_would_come(cause: Cause) -> None:
    assert sighting(end(cause), None) is None


def test_a_stale_connection_erases_nothing_even_after_content() -> None:
    assert sighting(end(Cause.STALE_CONNECTION, first_at=10.5), None) is None


def test_a_non_streamed_answer_teaches_its_total_time_and_never_gaps() -> None:
    ledger = Ledger()
    # Believed: a 1 s first token, then 10 tokens a second.
    ledger.note(Sighting(*KEY, 0.0, ttft=1.0, gaps=GapStats.of([0.1] * 50)))
    belief = ledger.belief_of(KEY, 0.0)
    assert belief is not None
    assert belief.gap is not None
    # 30 tokens in 12 s: three times what is believed (1 + 30 x 0.1 = 4 s).
    answered = end(Cause.ANSWERED, streamed=False, ended_at=22.0,
                   answer=Answered("stop", 5, 30))  # fmt: skip
    taught = sighting(answered, belief)
    assert taught is not None
    assert taught.completed == Completed(12.0, 30)
    assert taught.gaps is NO_GAPS  # no per-token gap is made up (SPEC B7)
    assert taught.ttft is None  # 12 s bounds the first token from above only
    before = ledger.belief_of(KEY, taught.at)
    assert before is not None
    after = ledger.note(taught)
    assert after is not None
    assert after.gap == before.gap  # the gap belief is untouched...
    assert after.ttft == before.ttft
    assert after.expected_seconds(30) > before.expected_seconds(30)  # type: ignore[operator]


def test_a_one_token_non_streamed_answer_is_a_time_to_first_token() -> None:
    answered = end(Cause.ANSWERED, streamed=False, answer=Answered("length", 5, 1))
    taught = sighting(answered, None)
    assert taught is not None
    assert (taught.ttft, taught.completed, taught.gaps) == (2.0, None, NO_GAPS)


def test_an_unknown_machines_first_non_streamed_answer_gives_it_a_belief() -> None:
    answered = end(Cause.ANSWERED, streamed=False, answer=Answered("stop", 5, 40))
    taught = sighting(answered, None)
    assert taught is not None
    ledger = Ledger()
    assert ledger.belief_of(KEY, 12.0) is None
    belief = ledger.note(taught)
    assert belief is not None
    # Its pace against the reference shape, and stand-in priors from it: refusable (B2).
    pace = 2.0 / REFERENCE_SHAPE.seconds(40)
    assert belief.expected_pace == pytest.approx(pace, rel=0.3)
    assert belief.expected_seconds(40) == pytest.approx(2.0, rel=0.3)
    assert belief.gap is not None
    assert belief.gap.weight == 0.0  # a prior, not data


def test_results_on_the_record() -> None:
    assert arm_result(end(Cause.ANSWERED), patience=5) is ArmResult.OK
    assert arm_result(end(Cause.ANSWERED), patience=1) is ArmResult.LATE
    capped = end(Cause.ANSWERED, answer=Answered("length", capped_by_upstream=True))
    assert arm_result(capped, patience=5) is ArmResult.LENGTH_CAPPED
    for status, result in ((429, ArmResult.RATE_LIMITED), (403, ArmResult.UNAUTHORIZED),
                           (503, ArmResult.SERVER_ERROR)):  # fmt: skip
        assert arm_result(end(Cause.HTTP_ERROR, status=status), patience=5) is result
    empty = Verdict(VerdictKind.MALFORMED, attributable=True)
    assert arm_result(end(Cause.DEGRADED, verdict=empty), patience=5) is ArmResult.EMPTY_SUCCESS
    mangled = Verdict(VerdictKind.MANGLED, attributable=True)
    assert arm_result(end(Cause.DEGRADED, verdict=mangled), patience=5) is ArmResult.DEGRADED
    assert arm_result(end(Cause.CLIENT_LEFT), patience=5) is ArmResult.CANCELLED
    assert arm_result(end(Cause.STALE_CONNECTION), patience=5) is ArmResult.STALE_CONNECTION
    for cause in Cause:  # every cause has a result
        arm_result(end(cause, status=503), patience=5)


def test_an_arm_run_ends_with_every_fact_it_saw() -> None:
    config = published_sheet("agg", "vendor/model", [("m1", 1.0, 50.0), ("m2", None, None)])
    provider = config.providers[0]
    run = ArmRun(
        Attempt(provider, provider.models[0], MachineRouting.only("m2")), 10.0, False,
        Silence(30.0, False), act=ArmAct.RACED,
    )  # fmt: skip
    run.named = "m1"
    answer = Answered("stop", 3, 5)
    ended = run.end(Cause.ANSWERED, 12.5, "answered", verdict=OK, answer=answer)
    assert {field.name: getattr(ended, field.name) for field in dataclasses.fields(ended)} == {
        "provider": "agg",
        "model": "vendor/model",
        "machine": "m1",
        "cause": Cause.ANSWERED,
        "started_at": 10.0,
        "ended_at": 12.5,
        "streamed": False,
        "direct": False,
        "named": True,
        "first_at": None,
        "gaps": NO_GAPS,
        "status": None,
        "error_code": None,
        "request_fault": None,
        "retry_after": None,
        "verdict": OK,
        "answer": answer,
        "act": ArmAct.RACED,
        "delivered": False,
        "detail": "answered",
        "span_id": 0,
        "client_held": 0.0,
    }
