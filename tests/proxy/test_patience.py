"""Patience through the proxy (SPEC B1-B3, B7): the chooser refuses machines that cannot
answer in time, learns machines the aggregator used unasked, pins the machine that
answered, and every streamed arm teaches the ledger."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from rolegate_proxy.core.outcomes import ArmAct, ArmResult

from ..support import (
    ProxyFactory,
    SimFactory,
    machine_policy,
    outcomes,
    role,
    role_table,
    sim_records,
    state_belief,
)

MODEL = "vendor/model-a"
LATE = {"kind": "lateFirstToken", "always": True, "seconds": 1.0}
ASK = {"model": "agent", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def _policy(url: str, machines: list[dict[str, Any]]) -> dict[str, Any]:
    return machine_policy(url, MODEL, machines)


async def _stream(url: str) -> httpx.Headers:
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream("POST", f"{url}/v1/chat/completions", json=ASK) as response,
    ):
        await response.aread()
        assert response.status_code == 200
        return response.headers


async def test_a_machine_that_cannot_answer_within_patience_is_refused_into_ignore(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "machines": [{"name": "fast"}, {"name": "slow"}]}]}
    )
    proxy = await proxy_server(
        [
            _policy(
                sim.url,
                [
                    {"name": "fast", "ttftSeconds": 0.2, "tokensPerSecond": 200},
                    # 2 s + 512 tokens at 20/s = 27.6 s: beyond a 10 s patience.
                    {"name": "slow", "ttftSeconds": 2, "tokensPerSecond": 20},
                ],
            ),
            role_table(role("agent", [MODEL], patience=10)),
        ]
    )
    await _stream(proxy.url)
    (record,) = await sim_records(sim.url)
    assert record["provider"]["order"] == ["fast"]
    assert record["provider"]["ignore"] == ["slow"]
    decision = (await outcomes(proxy, 1))[-1]
    assert any("patience" in skip.reason and skip.machine == "slow" for skip in decision.skipped)


async def test_a_machine_the_aggregator_used_unasked_becomes_a_candidate(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    sim = await sim_server(
        {
            "seed": 1,
            "models": [
                {"name": MODEL, "machines": [
                    {"name": "named", "faults": [{"kind": "down", "always": True}]},
                    {"name": "hidden"}]},
            ],
        }
    )  # fmt: skip
    proxy = await proxy_server(
        [_policy(sim.url, [{"name": "named"}]), role_table(role("agent", [MODEL]))]
    )
    first = await _stream(proxy.url)
    assert first["x-rolegate-machine"] == "hidden"
    ledger = proxy.state.dispatcher.ledger
    assert ledger.belief("agg", MODEL, "hidden", proxy.state.dispatcher.now()) is not None
    await _stream(proxy.url)
    records = await sim_records(sim.url)
    assert "hidden" not in records[0]["provider"]["order"]
    assert records[1]["provider"]["order"][0] == "hidden"  # known now, and it answered last


async def test_a_late_first_token_teaches_the_ledger(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    sim = await sim_server(
        {
            "seed": 1,
            "models": [
                {"name": MODEL, "machines": [{"name": "m1", "faults": [LATE]}]},
            ],
        }
    )  # fmt: skip
    proxy = await proxy_server(
        [
            _policy(sim.url, [{"name": "m1", "ttftSeconds": 0.1, "tokensPerSecond": 100}]),
            role_table(role("agent", [MODEL])),
        ]
    )
    dispatcher = proxy.state.dispatcher
    before = dispatcher.ledger.belief("agg", MODEL, "m1", dispatcher.now())
    assert before is not None
    assert before.expected_ttft is not None
    await _stream(proxy.url)
    after = dispatcher.ledger.belief("agg", MODEL, "m1", dispatcher.now())
    assert after is not None
    assert after.expected_ttft is not None
    assert after.expected_ttft > before.expected_ttft * 2


async def test_a_stream_far_slower_than_the_best_alternative_moves_mid_stream(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """The seed's measured case: a machine believed at ~60 tok/s writes at 7 while two on
    the same model are believed at 100. A rate act moves the stream while it is producing;
    a machine that continues partial messages finishes it in the same client stream."""
    reply = " ".join(f"w{i}" for i in range(120))
    down_first = [{"kind": "down", "schedule": [1]}]  # so the slow machine serves first
    fast = {"ttftSeconds": 0.05, "tokensPerSecond": 100, "continuesPartialMessage": True}
    sim = await sim_server(
        {
            "seed": 1,
            "models": [
                {"name": MODEL, "reply": reply, "machines": [
                    {"name": "fast1", **fast, "faults": down_first},
                    {"name": "fast2", **fast, "faults": down_first},
                    {"name": "slow", "ttftSeconds": 0.05, "tokensPerSecond": 7}]},
            ],
        }
    )  # fmt: skip
    proxy = await proxy_server(
        [
            _policy(
                sim.url,
                [
                    {"name": "fast1", "ttftSeconds": 0.1, "tokensPerSecond": 100,
                     "continuesPartialMessage": True},
                    {"name": "fast2", "ttftSeconds": 0.1, "tokensPerSecond": 100,
                     "continuesPartialMessage": True},
                    {"name": "slow", "ttftSeconds": 0.1, "tokensPerSecond": 60},
                ],
            ),
            role_table(role("agent", [MODEL], patience=120)),
        ]
    )  # fmt: skip
    started = time.monotonic()
    async with (
        httpx.AsyncClient(timeout=60) as client,
        client.stream("POST", f"{proxy.url}/v1/chat/completions", json=ASK) as response,
    ):
        assert response.headers["x-rolegate-machine"] == "slow"
        raw = await response.aread()
    took = time.monotonic() - started
    text = "".join(
        choice["delta"].get("content") or ""
        for block in raw.split(b"\n\n")
        if block.startswith(b"data: {")
        for choice in json.loads(block[6:])["choices"]
    )
    assert text == reply  # one seamless answer, nothing lost or repeated
    assert raw.endswith(b"data: [DONE]\n\n")
    assert took < 120 / 7 / 2  # far sooner than the slow machine alone (17 s)
    records = await sim_records(sim.url)
    onward = records[-1]
    assert onward["machine"] in ("fast1", "fast2")
    assert onward["continued_partial"] is True
    assert onward["provider"]["only"] == [onward["machine"]]
    decision = (await outcomes(proxy, 1))[-1]
    sent = [arm.machine for arm in decision.arms]
    assert sent[0] == "slow"
    assert sent[-1] == onward["machine"]  # the log names a second, distinct machine
    assert decision.machine == onward["machine"]
    (moved,) = [arm for arm in decision.arms if arm.result is ArmResult.MOVED]
    assert moved.act is ArmAct.CONTINUED
    assert "moved (rate)" in moved.detail
    assert decision.arms[-1].act is ArmAct.CONTINUED


async def test_a_late_first_token_races_a_better_machine_and_both_arms_teach(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """Before content reached the client, a move is a race: the better machine starts, the
    arm that produces content first is kept, the other is cancelled, and the late arm's
    wait moves its TTFT belief (the seed's second case)."""
    late_first = [
        {"kind": "lateFirstToken", "always": True, "seconds": 4},
    ]
    sim = await sim_server(
        {
            "seed": 1,
            "models": [
                {"name": MODEL, "machines": [
                    {"name": "fast", "faults": [{"kind": "down", "schedule": [1]}]},
                    {"name": "late", "faults": late_first}]},
            ],
        }
    )  # fmt: skip
    figures = {"ttftSeconds": 0.1, "tokensPerSecond": 100}
    proxy = await proxy_server(
        [
            _policy(sim.url, [{"name": "fast", **figures}, {"name": "late", **figures}]),
            role_table(role("agent", [MODEL], patience=60)),
        ]
    )
    before = await state_belief(proxy.url, "late")
    started = time.monotonic()
    headers = await _stream(proxy.url)
    took = time.monotonic() - started
    assert headers["x-rolegate-machine"] == "fast"
    assert took < 3.5  # the late machine alone would take 4 s to its first token
    after = await state_belief(proxy.url, "late")
    # The losing arm's wait taught the ledger, as read from the proxy's state endpoint.
    assert after["expected_ttft_seconds"] > before["expected_ttft_seconds"]
    decision = (await outcomes(proxy, 1))[-1]
    (lost,) = [arm for arm in decision.arms if arm.result is ArmResult.CANCELLED]
    assert lost.act is ArmAct.RACED
    assert "raced (ttft)" in lost.detail
    assert decision.arms[-1].machine == "fast"
    assert decision.arms[-1].act is ArmAct.RACED
    records = await sim_records(sim.url)
    late = [r for r in records if r["machine"] == "late"]
    assert late[0]["outcome"] == "client_disconnected"  # the losing arm was cancelled
