"""The closed loop's first consumer (SPEC C6): outcomes into the operational score.

Every arm of every drained outcome that names its machine and says something about it
(see `ArmResult`: answered, late, failed by the upstream; not a request fault, a
cancellation, a mangled encoding or an auth failure) becomes one observation of that
(provider, model, machine). The next routing decision reads the updated score: outcome,
then score, then decision, with no log export in between.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Final

from .beliefs import MachineKey
from .outcomes import ArmResult, Outcome
from .score import ObservationKind, Scoreboard

# What each arm result is, as an observation of its machine's operational quality. The
# results missing here say nothing about it: a request fault (the request's), a degraded
# verdict (the breaker's business, never the score's, SPEC A5), an auth or quota failure
# (a hard exclusion's), an arm we or the client cancelled, a move, a stale connection.
OBSERVED: Final[Mapping[ArmResult, ObservationKind]] = MappingProxyType(
    {
        ArmResult.OK: ObservationKind.OK,
        ArmResult.LATE: ObservationKind.LATE,
        ArmResult.SERVER_ERROR: ObservationKind.SERVER_ERROR,
        ArmResult.REFUSED: ObservationKind.REFUSED,
        ArmResult.TIMEOUT: ObservationKind.TIMEOUT,
        ArmResult.RATE_LIMITED: ObservationKind.RATE_LIMITED,
        ArmResult.PARSE_FAILURE: ObservationKind.PARSE_FAILURE,
        ArmResult.BROKEN_STREAM: ObservationKind.BROKEN_STREAM,
        ArmResult.LENGTH_CAPPED: ObservationKind.LENGTH_CAPPED,
        ArmResult.EMPTY_SUCCESS: ObservationKind.EMPTY_SUCCESS,
        ArmResult.MALFORMED_TOOL_CALL: ObservationKind.MALFORMED_TOOL_CALL,
    }
)


class ScoreFeed:
    def __init__(self, scores: Scoreboard, now: Callable[[], float]) -> None:
        self.scores = scores
        self._now = now
        self.observed = 0

    def __call__(self, batch: Sequence[Outcome]) -> None:
        now = self._now()
        for outcome in batch:
            for arm in outcome.arms:
                kind = OBSERVED.get(arm.result)
                if kind is None or arm.machine is None:
                    continue
                self.scores.observe(
                    MachineKey(arm.provider, arm.model, arm.machine),
                    kind,
                    now,
                    elapsed=arm.seconds,
                    patience=outcome.patience_seconds,
                )
                self.observed += 1
