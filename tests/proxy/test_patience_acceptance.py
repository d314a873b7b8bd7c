"""Issue 5's acceptance, through the proxy's public HTTP interface with the openai client:
the seed's three cases, read back from `/v1/rolegate/decisions` and `/v1/rolegate/state`."""

from __future__ import annotations

import re
import time
from typing import Any

import httpx
import openai
import pytest

from ..support import (
    ProxyFactory,
    SimFactory,
    machine_policy,
    role,
    role_table,
    sim_records,
    state_belief,
)
from ..waiting import eventually

MODEL = "vendor/model-a"
PROMPT: Any = [{"role": "user", "content": "write the next step"}]


def _policy(url: str, machines: list[dict[str, Any]]) -> dict[str, Any]:
    return machine_policy(url, MODEL, machines)


async def _decisions(url: str) -> list[dict[str, Any]]:
    """The recent decisions once the last request's outcome has reached the log."""
    async with httpx.AsyncClient() as client:

        async def logged() -> list[dict[str, Any]]:
            decisions: list[dict[str, Any]] = (
                await client.get(f"{url}/v1/rolegate/decisions")
            ).json()["decisions"]
            return decisions

        return await eventually(logged, what="a decision in the log")


async def _stream_text(url: str, role_name: str = "agent") -> str:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        stream = await client.chat.completions.create(model=role_name, messages=PROMPT, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


def _moves(decision: dict[str, Any]) -> list[str]:
    """The moves the rate test made: a stream continued elsewhere, or a race's loser."""
    return [a["detail"] for a in decision["arms"] if a["result"] == "moved" or (a["act"] == "raced"
            and a["result"] == "cancelled")]  # fmt: skip


FAST = {"ttftSeconds": 0.05, "tokensPerSecond": 90, "continuesPartialMessage": True}
DOWN_FIRST = [{"kind": "down", "schedule": [1]}]  # the slow machine is the aggregator's pick


async def test_case_1_a_2_tok_s_stream_moves_to_a_90_tok_s_machine(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    reply = " ".join(f"t{i}" for i in range(600))
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "reply": reply, "machines": [
            {"name": "fast1", **FAST, "faults": DOWN_FIRST},
            {"name": "fast2", **FAST, "faults": DOWN_FIRST},
            {"name": "slow", "ttftSeconds": 0.05, "tokensPerSecond": 2}]}]}
    )  # fmt: skip
    published = {"ttftSeconds": 0.1, "tokensPerSecond": 90, "continuesPartialMessage": True}
    proxy = await proxy_server(
        [
            _policy(sim.url, [{"name": "fast1", **published}, {"name": "fast2", **published},
                              {"name": "slow", "ttftSeconds": 0.1, "tokensPerSecond": 60}]),
            role_table(role("agent", [MODEL], patience=600, visibility="Watched")),
        ]
    )  # fmt: skip
    started = time.monotonic()
    text = await _stream_text(proxy.url)
    took = time.monotonic() - started
    assert text == reply  # one coherent answer
    (decision,) = await _decisions(proxy.url)
    (move,) = _moves(decision)
    tokens = int(re.search(r"after (\d+) tokens", move).group(1))  # type: ignore[union-attr]
    sent = [a["machine"] for a in decision["arms"]]
    assert sent[0] == "slow"
    assert sent[-1] in ("fast1", "fast2")  # a second, distinct machine
    fast_alone = 600 / 90
    print(
        f"\ncase 1: 600 tokens in {took:.1f} s through rolegate; slow machine alone "
        f"{600 / 2:.0f} s; fast machine alone {fast_alone:.1f} s; acted after {tokens} tokens"
    )
    assert took < 2 * fast_alone


