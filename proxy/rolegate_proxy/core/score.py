"""How good each machine has been (SPEC C1-C3, C9): the shrunk operational score, and the
semantic score an evaluator reports.

Two scores, never blended:

* **Operational** is only what the hot path sees of an attempt: its status, a refused or
  reset connection, a rate limit, an answer that would not parse, a broken stream, output
  cut at the length cap, an empty success, broken tool calls, and how long it took. Each
  attempt is one observation, valued by `observation_value`:

  * `ok`: 1;
  * `late` (a usable answer, but after the role's patience): patience / elapsed, clamped
    to [0, 1];
  * `server_error`, `refused`, `timeout`, `rate_limited`, `parse_failure`,
    `broken_stream`, `length_capped`, `empty_success`, `malformed_tool_call`: 0.

  So the operational score is a rate of usable answers in [0, 1], where a late answer
  counts for part of one: twice as late is worth half, never nothing (it was usable).
* **Semantic** comes only from an evaluator's judgment (`Scoreboard.judge`), on the scale
  the evaluator declares, normalized onto [0, 1]. It is None until one reports: no
  evaluator is not the same as a middling one.

**Smoothing.** `observed` is an exponentially weighted mean: an observation's weight
halves every `half_life` observations, so a machine that drifts is followed gradually (a
single failure moves a long record by at most alpha; the price is lag). The mean keeps a
weighted sum and the total weight, so it is bias-corrected like Adam's moments: the first
observations average plainly instead of being pulled towards an arbitrary starting value.

**Shrinkage.** `confidence = min(1, n / full_confidence)` and `score = target +
confidence * (observed - target)`: a machine with seven answers is mostly the target, one
with fifty or more is what it has shown. The target is the value that does not move the
ranking (SPEC C2, G3), so it depends on what is ranked, not only on the scale:

* A `ScoreView` on its own (the state endpoint, the metrics) is shrunk towards its scale's
  midpoint, `neutral` (0.5 on [0, 1]): the point of no evidence, with no field to compare.
* A routing decision shrinks every machine it ranks towards that field's own target,
  `field_target`: the confidence-weighted mean of the observed means of the machines with
  evidence. It is exactly the mean of their shrunk scores, so a cold machine (scored at the
  target) lands in the middle of the field it joins: never below every tried machine
  (punished for having no history), never above every one (overtaking a long honest
  record). The chooser computes it once per decision (core/chooser.py); reading a machine
  here stays O(1).

Grain: one score per (provider, model, machine), a `MachineKey`. Pure: no I/O, no event
loop; the clock is an argument. Memory is bounded (`ScoreSettings.max_keys`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from .beliefs import MachineKey
from .versions import Versions


class ObservationKind(StrEnum):
    """What one attempt ended as, as far as the hot path can tell."""

    OK = "ok"
    # A usable answer, but after the role's patience.
    LATE = "late"
    # A 5xx, or another upstream status that is not about the request.
    SERVER_ERROR = "server_error"
    # The connection was refused, reset or could not be made.
    REFUSED = "refused"
    TIMEOUT = "timeout"
    RATE_LIMITED = "rate_limited"
    # A success whose body would not parse.
    PARSE_FAILURE = "parse_failure"
    BROKEN_STREAM = "broken_stream"
    # The output stopped at the length cap.
    LENGTH_CAPPED = "length_capped"
    # A success with nothing in it.
    EMPTY_SUCCESS = "empty_success"
    # A success whose tool calls were broken (arguments not JSON, a tool never declared).
    MALFORMED_TOOL_CALL = "malformed_tool_call"


def observation_value(
    kind: ObservationKind, *, elapsed: float | None = None, patience: float | None = None
) -> float:
    """What one attempt is worth on [0, 1] (the table in the module docstring).

    `elapsed` (seconds to the usable answer) and `patience` (the role's, seconds) are read
    only for `late`, which needs both; other kinds ignore them, so a caller may pass them
    always. An answer classed late that in fact arrived within the patience is worth 1.
    """
    if kind is ObservationKind.OK:
        return 1.0
    if kind is not ObservationKind.LATE:
        return 0.0
    if elapsed is None or patience is None:
        raise ValueError("a late observation needs both elapsed and patience")
    # A late answer arrived, so it took a finite time; a patience is finite too.
    if not (0 < elapsed < math.inf and 0 <= patience < math.inf):
        raise ValueError(
            f"a late observation needs finite elapsed > 0 and patience >= 0, "
            f"got elapsed={elapsed}, patience={patience}"
        )
    return min(1.0, patience / elapsed)


@dataclass(frozen=True, slots=True)
class ScoreSettings:
    # N: observations after which the score is all evidence and no neutral point.
    full_confidence: int = 50
    # Observations after which an observation's weight in `observed` halves.
    half_life: float = 35.0
    # Machines tracked at most (least recently observed dropped first).
    max_keys: int = 4096

    def __post_init__(self) -> None:
        if self.full_confidence < 1:
            raise ValueError(
                f"full_confidence must be at least 1 observation, got {self.full_confidence}"
            )
        if not (self.half_life > 0 and math.isfinite(self.half_life)):
            raise ValueError(
                f"half_life must be a positive, finite count of observations, got {self.half_life}"
            )
        if self.max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, got {self.max_keys}")

    @property
    def alpha(self) -> float:
        """The weight the newest observation gets once the history is long: with it, an
        observation's weight halves after `half_life` more."""
        return 1.0 - math.exp2(-1.0 / self.half_life)


@dataclass(frozen=True, slots=True)
class ScoreScale:
    """The scale a score is reported on, [low, high].

    The neutral point is the scale's midpoint, defined here rather than copied as a
    constant, because it depends on the scale: an evaluator that declares 1..5 gets 3. It
    is the point of no evidence a view is shown against on its own. It is not what a
    ranking shrinks towards: where healthy machines sit near 0.95, a cold machine at 0.5
    would rank below every tried one and never be tried, so a routing decision shrinks
    towards its field's target instead (`field_target`).
    """

    low: float = 0.0
    high: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.low) and math.isfinite(self.high) and self.low < self.high):
            raise ValueError(f"a scale needs finite low < high, got {self.low}..{self.high}")

    @property
    def neutral(self) -> float:
        return (self.low + self.high) / 2.0

    def normalize(self, x: float) -> float:
        """`x` mapped onto [0, 1]; a value outside the scale is an evaluator's mistake, not
        something to clamp quietly."""
        if not self.low <= x <= self.high:
            raise ValueError(f"{x} is outside the scale {self.low}..{self.high}")
        return (x - self.low) / (self.high - self.low)

    def denormalize(self, x: float) -> float:
        """A value on [0, 1] mapped back onto this scale (for showing it as reported)."""
        return self.low + x * (self.high - self.low)


