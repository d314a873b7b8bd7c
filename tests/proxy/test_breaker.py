"""The circuit breaker as a pure state machine (SPEC A5-A8, C4): the clock is an argument,
jitter comes from a seeded `random.Random`, nothing sleeps. Includes the seed's measured
empty-200 incident replayed in the pure core."""

from __future__ import annotations

import inspect
import random
import re
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from email.utils import format_datetime

import pytest

from rolegate_policy.enums import (
    TransportScope,
)
from rolegate_policy.model import (
    BreakerSpec,
    DegradedOutputSpec,
)
from rolegate_policy.signatures import Signature
from rolegate_policy.status import CAMEL_CASE_PATTERN, BreakerPhase, Scope, TripReason
from rolegate_proxy.core import breaker as breaker_module
from rolegate_proxy.core import evidence as evidence_module
from rolegate_proxy.core import exclusions as exclusions_module
from rolegate_proxy.core import verdicts as verdicts_module
from rolegate_proxy.core.breaker import (
    BURST_SECONDS,
    PROBE_LEASE_SECONDS,
    Admission,
    Attempted,
    Breakers,
    TransportFault,
)
from rolegate_proxy.core.exclusions import (
    MAX_RETRY_AFTER_SECONDS,
    BreakerKey,
    BreakerView,
    Cause,
    Exclusion,
    Transition,
    TransitionKind,
    Trigger,
    is_request_fault,
    parse_retry_after,
)
from rolegate_proxy.core.tool_calls import DeclaredTools, ToolCall
from rolegate_proxy.core.verdicts import ASCII_PROMPT, PromptProfile, Verdict, judge, profile_texts

# The schedule these tests are written against (the defaults are shorter: see
# test_the_default_schedule_notices_a_recovery_within_half_a_minute).
LONG = {"cooldown_seconds": 30.0, "max_cooldown_seconds": 600.0}
NO_JITTER = BreakerSpec(jitter_fraction=0.0, **LONG)
MOJIBAKE = bytes.fromhex("c3a2c280c294").decode("utf-8")  # a double-encoded em dash
JAPANESE = profile_texts(["日本語で答えて"])

# The measured incident's cast (seed 000): two providers, four models.
OPENROUTER, NEURALWATT = "openrouter", "neuralwatt"
NEMOTRON = "nvidia/nemotron-3-nano-omni-30b-a3b-reasoning:free"
GLM = "z-ai/glm-5.3-flash"
QWEN, DEEPSEEK = "qwen3.6-35b", "deepseek-v4-flash"


def make(
    settings: BreakerSpec = NO_JITTER,
    *,
    seed: int = 0,
    degraded: DegradedOutputSpec | None = None,
    max_keys: int = 4096,
) -> Breakers:
    def degraded_for(_provider: str) -> DegradedOutputSpec:
        return degraded or DegradedOutputSpec()

    return Breakers(
        lambda _provider: settings,
        random.Random(seed),
        degraded_for=degraded_for,
        max_keys=max_keys,
    )


SOUND_CALL = ToolCall("call_1", "read_file", '{"path": "a.txt"}')
DECLARED = DeclaredTools(frozenset({"read_file"}))


def verdict(
    text: str | None, prompt: PromptProfile = ASCII_PROMPT, *, tool_calls: bool = False
) -> Verdict:
    return judge(
        text,
        finish_reason="stop",
        status=200,
        prompt=prompt,
        client_capped=False,
        tool_calls=(SOUND_CALL,) if tool_calls else (),
        declared=DECLARED,
    )


def clean(
    provider: str = "p",
    model: str = "m",
    *,
    machine: str | None = None,
    started_at: float | None = None,
) -> Attempted:
    answer = verdict("a fine answer")
    return Attempted.answered(provider, model, answer, machine=machine, started_at=started_at)


def empty(provider: str = "p", model: str = "m", *, machine: str | None = None) -> Attempted:
    return Attempted.answered(provider, model, verdict(""), machine=machine)


def mangled(
    provider: str = "p", model: str = "m", prompt: PromptProfile = ASCII_PROMPT
) -> Attempted:
    return Attempted.answered(provider, model, verdict("x " + MOJIBAKE + " y", prompt))


def tool_calls(provider: str = "p", model: str = "m") -> Attempted:
    return Attempted.answered(provider, model, verdict("", tool_calls=True))


def status(
    code: int,
    provider: str = "p",
    model: str = "m",
    *,
    machine: str | None = None,
    retry_after: float | None = None,
) -> Attempted:
    return Attempted.http_error(provider, model, code, machine=machine, retry_after=retry_after)


def feed(breakers: Breakers, outcomes: Iterable[Attempted], start: float, step: float) -> float:
    now = start
    for outcome in outcomes:
        breakers.record(outcome, now)
        now += step
    return now


def tripped(transitions: list[Transition]) -> list[Transition]:
    return [t for t in transitions if t.kind is TransitionKind.TRIPPED]


def open_breaker(
    breakers: Breakers, outcome: Callable[[], Attempted], now: float, times: int = 2
) -> Transition:
    """Record `outcome` until it trips; returns the trip."""
    for i in range(times):
        found = tripped(breakers.record(outcome(), now + i))
        if found:
            return found[0]
    raise AssertionError("did not trip")


