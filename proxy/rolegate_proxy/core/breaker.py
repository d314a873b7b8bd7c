"""The circuit breaker: a pure state machine per key, with the clock passed in (SPEC A5-A8, C4).

Every finished upstream attempt is recorded as an `Attempted`, successes included (they are
the rate arm's denominator). An outcome is evidence for up to three families, each on the
key its signature decides (SPEC A6):

* encoding faults (high-confidence, attributable mangling) on the provider;
* content faults (an attributable empty answer on a 2xx) on (provider, model);
* transport faults (a status >= 500 or 408/409/425, a failed connection, a timeout, a
  broken stream, an error inside the stream) on (provider, model, machine) when the
  aggregator named the failing machine, else as the ProviderPolicy's `transportScope` says.

A closed breaker opens on novelty, on a count, or on a rate (SPEC A7), stays open for an
exponentially growing, capped and jittered cooldown, then lets exactly one probe through
(`admit`) and closes on the next clean answer or re-opens for longer. 429, 401/403 and 402
impose separate hard exclusions with their own expiry. Nothing here is, or feeds, a quality
score (SPEC A5, C4). See docs/degraded-output.md for the rules and every setting.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import islice
from typing import Final, NamedTuple

from rolegate_policy.enums import (
    TransportScope,
)
from rolegate_policy.model import (
    BreakerSpec,
    DegradedOutputSpec,
)
from rolegate_policy.signatures import Family, SignatureRule, reason_of
from rolegate_policy.status import BreakerPhase, Scope, TripReason

from .evidence import CallBuckets, RateWindow, SignatureHistory
from .exclusions import (
    HARD_STATUSES,
    MAX_RETRY_AFTER_SECONDS,
    REASON_OF_CAUSE,
    BreakerKey,
    BreakerView,
    Cause,
    Exclusion,
    Transition,
    TransitionKind,
    Trigger,
    covering_keys,
    is_redirect,
    is_transport_status,
)
from .verdicts import Verdict

# The short window the count arms look back over: a novel signature must be seen
# novel_signature_count times, a familiar one familiar_signature_count times, within it.
BURST_SECONDS: Final = 300.0
# How long an admitted re-probe holds the half-open slot when nothing reports back.
PROBE_LEASE_SECONDS: Final = 120.0
# Keys tracked at most; closed, idle keys go first.
MAX_KEYS: Final = 4096
# Distinct fault signatures remembered per key, and fault times per signature.
MAX_SIGNATURES_PER_KEY: Final = 16
MAX_HISTORY: Final = 1024
# How often idle keys are looked for (see `_evict`).
IDLE_SWEEP_SECONDS: Final = 1.0
# Nothing legitimate multiplies a cooldown this many times.
_MAX_DOUBLINGS: Final = 2048


# Fault marks a pod keeps of one signature across a restart (the newest, and the rest
# thinned evenly): enough for "was it seen in the novelty window before this burst".
MAX_KEPT_MARKS: Final = 32


@dataclass(frozen=True, slots=True)
class FaultMarks:
    """When one fault signature was seen on one key, as a pod keeps it across a restart:
    seconds before the moment it was kept, oldest first (the novelty baseline)."""

    key: BreakerKey
    signature: str
    ages: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class PeerTrip:
    """A breaker another proxy pod of the fleet holds open: this pod keeps the key out of
    rotation until `until` (its clock), unless that pod's next word lifts it sooner. That
    pod alone probes the key; its closing the breaker clears it everywhere."""

    key: BreakerKey
    reason: TripReason
    pod: str
    until: float


@dataclass(frozen=True, slots=True)
class RateCount:
    """One key's rate window for one family of faults, as a pod shares it with the fleet:
    the outcomes in it and the faults among them."""

    key: BreakerKey
    family: Family
    count: int
    faults: int


class TransportFault(StrEnum):
    """An attempt that failed without a usable HTTP status."""

    CONNECTION_FAILED = "connection_failed"
    TIMEOUT = "timeout"
    BROKEN_STREAM = "broken_stream"
    STREAM_ERROR = "stream_error"


_FAULTY: Final = {
    Family.ENCODING: ("answers", "mangled"),
    Family.CONTENT: ("answers", "empty"),
    Family.TRANSPORT: ("attempts", "failed"),
}


# Not frozen: one is made for every attempt recorded, and a frozen dataclass sets each
# field through object.__setattr__. Nothing changes one once made.
@dataclass(slots=True)
class Attempted:
    """One finished upstream attempt, as the breaker needs it. Carries no text.

    `machine` is the aggregator's sub-provider that served or failed, when the response named
    it; None for a direct provider, which is its own machine (a machine named like the
    provider is treated as None). `status` is the HTTP status (None when there was none),
    `verdict` the structural verdict of a 2xx answer, `transport` a failure without a usable
    status, `retry_after` a 429's Retry-After in seconds, `started_at` when the attempt was
    admitted (on the same clock as `now`): an attempt that started before its key tripped
    cannot close or re-open it. `now` must not go backwards between calls.
    """

    provider: str
    model: str
    machine: str | None = None
    status: int | None = None
    verdict: Verdict | None = None
    transport: TransportFault | None = None
    retry_after: float | None = None
    started_at: float | None = None

    def __post_init__(self) -> None:
        if self.status is None and self.transport is None:
            raise ValueError("an outcome has an HTTP status or a transport fault")

    @classmethod
    def answered(
        cls,
        provider: str,
        model: str,
        verdict: Verdict,
        *,
        machine: str | None = None,
        status: int = 200,
        started_at: float | None = None,
    ) -> Attempted:
        return cls(provider, model, machine, status, verdict, started_at=started_at)

    @classmethod
    def http_error(
        cls,
        provider: str,
        model: str,
        status: int,
        *,
        machine: str | None = None,
        retry_after: float | None = None,
        started_at: float | None = None,
    ) -> Attempted:
        return cls(provider, model, machine, status, retry_after=retry_after, started_at=started_at)

    @classmethod
    def transport_failure(
        cls,
        provider: str,
        model: str,
        fault: TransportFault,
        *,
        machine: str | None = None,
        status: int | None = None,
        started_at: float | None = None,
    ) -> Attempted:
        return cls(provider, model, machine, status, transport=fault, started_at=started_at)


class Admission(NamedTuple):
    """The answer to "may this attempt be sent now?". `probes` names the half-open keys
    this attempt is the single re-probe of (empty for an ordinary attempt); `refused` the
    machines of its routing that may not be asked for after all (another request holds
    their re-probe); `transitions` the half-openings this decision was the first to see."""

    allowed: bool
    exclusion: Exclusion | None
    probes: tuple[BreakerKey, ...]
    at: float
    refused: tuple[str, ...] = ()
    transitions: tuple[Transition, ...] = ()

    @property
    def is_probe(self) -> bool:
        return bool(self.probes)


# --- classification ---------------------------------------------------------------------------


class _Sample(NamedTuple):
    family: Family
    key: BreakerKey
    # The fault's signature; None for a clean sample.
    signature: str | None


class _Hard(NamedTuple):
    cause: Cause
    key: BreakerKey
    status: int


def _transport_key(outcome: Attempted, settings: BreakerSpec) -> BreakerKey:
    # A direct provider's one machine carries the provider's name: it is not a sub-provider.
    if outcome.machine is not None and outcome.machine != outcome.provider:
        return BreakerKey(outcome.provider, outcome.model, outcome.machine)
    if settings.transport_scope is TransportScope.MODEL or (
        outcome.transport is TransportFault.TIMEOUT
    ):
        # A slow answer is the model's (on this provider), never the whole provider's: the
        # provider's other models answered at their own pace (SPEC E5).
        return BreakerKey(outcome.provider, outcome.model)
        return BreakerKey(outcome.provider, outcome.model)
    return BreakerKey(outcome.provider)


def _classify(
    outcome: Attempted, settings: BreakerSpec, degraded: Callable[[str], DegradedOutputSpec]
) -> tuple[list[_Sample], _Hard | None, bool]:
    """The samples an outcome contributes, the hard exclusion it imposes, and whether it was
    an answer (a 2xx that completed). `degraded` gives a provider's degraded-output
    settings, asked only of an answer whose verdict has a signature."""
    status = outcome.status
    if outcome.transport is not None:
        fault = outcome.transport.value
        return [_Sample(Family.TRANSPORT, _transport_key(outcome, settings), fault)], None, False
    assert status is not None
    if not 200 <= status < 300:
        cause = HARD_STATUSES.get(status)
        if cause is Cause.RATE_LIMITED:
            return [], _Hard(cause, _transport_key(outcome, settings), status), False
        if cause is Cause.AUTH_FAILURE and status == 403:
            # Forbidden is usually about this model (access, moderation), not the key.
            return [], _Hard(cause, BreakerKey(outcome.provider, outcome.model), status), False
        if cause is not None:
            return [], _Hard(cause, BreakerKey(outcome.provider), status), False
        if is_transport_status(status):
            # One signature for all 5xx: a 502 and a 503 are the same upstream falling over;
            # one for all 3xx: a redirect, whatever its kind, is an answer we never follow.
            grouped = status >= 500 or is_redirect(status)
            signature = f"http_{status // 100}xx" if grouped else f"http_{status}"
            key = _transport_key(outcome, settings)
            return [_Sample(Family.TRANSPORT, key, signature)], None, False
        return [], None, False  # about the request: no evidence either way
    samples = [_Sample(Family.TRANSPORT, _transport_key(outcome, settings), None)]
    samples.extend(_verdict_samples(outcome, degraded))
    return samples, None, True


def _verdict_samples(
    outcome: Attempted, degraded_for: Callable[[str], DegradedOutputSpec]
) -> list[_Sample]:
    """What an answer's verdict is evidence of, as the signature table says: a counted
    fault on its rule's key; for a diagnostic signature, a clean sample of its family (the
    answer could have shown that fault and did not); for every answer that is not itself
    a content fault, a clean content sample. Switched off or not the model's fault: no
    evidence of its family either way."""
    verdict = outcome.verdict
    if verdict is None:
        return []
    clean_content = _Sample(Family.CONTENT, BreakerKey(outcome.provider, outcome.model), None)
    rule = verdict.rule
    if rule is None or verdict.signature is None:
        return [clean_content]
    samples = [] if rule.family is Family.CONTENT else [clean_content]
    key = _rule_key(rule, outcome)
    degraded = degraded_for(outcome.provider)
    if verdict.counts(degraded):
        samples.append(_Sample(rule.family, key, verdict.signature.value))
    elif not rule.acts and rule.toggle(degraded):
        samples.append(_Sample(rule.family, key, None))
    return samples


def _rule_key(rule: SignatureRule, outcome: Attempted) -> BreakerKey:
    if rule.scope is Scope.PROVIDER:
        return BreakerKey(outcome.provider)
    if rule.scope is Scope.MACHINE and outcome.machine is not None:
        return BreakerKey(outcome.provider, outcome.model, outcome.machine)
    return BreakerKey(outcome.provider, outcome.model)


@dataclass(slots=True)
class _Evidence:
    """One family's evidence on one key since the key last changed state."""

    rate: RateWindow
    # Eligible outcomes, and the faults among them, over the burst window.
    calls: CallBuckets
    faults: CallBuckets
    counted_from: float

    def add(self, fault: bool, now: float) -> None:
        self.rate.add(fault)
        self.calls.add(now)
        if fault:
            self.faults.add(now)

    def reset(self, now: float) -> None:
        self.rate = RateWindow(self.rate.size)
        self.calls = CallBuckets(self.calls.span)
        self.faults = CallBuckets(self.faults.span)
        self.counted_from = now


