"""Feedback from an evaluator (SPEC C1): the semantic score's only source.

`POST /v1/feedback` takes one judgment of a past request:

    {"request_id": "...", "score": 4, "scale": [1, 5], "evaluator": "judge-v2"}

`scale` is optional (default [0, 1]). It answers only an administrator (the proxy's
admin token, or a grant with `admin: true`): a judgment moves routing, so an anonymous
caller must not be able to make one. The judgment updates only the semantic score of the
(provider, model, machine) that served that request — never the operational score, and
never another machine. The evaluator's name is kept with the score: an evaluator served
by the same provider it judges is not an independent witness, and the state endpoint
shows who judged.

Which machine served a request is remembered for the last `capacity` answered requests
(fed by the outcome channel); an older or unknown id is refused with a clear error.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

from ..core.beliefs import MachineKey
from ..core.outcomes import Outcome, OutcomeKind
from ..core.score import ScoreScale
from ..wire.errors import ProxyError, bad_request

DEFAULT_CAPACITY: Final = 50_000
MAX_KEYS: Final = 4096
MAX_EVALUATOR_LENGTH: Final = 100


@dataclass(slots=True)
class ServedRequest:
    key: MachineKey
    role: str | None
    # Evaluators that judged it; None until the first (most requests are never judged,
    # and an empty set per remembered request would cost ~200 bytes each).
    judged_by: set[str] | None = None

    def judged(self, evaluator: str) -> bool:
        return self.judged_by is not None and evaluator in self.judged_by

    def judge(self, evaluator: str) -> None:
        if self.judged_by is None:
            self.judged_by = set()
        self.judged_by.add(evaluator)


class ServedIndex:
    """request id -> the machine that served it, for the most recent answered requests.
    A consumer of the outcome channel; bounded, the oldest forgotten first."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._served: OrderedDict[str, ServedRequest | None] = OrderedDict()
        self._keys: dict[tuple[str, str, str], MachineKey] = {}

    def __call__(self, batch: Sequence[Outcome]) -> None:
        for outcome in batch:
            served: ServedRequest | None = None
            answered = outcome.outcome in (OutcomeKind.ANSWERED, OutcomeKind.INCOMPLETE)
            if answered and outcome.provider and outcome.model and outcome.machine:
                # One key object per machine, shared by its requests (memory, at 50,000),
                # found by a plain tuple (equal to it, and made in C).
                key = self._keys.get((outcome.provider, outcome.model, outcome.machine))
                if key is None:
                    key = MachineKey(outcome.provider, outcome.model, outcome.machine)
                    self._keys[key] = key
                    if len(self._keys) > MAX_KEYS:
                        self._keys.clear()
                served = ServedRequest(key, outcome.role)
            self._served[outcome.request_id] = served
            self._served.move_to_end(outcome.request_id)
            while len(self._served) > self.capacity:
                self._served.popitem(last=False)

    def lookup(self, request_id: str) -> ServedRequest:
        if request_id not in self._served:
            raise ProxyError(
                404,
                f"No request {request_id!r} is remembered: feedback must name the X-Request-Id "
                f"of one of the last {self.capacity} requests this proxy answered (each "
                "proxy replica remembers its own).",
                code="unknown_request",
                param="request_id",
            )
        served = self._served[request_id]
        if served is None:
            raise ProxyError(
                409,
                f"Request {request_id!r} was not answered by a machine rolegate can name, so "
                "there is nothing to judge.",
                code="not_answered",
                param="request_id",
            )
        return served


@dataclass(frozen=True, slots=True)
class Judgment:
    request_id: str
    score: float
    scale: ScoreScale
    evaluator: str


def parse_judgment(raw: bytes) -> Judgment:
    """A judgment from a request body, or a 400 that says what to fix."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise bad_request(
            f"The feedback body is not valid JSON ({error}); send a JSON object such as "
            '{"request_id": "...", "score": 0.8, "evaluator": "judge-v2"}.',
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise bad_request(
            'The feedback body must be a JSON object such as {"request_id": "...", '
            '"score": 0.8, "evaluator": "judge-v2"}.'
        )
    unknown = sorted(set(body) - {"request_id", "score", "scale", "evaluator"})
    if unknown:
        raise bad_request(
            f"Unknown feedback field(s) {', '.join(unknown)}; the fields are request_id, "
            "score, scale and evaluator.",
            param=unknown[0],
        )
    request_id = body.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        raise bad_request(
            "`request_id` must be the X-Request-Id of the request being judged.",
            param="request_id",
        )
    evaluator = body.get("evaluator")
    if (
        not isinstance(evaluator, str)
        or not evaluator.strip()
        or len(evaluator) > MAX_EVALUATOR_LENGTH
        or not evaluator.isprintable()
    ):
        raise bad_request(
            f"`evaluator` must name who judged (1 to {MAX_EVALUATOR_LENGTH} printable "
            "characters), e.g. the judge model and its provider.",
            param="evaluator",
        )
    scale = _scale(body.get("scale", [0, 1]))
    score = body.get("score")
    if not _number(score):
        raise bad_request("`score` must be a number on the declared scale.", param="score")
    assert isinstance(score, (int, float))
    if not scale.low <= score <= scale.high:
        raise bad_request(
            f"`score` {score:g} is outside the declared scale [{scale.low:g}, {scale.high:g}]; "
            "send a score on the scale, or declare the scale you use in `scale`.",
            param="score",
        )
    return Judgment(request_id, float(score), scale, evaluator.strip())


def _scale(value: Any) -> ScoreScale:
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(_number(v) for v in value)
        or not value[0] < value[1]
    ):
        raise bad_request(
            "`scale` must be [lowest, highest] with lowest < highest, e.g. [1, 5]; "
            "leave it out for [0, 1].",
            param="scale",
        )
    return ScoreScale(float(value[0]), float(value[1]))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