# --- one bad response is noise ----------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        empty(),
        mangled(),
        status(503),
        Attempted.transport_failure("p", "m", TransportFault.TIMEOUT),
        Attempted.transport_failure("p", "m", TransportFault.CONNECTION_FAILED),
        Attempted.transport_failure("p", "m", TransportFault.BROKEN_STREAM, status=200),
    ],
)
def test_a_single_bad_response_never_trips(bad: Attempted) -> None:
    breakers = make()
    assert breakers.record(bad, 0.0) == []
    assert breakers.exclusion("p", "m", None, 0.0) is None
    assert all(state.state is BreakerPhase.CLOSED for state in breakers.snapshot(0.0))


# --- scope by signature (SPEC A6) -------------------------------------------------------------


def test_empty_answers_trip_the_provider_model_pair_only() -> None:
    breakers = make()
    breakers.record(empty("p", "a"), 0.0)
    (trip,) = breakers.record(empty("p", "a"), 1.0)

    assert trip.kind is TransitionKind.TRIPPED
    assert trip.key == BreakerKey("p", "a")
    assert trip.key.scope is Scope.MODEL
    assert trip.reason is TripReason.EMPTY_RESPONSES
    assert trip.trigger is Trigger.NOVELTY
    assert trip.until == pytest.approx(1.0 + NO_JITTER.cooldown_seconds)
    refused = breakers.exclusion("p", "a", None, 2.0)
    assert refused is not None
    assert refused.cause is Cause.BREAKER
    assert refused.state is BreakerPhase.OPEN
    # The provider's other models are untouched.
    assert breakers.exclusion("p", "b", None, 2.0) is None
    assert breakers.admit("p", "b", None, 2.0).allowed


def test_mangled_output_trips_the_whole_provider() -> None:
    breakers = make()
    breakers.record(mangled("p", "a"), 0.0)
    (trip,) = breakers.record(mangled("p", "b"), 1.0)

    assert trip.key == BreakerKey("p")
    assert trip.key.scope is Scope.PROVIDER
    assert trip.reason is TripReason.MANGLED_OUTPUT
    for model in ("a", "b", "c"):
        refused = breakers.exclusion("p", model, "any-machine", 2.0)
        assert refused is not None
        assert refused.key == BreakerKey("p")
    assert breakers.exclusion("other", "a", None, 2.0) is None


def test_a_machine_mangling_ascii_prompts_trips_its_provider_but_not_non_ascii_ones() -> None:
    # The same machine, double-encoding everything: attributable only after ASCII prompts.
    quiet = make()
    for i in range(1000):
        assert quiet.record(mangled("p", "m", JAPANESE), float(i)) == []
    assert quiet.exclusion("p", "m", None, 1000.0) is None

    loud = make()
    loud.record(mangled("p", "m"), 0.0)
    assert tripped(loud.record(mangled("p", "m"), 1.0))[0].key == BreakerKey("p")


def test_low_confidence_signatures_never_trip() -> None:
    breakers = make()
    smart_quotes = Attempted.answered("p", "m", verdict("\u201cquoted\u201d"))
    assert smart_quotes.verdict is not None
    assert smart_quotes.verdict.signature is Signature.NON_ASCII_NOT_IN_PROMPT
    for i in range(1000):
        assert breakers.record(smart_quotes, float(i)) == []
    assert breakers.exclusion("p", "m", None, 1000.0) is None


def test_transport_faults_follow_the_declared_scope() -> None:
    for scope, key in (
        (TransportScope.PROVIDER, BreakerKey("p")),
        (TransportScope.MODEL, BreakerKey("p", "m")),
    ):
        breakers = make(BreakerSpec(jitter_fraction=0, transport_scope=scope))
        breakers.record(status(503), 0.0)
        (trip,) = breakers.record(status(502), 1.0)
        assert trip.key == key
        assert trip.reason is TripReason.UPSTREAM_ERRORS
        assert "http_5xx" in trip.detail


def test_redirects_are_transport_faults_under_one_signature() -> None:
    # A 3xx is never followed (flow/upstream.py): the upstream did not answer, as with a 5xx.
    breakers = make(BreakerSpec(jitter_fraction=0))
    breakers.record(status(307), 0.0)
    (trip,) = breakers.record(status(302), 1.0)
    assert trip.key == BreakerKey("p")
    assert trip.reason is TripReason.UPSTREAM_ERRORS
    assert "http_3xx" in trip.detail


def test_an_aggregators_named_failing_machine_is_tripped_alone() -> None:
    breakers = make()
    breakers.record(status(503, "agg", "m", machine="DeepInfra"), 0.0)
    (trip,) = breakers.record(status(500, "agg", "m", machine="DeepInfra"), 1.0)
    assert trip.key == BreakerKey("agg", "m", "DeepInfra")
    assert trip.key.scope is Scope.MACHINE
    assert breakers.exclusion("agg", "m", "DeepInfra", 2.0) is not None
    assert breakers.exclusion("agg", "m", "Together", 2.0) is None
    assert breakers.exclusion("agg", "other", "DeepInfra", 2.0) is None
    # A direct provider's single machine is named after it: the declared scope applies.
    direct = make()
    direct.record(status(503, "vllm", "m", machine="vllm"), 0.0)
    (trip,) = direct.record(status(503, "vllm", "m", machine="vllm"), 1.0)
    assert trip.key == BreakerKey("vllm")
    # Without naming a machine the caller asks about the provider and model: not excluded,
    # so an aggregator's router must ask per machine to build `provider.ignore`.
    assert breakers.exclusion("agg", "m", None, 2.0) is None