@dataclass(slots=True)
class _HardExclusion:
    since: float = 0.0
    until: float = 0.0
    active: bool = False
    detail: str = ""
    trips: int = 0
    # Consecutive impositions without an answer in between: the re-check backs off.
    streak: int = 0
    last_at: float | None = None


@dataclass(slots=True)
class _Entry:
    key: BreakerKey
    last_active: float
    evidence: dict[Family, _Evidence] = field(default_factory=dict)
    signatures: dict[str, SignatureHistory] = field(default_factory=dict)
    hard: dict[Cause, _HardExclusion] = field(default_factory=dict)
    # The breaker.
    open: bool = False
    since: float = 0.0  # when this open episode began
    opened_at: float = 0.0  # the latest trip (a failed probe re-opens)
    until: float = 0.0  # end of the cooldown; half-open from then on
    reason: TripReason | None = None
    trigger: Trigger | None = None
    detail: str = ""
    trips: int = 0
    consecutive: int = 0
    recovered_at: float | None = None
    probe_at: float | None = None
    probe_until: float = 0.0
    half_open_reported: bool = False

    def is_active(self) -> bool:
        return self.open or any(hard.active for hard in self.hard.values())

    def reset_evidence(self, now: float) -> None:
        for evidence in self.evidence.values():
            evidence.reset(now)


