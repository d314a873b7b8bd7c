"""A proxy serves many callers over one pool: a cookie one upstream answer sets (a session,
a bot-management marker) must never ride along on a later request, which may be another
caller's. The upstream here is a real server that sets a cookie on every answer and records
the Cookie header of every request that reaches it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from aiohttp import web

from ..support import ProxyFactory, provider_policy, role, role_table

MODEL = "vendor/cookies"
ANSWER = {
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
    ]
}


@pytest.fixture
async def cookie_setter() -> AsyncIterator[tuple[str, list[str | None]]]:
    cookies_seen: list[str | None] = []

    async def answer(request: web.Request) -> web.Response:
        cookies_seen.append(request.headers.get("Cookie"))
        response = web.json_response(ANSWER)
        response.set_cookie("upstream_session", f"caller-{len(cookies_seen)}", path="/")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    # A host name, not an address: the client's cookie jar ignores cookies from bare IPs.
    yield f"http://localhost:{port}", cookies_seen
    await runner.cleanup()


async def test_an_upstream_cookie_is_never_replayed_on_a_later_request(
    cookie_setter: tuple[str, list[str | None]], proxy_server: ProxyFactory
) -> None:
    url, cookies_seen = cookie_setter
    proxy = await proxy_server(
        [
            provider_policy("cookies", f"{url}/v1", {MODEL: ["m1"]}),
            role_table(role("agent", [MODEL])),
        ]
    )
    ask = {"model": "agent", "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient() as client:
        for _ in range(3):
            response = await client.post(f"{proxy.url}/v1/chat/completions", json=ask)
            assert response.status_code == 200, response.text
            # Nor is the upstream's cookie handed to the caller.
            assert "set-cookie" not in response.headers
    assert cookies_seen == [None, None, None]