@pytest.mark.parametrize(
    "fault",
    [TransportFault.CONNECTION_FAILED, TransportFault.TIMEOUT, TransportFault.STREAM_ERROR],
)
def test_refused_connections_timeouts_and_stream_errors_trip(fault: TransportFault) -> None:
    breakers = make()
    breakers.record(Attempted.transport_failure("p", "m", fault), 0.0)
    (trip,) = breakers.record(Attempted.transport_failure("p", "m", fault), 1.0)
    assert trip.reason is TripReason.UPSTREAM_ERRORS
    assert fault.value in trip.detail


@pytest.mark.parametrize("code", [400, 404, 413, 422])
def test_statuses_about_the_request_trip_nothing_and_are_no_evidence(code: int) -> None:
    assert is_request_fault(code)
    breakers = make()
    for i in range(100):
        assert breakers.record(status(code), float(i)) == []
    assert breakers.snapshot(100.0) == []
    for code_upstream in (408, 409, 425, 500, 503, 529):
        assert not is_request_fault(code_upstream)


# --- novelty, count and rate (SPEC A7) --------------------------------------------------------


def test_a_familiar_signature_needs_the_configured_count() -> None:
    breakers = make()
    open_breaker(breakers, empty, 0.0)
    probe_at = 100.0
    assert breakers.admit("p", "m", None, probe_at).is_probe
    assert breakers.record(clean(), probe_at)[0].kind is TransitionKind.RECOVERED

    # Seen within the novelty window: two no longer trip, the fifth does.
    now = probe_at + 1
    for i in range(NO_JITTER.familiar_signature_count - 1):
        assert breakers.record(empty(), now + i) == []
    (trip,) = breakers.record(empty(), now + 10)
    assert trip.trigger is Trigger.COUNT
    assert "5 familiar empty_response" in trip.detail


def test_a_signature_unseen_for_the_novelty_window_is_new_again() -> None:
    settings = BreakerSpec(jitter_fraction=0, novelty_window_seconds=3600)
    breakers = make(settings)
    open_breaker(breakers, empty, 0.0)
    breakers.admit("p", "m", None, 100.0)
    breakers.record(clean(), 100.0)

    later = 100.0 + 3600 + BURST_SECONDS + 1
    breakers.record(empty(), later)
    (trip,) = breakers.record(empty(), later + 1)
    assert trip.trigger is Trigger.NOVELTY


def test_count_arms_look_back_over_the_burst_window_only() -> None:
    breakers = make()
    breakers.record(empty(), 0.0)
    assert breakers.record(empty(), BURST_SECONDS + 1) == []


def test_a_familiar_trickle_diluted_by_heavy_traffic_does_not_trip() -> None:
    breakers = make()
    breakers.record(empty(), 0.0)  # seen today: familiar from now on
    now = BURST_SECONDS + 1
    # 1000 calls in under five minutes, 1% empty: ten empties in the burst, far below 25%.
    for i in range(1000):
        outcome = empty() if i % 100 == 50 else clean()
        assert breakers.record(outcome, now) == []
        now += 0.25
    assert breakers.exclusion("p", "m", None, now) is None


def test_a_new_signature_trips_at_its_count_whatever_the_traffic() -> None:
    breakers = make()
    now = 0.0
    for _ in range(200):
        assert breakers.record(clean(), now) == []
        now += 0.25
    assert breakers.record(empty(), now) == []
    (trip,) = breakers.record(empty(), now + 1)
    assert trip.trigger is Trigger.NOVELTY
    assert trip.detail.startswith("2 new empty_response within 300 s")


def test_the_rate_arm_trips_at_its_minimum_sample() -> None:
    # Count arms out of reach: only the rate can trip.
    settings = BreakerSpec(
        jitter_fraction=0, novel_signature_count=10_000, familiar_signature_count=10_000
    )
    breakers = make(settings)
    # Every third answer empty (35%); the 20th answer, the minimum sample, is a clean one.
    transitions: list[Transition] = []
    for i in range(settings.rate_min_samples):
        transitions += breakers.record(empty() if i % 3 == 0 else clean(), 10.0 * i)
        if i < settings.rate_min_samples - 1:
            assert transitions == []
    (trip,) = transitions
    assert trip.trigger is Trigger.RATE
    assert trip.key == BreakerKey("p", "m")
    assert trip.at == 10.0 * (settings.rate_min_samples - 1)
    assert trip.detail.startswith("7 of the last 20 answers empty (35%), above 25%")


def test_the_rate_arm_needs_its_minimum_sample() -> None:
    settings = BreakerSpec(
        jitter_fraction=0, novel_signature_count=10_000, familiar_signature_count=10_000
    )
    breakers = make(settings)
    # Every other answer empty (50%): nothing trips before the minimum sample.
    now = 0.0
    transitions: list[Transition] = []
    for i in range(settings.rate_min_samples - 1):
        transitions += breakers.record(empty() if i % 2 == 0 else clean(), now)
        now += 1.0
    assert transitions == []
    (trip,) = breakers.record(empty(), now)
    assert trip.trigger is Trigger.RATE
    assert "of the last 20 answers empty" in trip.detail


