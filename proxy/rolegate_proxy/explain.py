"""Explanations (SPEC C8): what the proxy decided recently and what it believes now.

Routing metadata only: roles, providers, models, machines, reasons, numbers. Never a
prompt, a completion or a credential. `GET /v1/rolegate/decisions` serves the recent
decisions (filter with `?role=` and `?request_id=`); `GET /v1/rolegate/state` serves every
machine's belief, the breakers and exclusions, and the configuration hash. Both, when the
proxy is given an admin token (`--admin-token-file`), require it as a bearer token.
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Any

from aiohttp import web

from .decisions import Decision

if TYPE_CHECKING:
    from .app import ProxyState


def _state(request: web.Request) -> ProxyState:
    # Imported here: app.py registers these handlers, so it cannot be imported above.
    from .app import STATE

    return request.app[STATE]


def _authorized(request: web.Request) -> web.Response | None:
    token = _state(request).settings.admin_token
    if not token:
        return None
    given = request.headers.get("Authorization", "")
    if hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        return None
    return web.json_response(
        {
            "error": {
                "message": "This endpoint needs the proxy's admin token: send "
                "`Authorization: Bearer <token>` (the proxy's --admin-token-file).",
                "type": "authentication_error",
                "param": None,
                "code": "admin_token_required",
            }
        },
        status=401,
    )


def _decision(decision: Decision) -> dict[str, Any]:
    return {
        "request_id": decision.request_id,
        "role": decision.role,
        "ruling": decision.ruling,
        "outcome": decision.outcome,
        "attempts": decision.attempts,
        "served": {
            "provider": decision.served_provider,
            "model": decision.served_model,
            "machine": decision.served_machine,
        },
        "candidates": [
            {
                "provider": note.provider,
                "model": note.model,
                "machine": note.machine,
                "action": note.action.value,
                "reason": note.reason,
            }
            for note in decision.notes
        ],
    }


async def decisions(request: web.Request) -> web.Response:
    if (denied := _authorized(request)) is not None:
        return denied
    role = request.query.get("role")
    request_id = request.query.get("request_id")
    found = [
        _decision(d)
        for d in _state(request).decisions.recent()
        if (role is None or d.role == role) and (request_id is None or d.request_id == request_id)
    ]
    return web.json_response({"decisions": found})


async def state(request: web.Request) -> web.Response:
    if (denied := _authorized(request)) is not None:
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
    return web.json_response(
        {"config_hash": proxy.config.hash, "beliefs": beliefs, "breakers": breakers}
    )
