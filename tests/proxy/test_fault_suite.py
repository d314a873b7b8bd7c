"""Every fault mode of the simulated provider, through the proxy, with the real openai client
(SPEC E4): with a healthy fallback the client gets the complete answer; with none, a clear
error. Never a truncated answer reported as success."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from ..support import ProxyFactory, SimFactory, provider_policy, role, role_table, sim_records

MODEL = "vendor/model-a"
SECOND = "vendor/model-b"
REPLY = "one two three four five six seven eight nine ten eleven twelve"
ASCII_PROMPT: Any = [{"role": "user", "content": "say the numbers"}]

# Faults that make an attempt unusable before any content reaches the client.
BEFORE_CONTENT: list[dict[str, Any]] = [
    {"kind": "rateLimit", "always": True, "retryAfterSeconds": 30},
    {"kind": "rateLimit", "always": True},
    {"kind": "serverError", "always": True, "status": 503},
    {"kind": "serverError", "always": True, "status": 500},
    {"kind": "reset", "always": True},
    {"kind": "noResponse", "always": True, "seconds": 30},
    {"kind": "stall", "always": True, "afterTokens": 0, "seconds": 30},
    {"kind": "cut", "always": True, "afterTokens": 0},
    {"kind": "streamError", "always": True, "afterTokens": 0},
    {"kind": "empty", "always": True},
]
# Faults after content reached the client: with nobody to continue the partial answer,
# the client must get a clear error.
AFTER_CONTENT: list[dict[str, Any]] = [
    {"kind": "cut", "always": True, "afterTokens": 3},
    {"kind": "streamError", "always": True, "afterTokens": 3},
    {"kind": "stall", "always": True, "afterTokens": 3, "seconds": 30},
]
# Faults that still deliver a complete, correct answer.
HARMLESS: list[dict[str, Any]] = [
    {"kind": "lateFirstToken", "always": True, "seconds": 0.3},
    {"kind": "rateCollapse", "always": True, "afterTokens": 3, "tokensPerSecond": 40},
    {"kind": "splitWrites", "always": True},
    # The final chunk, then a clean end: complete; the missing [DONE] is supplied (E4).
    {"kind": "noDone", "always": True},
    {"kind": "down", "always": True},  # the aggregator serves from the fallback itself
]


def _id(fault: dict[str, Any]) -> str:
    extra = fault.get("status") or fault.get("afterTokens") or fault.get("retryAfterSeconds")
    return f"{fault['kind']}-{extra}" if extra is not None else str(fault["kind"])


async def _proxy(
    sim_server: SimFactory, proxy_server: ProxyFactory, fault: dict[str, Any], *, fallback: bool
) -> tuple[str, str]:
    # The fallback is a healthy machine of the same model (for faults the aggregator names
    # a machine for) and a healthy second model (for faults of the connection itself).
    machines = [{"name": "bad", "ttftSeconds": 0, "tokensPerSecond": 0, "faults": [fault]}]
    models = [{"name": MODEL, "reply": REPLY, "machines": machines}]
    served = {MODEL: ["bad"]}
    if fallback:
        machines.append({"name": "good", "ttftSeconds": 0, "tokensPerSecond": 0})
        models.append({"name": SECOND, "reply": REPLY, "machines": [{"name": "good"}]})
        served = {MODEL: ["bad", "good"], SECOND: ["good"]}
    sim = await sim_server({"seed": 5, "models": models})
    proxy = await proxy_server(
        [
            provider_policy("agg", f"{sim.url}/v1", served),
            # Patience bounds silent upstreams: half of it is the idle limit.
            role_table(role("agent", list(served), patience=3)),
        ]
    )
    return proxy.url, sim.url


async def _ask(url: str, stream: bool) -> str:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        if not stream:
            completion = await client.chat.completions.create(model="agent", messages=ASCII_PROMPT)
            return completion.choices[0].message.content or ""
        chunks = await client.chat.completions.create(
            model="agent", messages=ASCII_PROMPT, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "complete"])
@pytest.mark.parametrize("fault", BEFORE_CONTENT + HARMLESS, ids=_id)
async def test_with_a_fallback_the_client_gets_the_complete_answer(
    sim_server: SimFactory, proxy_server: ProxyFactory, fault: dict[str, Any], stream: bool
) -> None:
    url, sim_url = await _proxy(sim_server, proxy_server, fault, fallback=True)
    assert await _ask(url, stream) == REPLY
    assert len(await sim_records(sim_url)) <= 2  # bounded: the bad machine once at most


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "complete"])
@pytest.mark.parametrize("fault", BEFORE_CONTENT, ids=_id)
async def test_without_a_fallback_the_client_gets_a_clear_error(
    sim_server: SimFactory, proxy_server: ProxyFactory, fault: dict[str, Any], stream: bool
) -> None:
    url, sim_url = await _proxy(sim_server, proxy_server, fault, fallback=False)
    with pytest.raises(openai.APIStatusError) as caught:
        await _ask(url, stream)
    assert caught.value.status_code in (429, 502, 503)
    assert "agg" in caught.value.message
    assert len(await sim_records(sim_url)) <= 3


@pytest.mark.parametrize("fault", AFTER_CONTENT, ids=_id)
async def test_a_fault_after_content_ends_the_stream_with_a_clear_error(
    sim_server: SimFactory, proxy_server: ProxyFactory, fault: dict[str, Any]
) -> None:
    url, _ = await _proxy(sim_server, proxy_server, fault, fallback=True)
    with pytest.raises(openai.APIError, match="incomplete"):
        await _ask(url, stream=True)


@pytest.mark.parametrize("fault", AFTER_CONTENT, ids=_id)
async def test_a_fault_after_content_is_retried_when_nothing_was_sent_yet(
    sim_server: SimFactory, proxy_server: ProxyFactory, fault: dict[str, Any]
) -> None:
    # Not streamed: nothing reaches the client before the answer is complete, so the
    # same fault is invisible to it and the fallback answers.
    url, _ = await _proxy(sim_server, proxy_server, fault, fallback=True)
    assert await _ask(url, stream=False) == REPLY
