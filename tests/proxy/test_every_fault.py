"""Every fault a new user meets (issue 13), through the real proxy, simulator and openai
client, with the default settings: the client gets the complete answer (for a content-policy
400, the provider's refusal after exactly one attempt), after the attempts the upstream's
log shows, in the time the user would expect. The cases are `tests/fault_cases.py`, which
`bench/faults.py` prints as a table; then the aggregator's own cases."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest

from ..fault_cases import CASES, DEFAULTS, OUTAGE, REPLY, Case, run, run_outage
from ..support import ProxyFactory, SimFactory, machine_policy, role, role_table, sim_records

# What the upstream saw for each case, in order (p1: the primary, f1: the fallback).
ATTEMPTS = {
    # Retry-After honoured on the primary: nothing else serves its model.
    "429 with Retry-After: 2, once": ["p1 429", "p1 200"],
    "429 forever, no Retry-After": ["p1 429", "f1 200"],
    # A transient failure is retried on the same model.
    "500 once": ["p1 500", "p1 200"],
    "503 forever": ["p1 503", "p1 503", "f1 200"],
    "TCP reset before headers, once": ["p1 reset", "p1 200"],
    # Published figures call the silent primary late: the fallback races it and wins.
    "accepted, then silent for 120 s": ["p1 client_disconnected", "f1 200"],
    "first token after 20 s": ["p1 200", "f1 200"],
    # Content reached the client: the fallback continues it (it continues prefills).
    "stream cut after 40 of 60 tokens": ["p1 200", "f1 200 continued"],
    "20 tokens, 30 s of silence, then close": ["p1 200", "f1 200 continued"],
    "the 10th event is invalid JSON": ["p1 200"],
    "complete stream without data: [DONE]": ["p1 200"],
    "400 context_length_exceeded": ["p1 400", "f1 200"],
    "400 content policy": ["p1 400"],
    # The fallback refuses the prefill: never the answer while the primary can continue.
    "stream cut, fallback refuses the prefill": ["p1 200", "f1 400", "p1 200 continued"],
    "503 forever, usage accounting": ["p1 503", "p1 503", "f1 200"],
}
# Cases that must be quick, however long the fault lasts (seconds).
QUICK = {
    "accepted, then silent for 120 s": 3.0,
    "first token after 20 s": 3.0,
    "20 tokens, 30 s of silence, then close": 3.0,
}


def test_every_case_has_its_expectation() -> None:
    assert set(ATTEMPTS) == {case.name for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
async def test_the_client_gets_the_complete_answer(case: Case) -> None:
    outcome = await run(case, DEFAULTS)
    assert outcome.verdict(case).startswith("ok"), (outcome.verdict(case), outcome.attempts)
    assert outcome.attempts == ATTEMPTS[case.name]
    assert outcome.seconds < QUICK.get(case.name, 10.0)
    if case.error_status is None:
        # Usage always arrives, whoever served and however it was spliced.
        assert outcome.usage is not None
        assert outcome.usage.completion_tokens == 60
    if case.name == "429 with Retry-After: 2, once":
        first, second = outcome.records
        assert second["arrived_monotonic"] - first["arrived_monotonic"] >= 2.0
    if case.name == "503 forever, usage accounting":
        assert outcome.models == {"vendor/fallback"}  # the model that served, by name


async def test_a_primary_that_recovers_serves_again_soon_and_nobody_noticed_the_outage() -> None:
    """The outage case at a tenth of its durations, the breaker's schedule scaled alike
    (`bench/faults.py` runs it at full length with the default settings): every request
    is answered, and the primary serves again within a tenth of 30 s of recovering."""
    outage = await run_outage(DEFAULTS, scale=0.1)
    assert outage.answered, OUTAGE
    assert [m for at, m in outage.served if at < outage.recovered_at] == ["f1"] * len(
        [1 for at, _ in outage.served if at < outage.recovered_at]
    )
    assert outage.back_after is not None
    assert outage.back_after <= 3.0


# --- through an OpenRouter-style aggregator ------------------------------------------------

MODEL, OTHER = "vendor/model-a", "vendor/model-b"
PROMPT: Any = [{"role": "user", "content": "count"}]


async def _stream(url: str, role_name: str = "agent") -> tuple[str, float]:
    started = time.monotonic()
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        stream = await client.chat.completions.create(model=role_name, messages=PROMPT, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    return text, time.monotonic() - started


async def test_a_role_served_only_through_an_aggregator_waits_its_whole_patience(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """Its one candidate is its last: the attempt gets all the patience (8 s), so a first
    token due at 4.5 s arrives."""
    late = {"kind": "lateFirstToken", "always": True, "seconds": 4.5}
    sim = await sim_server({"seed": 1, "models": [{"name": MODEL, "reply": REPLY,
        "machines": [{"name": "m1", "faults": [late]}]}]})  # fmt: skip
    proxy = await proxy_server(
        [machine_policy(sim.url, MODEL, [{"name": "m1"}]),
         role_table(role("agent", [MODEL], patience=8))]
    )  # fmt: skip
    text, seconds = await _stream(proxy.url)
    assert text == REPLY
    assert 4.5 <= seconds < 8.0
    assert len(await sim_records(sim.url)) == 1


async def test_keep_alive_comments_never_extend_the_patience(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """An aggregator sending `: OPENROUTER PROCESSING` while it queues (for 30 s): a 6 s
    role is answered by its fallback model within its patience, not held 30 s."""
    queued = {"kind": "keepAliveComments", "always": True, "seconds": 30, "everySeconds": 0.2}
    sim = await sim_server({"seed": 1, "models": [
        {"name": MODEL, "reply": REPLY, "machines": [{"name": "m1", "faults": [queued]}]},
        {"name": OTHER, "reply": REPLY, "machines": [{"name": "m2"}]}]})  # fmt: skip
    proxy = await proxy_server(
        [machine_policy(sim.url, MODEL, [{"name": "m1"}]),
         machine_policy(sim.url, OTHER, [{"name": "m2"}], name="agg2"),
         role_table(role("agent", [MODEL, OTHER], patience=6))]
    )  # fmt: skip
    text, seconds = await _stream(proxy.url)
    assert text == REPLY
    assert seconds < 6.0
    machines = [r["machine"] for r in await sim_records(sim.url)]
    assert machines[-1] == "m2"


async def test_first_token_timeouts_trip_the_machine_not_the_aggregator(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """Two first-token timeouts on one machine take that machine out; a healthy model on
    the same aggregator goes on answering."""
    silent = {"kind": "noResponse", "always": True, "seconds": 30}
    sim = await sim_server({"seed": 1, "models": [
        {"name": MODEL, "reply": REPLY, "machines": [{"name": "slow", "faults": [silent]}]},
        {"name": OTHER, "reply": REPLY, "machines": [{"name": "fine"}]}]})  # fmt: skip
    policy = machine_policy(sim.url, MODEL, [{"name": "slow"}])
    policy["spec"]["models"].append({"name": OTHER, "machines": [{"name": "fine"}]})
    policy["spec"]["timeouts"] = {"idleSeconds": 0.3}
    proxy = await proxy_server(
        [policy, role_table(role("agent", [MODEL], patience=2), role("other", [OTHER]))]
    )
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0) as c:
        for _ in range(2):
            with pytest.raises(openai.APIStatusError):
                await c.chat.completions.create(model="agent", messages=PROMPT, stream=True)
    async with httpx.AsyncClient() as client:
        breakers = (await client.get(f"{proxy.url}/v1/rolegate/state")).json()["breakers"]
    tripped = [(b["scope"], b.get("machine")) for b in breakers if b["state"] != "Closed"]
    assert tripped == [("Machine", "slow")]
    text, _ = await _stream(proxy.url, "other")
    assert text == REPLY