def test_successes_are_the_rate_arms_denominator() -> None:
    settings = BreakerSpec(
        jitter_fraction=0, novel_signature_count=10_000, familiar_signature_count=10_000
    )
    breakers = make(settings)
    # 20% empty (below the 25% threshold) over 1,000 calls: never trips.
    for i in range(1000):
        assert breakers.record(empty() if i % 5 == 0 else clean(), float(i)) == []
    # Tool-call answers count as answers that were not empty.
    breakers_tools = make(settings)
    for i in range(1000):
        outcome = empty() if i % 5 == 0 else tool_calls()
        assert breakers_tools.record(outcome, float(i)) == []


def _incident_outcome(model: str, i: int) -> Attempted:
    """The measured window's mix per model: nemotron 38 empty / 70 tool calls of 108
    (35.2%), the others no empties at all and a share of tool-call answers."""
    provider = NEURALWATT if model in (QWEN, DEEPSEEK) else OPENROUTER
    machine = "Nvidia" if provider == OPENROUTER else None
    if model == NEMOTRON:
        is_empty = (i * 38) % 108 < 38
        answer = verdict("") if is_empty else verdict("", tool_calls=True)
    else:
        answer = verdict("", tool_calls=True) if i % 3 == 0 else verdict("here you go")
    return Attempted.answered(provider, model, answer, machine=machine)


def test_the_measured_empty_200_incident_replayed() -> None:
    """Seed 000, 2026-09-08: one model at 35% empty-on-200, three at 0%, two providers."""
    breakers = make(BreakerSpec())  # the defaults, jitter included
    calls = {NEMOTRON: 0, GLM: 0, QWEN: 0, DEEPSEEK: 0}
    trip_at_call: int | None = None
    transitions: list[Transition] = []
    now = 0.0
    for _ in range(1200):
        for model in calls:
            outcome = _incident_outcome(model, calls[model])
            admitted = breakers.admit(outcome.provider, model, outcome.machine, now)
            if not admitted.allowed:
                continue  # routed around: another model serves
            calls[model] += 1
            found = breakers.record(outcome, now)
            transitions += found
            if model == NEMOTRON and tripped(found) and trip_at_call is None:
                trip_at_call = calls[model]
        transitions += breakers.poll(now)
        now += 14.0  # ~108 calls in 25 minutes, as measured

    # The 35% pair trips within the rate arm's minimum sample...
    assert trip_at_call is not None
    assert trip_at_call <= BreakerSpec().rate_min_samples
    trips = tripped(transitions)
    assert trips
    assert {t.key for t in trips} == {BreakerKey(OPENROUTER, NEMOTRON)}
    assert {t.reason for t in trips} == {TripReason.EMPTY_RESPONSES}
    # ...the three healthy models never trip over at least 1,000 calls each...
    for model in (GLM, QWEN, DEEPSEEK):
        assert calls[model] >= 1000
    # ...and neither provider as a whole is tripped.
    for state in breakers.snapshot(now):
        if state.key.scope is not Scope.MODEL or state.key.model != NEMOTRON:
            assert state.trips == 0
            assert state.state is BreakerPhase.CLOSED


def test_the_rate_arm_alone_trips_the_incident_within_its_minimum_sample() -> None:
    settings = BreakerSpec(novel_signature_count=10_000, familiar_signature_count=10_000)
    breakers = make(settings)
    for i in range(settings.rate_min_samples):
        if tripped(breakers.record(_incident_outcome(NEMOTRON, i), 14.0 * i)):
            assert i + 1 == settings.rate_min_samples
            return
    raise AssertionError("the rate arm did not trip within its minimum sample")


def test_zero_percent_never_trips_over_thousands_of_calls() -> None:
    breakers = make(BreakerSpec())
    now = 0.0
    for i in range(3000):
        for model in (GLM, QWEN, DEEPSEEK):
            assert breakers.record(_incident_outcome(model, i), now) == []
        now += 1.0
    assert all(state.trips == 0 for state in breakers.snapshot(now))


def test_disabled_detection_counts_nothing() -> None:
    breakers = make(degraded=DegradedOutputSpec(detect_empty=False, detect_mangled=False))
    for i in range(100):
        assert breakers.record(empty(), float(i)) == []
        assert breakers.record(mangled(), float(i)) == []


# --- cooldown, backoff, jitter ----------------------------------------------------------------


def _cooldowns(breakers: Breakers, n: int) -> list[float]:
    """Trip, then fail the probe n - 1 times; the cooldown of each trip."""
    trip = open_breaker(breakers, empty, 0.0)
    cooldowns: list[float] = []
    for _ in range(n):
        assert trip.until is not None
        cooldowns.append(trip.until - trip.at)
        if len(cooldowns) == n:
            break
        assert breakers.admit("p", "m", None, trip.until).is_probe
        (trip,) = breakers.record(empty(), trip.until)
        assert trip.trigger is Trigger.PROBE
    return cooldowns


def test_the_cooldown_grows_exponentially_up_to_its_cap() -> None:
    assert _cooldowns(make(), 8) == pytest.approx([30, 60, 120, 240, 480, 600, 600, 600])
    slow = BreakerSpec(
        jitter_fraction=0, cooldown_seconds=5, max_cooldown_seconds=40, backoff_multiplier=3
    )
    assert _cooldowns(make(slow), 4) == pytest.approx([5, 15, 40, 40])


