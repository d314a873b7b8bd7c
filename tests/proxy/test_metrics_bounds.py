"""Names an upstream makes up, through the real proxy (issue 12, finding 11): an aggregator
names a different machine in every answer, as a real one with a long tail of sub-providers
does. `/metrics` stays bounded (machines past `metrics_max_machines` per provider fold into
`other`), a name with control characters reaches no header and no label raw, and rendering a
large `/metrics` never holds the event loop the proxy shares with this test."""

from __future__ import annotations

import asyncio
import gc
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from rolegate_proxy.edge.server import RunningProxy

from ..support import ProxyFactory, provider_policy, role, role_table

MODEL = "vendor/model-a"
CONFIGURED = "configured-machine"
EVIL = "evil\r\nX-Injected: 1\x00\x1b[31m"
LAG_PROBE_SECONDS = 0.001
SCORE_MACHINE = re.compile(rb'^rolegate_operational_score\{[^}\n]*machine="([^"\n]*)"', re.M)


async def _answer(request: web.Request) -> web.Response:
    """An OpenAI-compatible aggregator that says the machine named in the prompt served."""
    body = await request.json()
    machine = body["messages"][-1]["content"]
    return web.json_response(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": MODEL,
            "provider": machine,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }
    )


@pytest.fixture
async def upstream() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}/v1"
    await runner.cleanup()


async def _proxy(proxy_server: ProxyFactory, upstream: str, **settings: Any) -> RunningProxy:
    return await proxy_server(
        [
            provider_policy("agg", upstream, {MODEL: [CONFIGURED]}),
            role_table(role("agent", [MODEL])),
        ],
        **settings,
    )


async def _ask(client: aiohttp.ClientSession, proxy: RunningProxy, machine: str) -> str:
    """One non-streamed request answered by `machine`; the machine header it got back."""
    body = {"model": "agent", "messages": [{"role": "user", "content": machine}]}
    async with client.post(f"{proxy.url}/v1/chat/completions", json=body) as response:
        answer = await response.json()
        assert response.status == 200, answer
        assert answer["choices"][0]["message"]["content"] == "ok"
        return response.headers["X-Rolegate-Machine"]


async def _answered_by(proxy: RunningProxy, machines: list[str]) -> None:
    """Every machine answers one request, 20 at a time."""
    gate = asyncio.Semaphore(20)

    async def one(client: aiohttp.ClientSession, machine: str) -> None:
        async with gate:
            await _ask(client, proxy, machine)

    async with aiohttp.ClientSession() as client:
        await asyncio.gather(*(one(client, machine) for machine in machines))


async def _metrics(client: aiohttp.ClientSession, proxy: RunningProxy) -> bytes:
    async with client.get(f"{proxy.url}/metrics") as response:
        assert response.status == 200
        return await response.read()


async def _scrape(proxy: RunningProxy) -> bytes:
    async with aiohttp.ClientSession() as client:
        return await _metrics(client, proxy)


def _machine_labels(text: bytes) -> dict[str, set[str]]:
    """Metric family -> the machine label values it has."""
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            if "machine" in sample.labels:
                found.setdefault(family.name, set()).add(sample.labels["machine"])
    return found


async def test_machines_past_the_limit_fold_into_other(
    proxy_server: ProxyFactory, upstream: str
) -> None:
    limit = 20
    proxy = await _proxy(proxy_server, upstream, metrics_max_machines=limit)
    await _answered_by(proxy, [CONFIGURED] + [f"tail-{i:04d}" for i in range(300)])
    text = await _scrape(proxy)

    by_family = _machine_labels(text)
    # Every series labelled by machine: arms, served time, time to first token, scores.
    assert {
        "rolegate_arms",
        "rolegate_served_seconds",
        "rolegate_time_to_first_token_seconds",
        "rolegate_operational_score",
    } <= set(by_family)
    for family, machines in by_family.items():
        named = machines - {"other", ""}
        assert len(named) <= limit + 1, (family, len(named))
        assert "other" in machines, family
        # The configured machine keeps its own label and does not take a place.
        assert CONFIGURED in named, family
        assert {f"tail-{i:04d}" for i in range(limit)} <= named, family
    # Measured 110 KB; unbounded, the 300 machines made it 1.4 MB.
    assert len(text) < 200_000, len(text)


async def test_an_upstream_name_with_control_characters_reaches_nothing_raw(
    proxy_server: ProxyFactory, upstream: str
) -> None:
    proxy = await _proxy(proxy_server, upstream)
    async with aiohttp.ClientSession() as client:
        header = await _ask(client, proxy, EVIL)
        text = await _metrics(client, proxy)

    assert header.isprintable(), header
    assert " " not in header, header
    assert header.startswith("evil%0D%0AX-Injected:%201"), header
    machines = set().union(*_machine_labels(text).values())
    assert header in machines
    assert all(name.isprintable() for name in machines), machines
    assert not any(line.startswith(b"X-Injected") for line in text.splitlines())
    for raw in (b"\r", b"\x00", b"\x1b"):
        assert raw not in text, raw


async def _worst_lag_while(work: Callable[[], Awaitable[None]]) -> float:
    """The longest the loop was held (past the probe's own sleep) while `work` ran."""
    loop = asyncio.get_running_loop()
    worst = 0.0
    done = False

    async def probe() -> None:
        nonlocal worst
        while not done:
            before = loop.time()
            await asyncio.sleep(LAG_PROBE_SECONDS)
            worst = max(worst, loop.time() - before - LAG_PROBE_SECONDS)

    probing = asyncio.create_task(probe())
    try:
        await work()
    finally:
        done = True
        await probing
    return worst


# 1,500 requests through the proxy come before the measurement: on a loaded machine they
# take longer than the suite's default limit.
@pytest.mark.timeout(240)
async def test_rendering_a_large_metrics_page_does_not_hold_the_loop(
    proxy_server: ProxyFactory, upstream: str
) -> None:
    """1,500 machines each with their own series (the limit set above them): a page of
    7 MB. The proxy runs on this test's loop, so the probe sees what it holds."""
    proxy = await _proxy(proxy_server, upstream, metrics_max_machines=2000)
    await _answered_by(proxy, [f"tail-{i:04d}" for i in range(1500)])
    pages: list[bytes] = []
    took: list[float] = []
    loop = asyncio.get_running_loop()

    async def scrapes() -> None:
        async with aiohttp.ClientSession() as client:
            for _ in range(3):
                began = loop.time()
                pages.append(await _metrics(client, proxy))
                took.append(loop.time() - began)

    # What earlier tests left in this process is not the proxy's: a full pass of the cycle
    # collector over it (some 200 ms after 1,600 tests) would be measured as a hold.
    gc.collect()
    gc.freeze()
    try:
        worst = await _worst_lag_while(scrapes)
    finally:
        gc.unfreeze()

    # A pattern, not the exposition parser: parsing 7 MB in Python takes longer than the
    # rest of this test.
    machines = set(SCORE_MACHINE.findall(pages[-1]))
    assert len(machines) >= 1500, len(machines)
    # Rendered on the loop, the render is one hold: 450-700 ms, nearly all of the scrape.
    # In a worker thread (the cycle collector paused) the loop only waits for the
    # interpreter lock: 11-13 ms held in scrapes of several hundred. A ratio, measured in
    # one run, so a loaded machine slows both sides alike; the figure itself is a bench's.
    sizes = [len(page) for page in pages]
    assert worst < min(took) / 4, (
        f"the loop was held {worst * 1000:.0f} ms in scrapes of "
        f"{[round(t * 1000) for t in took]} ms rendering {sizes} bytes"
    )