async def test_case_1b_a_collapse_mid_stream_moves_and_a_slow_machine_alone_does_not(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    reply = " ".join(f"t{i}" for i in range(300))
    collapse = {"kind": "rateCollapse", "always": True, "afterTokens": 40, "tokensPerSecond": 4}
    sim = await sim_server(
        {"seed": 2, "models": [{"name": MODEL, "reply": reply, "machines": [
            {"name": "fast1", **FAST},
            {"name": "degrading", **FAST, "faults": [collapse]}]}]}
    )  # fmt: skip
    published = {"ttftSeconds": 0.1, "tokensPerSecond": 90, "continuesPartialMessage": True}
    # Published a little faster, so the degrading machine is the first choice.
    first = {**published, "tokensPerSecond": 100}
    proxy = await proxy_server(
        [
            _policy(sim.url, [{"name": "fast1", **published}, {"name": "degrading", **first}]),
            role_table(role("agent", [MODEL], patience=600)),
        ]
    )
    assert await _stream_text(proxy.url) == reply
    (decision,) = await _decisions(proxy.url)
    assert len(_moves(decision)) == 1

    # Believed slow, writing slow, nothing faster admissible: never moved.
    lone = await sim_server(
        {"seed": 3, "models": [{"name": MODEL, "reply": reply[:200],
                                "machines": [{"name": "slow", "tokensPerSecond": 20}]}]}
    )  # fmt: skip
    steady = await proxy_server(
        [
            _policy(lone.url, [{"name": "slow", "ttftSeconds": 0.1, "tokensPerSecond": 20}]),
            role_table(role("agent", [MODEL], patience=600)),
        ]
    )
    assert await _stream_text(steady.url) == reply[:200]
    (decision,) = await _decisions(steady.url)
    assert _moves(decision) == []


async def test_case_2_a_late_first_token_moves_the_belief_even_when_the_stream_is_cut(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    # The machine answers its first token 1.5 s late (published: 0.2 s), then is cut.
    cut = {"kind": "cut", "always": True, "afterTokens": 3}
    late = {"name": "m1", "ttftSeconds": 1.5, "tokensPerSecond": 100, "faults": [cut]}
    sim = await sim_server({"seed": 1, "models": [{"name": MODEL, "machines": [late]}]})
    proxy = await proxy_server(
        [
            _policy(sim.url, [{"name": "m1", "ttftSeconds": 0.2, "tokensPerSecond": 100}]),
            role_table(role("agent", [MODEL], patience=60)),
        ]
    )
    before = await state_belief(proxy.url, "m1")
    with pytest.raises(openai.APIError, match="incomplete"):
        await _stream_text(proxy.url)
    after = await state_belief(proxy.url, "m1")
    assert after["expected_ttft_seconds"] > before["expected_ttft_seconds"] * 2
    assert after["sightings"] == 1


async def test_case_2_an_arm_the_client_abandoned_still_teaches(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    late = [{"kind": "lateFirstToken", "always": True, "seconds": 5}]
    sim = await sim_server({"seed": 1, "models": [{"name": MODEL, "machines": [
        {"name": "m1", "faults": late}]}]})  # fmt: skip
    proxy = await proxy_server(
        [
            _policy(sim.url, [{"name": "m1", "ttftSeconds": 0.2, "tokensPerSecond": 100}]),
            role_table(role("agent", [MODEL], patience=60)),
        ]
    )
    before = await state_belief(proxy.url, "m1")
    body = {"model": "agent", "messages": PROMPT, "stream": True}
    async with httpx.AsyncClient() as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(f"{proxy.url}/v1/chat/completions", json=body, timeout=1.5)

    # The abandoned arm teaches the ledger as it is cancelled, just after the client left.
    async def moved() -> bool:
        after = await state_belief(proxy.url, "m1")
        return bool(after["expected_ttft_seconds"] > before["expected_ttft_seconds"])

    await eventually(moved, what="the TTFT belief to move")


async def test_case_3_rulings_refusals_and_unknown_machines(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "reply": "a b c", "machines": [
            {"name": "fast", "faults": [{"kind": "down", "schedule": [3]}]},
            {"name": "slow", "faults": [{"kind": "down", "schedule": [1]}]},
            {"name": "stranger", "tokensPerSecond": 2}]}]}
    )  # fmt: skip
    proxy = await proxy_server(
        [
            _policy(sim.url, [{"name": "fast", "ttftSeconds": 0.1, "tokensPerSecond": 200},
                              {"name": "slow", "ttftSeconds": 3, "tokensPerSecond": 20}]),
            role_table(
                role("reflex", [MODEL], patience=4, visibility="Unwatched"),
                role("agent", [MODEL], patience=60, visibility="Watched"),
            ),
        ]
    )  # fmt: skip
    await _stream_text(proxy.url, "reflex")
    await _stream_text(proxy.url, "agent")
    reflex, agent = (await sim_records(sim.url))[:2]
    # Unwatched, short patience, Auto: `only` of the admitted; slow (3 s + 512/20 s) refused.
    assert reflex["provider"]["only"] == ["fast"]
    # Watched, long patience: `order` + `ignore`; the refused machine only in `ignore`.
    assert agent["provider"]["order"] == ["fast", "slow"]
    assert agent["provider"].get("ignore") in (None, [])
    # The aggregator serves from a machine never named (fast is down for request 3)...
    await _stream_text(proxy.url, "agent")
    third = (await sim_records(sim.url))[2]
    # ... which the ledger now knows; at 2 tok/s it is beyond even the agent's patience
    # for 512 tokens, so it is refused by name from then on.
    stranger = await state_belief(proxy.url, "stranger")
    assert stranger["sightings"] >= 1
    await _stream_text(proxy.url, "agent")
    fourth = (await sim_records(sim.url))[-1]
    assert "stranger" in (fourth["provider"].get("ignore") or [])
    assert "stranger" not in fourth["provider"]["order"]
    assert third["machine"] in ("slow", "stranger")