def test_the_default_schedule_notices_a_recovery_within_half_a_minute() -> None:
    """By default the cooldown grows 10, 20, 30 s and stays at 30 (SPEC A5: backoff
    bounded so that recovery is noticed), jittered by a tenth."""
    defaults = BreakerSpec()
    assert _cooldowns(make(BreakerSpec(jitter_fraction=0)), 5) == pytest.approx(
        [10, 20, 30, 30, 30]
    )
    assert defaults.max_cooldown_seconds * (1 + defaults.jitter_fraction) <= 33


def test_jitter_stays_within_its_fraction_and_separates_replicas() -> None:
    settings = BreakerSpec(jitter_fraction=0.1, **LONG)
    seen: list[list[float]] = []
    for seed in range(40):
        cooldowns = _cooldowns(make(settings, seed=seed), 7)
        for cooldown, base in zip(cooldowns, [30, 60, 120, 240, 480, 600, 600], strict=True):
            assert base * 0.9 <= cooldown <= base * 1.1
        seen.append(cooldowns)
    assert len({c[0] for c in seen}) == len(seen)  # no two replicas re-probe in lockstep


def test_recovery_then_a_quick_relapse_keeps_backing_off() -> None:
    breakers = make()
    trip = open_breaker(breakers, empty, 0.0)
    assert trip.until is not None
    breakers.admit("p", "m", None, trip.until)
    breakers.record(clean(), trip.until)
    # Relapse within max_cooldown_seconds of the recovery: the next cooldown is longer.
    relapse = trip.until + 10
    for i in range(5):
        found = breakers.record(empty(), relapse + i)
    (again,) = found
    assert again.until is not None
    assert again.until - again.at == pytest.approx(60)


def test_a_trip_long_after_recovery_starts_from_the_base_cooldown() -> None:
    breakers = make()
    trip = open_breaker(breakers, empty, 0.0)
    assert trip.until is not None
    breakers.admit("p", "m", None, trip.until)
    breakers.record(clean(), trip.until)
    later = trip.until + NO_JITTER.max_cooldown_seconds + NO_JITTER.novelty_window_seconds
    breakers.record(empty(), later)
    (again,) = breakers.record(empty(), later + 1)
    assert again.until is not None
    assert again.until - again.at == pytest.approx(30)
    assert again.trips == 2


# --- half-open: exactly one probe -------------------------------------------------------------


def test_half_open_admits_exactly_one_probe() -> None:
    breakers = make()
    trip = open_breaker(breakers, empty, 0.0)
    assert trip.until is not None
    before = breakers.admit("p", "m", None, trip.until - 0.001)
    assert not before.allowed
    assert before.exclusion is not None
    assert before.exclusion.state is BreakerPhase.OPEN

    now = trip.until
    first = breakers.admit("p", "m", None, now)
    second = breakers.admit("p", "m", None, now)
    assert first.allowed
    assert first.is_probe
    assert first.probes == (BreakerKey("p", "m"),)
    assert not second.allowed
    assert second.exclusion is not None
    assert second.exclusion.state is BreakerPhase.HALF_OPEN
    assert second.exclusion.detail == "a re-probe is in flight"
    # A read agrees, and takes nothing.
    assert breakers.exclusion("p", "m", None, now) == second.exclusion
    # Other models of the provider are not probes.
    other = breakers.admit("p", "other", None, now)
    assert other.allowed
    assert not other.is_probe


def test_reading_a_free_half_open_slot_does_not_take_it() -> None:
    breakers = make()
    trip = open_breaker(breakers, empty, 0.0)
    assert trip.until is not None
    assert breakers.exclusion("p", "m", None, trip.until) is None
    assert breakers.exclusion("p", "m", None, trip.until) is None
    assert breakers.admit("p", "m", None, trip.until).is_probe


def test_a_released_or_expired_probe_slot_lets_the_next_attempt_probe() -> None:
    breakers = make()
    trip = open_breaker(breakers, empty, 0.0)
    assert trip.until is not None
    now = trip.until
    probe = breakers.admit("p", "m", None, now)
    breakers.release(probe)
    retry = breakers.admit("p", "m", None, now + 1)
    assert retry.is_probe
    # Releasing a stale admission does not free the current probe's slot.
    breakers.release(probe)
    assert not breakers.admit("p", "m", None, now + 2).allowed
    # Nobody reported back within the lease: the slot frees itself.
    assert breakers.admit("p", "m", None, now + 1 + PROBE_LEASE_SECONDS).is_probe
    # A caller may lease for its own patience.
    short = make()
    t2 = open_breaker(short, empty, 0.0)
    assert t2.until is not None
    short.admit("p", "m", None, t2.until, probe_lease=5)
    assert not short.admit("p", "m", None, t2.until + 4.9).allowed
    assert short.admit("p", "m", None, t2.until + 5).is_probe


