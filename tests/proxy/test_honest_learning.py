"""Honest learning through the real proxy and simulator (SPEC B5, B7; issue 31, finding 3):
whole non-streamed answers never become per-token gaps, so a healthy stream on the same
machine is never taken for a slow one and moved."""

from __future__ import annotations

import json

import aiohttp
import httpx
import pytest

from rolegate_proxy.core.beliefs import MachineKey

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
REPLY = " ".join(f"w{i}" for i in range(60))
# Both machines really write at 60 tok/s from the first byte. Their sheets claim a slow
# first token (0.5 s and 0.6 s): a short non-streamed answer, all of it in a few tens of
# milliseconds, is then far faster than the sheet's shape, which is what made the old split
# teach gaps of about a millisecond.
REAL = {"ttftSeconds": 0, "tokensPerSecond": 60}
NON_STREAMED = 40
STREAMED = 6


async def _whole_answer(session: aiohttp.ClientSession, url: str) -> None:
    body = {"model": "agent", "messages": [{"role": "user", "content": "ping"}],
            "max_tokens": 3}  # fmt: skip
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        assert response.status == 200
        answer = await response.json()
    assert answer["usage"]["completion_tokens"] == 3


async def _streamed_text(client: httpx.AsyncClient, url: str) -> str:
    body = {"model": "agent", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        raw = await response.aread()
    return "".join(
        choice["delta"].get("content") or ""
        for block in raw.split(b"\n\n")
        if block.startswith(b"data: {")
        for choice in json.loads(block[6:])["choices"]
    )


async def test_healthy_streams_after_many_whole_answers_are_never_moved(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """One long-lived proxy: forty short non-streamed answers from machine `a`, then streams
    from `a` at its true 60 tok/s, with `b` on the same model, published no faster and able
    to continue a partial answer. Before B7's rule the answers taught ~1 ms gaps, `a` was
    believed at hundreds of tokens a second, and each stream was moved to `b` after its
    first eight tokens."""
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "reply": REPLY, "machines": [
            {"name": "a", **REAL},
            {"name": "b", **REAL, "continuesPartialMessage": True}]}]}
    )  # fmt: skip
    proxy = await proxy_server(
        [
            machine_policy(sim.url, MODEL, [
                {"name": "a", "ttftSeconds": 0.5, "tokensPerSecond": 60},
                {"name": "b", "ttftSeconds": 0.6, "tokensPerSecond": 60,
                 "continuesPartialMessage": True}]),
            role_table(role("agent", [MODEL], patience=60)),
        ]
    )  # fmt: skip
    async with aiohttp.ClientSession() as session:
        for _ in range(NON_STREAMED):
            await _whole_answer(session, proxy.url)
    whole = await sim_records(sim.url)
    assert [r["machine"] for r in whole] == ["a"] * NON_STREAMED

    # What the answers taught: their pace (far faster than the sheet's 0.55 s shape), and
    # no gap: `a` is still believed at the rate it publishes.
    taught = await state_belief(proxy.url, "a")
    assert taught["expected_answer_pace"] < 0.5
    assert taught["expected_tokens_per_second"] == pytest.approx(60, rel=0.05)

    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(STREAMED):
            assert await _streamed_text(client, proxy.url) == REPLY

    streamed = (await sim_records(sim.url))[NON_STREAMED:]
    # One attempt per stream, every one on `a`: nothing raced, continued or moved to `b`.
    assert [r["machine"] for r in streamed] == ["a"] * STREAMED
    assert not any(r.get("continued_partial") for r in streamed)
    decisions = (await outcomes(proxy, NON_STREAMED + STREAMED))[-STREAMED:]
    for decision in decisions:
        assert [arm.machine for arm in decision.arms] == ["a"]
        assert [arm.act for arm in decision.arms] == [None]
    # The streams' own gaps taught the rate they showed.
    dispatcher = proxy.state.dispatcher
    belief = dispatcher.ledger.belief_of(MachineKey("agg", MODEL, "a"), dispatcher.now())
    assert belief is not None
    assert belief.expected_rate == pytest.approx(60, rel=0.2)