async def test_case_3_an_empty_admitted_set_falls_back_to_order(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """Under `Order` (a slow answer beats none) an empty admitted set is sent as an
    `order` of the slow machines, never an empty `only`."""
    sim = await sim_server({"seed": 1, "models": [{"name": MODEL, "reply": "ok",
                                                   "machines": [{"name": "slow"}]}]})  # fmt: skip
    proxy = await proxy_server(
        [
            _policy(sim.url, [{"name": "slow", "ttftSeconds": 3, "tokensPerSecond": 20}]),
            role_table(role("reflex", [MODEL], patience=4, visibility="Watched")),
        ]
    )
    assert await _stream_text(proxy.url, "reflex") == "ok"
    (record,) = await sim_records(sim.url)
    assert record["provider"]["order"] == ["slow"]
    assert not record["provider"].get("only")


async def test_case_3_under_only_an_empty_admitted_set_is_refused_at_once(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """`Only` (Auto: Unwatched, short patience) demands the admitted set: a pool too slow
    is a 503 at once, naming the role, its patience and the fastest machine believed."""
    sim = await sim_server({"seed": 1, "models": [{"name": MODEL, "reply": "ok",
                                                   "machines": [{"name": "slow"}]}]})  # fmt: skip
    proxy = await proxy_server(
        [
            _policy(sim.url, [{"name": "slow", "ttftSeconds": 3, "tokensPerSecond": 20}]),
            role_table(role("reflex", [MODEL], patience=4, visibility="Unwatched")),
        ]
    )
    started = time.monotonic()
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0) as c:
        with pytest.raises(openai.InternalServerError) as caught:
            await c.chat.completions.create(model="reflex", messages=PROMPT, stream=True)
    assert time.monotonic() - started < 1.0
    assert caught.value.status_code == 503
    assert caught.value.code == "no_machine_within_patience"
    message = str(caught.value)
    assert "'reflex'" in message
    assert "patience of 4 s" in message
    assert "the fastest believed is slow serving" in message
    assert await sim_records(sim.url) == []