def test_an_attempt_reaching_a_cooled_machine_reports_its_half_opening_and_probes_alone() -> None:
    """Issue 12 finding 3: a machine key past its cooldown, reached through `admit_attempt`
    before any `poll` tick, reports HALF_OPENED there (once), makes that attempt its one
    probe, and is refused to every other attempt until the probe reports or is released."""
    breakers = make()
    breakers.record(status(503, "agg", "m", machine="DeepInfra"), 0.0)
    (trip,) = breakers.record(status(500, "agg", "m", machine="DeepInfra"), 1.0)
    assert trip.until is not None
    key = BreakerKey("agg", "m", "DeepInfra")

    probe = breakers.admit_attempt("agg", "m", ["DeepInfra", "Together"], trip.until)
    assert probe.allowed
    assert probe.probes == (key,)
    assert probe.refused == ()
    (half,) = probe.transitions
    assert (half.kind, half.key) == (TransitionKind.HALF_OPENED, key)
    assert breakers.poll(trip.until) == []  # reported once, where it happened

    other = breakers.admit_attempt("agg", "m", ["DeepInfra", "Together"], trip.until + 0.1)
    assert other.allowed
    assert other.refused == ("DeepInfra",)
    assert other.probes == ()
    assert other.transitions == ()
    # Asking only for the machine whose probe is out refuses the attempt outright.
    assert not breakers.admit_attempt("agg", "m", ["DeepInfra"], trip.until + 0.2).allowed

    breakers.release(probe)
    again = breakers.admit_attempt("agg", "m", ["DeepInfra"], trip.until + 0.3)
    assert again.probes == (key,)
    assert again.transitions == ()


def test_the_next_clean_response_closes_the_breaker() -> None:
    breakers = make()
    trip = open_breaker(breakers, empty, 0.0)
    assert trip.until is not None
    assert breakers.poll(trip.until - 1) == []
    (half,) = breakers.poll(trip.until)
    assert half.kind is TransitionKind.HALF_OPENED
    assert breakers.poll(trip.until + 1) == []  # reported once
    states = breakers.snapshot(trip.until)
    assert [s.state for s in states if s.key == BreakerKey("p", "m")] == [BreakerPhase.HALF_OPEN]

    assert breakers.admit("p", "m", None, trip.until).is_probe
    (recovered,) = breakers.record(clean(), trip.until + 2)
    assert recovered.kind is TransitionKind.RECOVERED
    assert recovered.reason is TripReason.EMPTY_RESPONSES
    assert recovered.key == BreakerKey("p", "m")
    assert breakers.exclusion("p", "m", None, trip.until + 3) is None
    assert breakers.admit("p", "m", None, trip.until + 3) == Admission(
        True, None, (), trip.until + 3
    )


def test_a_clean_response_clears_a_provider_wide_encoding_trip() -> None:
    breakers = make()
    trip = open_breaker(breakers, mangled, 0.0)
    assert trip.until is not None
    breakers.admit("p", "other-model", None, trip.until)
    (recovered,) = breakers.record(clean("p", "other-model"), trip.until)
    assert recovered.key == BreakerKey("p")
    assert recovered.reason is TripReason.MANGLED_OUTPUT
    assert breakers.exclusion("p", "m", None, trip.until) is None


def test_stragglers_neither_close_nor_reopen() -> None:
    breakers = make()
    trip = open_breaker(breakers, empty, 0.0)
    assert trip.until is not None
    # While open: a late clean answer from before the trip changes nothing.
    assert breakers.record(clean(), 5.0) == []
    assert breakers.exclusion("p", "m", None, 5.0) is not None
    # Half-open: an answer to an attempt started before the trip is no probe result.
    assert breakers.record(clean(started_at=0.5), trip.until + 1) == []
    assert breakers.exclusion("p", "m", None, trip.until + 1) is None  # still half-open, free
    (state,) = [s for s in breakers.snapshot(trip.until + 1) if s.key == BreakerKey("p", "m")]
    assert state.state is BreakerPhase.HALF_OPEN


def test_an_inconclusive_probe_frees_the_slot_without_closing() -> None:
    breakers = make()
    trip = open_breaker(breakers, empty, 0.0)
    assert trip.until is not None
    assert breakers.admit("p", "m", None, trip.until).is_probe
    # A 400 is about the request: says nothing about the model.
    assert breakers.record(status(400), trip.until + 1) == []
    assert breakers.admit("p", "m", None, trip.until + 2).is_probe


# --- hard exclusions --------------------------------------------------------------------------


def test_retry_after_sets_the_open_time_of_that_key() -> None:
    breakers = make()
    (t,) = breakers.record(status(429, retry_after=7.0), 100.0)
    assert t.cause is Cause.RATE_LIMITED
    assert t.reason is TripReason.RATE_LIMITED
    assert t.trigger is Trigger.STATUS
    assert t.until == 107.0
    assert t.key == BreakerKey("p")  # the transport key, as declared
    refused = breakers.exclusion("p", "m", None, 106.999)
    assert refused is not None
    assert refused.cause is Cause.RATE_LIMITED
    assert refused.until == 107.0
    assert "Retry-After 7 s" in refused.detail
    assert breakers.exclusion("p", "m", None, 107.0) is None
    (lifted,) = breakers.poll(107.0)
    assert lifted.kind is TransitionKind.RECOVERED
    assert lifted.cause is Cause.RATE_LIMITED


def test_retry_after_follows_the_machine_and_the_transport_scope() -> None:
    breakers = make(BreakerSpec(transport_scope=TransportScope.MODEL))
    (t,) = breakers.record(status(429, retry_after=3.0), 0.0)
    assert t.key == BreakerKey("p", "m")
    (t,) = breakers.record(status(429, "agg", "m", machine="DeepInfra", retry_after=3.0), 0.0)
    assert t.key == BreakerKey("agg", "m", "DeepInfra")


