"""Why a candidate may not be sent to (SPEC A5-A8, C4): the vocabulary the breaker speaks.

Pure data and pure functions. "May we send" is binary and each exclusion is reversible by
its own rule: a `Breaker` trip by its cooldown and half-open re-probe, a `RateLimited` one by
the upstream's Retry-After, `AuthFailure` and `Quota` by an escalating re-check. Nothing
here knows about, or feeds, a quality score. See docs/degraded-output.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from enum import StrEnum
from typing import Final, NamedTuple

from rolegate_policy.status import BreakerPhase, Scope, TripReason


class Cause(StrEnum):
    """The kind of exclusion. Each is held separately, with its own expiry and reason."""

    BREAKER = "Breaker"
    RATE_LIMITED = "RateLimited"
    AUTH_FAILURE = "AuthFailure"
    QUOTA = "Quota"


class Trigger(StrEnum):
    """Which rule opened the breaker or imposed the exclusion."""

    # A signature unseen on this key in the novelty window, seen novel_signature_count times.
    NOVELTY = "Novelty"
    # A familiar signature seen familiar_signature_count times.
    COUNT = "Count"
    # The attributable rate over the last rate_window outcomes above rate_threshold.
    RATE = "Rate"
    # The half-open re-probe failed.
    PROBE = "Probe"
    # The upstream said so itself: 429, 401/403, 402.
    STATUS = "Status"
    # Another proxy pod of the fleet tripped it; that pod probes it.
    FLEET = "Fleet"


class TransitionKind(StrEnum):
    TRIPPED = "tripped"
    HALF_OPENED = "half_opened"
    RECOVERED = "recovered"


class BreakerKey(NamedTuple):
    """A provider, a (provider, model) or a (provider, model, machine): a machine key
    names its model too. A named tuple: several are made and hashed for every attempt
    recorded, and a tuple is built and hashed in C (a frozen dataclass in Python)."""

    provider: str
    model: str | None = None
    machine: str | None = None

    @property
    def scope(self) -> Scope:
        if self.machine is not None:
            return Scope.MACHINE
        if self.model is not None:
            return Scope.MODEL
        return Scope.PROVIDER

    def covers(self, provider: str, model: str, machine: str | None) -> bool:
        """Whether this key takes the candidate (provider, model, machine) out."""
        if self.provider != provider:
            return False
        if self.model is not None and self.model != model:
            return False
        return self.machine is None or self.machine == machine

    def describe(self) -> str:
        if self.machine is not None:
            return f"machine {self.machine} serving {self.model} at {self.provider}"
        if self.model is not None:
            return f"model {self.model} at {self.provider}"
        return f"provider {self.provider}"


def covering_keys(provider: str, model: str, machine: str | None) -> tuple[BreakerKey, ...]:
    """Every key that can take the candidate out, widest first."""
    if machine is None:
        return (BreakerKey(provider), BreakerKey(provider, model))
    return (BreakerKey(provider), BreakerKey(provider, model), BreakerKey(provider, model, machine))


@dataclass(frozen=True, slots=True)
class Exclusion:
    """Why a candidate may not be sent to right now. `until` is when that may change (None
    only for a half-open breaker waiting on nothing in particular)."""

    key: BreakerKey
    cause: Cause
    reason: TripReason
    state: BreakerPhase
    since: float
    until: float | None
    trigger: Trigger
    detail: str

    def describe(self) -> str:
        return f"{self.key.describe()}: {self.reason} ({self.detail})"


@dataclass(frozen=True, slots=True)
class Transition:
    """A breaker or exclusion changing state: what the status reporter and Events are made of."""

    kind: TransitionKind
    key: BreakerKey
    cause: Cause
    reason: TripReason
    at: float
    until: float | None
    trips: int
    trigger: Trigger | None
    detail: str


@dataclass(frozen=True, slots=True)
class BreakerView:
    """One key's breaker, or one hard exclusion, as a status report or a metric sees it."""

    key: BreakerKey
    cause: Cause
    state: BreakerPhase
    # The last trip's reason; None for a breaker that never tripped.
    reason: TripReason | None
    since: float | None
    until: float | None
    trips: int
    trigger: Trigger | None
    detail: str

    @property
    def scope(self) -> Scope:
        return self.key.scope


# --- what an HTTP status says -----------------------------------------------------------------

# 4xx statuses that are the upstream's state, not the request's: they count as transport faults.
TRANSPORT_CLIENT_STATUSES: Final = frozenset({408, 409, 425})
HARD_STATUSES: Final = {
    429: Cause.RATE_LIMITED,
    401: Cause.AUTH_FAILURE,
    403: Cause.AUTH_FAILURE,
    402: Cause.QUOTA,
}
REASON_OF_CAUSE: Final = {
    Cause.RATE_LIMITED: TripReason.RATE_LIMITED,
    Cause.AUTH_FAILURE: TripReason.AUTH_FAILURE,
    Cause.QUOTA: TripReason.QUOTA,
}


def is_request_fault(status: int) -> bool:
    """A status about the request, not the upstream (400 context length or content filter,
    404, 413, 422, ...): it trips nothing and is no evidence either way."""
    return (
        400 <= status < 500
        and status not in TRANSPORT_CLIENT_STATUSES
        and status not in HARD_STATUSES
    )


def is_transport_status(status: int) -> bool:
    """A status that counts as a transport fault: 5xx (and anything above), 408, 409, 425,
    and every 3xx (a redirect is never followed: the upstream did not answer)."""
    return status >= 500 or is_redirect(status) or status in TRANSPORT_CLIENT_STATUSES


def is_redirect(status: int) -> bool:
    return 300 <= status < 400


# A Retry-After longer than this is taken as this: a day out of rotation is already a choice
# an operator should make, not a header.
MAX_RETRY_AFTER_SECONDS: Final = 86400.0


def parse_retry_after(value: str | None, *, wall_now: float) -> float | None:
    """Seconds to wait from a Retry-After header: delta-seconds or an HTTP-date (compared
    with `wall_now`, Unix seconds). None when absent or unreadable; never negative."""
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            return None
        seconds = when.timestamp() - wall_now
    if not math.isfinite(seconds):
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_SECONDS)
