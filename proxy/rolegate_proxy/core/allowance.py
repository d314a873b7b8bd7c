"""What each AccessGrant's callers may still use: requests and tokens a minute, dollars a day.

Each limit is a token bucket: it holds up to the limit, refills continuously at the limit
per window, and a request is admitted while every bucket of its grant has something left
(a request takes one from the requests bucket at once; tokens and dollars are known only
when the answer ends, and are taken then, so a bucket may go below zero and the next
request waits until it is back above). A refused request is told when to retry: the time
until the emptiest bucket holds what it needs.

Counted by each proxy pod on its own (the request path never waits on a peer): with N
replicas behind one Service, a grant's callers may use up to N times a figure.
Pure: the clock is an argument; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from rolegate_policy.config import CompiledGrant

MINUTE: Final = 60.0
DAY: Final = 86_400.0


class LimitKind(StrEnum):
    REQUESTS = "requests"
    TOKENS = "tokens"
    COST = "cost"


# How each limit is spelled in an AccessGrant, and its unit for people.
LIMIT_FIELDS: Final = {
    LimitKind.REQUESTS: ("requestsPerMinute", "requests a minute"),
    LimitKind.TOKENS: ("tokensPerMinute", "tokens a minute"),
    LimitKind.COST: ("costPerDayUSD", "USD a day"),
}


@dataclass(slots=True)
class Bucket:
    """Up to `size` units, refilled at `size` per `window` seconds."""

    size: float
    window: float
    level: float
    at: float

    def refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.size, self.level + (now - self.at) * self.size / self.window)
            self.at = now

    def wait(self, need: float) -> float:
        """Seconds until the bucket holds `need` (after `refill`)."""
        if self.level >= need:
            return 0.0
        return (need - self.level) * self.window / self.size


@dataclass(frozen=True, slots=True)
class Limited:
    """A request refused by a limit: which one, and when to retry."""

    grant: str
    kind: LimitKind
    figure: float
    retry_after: float

    @property
    def retry_after_header(self) -> str:
        """Whole seconds, rounded up, at least 1 (RFC 9110 delay-seconds)."""
        return str(max(1, math.ceil(self.retry_after)))


# What a request needs in a bucket to be admitted: a whole request, or any positive
# balance of tokens and dollars (their use is known only afterwards).
_NEEDS: Final = {LimitKind.REQUESTS: 1.0, LimitKind.TOKENS: 1e-9, LimitKind.COST: 1e-12}


class GrantAllowance:
    """The buckets of one grant."""

    def __init__(self, grant: CompiledGrant, now: float) -> None:
        self.grant = grant.name
        self.buckets: dict[LimitKind, Bucket] = {}
        for kind, figure, window in (
            (LimitKind.REQUESTS, grant.requests_per_minute, MINUTE),
            (LimitKind.TOKENS, grant.tokens_per_minute, MINUTE),
            (LimitKind.COST, grant.cost_per_day_usd, DAY),
        ):
            if figure is not None:
                self.buckets[kind] = Bucket(float(figure), window, float(figure), now)

    def carry(self, old: GrantAllowance) -> None:
        """Keep what was already used under a new configuration: a configuration change
        never hands a grant a fresh allowance (a smaller limit starts as full as the old
        bucket was, at most its new size)."""
        for kind, bucket in self.buckets.items():
            before = old.buckets.get(kind)
            if before is not None:
                used = before.size - before.level
                bucket.level, bucket.at = min(bucket.size, bucket.size - used), before.at

    def admit(self, now: float) -> Limited | None:
        """Take one request, or say which limit refuses it (the one to wait longest for)."""
        refusal: Limited | None = None
        for kind, bucket in self.buckets.items():
            bucket.refill(now)
            wait = bucket.wait(_NEEDS[kind])
            if wait > 0 and (refusal is None or wait > refusal.retry_after):
                refusal = Limited(self.grant, kind, bucket.size, wait)
        if refusal is None and (requests := self.buckets.get(LimitKind.REQUESTS)) is not None:
            requests.level -= 1.0
        return refusal

    def charge(self, tokens: int, cost_usd: float, now: float) -> None:
        """Take what an answer used."""
        for kind, amount in ((LimitKind.TOKENS, float(tokens)), (LimitKind.COST, cost_usd)):
            bucket = self.buckets.get(kind)
            if bucket is not None and amount > 0:
                bucket.refill(now)
                bucket.level -= amount

    def remaining(self, now: float) -> dict[LimitKind, float]:
        """What each bucket holds now, as a share of its size (negative when overdrawn)."""
        shares = {}
        for kind, bucket in self.buckets.items():
            bucket.refill(now)
            shares[kind] = bucket.level / bucket.size
        return shares


class Allowances:
    """Every limited grant's allowance, by grant name. Rebuilt on a configuration change,
    carrying each grant's use over."""

    def __init__(self) -> None:
        self._by_grant: dict[str, GrantAllowance] = {}

    def configure(self, grants: Iterable[CompiledGrant], now: float) -> None:
        fresh: dict[str, GrantAllowance] = {}
        for grant in grants:
            if not grant.limited:
                continue
            allowance = GrantAllowance(grant, now)
            if (old := self._by_grant.get(grant.name)) is not None:
                allowance.carry(old)
            fresh[grant.name] = allowance
        self._by_grant = fresh

    def admit(self, grant: str, now: float) -> Limited | None:
        allowance = self._by_grant.get(grant)
        return None if allowance is None else allowance.admit(now)

    def charge(self, grant: str, tokens: int, cost_usd: float, now: float) -> None:
        allowance = self._by_grant.get(grant)
        if allowance is not None:
            allowance.charge(tokens, cost_usd, now)

    def remaining(self, now: float) -> dict[str, dict[LimitKind, float]]:
        return {name: allowance.remaining(now) for name, allowance in self._by_grant.items()}