def test_a_longer_retry_after_extends_and_in_flight_429s_do_not_escalate() -> None:
    breakers = make()
    breakers.record(status(429), 0.0)  # no Retry-After: the base cooldown
    for i in range(10):
        assert breakers.record(status(429), 1.0 + i) == []  # stragglers
    refused = breakers.exclusion("p", "m", None, 20.0)
    assert refused is not None
    assert refused.until == pytest.approx(30.0)
    breakers.record(status(429, retry_after=100.0), 20.0)
    refused = breakers.exclusion("p", "m", None, 50.0)
    assert refused is not None
    assert refused.until == pytest.approx(120.0)
    # After it lapses, a new 429 without Retry-After backs off one step.
    (again,) = [t for t in breakers.record(status(429), 130.0) if t.kind is TransitionKind.TRIPPED]
    assert again.until == pytest.approx(130.0 + 60.0)


def test_a_zero_retry_after_excludes_nothing() -> None:
    breakers = make()
    assert breakers.record(status(429, retry_after=0.0), 0.0) == []
    assert breakers.exclusion("p", "m", None, 0.0) is None


def test_hard_exclusions_stay_distinguishable_by_cause() -> None:
    breakers = make()
    breakers.record(status(401), 0.0)
    breakers.record(status(402), 0.0)
    breakers.record(status(403, model="m"), 0.0)
    breakers.record(status(429, retry_after=1000.0), 0.0)
    open_breaker(breakers, empty, 0.0)

    found = breakers.exclusions("p", "m", None, 1.0)
    by_cause = {(e.cause, e.key) for e in found}
    assert by_cause == {
        (Cause.AUTH_FAILURE, BreakerKey("p")),
        (Cause.QUOTA, BreakerKey("p")),
        (Cause.RATE_LIMITED, BreakerKey("p")),
        (Cause.AUTH_FAILURE, BreakerKey("p", "m")),
        (Cause.BREAKER, BreakerKey("p", "m")),
    }
    reasons = {e.cause: e.reason for e in found}
    assert reasons == {
        Cause.AUTH_FAILURE: TripReason.AUTH_FAILURE,
        Cause.QUOTA: TripReason.QUOTA,
        Cause.RATE_LIMITED: TripReason.RATE_LIMITED,
        Cause.BREAKER: TripReason.EMPTY_RESPONSES,
    }
    # The one reported is the longest: the Retry-After.
    longest = breakers.exclusion("p", "m", None, 1.0)
    assert longest is not None
    assert longest.cause is Cause.RATE_LIMITED
    # Each lapses on its own: 402/401 after the base cooldown, the 429 much later.
    assert {e.cause for e in breakers.exclusions("p", "m", None, 40.0)} == {Cause.RATE_LIMITED}
    lifted = breakers.poll(40.0)
    assert {(t.cause, t.key) for t in lifted if t.kind is TransitionKind.RECOVERED} == {
        (Cause.AUTH_FAILURE, BreakerKey("p")),
        (Cause.QUOTA, BreakerKey("p")),
        (Cause.AUTH_FAILURE, BreakerKey("p", "m")),
    }
    snapshot = breakers.snapshot(40.0, include_closed=False)
    assert {(s.cause, s.state) for s in snapshot} == {
        (Cause.RATE_LIMITED, BreakerPhase.OPEN),
        (Cause.BREAKER, BreakerPhase.HALF_OPEN),
    }


def test_auth_failures_back_off_until_an_answer_resets_them() -> None:
    breakers = make()
    durations = []
    now = 0.0
    for _ in range(4):
        (t,) = tripped(breakers.record(status(401), now))
        assert t.until is not None
        durations.append(t.until - now)
        now = t.until
    assert durations == pytest.approx([30, 60, 120, 240])
    breakers.record(clean(), now)
    (t,) = tripped(breakers.record(status(401), now + 1))
    assert t.until == pytest.approx(now + 1 + 30)


def test_an_answer_ends_only_the_streaks_no_longer_imposed_on_every_key_over_it() -> None:
    breakers = make()
    (first,) = tripped(breakers.record(status(401), 0.0))
    assert first.until is not None
    (second,) = tripped(breakers.record(status(401), first.until))
    assert second.until is not None
    # An answer while the exclusion is still imposed (one sent before it) ends nothing.
    breakers.record(clean(), first.until + 1)
    (third,) = tripped(breakers.record(status(401), second.until))
    assert third.until is not None
    assert third.until - second.until == pytest.approx(120)
    # Once it lapsed, an answer from any machine of the provider ends it.
    breakers.record(clean(machine="x"), third.until)
    (fourth,) = tripped(breakers.record(status(401), third.until + 1))
    assert fourth.until == pytest.approx(third.until + 1 + 30)


# --- reporting --------------------------------------------------------------------------------


def test_reasons_are_camel_case_words_the_crd_accepts() -> None:
    for reason in TripReason:
        assert re.fullmatch(CAMEL_CASE_PATTERN, reason.value)
    assert {r.value for r in TripReason} >= {
        "EmptyResponses",
        "MangledOutput",
        "UpstreamErrors",
        "RateLimited",
        "AuthFailure",
        "Quota",
    }
    assert {s.value for s in Scope} == {"Provider", "Model", "Machine"}
    assert {s.value for s in BreakerPhase} == {"Open", "HalfOpen", "Closed"}


