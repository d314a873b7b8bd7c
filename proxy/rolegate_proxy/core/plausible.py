"""What a number about a machine may plausibly be (SPEC E8): the one place the bounds live.

A pod reads numbers from outside the process: its peers' memories (ProxyMemory objects)
and its own `--state-file`. Shape and finiteness are not enough: a TTFT whose log-sum is
1e5 is a finite number, and once it reaches a belief's arithmetic it overflows on every
routing decision. So every value read is held to the bounds below, and a memory with any
value outside them is refused whole (wire/pod_memory.py). The same bounds are the ones
the pod's own ledger files observations within (core/beliefs.py clamps every observed
duration into them), so an honest pod never writes what a peer would refuse.

Where the policy bounds a quantity, the bound is the policy's own (rolegate_policy.model);
the rest are named here, each with why.
"""

from __future__ import annotations

import math
from typing import Final, NamedTuple

from pydantic import BaseModel

from rolegate_policy.model import MAX_SECONDS, BreakerSpec


def _policy_upper(model: type[BaseModel], name: str) -> float:
    """The `le` bound the policy model declares for one field (what the CRD enforces)."""
    for constraint in model.model_fields[name].metadata:
        bound = getattr(constraint, "le", None)
        if bound is not None:
            return float(bound)
    raise LookupError(f"{model.__name__}.{name} declares no upper bound")


# -- durations ------------------------------------------------------------------------------

# The longest duration the policy lets anyone declare: a role's patience, a published time
# to first token, a provider's idle timeout (rolegate_policy.model.MAX_SECONDS, one hour).
# No arm is waited on longer than a patience, and no stream idles longer than its timeout,
# so no observed TTFT or per-token gap is longer.
MAX_DURATION_SECONDS: Final = MAX_SECONDS
# A first token within a millisecond of sending the request is no model's: the request has
# to cross a network and be read before a token exists. (A published TTFT of 0, "instant",
# is read as this too.) The liar's 0.175 ms is below it.
MIN_TTFT_SECONDS: Final = 1e-3
# A per-token gap of 0.1 ms is 10,000 tokens a second, above any model served today; a
# burst of tokens read in one network read has a gap of "zero" and is floored here.
MIN_GAP_SECONDS: Final = 1e-4


class LogRange(NamedTuple):
    """A range of durations on the log scale (log seconds), as the ledger holds them."""

    low: float
    high: float

    @classmethod
    def of(cls, low_seconds: float, high_seconds: float) -> LogRange:
        return cls(math.log(low_seconds), math.log(high_seconds))

    def clamp(self, y: float) -> float:
        """`y` within the range; a NaN reads as the longest (never as instant)."""
        if not y < self.high:
            return self.high
        return max(y, self.low)

    @property
    def max_variance(self) -> float:
        """The widest variance values within the range can have (Popoviciu: a quarter of
        the range squared). Any mix of observations within the range has at most this."""
        return (self.high - self.low) ** 2 / 4.0


TTFT_LOG: Final = LogRange.of(MIN_TTFT_SECONDS, MAX_DURATION_SECONDS)
GAP_LOG: Final = LogRange.of(MIN_GAP_SECONDS, MAX_DURATION_SECONDS)
# The pace of a whole non-streamed answer: its time over what its machine's published (or
# a reference) shape gives for its tokens (core/beliefs.py). A million times faster or
# slower than the shape is no machine's, it is a wrong sheet or a wrong count.
PACE_LOG: Final = LogRange.of(1e-6, 1e6)

# What a belief's arithmetic may answer, whatever got into it (defence in depth: nothing
# outside the ranges above should reach a belief). 1e9 s is 31 years: a belief that long
# refuses the machine for every patience the policy allows, as infinity would, without
# overflowing; 1e-9 s keeps a rate (1 / gap) finite.
MIN_BELIEVED_SECONDS: Final = 1e-9
MAX_BELIEVED_SECONDS: Final = 1e9

# -- counts, weights, times ----------------------------------------------------------------

# The data behind one belief never weighs more than this many observations: the ledger's
# cap (LedgerSettings.max_weight's default), so evidence claiming more was not written by a
# rolegate ledger. It is also the most one peer's evidence may weigh in a belief here.
MAX_EVIDENCE_WEIGHT: Final = 40.0
# Sightings and score observations a memory may claim for one machine: 10^12 is a pod
# answering 10,000 requests a second to one machine for three years. (Far below 2^53, so
# every count is exact in a JSON number.)
MAX_COUNT: Final = 10**12
# How far in the future a memory's writtenAt may be: pods' clocks disagree by milliseconds
# under NTP; a minute is generous. A memory from further ahead would count as brand new
# (weight 1) and keep its trips in force for as long as it stays "in the future".
MAX_CLOCK_SKEW_SECONDS: Final = 60.0
# A fault mark older than the longest novelty window the policy allows (30 days) is never
# taken back, so none is written and none older is read.
MAX_FAULT_AGE_SECONDS: Final = _policy_upper(BreakerSpec, "novelty_window_seconds")
# A rate window holds at most the longest window the policy allows (100,000 calls).
MAX_RATE_WINDOW: Final = int(_policy_upper(BreakerSpec, "rate_window"))

# The wire keeps six significant digits, so a value recomputed from rounded numbers (a
# mean from a sum and a count, a variance from two sums) is off by about 1e-5 of its size:
# every bound is applied with this relative slack.
ROUNDING: Final = 1e-4


def within(value: float, low: float, high: float) -> bool:
    """`low <= value <= high` up to the wire's rounding (each end's own); False for a NaN."""
    return low - _slack(low) <= value <= high + _slack(high)


def _slack(bound: float) -> float:
    return ROUNDING * max(abs(bound), 1.0)


def evidence_fault(n: float, s1: float, s2: float, durations: LogRange) -> str | None:
    """What is implausible about one quantity's evidence (`n` pseudo-observations, the sum
    of their log durations and of their squares), or None. Named by what it is, never by
    its value."""
    if not (n > 0.0 and within(n, 0.0, MAX_EVIDENCE_WEIGHT)):
        return f"its count is not a pseudo-count of at most {MAX_EVIDENCE_WEIGHT:g}"
    mean = s1 / n
    if not within(mean, durations.low, durations.high):
        low, high = math.exp(durations.low), math.exp(durations.high)
        return f"its mean is not a duration of {low:g} s to {high:g} s"
    second = s2 / n
    variance = second - mean * mean
    slack = ROUNDING * max(second, 1.0)
    if not variance >= -slack:
        return "its sum of squares is less than its sum allows"
    if not variance <= durations.max_variance + slack:
        return "its spread is wider than durations in range allow"
    return None
