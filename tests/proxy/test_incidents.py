"""The seed's measured incidents, replayed through the proxy against the simulated provider
(SPEC A5-A8): breakers trip on the right scope and only there."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import aiohttp
import httpx
import pytest

from rolegate_policy.model import RetrySpec
from rolegate_policy.status import BreakerPhase
from rolegate_proxy.core.exclusions import (
    BreakerKey,
)
from rolegate_proxy.edge.server import RunningProxy

from ..support import ProxyFactory, SimFactory, provider_policy, role, role_table, sim_records

NEMOTRON = "nvidia/nemotron-nano:free"
QWEN = "qwen/qwen3.6-35b"
DEEPSEEK = "deepseek/deepseek-v4-flash"
GLM = "z-ai/glm-5.3-flash"
ASCII = [{"role": "user", "content": "rename the variable"}]
MOJIBAKE = {"kind": "mojibake", "always": True}


def _open_keys(proxy: RunningProxy) -> set[BreakerKey]:
    breakers = proxy.state.dispatcher.breakers
    return {
        state.key
        for state in breakers.snapshot(proxy.state.dispatcher.now())
        if state.state is not BreakerPhase.CLOSED
    }


async def _post(client: aiohttp.ClientSession, url: str, role_name: str, messages: Any) -> int:
    """One request's status. aiohttp, not httpx: the replays send thousands, and a client
    several times cheaper per request keeps them quick on a loaded machine."""
    body = {"model": role_name, "messages": messages}
    async with client.post(f"{url}/v1/chat/completions", json=body) as response:
        await response.read()
        return response.status


def _session() -> aiohttp.ClientSession:
    # No total: a thousand requests queue for the pool's connections, and on a loaded
    # machine that wait is not the proxy's latency. A read that hangs still fails.
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=60))


async def test_the_empty_on_200_incident_trips_one_model_and_nothing_else(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """One model at 35% empty-on-200, three at 0%, across two providers."""
    instant = {"ttftSeconds": 0, "tokensPerSecond": 0}
    openrouter = await sim_server(
        {
            "seed": 908,
            "models": [
                {"name": NEMOTRON, "machines": [
                    {"name": "free", **instant,
                     "faults": [{"kind": "empty", "probability": 0.35}]}]},
                {"name": QWEN, "machines": [{"name": "alibaba", **instant}]},
            ],
        }
    )  # fmt: skip
    neuralwatt = await sim_server(
        {
            "seed": 908,
            "models": [
                {"name": DEEPSEEK, "machines": [{"name": "nw", **instant}]},
                {"name": GLM, "machines": [{"name": "nw", **instant}]},
            ],
        }
    )
    proxy = await proxy_server(
        [
            provider_policy(
                "openrouter", f"{openrouter.url}/v1", {NEMOTRON: ["free"], QWEN: ["alibaba"]}
            ),
            provider_policy("neuralwatt", f"{neuralwatt.url}/v1", {DEEPSEEK: ["nw"], GLM: ["nw"]}),
            role_table(
                role("nemotron", [NEMOTRON]),
                role("qwen", [QWEN]),
                role("deepseek", [DEEPSEEK]),
                role("glm", [GLM]),
            ),
        ]
    )
    tripped_after = None
    async with _session() as client:
        for sent in range(1, 101):
            await _post(client, proxy.url, "nemotron", ASCII)
            if BreakerKey("openrouter", NEMOTRON) in _open_keys(proxy):
                tripped_after = sent
                break
        # Within the rate arm's minimum sample (20 by default).
        assert tripped_after is not None
        assert tripped_after <= 20
        # 1,000 requests to each healthy model: they never trip, nor does either provider.
        for role_name in ("qwen", "deepseek", "glm"):
            statuses = await asyncio.gather(
                *(_post(client, proxy.url, role_name, ASCII) for _ in range(1000))
            )
            assert set(statuses) == {200}
    assert _open_keys(proxy) == {BreakerKey("openrouter", NEMOTRON)}
    records = await sim_records(openrouter.url)
    assert sum(r["model"] == QWEN for r in records) == 1000


@pytest.mark.parametrize(
    ("prompt", "trips"),
    [
        (ASCII, True),
        ([{"role": "user", "content": "Réponds en français — café, 日本語 🚀"}], False),
    ],
    ids=["ascii-prompt-trips-the-provider", "non-ascii-prompt-trips-nothing"],
)
async def test_double_encoded_output_trips_the_provider_only_when_attributable(
    sim_server: SimFactory, proxy_server: ProxyFactory, prompt: Any, trips: bool
) -> None:
    instant = {"ttftSeconds": 0, "tokensPerSecond": 0}
    sim = await sim_server(
        {
            "seed": 1,
            "models": [
                {"name": QWEN, "reply": "It\u2019s done \u2014 caf\u00e9 \u2713",
                 "machines": [{"name": "m1", **instant, "faults": [MOJIBAKE]}]},
                {"name": DEEPSEEK, "reply": "fine", "machines": [{"name": "m1", **instant}]},
            ],
        }
    )  # fmt: skip
    proxy = await proxy_server(
        [
            provider_policy("router", f"{sim.url}/v1", {QWEN: ["m1"], DEEPSEEK: ["m1"]}),
            role_table(role("agent", [QWEN]), role("other", [DEEPSEEK])),
        ]
    )
    async with httpx.AsyncClient(timeout=10) as client:
        for _ in range(6):
            body = {"model": "agent", "messages": prompt, "stream": True}
            async with client.stream("POST", f"{proxy.url}/v1/chat/completions", json=body) as r:
                await r.aread()
    if trips:
        # Encoding faults are transport-shaped: the whole provider, other models included.
        assert BreakerKey("router") in _open_keys(proxy)
        async with httpx.AsyncClient(timeout=10) as client:
            refused = await client.post(
                f"{proxy.url}/v1/chat/completions", json={"model": "other", "messages": ASCII}
            )
        assert refused.status_code == 503
        assert "MangledOutput" in refused.json()["error"]["message"]
    else:
        assert _open_keys(proxy) == set()
    async with httpx.AsyncClient(timeout=10) as client:
        metrics = (await client.get(f"{proxy.url}/metrics")).text
    attributable = str(trips).lower()
    counted = re.search(
        rf'rolegate_verdicts_total{{attributable="{attributable}",model="{re.escape(QWEN)}",'
        r'provider="router",signature="double_encoded_utf8",verdict="mangled"} (\S+)',
        metrics,
    )
    assert counted is not None
    # Tripped after two (novelty); untripped, all six answers were judged.
    assert float(counted.group(1)) == (2.0 if trips else 6.0)
    assert (
        'rolegate_breaker_open{cause="Breaker",machine="",model="",provider="router"' in metrics
    ) is trips
    assert ('kind="tripped",provider="router",reason="MangledOutput"' in metrics) is trips
    rows = proxy.state.dispatcher.verdicts.rows()
    assert rows
    assert all(row.verdict == "mangled" for row in rows)
    assert all(row.attributable is trips for row in rows)


async def test_retry_after_is_honoured(sim_server: SimFactory, proxy_server: ProxyFactory) -> None:
    """A 429 with Retry-After: 1 keeps that machine out for a second, measured."""
    instant = {"ttftSeconds": 0, "tokensPerSecond": 0}
    sim = await sim_server(
        {
            "seed": 1,
            "models": [
                {"name": QWEN, "machines": [
                    {"name": "busy", **instant,
                     "faults": [{"kind": "rateLimit", "schedule": [1], "retryAfterSeconds": 1}]},
                    {"name": "spare", **instant}]},
            ],
        }
    )  # fmt: skip
    proxy = await proxy_server(
        [
            provider_policy("router", f"{sim.url}/v1", {QWEN: ["busy", "spare"]}),
            role_table(role("agent", [QWEN])),
        ]
    )
    async with _session() as client:
        first = time.monotonic()
        assert await _post(client, proxy.url, "agent", ASCII) == 200
        while time.monotonic() - first < 3:
            assert await _post(client, proxy.url, "agent", ASCII) == 200
            await asyncio.sleep(0.05)
    records = await sim_records(sim.url)
    limited = records[0]
    assert (limited["machine"], limited["status"]) == ("busy", 429)
    # While excluded it was sent in `ignore`, and only then; afterwards it is offered again
    # (after `spare`, which answered last and leads by affinity).
    ignored = [r for r in records[1:] if "busy" in (r["provider"].get("ignore") or [])]
    offered = [r for r in records[1:] if "busy" in (r["provider"].get("order") or [])]
    assert ignored
    assert offered
    assert all(r["started_at"] - limited["started_at"] < 1.2 for r in ignored)
    assert offered[0]["started_at"] - limited["started_at"] >= 1.0


@pytest.mark.parametrize(
    ("message", "status", "next_model_serves"),
    [
        ("This model's maximum context length is 8192 tokens", 200, True),
        ("Input flagged by content filter", 400, False),
        ("Unsupported parameter: 'logit_bias'", 400, False),
    ],
    ids=["context-length-moves-on", "content-filter-returns", "other-400-returns"],
)
async def test_a_400_is_never_resent_to_the_same_model(
    sim_server: SimFactory,
    proxy_server: ProxyFactory,
    message: str,
    status: int,
    next_model_serves: bool,
) -> None:
    instant = {"ttftSeconds": 0, "tokensPerSecond": 0}
    rejected = {"kind": "serverError", "always": True, "status": 400, "message": message}
    sim = await sim_server(
        {
            "seed": 1,
            "models": [
                {"name": QWEN, "machines": [
                    {"name": "a", **instant, "faults": [rejected]},
                    {"name": "b", **instant, "faults": [rejected]}]},
                {"name": DEEPSEEK, "reply": "larger", "machines": [{"name": "c", **instant}]},
            ],
        }
    )  # fmt: skip
    proxy = await proxy_server(
        [
            provider_policy("router", f"{sim.url}/v1", {QWEN: ["a", "b"], DEEPSEEK: ["c"]}),
            role_table(role("agent", [QWEN, DEEPSEEK])),
        ]
    )
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.post(
            f"{proxy.url}/v1/chat/completions", json={"model": "agent", "messages": ASCII}
        )
    assert response.status_code == status
    records = await sim_records(sim.url)
    assert sum(r["model"] == QWEN for r in records) == 1
    if next_model_serves:
        assert response.json()["model"] == DEEPSEEK
    else:
        error = response.json()["error"]
        # Said in rolegate's words with the upstream's status; its own text never repeated.
        assert "rejected the request" in error["message"]
        assert "HTTP 400" in error["message"]
        assert message not in error["message"]
        assert error["code"] == ("content_filter" if "filter" in message else "upstream_rejected")
        assert len(records) == 1
    assert _open_keys(proxy) == set()  # about the request: trips nothing


async def test_attempts_are_bounded_when_everything_fails(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    failing = [{"kind": "serverError", "always": True, "status": 503}]
    machines: list[dict[str, Any]] = [{"name": f"m{i}", "faults": failing} for i in range(6)]
    sim = await sim_server(
        {
            "seed": 1,
            "models": [{"name": QWEN, "machines": machines}, {"name": GLM, "machines": machines}],
        }
    )
    names = [m["name"] for m in machines]
    proxy = await proxy_server(
        [
            provider_policy("router", f"{sim.url}/v1", {QWEN: names, GLM: names}),
            role_table(role("agent", [QWEN, GLM])),
        ]
    )
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.post(
            f"{proxy.url}/v1/chat/completions", json={"model": "agent", "messages": ASCII}
        )
    assert response.status_code == 502
    # attemptsPerModel machines of each model (each avoiding the one before), then stop.
    assert len(await sim_records(sim.url)) == 2 * RetrySpec().attempts_per_model