UNIT_SCALE = ScoreScale()


@dataclass(frozen=True, slots=True)
class ScoreView:
    """A score as read at one moment. `score` is the shrunk score, `observed` the smoothed
    mean it is shrunk from (None with no observation), `n` the observations behind it,
    `confidence` min(1, n / N), `neutral` the point it is shrunk towards: its scale's
    midpoint. A routing decision shrinks the same evidence towards its field's target
    instead (`toward`, `field_target`)."""

    score: float
    observed: float | None
    n: int
    confidence: float
    neutral: float

    def toward(self, target: float) -> float:
        """The score shrunk towards `target` rather than `neutral`: `target` itself with no
        observation, the observed mean itself at full confidence (exactly, so a machine
        with a long record is what it has shown whatever the field)."""
        observed = self.observed
        if observed is None:
            return target
        if self.confidence >= 1.0:
            return observed
        return target + self.confidence * (observed - target)

    def on(self, scale: ScoreScale) -> ScoreView:
        """This view (taken on [0, 1]) expressed on `scale`, e.g. an evaluator's 1..5."""
        return ScoreView(
            scale.denormalize(self.score),
            None if self.observed is None else scale.denormalize(self.observed),
            self.n,
            self.confidence,
            scale.denormalize(self.neutral),
        )


@dataclass(frozen=True, slots=True)
class ScoreEvidence:
    """A running score as numbers a pod can keep or share: its observation count, its
    smoothed mean, and the total weight behind that mean (at most 1 / alpha)."""

    n: int
    mean: float
    weight: float


