"""The closed loop's first consumer (SPEC C6): outcomes into the operational score.

Every arm of every drained outcome that names its machine and says something about it
(see `ArmResult`: answered, late, failed by the upstream; not a request fault, a
cancellation, a mangled encoding or an auth failure) becomes one observation of that
(provider, model, machine). The next routing decision reads the updated score: outcome,
then score, then decision, with no log export in between.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

from .beliefs import MachineKey
from .outcomes import ArmResult, Outcome
from .score import ObservationKind, Scoreboard

OBSERVED: Final = {
    result: ObservationKind(result.value)
    for result in ArmResult
    if result.value in {kind.value for kind in ObservationKind}
}


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