def test_the_snapshot_reports_every_key_sorted() -> None:
    breakers = make()
    breakers.record(clean("b", "m"), 0.0)
    trip = open_breaker(breakers, lambda: empty("a", "m"), 0.0)
    snapshot = breakers.snapshot(1.0)
    assert [s.key for s in snapshot] == [
        BreakerKey("a"),
        BreakerKey("a", "m"),
        BreakerKey("b"),
        BreakerKey("b", "m"),
    ]
    opened = snapshot[1]
    assert opened == BreakerView(
        BreakerKey("a", "m"),
        Cause.BREAKER,
        BreakerPhase.OPEN,
        TripReason.EMPTY_RESPONSES,
        trip.at,
        trip.until,
        1,
        Trigger.NOVELTY,
        opened.detail,
    )
    assert opened.scope is Scope.MODEL
    assert [s.key for s in breakers.snapshot(1.0, include_closed=False)] == [BreakerKey("a", "m")]


# --- bounded memory ---------------------------------------------------------------------------


def test_keys_are_bounded_and_open_breakers_survive_eviction() -> None:
    breakers = make(max_keys=10)
    open_breaker(breakers, lambda: empty("p", "sick"), 0.0)
    for i in range(200):
        breakers.record(clean("p", f"model-{i}"), 10.0 + i)
        assert len(breakers) <= 10
    assert breakers.exclusion("p", "sick", None, 20.0) is not None


def test_idle_closed_keys_are_evicted_after_the_novelty_window() -> None:
    settings = BreakerSpec(novelty_window_seconds=100)
    breakers = make(settings)
    for i in range(5):
        breakers.record(clean("p", f"m{i}"), 0.0)
    assert len(breakers) == 6
    breakers.record(clean("q", "x"), 1000.0)
    assert len(breakers) < 6
    assert all(s.key.provider in ("p", "q") for s in breakers.snapshot(1000.0))


def test_a_reloaded_rate_window_keeps_the_latest_outcomes() -> None:
    current = {"settings": BreakerSpec(jitter_fraction=0, novel_signature_count=10_000)}
    breakers = Breakers(lambda _p: current["settings"], random.Random(0))
    for i in range(50):
        breakers.record(clean(), float(i))
    current["settings"] = BreakerSpec(
        jitter_fraction=0,
        novel_signature_count=10_000,
        familiar_signature_count=10_000,
        rate_window=10,
        rate_min_samples=5,
    )
    transitions: list[Transition] = []
    for i in range(3):
        transitions += breakers.record(empty(), 1000.0 + i)
    (trip,) = transitions
    assert trip.trigger is Trigger.RATE
    assert "3 of the last 10 answers empty" in trip.detail


# --- a trip, not a score (SPEC A5, C4) --------------------------------------------------------


def test_verdicts_and_breakers_expose_and_import_no_score() -> None:
    """Structural verdicts feed the breaker as an availability skip and nothing else: no
    name in these modules or their public types speaks of a score, quality or proficiency,
    and none of them imports anything that could hold one."""
    words = ("score", "quality", "proficiency")
    for module in (verdicts_module, breaker_module, evidence_module, exclusions_module):
        names = [name.lower() for name in vars(module)]
        assert not [n for n in names if any(w in n for w in words)], module.__name__
        imports = re.findall(r"^(?:from|import) (\S+)", inspect.getsource(module), re.M)
        assert set(imports) <= {
            "__future__",
            "re",
            "math",
            "random",
            "collections",
            "collections.abc",
            "dataclasses",
            "enum",
            "itertools",
            "typing",
            "email.utils",
            "rolegate_policy.config",
            "rolegate_policy.enums",
            "rolegate_policy.model",
            "rolegate_policy.signatures",
            "rolegate_policy.status",
            ".evidence",
            ".exclusions",
            ".tool_calls",
            ".verdicts",
        }, module.__name__
    for cls in (Breakers, Attempted, Verdict, Exclusion, BreakerView, Transition, Admission):
        members = [name.lower() for name in dir(cls)]
        assert not [n for n in members if any(w in n for w in words)], cls.__name__


def test_an_outcome_needs_a_status_or_a_transport_fault() -> None:
    with pytest.raises(ValueError, match="HTTP status or a transport fault"):
        Attempted("p", "m")


# --- Retry-After parsing ----------------------------------------------------------------------


def test_parse_retry_after() -> None:
    wall = 1_700_000_000.0
    assert parse_retry_after("7", wall_now=wall) == 7.0
    assert parse_retry_after(" 1.5 ", wall_now=wall) == 1.5
    assert parse_retry_after("-3", wall_now=wall) == 0.0
    assert parse_retry_after("999999999", wall_now=wall) == MAX_RETRY_AFTER_SECONDS
    date = format_datetime(datetime.fromtimestamp(wall + 120, tz=UTC), usegmt=True)
    assert parse_retry_after(date, wall_now=wall) == pytest.approx(120.0)
    for bad in (None, "", "soon", "nan", "inf", "Mon, 99 Foo 2024 99:99:99 GMT"):
        assert parse_retry_after(bad, wall_now=wall) is None
