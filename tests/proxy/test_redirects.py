"""An upstream that answers a redirect (flow/upstream.py): never followed, never relayed as
an answer, but an upstream fault carrying its status, which the breaker counts like a 5xx.

Two real servers: one answers every chat request 307 with a Location on the other, which
records whatever reaches it. The prompt must never reach the second.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest
from aiohttp import web

from rolegate_policy.status import BreakerPhase
from rolegate_proxy.core.outcomes import ArmResult

from ..support import ProxyFactory, SimFactory, one_machine_sim, provider_policy, role, role_table
from ..waiting import eventually

REDIRECTED = "vendor/redirected"
GOOD_MODEL = "vendor/good"
SECRET = "zq7prompt"
ASK = {"model": "agent", "messages": [{"role": "user", "content": SECRET}]}


@dataclass
class Servers:
    redirector: str
    elsewhere: str
    # Every body the redirect's target received.
    reached_elsewhere: list[bytes] = field(default_factory=list)
    redirected: int = 0


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


@pytest.fixture
async def servers() -> AsyncIterator[Servers]:
    found = Servers("", "")

    async def record(request: web.Request) -> web.Response:
        found.reached_elsewhere.append(await request.read())
        return web.json_response(
            {"choices": [{"index": 0, "message": {"role": "assistant", "content": "stolen"},
                          "finish_reason": "stop"}]}
        )  # fmt: skip

    async def redirect(request: web.Request) -> web.Response:
        found.redirected += 1
        raise web.HTTPTemporaryRedirect(f"{found.elsewhere}/v1/chat/completions")

    elsewhere_app = web.Application()
    elsewhere_app.router.add_route("*", "/{tail:.*}", record)
    redirector_app = web.Application()
    redirector_app.router.add_post("/v1/chat/completions", redirect)
    elsewhere, found.elsewhere = await _serve(elsewhere_app)
    redirector, found.redirector = await _serve(redirector_app)
    yield found
    await redirector.cleanup()
    await elsewhere.cleanup()


async def test_a_redirect_is_an_upstream_fault_with_its_status_and_never_followed(
    servers: Servers, proxy_server: ProxyFactory
) -> None:
    proxy = await proxy_server(
        [
            provider_policy("redir", f"{servers.redirector}/v1", {REDIRECTED: ["m1"]}),
            role_table(role("agent", [REDIRECTED])),
        ]
    )
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{proxy.url}/v1/chat/completions", json=ASK)
    # Not the redirect, not the other server's answer: no upstream could serve.
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["code"] == "upstream_unavailable", error
    assert "HTTP 307, a redirect (never followed)" in error["message"], error
    assert SECRET not in response.text
    assert servers.redirected == 1
    assert servers.reached_elsewhere == []
    (outcome,) = proxy.state.decisions.recent()
    (arm,) = outcome.arms
    assert (arm.result, arm.status) == (ArmResult.SERVER_ERROR, 307), arm

    # The breaker counts it as it counts a 5xx: a second one trips the provider's key.
    async with httpx.AsyncClient() as client:
        await client.post(f"{proxy.url}/v1/chat/completions", json=ASK)
    dispatcher = proxy.state.dispatcher

    async def tripped() -> str | None:
        views = dispatcher.breakers.snapshot(dispatcher.now())
        opened = [v for v in views if v.key.provider == "redir" and v.state is BreakerPhase.OPEN]
        return opened[0].detail if opened else None

    detail = await eventually(tripped, what="the redirecting provider's breaker open")
    assert "http_3xx" in detail
    assert servers.reached_elsewhere == []


async def test_a_redirecting_upstream_fails_over_to_the_next_candidate(
    servers: Servers, sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    sim = await one_machine_sim(sim_server, GOOD_MODEL, reply="fine", tokens_per_second=500)
    proxy = await proxy_server(
        [
            provider_policy("redir", f"{servers.redirector}/v1", {REDIRECTED: ["m1"]}),
            provider_policy("good", f"{sim.url}/v1", {GOOD_MODEL: ["m1"]}),
            role_table(role("agent", [REDIRECTED, GOOD_MODEL], ruling="Order")),
        ]
    )
    for stream in (False, True):
        async with httpx.AsyncClient() as client:
            response = await client.post(
                f"{proxy.url}/v1/chat/completions", json={**ASK, "stream": stream}
            )
        assert response.status_code == 200, response.text
        assert "fine" in response.text
        assert "stolen" not in response.text
    assert servers.redirected >= 1
    assert servers.reached_elsewhere == []
