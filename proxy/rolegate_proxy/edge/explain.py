"""Explanations (SPEC C8): what the proxy decided recently and what it believes now.

Routing metadata only: roles, providers, models, machines, reasons, numbers. Never a
prompt, a completion or a credential. `GET /v1/rolegate/decisions` serves the recent
decisions (filter with `?role=` and `?request_id=`); `GET /v1/rolegate/state` serves every
machine's operational and semantic score (with n and confidence), belief, the breakers and
hard exclusions, the breakers other pods of the fleet hold open (`fleet_trips`), the
outcome channel's counters and the configuration hash. Both, and
`POST /v1/feedback` (an evaluator's judgment), answer only an administrator: a caller
presenting the proxy's admin token (`--admin-token-file`), or one an AccessGrant with
`admin: true` is for.
"""

from __future__ import annotations

from typing import Any

from aiohttp import hdrs, web

from rolegate_policy.config import (
    ProxyConfig,
)

from ..core.beliefs import MachineKey
from ..core.score import Scoreboard, ScoreView, field_target
from ..wire.errors import ProxyError
from .feedback import parse_judgment
from .state import STATE, ProxyState


def _state(request: web.Request) -> ProxyState:
    return request.app[STATE]


async def _refused(request: web.Request) -> web.Response | None:
    """None when the caller may administer the proxy (its admin token, or a grant with
    `admin: true`), else the 401/403 saying what to send. Never open by default."""
    proxy = _state(request)
    try:
        await proxy.access.administrator(
            request.headers.get(hdrs.AUTHORIZATION), proxy.settings.admin_token
        )
    except ProxyError as error:
        return error.response()
    return None


async def decisions(request: web.Request) -> web.Response:
    if (denied := await _refused(request)) is not None:
        return denied
    found = _state(request).decisions.recent(
        role=request.query.get("role"), request_id=request.query.get("request_id")
    )
    return web.json_response({"decisions": [outcome.as_json() for outcome in found]})


async def feedback(request: web.Request) -> web.Response:
    """`POST /v1/feedback`: one evaluator's judgment of a past request (see feedback.py)."""
    proxy = _state(request)
    if (denied := await _refused(request)) is not None:
        return denied
    try:
        judgment = parse_judgment(await request.read())
        served = proxy.served.lookup(judgment.request_id)
        if served.judged(judgment.evaluator):
            raise ProxyError(
                409,
                f"Evaluator {judgment.evaluator!r} has already judged request "
                f"{judgment.request_id!r}; each evaluator judges a request once.",
                code="already_judged",
                param="evaluator",
            )
        dispatcher = proxy.dispatcher
        dispatcher.scores.judge(
            served.key,
            judgment.score,
            scale=judgment.scale,
            evaluator=judgment.evaluator,
            now=dispatcher.now(),
        )
    except ProxyError as error:
        return error.response()
    served.judge(judgment.evaluator)
    proxy.metrics.feedback.labels(judgment.evaluator).inc()
    view = dispatcher.scores.semantic(served.key)
    return web.json_response(
        {
            "request_id": judgment.request_id,
            "provider": served.key.provider,
            "model": served.key.model,
            "machine": served.key.machine,
            "semantic": _view(view),
        },
        status=202,
    )


def _scores(config: ProxyConfig, board: Scoreboard) -> list[dict[str, Any]]:
    """Every machine of the configuration (cold ones at neutral, n 0) and every machine
    scored since (an aggregator may have used one it was not told of), sorted."""
    rows = {row.key: row for row in board.rows()}
    keys = set(rows)
    for provider in config.providers:
        for model in provider.models:
            keys.update(MachineKey(provider.name, model.name, m.name) for m in model.machines)
    # Routing compares a model's machines shrunk towards their field's target, not towards
    # the scale's midpoint (SPEC G3): the state shows that score too, so that an untried
    # machine does not look worse than a slow one with a few answers.
    fields: dict[tuple[str, str], list[ScoreView]] = {}
    for key in keys:
        fields.setdefault((key.provider, key.model), []).append(board.operational(key))
    targets = {model: field_target(views) for model, views in fields.items()}
    found = []
    for key in sorted(keys):
        row = rows.get(key)
        operational = board.operational(key)
        target = targets[(key.provider, key.model)]
        found.append(
            {
                "provider": key.provider,
                "model": key.model,
                "machine": key.machine,
                "operational": _view(operational),
                "operational_in_field": {
                    "score": operational.toward(target),
                    "field_target": target,
                },
                "semantic": _view(board.semantic(key)),
                "semantic_scale": (
                    [row.semantic_scale.low, row.semantic_scale.high]
                    if row is not None and row.semantic_scale is not None
                    else None
                ),
                "observations": (
                    {kind.value: count for kind, count in row.kinds.items()} if row else {}
                ),
                "evaluators": dict(row.evaluators) if row is not None else {},
            }
        )
    return found


def _view(view: ScoreView | None) -> dict[str, Any] | None:
    if view is None:
        return None
    return {
        "score": view.score,
        "observed": view.observed,
        "n": view.n,
        "confidence": view.confidence,
        "neutral": view.neutral,
    }


async def state(request: web.Request) -> web.Response:
    if (denied := await _refused(request)) is not None:
        return denied
    proxy = _state(request)
    dispatcher = proxy.dispatcher
    now = dispatcher.now()
    beliefs = []
    for belief in dispatcher.ledger.beliefs(now):
        beliefs.append(
            {
                "provider": belief.key.provider,
                "model": belief.key.model,
                "machine": belief.key.machine,
                "source": belief.source.value,
                "sightings": belief.sightings,
                "expected_ttft_seconds": belief.expected_ttft,
                "expected_tokens_per_second": belief.expected_rate,
                # Whole non-streamed answers' time over the published shape (SPEC B7).
                "expected_answer_pace": belief.expected_pace,
            }
        )
    breakers = [
        {
            "provider": s.key.provider,
            "model": s.key.model,
            "machine": s.key.machine,
            "scope": s.key.scope.value,
            "cause": s.cause.value,
            "state": s.state.value,
            "reason": s.reason.value if s.reason else None,
            "trips": s.trips,
            "seconds_until": None if s.until is None else max(0.0, s.until - now),
        }
        for s in dispatcher.breakers.snapshot(now, include_closed=False)
    ]
    # Keys another pod of the fleet holds open: kept out here too, probed there.
    fleet_trips = [
        {
            "provider": trip.key.provider,
            "model": trip.key.model,
            "machine": trip.key.machine,
            "scope": trip.key.scope.value,
            "reason": trip.reason.value,
            "pod": trip.pod,
            "seconds_until": max(0.0, trip.until - now),
        }
        for trip in dispatcher.breakers.peer_trips(now)
    ]
    scores = _scores(proxy.config, dispatcher.scores)
    # Requests in flight and concurrency per machine: what routing counts as its queue.
    load = [
        {
            "provider": row.key.provider,
            "model": row.key.model,
            "machine": row.key.machine,
            "in_flight": row.in_flight,
            "fleet_in_flight": row.fleet_in_flight,
            "learned_concurrency": row.learned_concurrency,
        }
        for row in dispatcher.load.rows(now)
    ]
    channel = proxy.outcomes
    return web.json_response(
        {
            "config_hash": proxy.config.hash,
            "scores": scores,
            "beliefs": beliefs,
            "breakers": breakers,
            "fleet_trips": fleet_trips,
            "load": load,
            "outcomes": {
                "emitted": channel.emitted,
                "dropped": channel.dropped,
                "buffered": len(channel),
                "capacity": channel.capacity,
            },
        }
    )