def field_target(views: Iterable[ScoreView]) -> float:
    """The shrinkage target of one ranking: the value that does not move it (SPEC C2, G3).

    Over the views with evidence, sum(c_i * observed_i) / sum(c_i), c_i each one's
    confidence; the scale's midpoint when none has any. Derived, not chosen: it is the one
    value T for which the mean of the field's scores shrunk towards T (`toward`) is T
    itself, since sum(c_i * (observed_i - T)) = 0. So a cold machine, scored at T, sits at
    the field's mean: at or above its worst tried machine (not punished for having no
    history) and at or below its best (it cannot overtake a long honest record); alone
    beside one machine with a record, it ties with it, and the published figures (cost,
    then expected time) decide. Each machine counts by its confidence, capped at 1, rather
    than by its raw count of calls: the smoothed mean forgets old calls, and a busy machine
    is not more of the field than a quiet one whose record is as sure.

    Clamped to [lowest, highest] observed mean, where it lies in exact arithmetic: so when
    every machine with evidence has the same mean, the target is that mean exactly, and a
    cold machine ties with them exactly (a strict ranking, tolerance 0, sees no rounding).
    """
    weight = weighted = 0.0
    low, high = math.inf, -math.inf
    for view in views:
        observed = view.observed
        if observed is None:
            continue
        confidence = view.confidence
        weight += confidence
        weighted += confidence * observed
        low = min(low, observed)
        high = max(high, observed)
    if weight == 0.0:
        return UNIT_SCALE.neutral
    return min(high, max(low, weighted / weight))


class RunningScore:
    """A bias-corrected exponentially weighted mean of observations, and their count.

    `_weighted` and `_weight` both decay by (1 - alpha) per observation, then gain the new
    value and weight 1; their ratio is the mean. Early on the weights are all near 1 (a
    plain average); later the total weight approaches 1 / alpha and the newest observation
    gets alpha of it."""

    __slots__ = ("_keep", "_weight", "_weighted", "last_at", "n")

    def __init__(self, alpha: float) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self._keep = 1.0 - alpha
        self._weighted = 0.0
        self._weight = 0.0
        self.n = 0
        self.last_at: float | None = None

    def observe(self, value: float, now: float) -> None:
        # A NaN would poison the mean for good.
        if not math.isfinite(value):
            raise ValueError(f"an observation must be finite, got {value}")
        self._weighted = self._keep * self._weighted + value
        self._weight = self._keep * self._weight + 1.0
        self.n += 1
        self.last_at = now if self.last_at is None else max(self.last_at, now)

    @property
    def observed(self) -> float | None:
        return None if self.n == 0 else self._weighted / self._weight

    def evidence(self) -> ScoreEvidence | None:
        if self.n == 0:
            return None
        return ScoreEvidence(self.n, self._weighted / self._weight, self._weight)

    def restore(self, evidence: ScoreEvidence) -> None:
        """Take back a record kept elsewhere (a restart): the same mean, count and weight
        (so the next observation moves it exactly as it would have)."""
        self.n = evidence.n
        self._weight = evidence.weight
        self._weighted = evidence.mean * evidence.weight

    def view(self, settings: ScoreSettings, neutral: float) -> ScoreView:
        if self.n == 0:
            return ScoreView(neutral, None, 0, 0.0, neutral)
        observed = self._weighted / self._weight
        if self.n >= settings.full_confidence:
            return ScoreView(observed, observed, self.n, 1.0, neutral)
        confidence = self.n / settings.full_confidence
        score = neutral + confidence * (observed - neutral)
        return ScoreView(score, observed, self.n, confidence, neutral)


@dataclass(frozen=True, slots=True)
class ScoreRow:
    """One machine's scores, for the state endpoint and metrics. `kinds` counts its
    observations by kind (only kinds seen); `semantic_scale` is the scale the latest
    judgment was reported on; `evaluators` counts judgments per evaluator, named because an
    evaluator served by the same provider is not independent of it."""

    key: MachineKey
    operational: ScoreView
    semantic: ScoreView | None
    kinds: dict[ObservationKind, int]
    semantic_scale: ScoreScale | None
    evaluators: dict[str, int]
    last_at: float | None


class _Semantic:
    __slots__ = ("evaluators", "running", "scale", "view")

    def __init__(self, alpha: float, scale: ScoreScale, view: ScoreView) -> None:
        self.running = RunningScore(alpha)
        self.scale = scale
        self.evaluators: dict[str, int] = {}
        self.view = view


