"""An aggregator that names a new machine in every answer (SPEC E8, issue 30): routing
considers the machines on the sheet and the 64 it named most recently, so the routing
field sent back to it stays bounded however many it invents. Measured before: after
1,500 invented names every request carried a 1,502-name routing list (27 KB).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from rolegate_proxy.core.chooser import MAX_LEARNED_MACHINES

from ..support import ProxyFactory, provider_policy, role, role_table

MODEL = "vendor/inventive"
INVENTED = 2000
ASK = {"model": "agent", "messages": [{"role": "user", "content": "hi"}]}


@dataclass
class Inventor:
    url: str = ""
    answered: int = 0
    # Each request's routing field: its machines, as listed in it.
    routings: list[dict[str, Any]] = field(default_factory=list)


@pytest.fixture
async def inventor() -> AsyncIterator[Inventor]:
    found = Inventor()

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        found.routings.append(body.get("provider", {}))
        found.answered += 1
        return web.json_response(
            {"id": f"c{found.answered}", "object": "chat.completion", "model": MODEL,
             "provider": f"invented-{found.answered}",
             "choices": [{"index": 0, "finish_reason": "stop",
                          "message": {"role": "assistant", "content": "fine"}}]}
        )  # fmt: skip

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    found.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield found
    await runner.cleanup()


def _named(routing: dict[str, Any]) -> list[str]:
    return [*routing.get("order", ()), *routing.get("only", ()), *routing.get("ignore", ())]


async def test_an_aggregator_inventing_machines_gets_a_bounded_routing_list(
    inventor: Inventor, proxy_server: ProxyFactory
) -> None:
    proxy = await proxy_server(
        [
            provider_policy("agg", f"{inventor.url}/v1", {MODEL: ["on-the-sheet"]}),
            role_table(role("agent", [MODEL])),
        ]
    )
    async with aiohttp.ClientSession() as session:

        async def ask() -> None:
            async with session.post(f"{proxy.url}/v1/chat/completions", json=ASK) as response:
                assert response.status == 200, await response.text()

        for _ in range(INVENTED // 10):
            await asyncio.gather(*(ask() for _ in range(10)))
    assert inventor.answered == INVENTED
    longest = max(len(_named(routing)) for routing in inventor.routings)
    assert longest <= 1 + MAX_LEARNED_MACHINES, longest
    last = _named(inventor.routings[-1])
    assert "on-the-sheet" in last
    # The machines it named last are the ones routing still considers.
    assert f"invented-{INVENTED - 30}" in last
    assert "invented-1" not in last