# --- the breakers -----------------------------------------------------------------------------


def _all_on(_provider: str) -> DegradedOutputSpec:
    return DegradedOutputSpec()


class Breakers:
    """Every breaker and hard exclusion of one proxy process, keyed by provider, (provider,
    model) or (provider, model, machine). Pure: `now` is passed in (seconds, any clock, one
    clock throughout) and jitter comes from `rng`. Not thread-safe; the proxy's event loop
    is its only caller.

    `settings_for(provider)` gives that provider's BreakerSpec and is asked on every
    call, so a reloaded configuration applies at once; `degraded_for(provider)` which
    degraded answers count (all, by default).
    """

    def __init__(
        self,
        settings_for: Callable[[str], BreakerSpec],
        rng: random.Random,
        *,
        degraded_for: Callable[[str], DegradedOutputSpec] = _all_on,
        burst_seconds: float = BURST_SECONDS,
        probe_lease_seconds: float = PROBE_LEASE_SECONDS,
        max_keys: int = MAX_KEYS,
    ) -> None:
        if burst_seconds <= 0 or probe_lease_seconds <= 0 or max_keys < 1:
            raise ValueError("burst_seconds, probe_lease_seconds and max_keys must be positive")
        self._settings_for = settings_for
        self._degraded_for = degraded_for
        self._rng = rng
        self._burst = burst_seconds
        self._lease = probe_lease_seconds
        self._max_keys = max_keys
        self._entries: OrderedDict[BreakerKey, _Entry] = OrderedDict()
        self._next_idle_sweep = -math.inf
        # Keys with an open breaker or an active hard exclusion, in the order they became so.
        self._active: dict[BreakerKey, None] = {}
        # The active keys by what they cover, for the read every routing decision makes
        # for every machine (see `_check`): (provider, model, machine) of each key.
        self._covering: set[tuple[str, str | None, str | None]] = set()
        # Keys the fleet's other pods hold open (see `hear_trips`).
        self._fleet: dict[BreakerKey, PeerTrip] = {}
        # The fleet's other pods' rate windows, summed (see `hear_rates`).
        self._peer_rates: dict[tuple[BreakerKey, Family], tuple[int, int]] = {}
        # Bumped by every change that can change what `exclusion` answers other than time
        # passing (a trip, a recovery, a hard exclusion imposed or lifted, a probe slot
        # taken or given back, the fleet's trips), so a reader may keep its answers while
        # the epoch stands and until the earliest `Exclusion.until` it was given.
        self.epoch = 0
        # Keys with a hard exclusion whose streak an answer would end (see `record`).
        self._streaks: set[BreakerKey] = set()

    def __len__(self) -> int:
        return len(self._entries)

    # -- recording ------------------------------------------------------------------------

    def record(self, outcome: Attempted, now: float) -> list[Transition]:
        """Record one finished attempt; returns the transitions it caused."""
        provider, model, machine = outcome.provider, outcome.model, outcome.machine
        settings = self._settings_for(provider)
        samples, hard, answered = _classify(outcome, settings, self._degraded_for)
        transitions: list[Transition] = []

        # Only an open key changes state on an outcome, and every open key is active: with
        # no active key over this outcome (the common case) there is nothing to re-probe.
        if self._covers(provider, model, machine):
            faults = {sample.key: sample for sample in samples if sample.signature is not None}
            for key in covering_keys(provider, model, machine):
                entry = self._entries.get(key)
                if entry is None or not entry.open or now < entry.until:
                    continue  # closed, or open and this is a straggler: no state change
                if outcome.started_at is not None and outcome.started_at < entry.opened_at:
                    continue  # sent before the trip: says nothing about the re-probe
                half_opened = self._half_opened(entry)
                if half_opened is not None:
                    transitions.append(half_opened)
                fault = faults.get(key)
                if fault is not None:
                    detail = f"the re-probe failed: {fault.signature}"
                    reason = reason_of(fault.family, fault.signature)
                    transitions.append(
                        self._trip(entry, reason, Trigger.PROBE, detail, now, settings)
                    )
                elif answered:
                    transitions.append(self._recover(entry, now))
                else:
                    entry.probe_at = None  # inconclusive: let another probe through
                    self.epoch += 1

        for sample in samples:
            entry = self._entry(sample.key, now)
            if sample.signature is not None:
                self._history(entry, sample.signature, settings).add(now)
            if entry.open:
                continue  # evidence while open is not kept: the window restarts on recovery
            evidence = self._evidence(entry, sample.family, settings, now)
            evidence.add(sample.signature is not None, now)
            tripped = self._evaluate(entry, sample, evidence, settings, now)
            if tripped is not None:
                transitions.append(tripped)

        if hard is not None:
            transitions.extend(self._impose(hard, outcome.retry_after, now, settings))
        if answered and self._streaks:
            # An answer ends the streak of every exclusion over it that is no longer
            # imposed (only keys with a streak are looked at).
            for key in covering_keys(provider, model, machine):
                if key not in self._streaks:
                    continue
                found = self._entries.get(key)
                if found is None:
                    self._streaks.discard(key)
                    continue
                for exclusion in found.hard.values():
                    if not (exclusion.active and exclusion.until > now):
                        exclusion.streak = 0
                if not any(exclusion.streak for exclusion in found.hard.values()):
                    self._streaks.discard(key)
        self._evict(now)
        return transitions

    def _covers(self, provider: str, model: str, machine: str | None) -> bool:
        """Whether an active key (open, half-open or hard-excluded) covers the candidate."""
        covering = self._covering
        return bool(covering) and (
            (provider, None, None) in covering
            or (provider, model, None) in covering
            or (machine is not None and (provider, model, machine) in covering)
        )

    def _evaluate(
        self,
        entry: _Entry,
        sample: _Sample,
        evidence: _Evidence,
        settings: BreakerSpec,
        now: float,
    ) -> Transition | None:
        # The rate arm, on every sample: the rate is over the window, whatever this one was,
        # and over the fleet's other pods' windows of the same key when they share them.
        count, faults = evidence.rate.count, evidence.rate.faults
        where = ""
        peers = self._peer_rates.get((entry.key, sample.family)) if self._peer_rates else None
        if peers is not None:
            count, faults, where = count + peers[0], faults + peers[1], " across the fleet"
            if count > settings.rate_window:
                # The last rate_window outcomes of the fleet, at the fleet's fault rate.
                faults = round(faults * settings.rate_window / count)
                count = settings.rate_window
        if count >= settings.rate_min_samples and faults > settings.rate_threshold * count:
            noun, faulty = _FAULTY[sample.family]
            detail = (
                f"{faults} of the last {count} {noun} {faulty}{where} "
                f"({faults / count:.0%}), above {settings.rate_threshold:.0%}"
            )
            reason = reason_of(sample.family, sample.signature)
            return self._trip(entry, reason, Trigger.RATE, detail, now, settings)
        if sample.signature is None:
            return None
        reason = reason_of(sample.family, sample.signature)
        # The count arms, on a fault: novelty against the baseline, then a count in the burst.
        start = max(now - self._burst, evidence.counted_from)
        history = entry.signatures[sample.signature]
        seen = history.count_after(start)
        familiar = history.seen_between(now - settings.novelty_window_seconds, start)
        needed = settings.familiar_signature_count if familiar else settings.novel_signature_count
        if seen < needed:
            return None
        calls = evidence.calls.count_since(start)
        faults_in_burst = evidence.faults.count_since(start)
        if familiar and faults_in_burst < settings.rate_threshold * calls:
            # A familiar signature is background noise; its count must be a burst, not a
            # trickle that heavy traffic makes long. A new one trips at its count (SPEC A7).
            return None
        kind = "familiar" if familiar else "new"
        detail = f"{seen} {kind} {sample.signature} within {self._burst:g} s"
        trigger = Trigger.COUNT if familiar else Trigger.NOVELTY
        return self._trip(entry, reason, trigger, detail, now, settings)

    def _trip(
        self,
        entry: _Entry,
        reason: TripReason,
        trigger: Trigger,
        detail: str,
        now: float,
        settings: BreakerSpec,
    ) -> Transition:
        self.epoch += 1
        flapping = (
            entry.recovered_at is not None
            and now - entry.recovered_at <= settings.max_cooldown_seconds
        )
        if not entry.open:
            entry.since = now
        entry.consecutive = entry.consecutive + 1 if entry.open or flapping else 1
        cooldown = self._cooldown(settings, entry.consecutive)
        entry.open = True
        entry.opened_at = now
        entry.until = now + cooldown
        entry.reason = reason
        entry.trigger = trigger
        entry.detail = detail
        entry.trips += 1
        entry.probe_at = None
        entry.half_open_reported = False
        entry.reset_evidence(now)
        self._mark_active(entry.key)
        return Transition(
            TransitionKind.TRIPPED,
            entry.key,
            Cause.BREAKER,
            reason,
            now,
            entry.until,
            entry.trips,
            trigger,
            f"{detail}; out for {cooldown:.0f} s",
        )

    def _recover(self, entry: _Entry, now: float) -> Transition:
        self.epoch += 1
        assert entry.reason is not None
        entry.open = False
        entry.recovered_at = now
        entry.probe_at = None
        entry.reset_evidence(now)
        if not entry.is_active():
            self._unmark_active(entry.key)
        return Transition(
            TransitionKind.RECOVERED,
            entry.key,
            Cause.BREAKER,
            entry.reason,
            now,
            None,
            entry.trips,
            entry.trigger,
            "a clean answer after the cooldown",
        )

    def _impose(
        self, hard: _Hard, retry_after: float | None, now: float, settings: BreakerSpec
    ) -> list[Transition]:
        self.epoch += 1
        entry = self._entry(hard.key, now)
        exclusion = entry.hard.get(hard.cause)
        if exclusion is None:
            exclusion = entry.hard[hard.cause] = _HardExclusion()
        transitions: list[Transition] = []
        reason = REASON_OF_CAUSE[hard.cause]
        told = hard.cause is Cause.RATE_LIMITED and retry_after is not None
        if exclusion.active and exclusion.until > now:
            # Attempts already in flight when it was imposed: only the upstream's own word
            # (a longer Retry-After) changes anything; they do not escalate it.
            if told and retry_after is not None:
                duration = min(max(retry_after, 0.0), MAX_RETRY_AFTER_SECONDS)
                if now + duration > exclusion.until:
                    exclusion.until = now + duration
                    exclusion.detail = f"HTTP 429 with Retry-After {duration:g} s"
            return transitions
        if exclusion.active:
            transitions.append(self._lift(entry, hard.cause, exclusion, exclusion.until))
        stale = exclusion.last_at is not None and (
            now - exclusion.last_at > settings.max_cooldown_seconds
        )
        exclusion.streak = 1 if stale else exclusion.streak + 1
        self._streaks.add(entry.key)
        exclusion.last_at = now
        if told and retry_after is not None:
            duration = min(max(retry_after, 0.0), MAX_RETRY_AFTER_SECONDS)
            detail = f"HTTP 429 with Retry-After {duration:g} s"
        else:
            duration = self._cooldown(settings, exclusion.streak)
            detail = f"HTTP {hard.status}; re-checked after {duration:.0f} s"
        if duration <= 0:
            return transitions
        exclusion.active = True
        exclusion.since = now
        exclusion.until = now + duration
        exclusion.detail = detail
        exclusion.trips += 1
        self._mark_active(entry.key)
        transitions.append(
            Transition(
                TransitionKind.TRIPPED,
                entry.key,
                hard.cause,
                reason,
                now,
                exclusion.until,
                exclusion.trips,
                Trigger.STATUS,
                detail,
            )
        )
        return transitions

    def _lift(
        self, entry: _Entry, cause: Cause, exclusion: _HardExclusion, at: float
    ) -> Transition:
        self.epoch += 1
        exclusion.active = False
        return Transition(
            TransitionKind.RECOVERED,
            entry.key,
            cause,
            REASON_OF_CAUSE[cause],
            at,
            None,
            exclusion.trips,
            Trigger.STATUS,
            "expired",
        )

    def _cooldown(self, settings: BreakerSpec, consecutive: int) -> float:
        """cooldown * multiplier^(consecutive - 1), capped, then +- jitter_fraction."""
        cap = max(settings.max_cooldown_seconds, settings.cooldown_seconds)
        value = settings.cooldown_seconds
        for _ in range(min(consecutive - 1, _MAX_DOUBLINGS)):
            value *= settings.backoff_multiplier
            if value >= cap:
                break
        value = min(value, cap)
        if settings.jitter_fraction > 0:
            value *= 1 + self._rng.uniform(-settings.jitter_fraction, settings.jitter_fraction)
        return value

    # -- asking ---------------------------------------------------------------------------

    def exclusions(
        self, provider: str, model: str, machine: str | None, now: float
    ) -> list[Exclusion]:
        """Every reason the candidate may not be sent to now (empty: it may)."""
        return self._check(provider, model, machine, now)[0]

    def exclusion(
        self, provider: str, model: str, machine: str | None, now: float
    ) -> Exclusion | None:
        """Why the candidate may not be sent to now: the exclusion lasting longest, or None.

        A read, changing nothing: a half-open key whose probe slot is free reads as None. To
        send, call `admit`, which takes that slot; a second caller is then refused."""
        # Asked for every machine of every routing decision: answer at once when no active
        # key covers the candidate (the same test `_check` starts with).
        covering = self._covering
        if not self._fleet and (
            not covering
            or (
                (provider, None, None) not in covering
                and (provider, model, None) not in covering
                and (machine is None or (provider, model, machine) not in covering)
            )
        ):
            return None
        return _longest(self._check(provider, model, machine, now)[0])

    def admit(
        self,
        provider: str,
        model: str,
        machine: str | None,
        now: float,
        *,
        probe_lease: float | None = None,
    ) -> Admission:
        """Decide whether to send this attempt, immediately before sending it.

        Half-open keys over the candidate admit exactly one attempt, which becomes their
        probe (`Admission.probes`) and holds the slot until its outcome is recorded, it is
        `release`d, or `probe_lease` (default PROBE_LEASE_SECONDS) passes."""
        refused, half_open = self._check(provider, model, machine, now)
        if refused:
            return Admission(False, _longest(refused), (), now)
        return Admission(
            True, None, self._take_probes(half_open, now, probe_lease), now,
            transitions=self._half_openings(half_open),
        )  # fmt: skip

    def admit_attempt(
        self, provider: str, model: str, machines: Sequence[str], now: float
    ) -> Admission:
        """`admit` for an attempt at (provider, model) that asks an aggregator for
        `machines` (empty for a direct provider). The provider's and the model's keys decide
        whether it may be sent at all; then each machine's own key: a machine whose
        re-probe another request holds, or that is excluded now, is `refused` (to be put
        in the routing's `ignore`); a half-open machine makes this attempt its probe. So
        exactly one attempt probes a key, whatever the key's scope."""
        wide = self.admit(provider, model, None, now)
        covering, fleet = self._covering, self._fleet
        covered = [
            m
            for m in machines
            if (provider, model, m) in covering
            or (fleet and BreakerKey(provider, model, m) in fleet)
        ]
        if not wide.allowed or not covered:
            return wide  # no machine has a key of its own: the common case, decided
        probes, transitions, refused = list(wide.probes), list(wide.transitions), []
        for machine in covered:
            key = BreakerKey(provider, model, machine)
            if self._peer_exclusion(key, now) is not None:
                refused.append(machine)
                continue
            entry = self._entries.get(key)
            if entry is None:
                continue
            excluded, half_open = self._check_entry(entry, now)
            if excluded:
                refused.append(machine)
            elif half_open:
                probes.extend(self._take_probes([entry], now, None))
                transitions.extend(self._half_openings([entry]))
        admission = Admission(True, None, tuple(probes), now, tuple(refused), tuple(transitions))
        if len(refused) == len(machines):
            self.release(admission)
            return Admission(False, None, (), now, tuple(refused), tuple(transitions))
        return admission

    def _take_probes(
        self, half_open: Sequence[_Entry], now: float, probe_lease: float | None
    ) -> tuple[BreakerKey, ...]:
        lease = self._lease if probe_lease is None else probe_lease
        if half_open:
            self.epoch += 1
        for entry in half_open:
            entry.probe_at = now
            entry.probe_until = now + lease
        return tuple(entry.key for entry in half_open)

    def _half_openings(self, entries: Sequence[_Entry]) -> tuple[Transition, ...]:
        """The HALF_OPENED transitions of these past-cooldown keys not yet reported (by
        `poll`, `admit` or `record`, whichever sees it first)."""
        return tuple(t for entry in entries if (t := self._half_opened(entry)) is not None)

    def _half_opened(self, entry: _Entry) -> Transition | None:
        if entry.half_open_reported or not entry.open:
            return None
        entry.half_open_reported = True
        assert entry.reason is not None
        return Transition(
            TransitionKind.HALF_OPENED,
            entry.key,
            Cause.BREAKER,
            entry.reason,
            entry.until,
            None,
            entry.trips,
            entry.trigger,
            "cooldown over: one re-probe allowed",
        )

    def release(self, admission: Admission) -> None:
        """Give back the probe slots of an admitted attempt that ended without an outcome
        (the client went away, the attempt was never sent)."""
        for key in admission.probes:
            entry = self._entries.get(key)
            if entry is not None and entry.probe_at == admission.at:
                entry.probe_at = None
                self.epoch += 1

    def _mark_active(self, key: BreakerKey) -> None:
        self.epoch += 1
        self._active[key] = None
        self._covering.add((key.provider, key.model, key.machine))

    def _unmark_active(self, key: BreakerKey) -> None:
        self.epoch += 1
        self._active.pop(key, None)
        self._covering.discard((key.provider, key.model, key.machine))

    def _check(
        self, provider: str, model: str, machine: str | None, now: float
    ) -> tuple[list[Exclusion], list[_Entry]]:
        refused: list[Exclusion] = []
        half_open: list[_Entry] = []
        # The common case, on every machine of every routing decision: no active key
        # covers this candidate. Only active keys (open, half-open or hard-excluded) can
        # refuse or hold a probe slot, and there are few of them.
        covering = self._covering
        if self._fleet:
            for key in covering_keys(provider, model, machine):
                peer = self._peer_exclusion(key, now)
                if peer is not None:
                    refused.append(peer)
        if (
            (provider, None, None) not in covering
            and (provider, model, None) not in covering
            and (machine is None or (provider, model, machine) not in covering)
        ):
            return refused, half_open
        for key in covering_keys(provider, model, machine):
            entry = self._entries.get(key)
            if entry is None:
                continue
            excluded, is_half_open = self._check_entry(entry, now)
            refused.extend(excluded)
            if is_half_open:
                half_open.append(entry)
        return refused, half_open

    def _peer_exclusion(self, key: BreakerKey, now: float) -> Exclusion | None:
        trip = self._fleet.get(key)
        if trip is None or now >= trip.until:
            return None
        own = self._entries.get(key)
        if own is not None and own.open:
            # This pod tripped the key itself: its own breaker, and its own probe, decide
            # (two pods that both tripped it must not keep each other from probing).
            return None
        return Exclusion(
            key,
            Cause.BREAKER,
            trip.reason,
            BreakerPhase.OPEN,
            now,
            trip.until,
            Trigger.FLEET,
            f"tripped on proxy pod {trip.pod}, which probes it",
        )

    def hear_trips(self, trips: Iterable[PeerTrip]) -> None:
        """Replace the breakers the fleet's other pods hold open (a key several hold stays
        out until the latest `until`)."""
        fleet: dict[BreakerKey, PeerTrip] = {}
        for trip in trips:
            held = fleet.get(trip.key)
            if held is None or trip.until > held.until:
                fleet[trip.key] = trip
        if fleet != self._fleet:
            self.epoch += 1
        self._fleet = fleet

    def rate_counts(self) -> list[RateCount]:
        """This pod's own rate windows with something in them (never what it heard)."""
        return [
            RateCount(key, family, evidence.rate.count, evidence.rate.faults)
            for key, entry in self._entries.items()
            for family, evidence in entry.evidence.items()
            if evidence.rate.count > 0 and not entry.open
        ]

    def hear_rates(self, counts: Iterable[RateCount]) -> None:
        """Replace the fleet's other pods' rate windows, summed per key and family: the
        rate arm counts them with this pod's own, so a fault rate spread thinly over N
        pods trips at the fleet's minimum sample, not at N times it."""
        summed: dict[tuple[BreakerKey, Family], tuple[int, int]] = {}
        for item in counts:
            calls, faults = summed.get((item.key, item.family), (0, 0))
            summed[(item.key, item.family)] = (calls + item.count, faults + item.faults)
        self._peer_rates = summed

    def peer_trips(self, now: float) -> list[PeerTrip]:
        """The fleet's other pods' open breakers keeping keys out here now, sorted."""
        live = (trip for trip in self._fleet.values() if now < trip.until)
        return sorted(live, key=lambda trip: _sort_key(trip.key))

    def own_trips(self, now: float) -> list[tuple[BreakerKey, TripReason]]:
        """This pod's open and half-open breakers (not what it heard), for the fleet."""
        return [
            (view.key, view.reason)
            for view in self.snapshot(now, include_closed=False)
            if view.cause is Cause.BREAKER and view.reason is not None
        ]

    def _check_entry(self, entry: _Entry, now: float) -> tuple[list[Exclusion], bool]:
        """Every reason one key refuses now, or whether it is half-open with its probe slot
        free."""
        found: list[Exclusion] = [
            Exclusion(
                entry.key,
                cause,
                REASON_OF_CAUSE[cause],
                BreakerPhase.OPEN,
                hard.since,
                hard.until,
                Trigger.STATUS,
                hard.detail,
            )
            for cause, hard in entry.hard.items()
            if hard.active and hard.until > now
        ]
        if entry.open:
            assert entry.reason is not None
            assert entry.trigger is not None
            if now < entry.until:
                found.append(
                    Exclusion(
                        entry.key,
                        Cause.BREAKER,
                        entry.reason,
                        BreakerPhase.OPEN,
                        entry.since,
                        entry.until,
                        entry.trigger,
                        entry.detail,
                    )
                )
            elif entry.probe_at is not None and now < entry.probe_until:
                found.append(
                    Exclusion(
                        entry.key,
                        Cause.BREAKER,
                        entry.reason,
                        BreakerPhase.HALF_OPEN,
                        entry.since,
                        entry.probe_until,
                        entry.trigger,
                        "a re-probe is in flight",
                    )
                )
        return found, not found and entry.open

    # -- time passing and reporting -------------------------------------------------------

    def poll(self, now: float) -> list[Transition]:
        """Transitions time alone causes: a cooldown ending (half-opened) and a hard
        exclusion expiring (recovered). Call it periodically; O(active keys)."""
        transitions: list[Transition] = []
        for key in list(self._active):
            entry = self._entries.get(key)
            if entry is None:
                self._unmark_active(key)
                continue
            if entry.open and now >= entry.until:
                half_opened = self._half_opened(entry)
                if half_opened is not None:
                    transitions.append(half_opened)
            for cause, hard in entry.hard.items():
                if hard.active and hard.until <= now:
                    transitions.append(self._lift(entry, cause, hard, hard.until))
            if not entry.is_active():
                self._unmark_active(key)
        return transitions

    def snapshot(self, now: float, *, include_closed: bool = True) -> list[BreakerView]:
        """Every tracked key's breaker, and each active hard exclusion as its own row,
        sorted by key then cause. For status reports and metrics."""
        states: list[BreakerView] = []
        for entry in self._entries.values():
            if entry.open:
                half_open = now >= entry.until
                states.append(
                    BreakerView(
                        entry.key,
                        Cause.BREAKER,
                        BreakerPhase.HALF_OPEN if half_open else BreakerPhase.OPEN,
                        entry.reason,
                        entry.since,
                        None if half_open else entry.until,
                        entry.trips,
                        entry.trigger,
                        entry.detail,
                    )
                )
            elif include_closed:
                states.append(
                    BreakerView(
                        entry.key,
                        Cause.BREAKER,
                        BreakerPhase.CLOSED,
                        entry.reason,
                        None,
                        None,
                        entry.trips,
                        entry.trigger,
                        "",
                    )
                )
            for cause, hard in entry.hard.items():
                if hard.active and hard.until > now:
                    states.append(
                        BreakerView(
                            entry.key,
                            cause,
                            BreakerPhase.OPEN,
                            REASON_OF_CAUSE[cause],
                            hard.since,
                            hard.until,
                            hard.trips,
                            Trigger.STATUS,
                            hard.detail,
                        )
                    )
        states.sort(key=lambda state: (*_sort_key(state.key), state.cause.value))
        return states

    # -- bookkeeping ----------------------------------------------------------------------

    def _entry(self, key: BreakerKey, now: float) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(key, now)
        else:
            self._entries.move_to_end(key)
            entry.last_active = max(entry.last_active, now)
        return entry

    def _evidence(
        self, entry: _Entry, family: Family, settings: BreakerSpec, now: float
    ) -> _Evidence:
        evidence = entry.evidence.get(family)
        if evidence is None:
            # Faults from before the key last changed state were spent on that change.
            changed = entry.recovered_at if entry.recovered_at is not None else float("-inf")
            evidence = entry.evidence[family] = _Evidence(
                RateWindow(settings.rate_window),
                CallBuckets(self._burst),
                CallBuckets(self._burst),
                changed,
            )
        elif evidence.rate.size != settings.rate_window:
            evidence.rate = evidence.rate.resized(settings.rate_window)
        return evidence

    def _history(self, entry: _Entry, signature: str, settings: BreakerSpec) -> SignatureHistory:
        needed = min(
            max(settings.novel_signature_count, settings.familiar_signature_count), MAX_HISTORY
        )
        history = entry.signatures.get(signature)
        if history is None:
            if len(entry.signatures) >= MAX_SIGNATURES_PER_KEY:
                stalest = min(entry.signatures, key=lambda name: entry.signatures[name].last)
                del entry.signatures[stalest]
            history = entry.signatures[signature] = SignatureHistory(
                needed, settings.novelty_window_seconds, self._burst
            )
        else:
            history.ensure(needed, settings.novelty_window_seconds, self._burst)
        return history

    # -- memory across restarts ------------------------------------------------------------

    def fault_marks(self, now: float) -> list[FaultMarks]:
        """Every signature's novelty baseline, as ages at `now`."""
        kept = []
        for key, entry in self._entries.items():
            for signature, history in entry.signatures.items():
                marks = list(history.marks)
                if not marks:
                    continue
                if len(marks) > MAX_KEPT_MARKS:
                    step = len(marks) / (MAX_KEPT_MARKS - 1)
                    marks = [marks[int(i * step)] for i in range(MAX_KEPT_MARKS - 1)] + marks[-1:]
                kept.append(FaultMarks(key, signature, tuple(max(0.0, now - at) for at in marks)))
        return kept

    def restore_marks(self, kept: Iterable[FaultMarks], age: float, now: float) -> None:
        """Take a novelty baseline back after a restart (`age`: how long it was kept): a
        signature seen within its window before the restart is familiar after it."""
        for item in kept:
            settings = self._settings_for(item.key.provider)
            entry = self._entry(item.key, now)
            history = self._history(entry, item.signature, settings)
            for at in sorted(now - age - mark for mark in item.ages):
                if now - at <= settings.novelty_window_seconds:
                    history.marks.append(at)

    def _evict(self, now: float) -> None:
        # Closed keys idle for longer than their novelty window (hours) hold nothing worth
        # keeping: looked for at most once a second, not on every record.
        if now < self._next_idle_sweep and len(self._entries) <= self._max_keys:
            return
        self._next_idle_sweep = now + IDLE_SWEEP_SECONDS
        for key in list(islice(self._entries, 8)):
            entry = self._entries[key]
            if entry.is_active():
                continue
            idle = now - entry.last_active
            if idle > self._settings_for(key.provider).novelty_window_seconds:
                del self._entries[key]
        while len(self._entries) > self._max_keys:
            victim = next(
                (key for key, entry in self._entries.items() if not entry.is_active()),
                next(iter(self._entries)),
            )
            del self._entries[victim]
            self._unmark_active(victim)


def _longest(exclusions: list[Exclusion]) -> Exclusion | None:
    if not exclusions:
        return None
    return max(exclusions, key=lambda e: float("inf") if e.until is None else e.until)


def _sort_key(key: BreakerKey) -> tuple[str, str, str]:
    return (key.provider, key.model or "", key.machine or "")