class _Record:
    __slots__ = ("heard", "kinds", "last_at", "operational", "semantic", "view")

    def __init__(self, alpha: float, view: ScoreView) -> None:
        self.operational = RunningScore(alpha)
        self.kinds: dict[ObservationKind, int] = {}
        self.semantic: _Semantic | None = None
        self.last_at: float | None = None
        # What the fleet's other pods observed of this machine (see `Scoreboard.hear`).
        self.heard: ScoreEvidence | None = None
        # The operational view, recomputed on every observation: reads far outnumber
        # writes (every machine is read on every routing decision).
        self.view = view


class Scoreboard:
    """Every machine's operational and semantic scores. `observe` files what an attempt
    ended as (operational only); `judge` files an evaluator's judgment (semantic only);
    `operational` and `semantic` read. Reading is O(1) and allocates nothing."""

    def __init__(self, settings: ScoreSettings | None = None) -> None:
        self.settings = settings or ScoreSettings()
        self._alpha = self.settings.alpha
        self._records: OrderedDict[MachineKey, _Record] = OrderedDict()
        self._cold = RunningScore(self._alpha).view(self.settings, UNIT_SCALE.neutral)
        # What changed, for readers that keep what they derived (the chooser's standings).
        self.versions = Versions()

    def __len__(self) -> int:
        return len(self._records)

    # -- writing ---------------------------------------------------------------------------

    def observe(
        self,
        key: MachineKey,
        kind: ObservationKind,
        now: float,
        *,
        elapsed: float | None = None,
        patience: float | None = None,
    ) -> ScoreView:
        """File one attempt's outcome; returns the operational view afterwards."""
        value = observation_value(kind, elapsed=elapsed, patience=patience)
        record = self._record(key, now)
        self.versions.changed(key.provider, key.model, now)
        record.operational.observe(value, now)
        record.kinds[kind] = record.kinds.get(kind, 0) + 1
        record.view = self._view_of(record)
        return record.view

    def judge(
        self, key: MachineKey, value: float, *, scale: ScoreScale, evaluator: str, now: float
    ) -> ScoreView:
        """File one evaluator's judgment of an answer from `key`, on `scale`; returns the
        semantic view afterwards (on [0, 1]). A value outside the scale is refused."""
        normalized = scale.normalize(value)
        record = self._record(key, now)
        self.versions.changed(key.provider, key.model, now)
        semantic = record.semantic
        if semantic is None:
            semantic = record.semantic = _Semantic(self._alpha, scale, self._cold)
        semantic.scale = scale
        semantic.running.observe(normalized, now)
        semantic.evaluators[evaluator] = semantic.evaluators.get(evaluator, 0) + 1
        semantic.view = semantic.running.view(self.settings, UNIT_SCALE.neutral)
        return semantic.view

    # -- reading ---------------------------------------------------------------------------

    def operational(self, key: MachineKey) -> ScoreView:
        """The operational view of `key`: neutral, with no confidence, when never seen."""
        record = self._records.get(key)
        return self._cold if record is None else record.view

    def evidence(self, key: MachineKey) -> tuple[ScoreView, float | None]:
        """The operational view and the semantic score (None until judged) in one read:
        what the ranking needs of every admitted machine on every decision (it shrinks the
        operational evidence towards its own field's target, `field_target`)."""
        record = self._records.get(key)
        if record is None:
            return self._cold, None
        semantic = record.semantic
        return record.view, None if semantic is None else semantic.view.score

    def last_observed(self, key: MachineKey) -> float | None:
        """When `key` was last observed operationally (None: never, or forgotten)."""
        record = self._records.get(key)
        return None if record is None else record.operational.last_at

    def semantic(self, key: MachineKey) -> ScoreView | None:
        """The semantic view of `key` on [0, 1], or None until an evaluator judged it."""
        record = self._records.get(key)
        semantic = None if record is None else record.semantic
        return None if semantic is None else semantic.view

    def rows(self) -> list[ScoreRow]:
        """Every machine held, in key order."""
        rows = []
        for key in sorted(self._records):
            record = self._records[key]
            semantic = record.semantic
            rows.append(
                ScoreRow(
                    key,
                    record.view,
                    None if semantic is None else semantic.view,
                    {kind: record.kinds[kind] for kind in ObservationKind if kind in record.kinds},
                    None if semantic is None else semantic.scale,
                    {} if semantic is None else dict(sorted(semantic.evaluators.items())),
                    record.last_at,
                )
            )
        return rows

    def views(self) -> list[tuple[MachineKey, ScoreView, ScoreView | None]]:
        """Every machine's operational and semantic views, unordered: the copy a metrics
        scrape takes on the event loop, a few times cheaper than `rows` (the views are
        immutable; the scrape renders them in another thread)."""
        return [
            (key, record.view, None if record.semantic is None else record.semantic.view)
            for key, record in self._records.items()
        ]

    # -- memory across restarts ------------------------------------------------------------

    def records(self) -> list[tuple[MachineKey, ScoreEvidence]]:
        """Every machine's operational record, most recently observed first."""
        found = []
        for key, record in reversed(self._records.items()):
            evidence = record.operational.evidence()
            if evidence is not None:
                found.append((key, evidence))
        return found

    def restore(self, items: Iterable[tuple[MachineKey, ScoreEvidence]], now: float) -> None:
        """Take back operational records kept before a restart. (Semantic scores are not
        kept: an evaluator's judgments count from the restart on.) A record's weight is
        held at 1 / alpha, the most one can reach here: a file claiming more would
        otherwise freeze the score against the next hundreds of observations."""
        most = 1.0 / self._alpha
        for key, evidence in items:
            record = self._record(key, now)
            if evidence.weight > most:
                evidence = ScoreEvidence(evidence.n, evidence.mean, most)
            record.operational.restore(evidence)
            record.view = self._view_of(record)
        self.versions.changed_all()

    def hear(self, peers: Iterable[tuple[MachineKey, ScoreEvidence, float]], now: float) -> None:
        """Replace what the fleet said: each peer's record with the weight its age leaves
        it, summed per machine, counted with this pod's own observations in the view (the
        mean weighted by the records' weights, the count by their counts). Only `evidence`
        is ever shared, so nothing heard is passed on.

        One peer's record weighs at most 1 / alpha in the mean, the most any record here
        can weigh (a long history's total weight): a peer claiming more moves the score
        no further than a long honest record would."""
        most = 1.0 / self._alpha
        heard: dict[MachineKey, tuple[float, float, float]] = {}
        for key, evidence, weight in peers:
            carried = min(evidence.weight, most) * weight
            if not carried > 0:
                continue
            n, total, weighted = heard.get(key, (0.0, 0.0, 0.0))
            heard[key] = (
                n + evidence.n * weight,
                total + carried,
                weighted + evidence.mean * carried,
            )
        for key, record in self._records.items():
            if record.heard is not None and key not in heard:
                record.heard = None
                record.view = self._view_of(record)
        for key, (n, total, weighted) in heard.items():
            found = self._records.get(key)
            record = found if found is not None else self._record(key, now)
            record.heard = ScoreEvidence(round(n), weighted / total, total)
            record.view = self._view_of(record)
        self.versions.changed_all()

    def _view_of(self, record: _Record) -> ScoreView:
        """The operational view: this pod's record, and the fleet's when it heard one."""
        own, heard = record.operational, record.heard
        if heard is None or heard.n == 0:
            return own.view(self.settings, UNIT_SCALE.neutral)
        combined = RunningScore(self._alpha)
        mine = own.evidence()
        if mine is None:
            combined.restore(heard)
        else:
            weight = mine.weight + heard.weight
            mean = (mine.mean * mine.weight + heard.mean * heard.weight) / weight
            combined.restore(ScoreEvidence(mine.n + heard.n, mean, weight))
        return combined.view(self.settings, UNIT_SCALE.neutral)

    # -- bookkeeping -----------------------------------------------------------------------

    def _record(self, key: MachineKey, now: float) -> _Record:
        """The record of `key`, made most recently observed (created if new; the least
        recently observed is dropped past `max_keys`)."""
        record = self._records.get(key)
        if record is None:
            record = self._records[key] = _Record(self._alpha, self._cold)
            while len(self._records) > self.settings.max_keys:
                victim, _ = self._records.popitem(last=False)
                self.versions.changed(victim.provider, victim.model, now)
        else:
            self._records.move_to_end(key)
        record.last_at = now if record.last_at is None else max(record.last_at, now)
        return record
