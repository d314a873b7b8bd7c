"""SPEC E4 through the real proxy, the real simulator and real clients: one malformed stream
event is skipped and counted, never fatal; and the attempts of one request are separated by
a backoff.

The simulator's `malformedEvent` fault inserts one event whose data is not JSON
(`data: {"choices": [`) before a content event, leaving the answer's own events whole, so
the client must receive the complete reply, and never the bad bytes. Everything is read back
over the proxy's public surfaces (`/v1/rolegate/decisions`, `/v1/rolegate/state`,
`/metrics`) and the simulator's request records.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rolegate_policy.model import RetrySpec

from ..support import (
    ProxyFactory,
    SimFactory,
    machine_policy,
    provider_policy,
    role,
    role_table,
    sim_records,
)
from ..waiting import eventually

MODEL = "vendor/model-a"
# Six tokens, with two-, three- and four-byte UTF-8 characters.
REPLY = "Sure — café, 日本語 🎉 done."
# The prompt holds the answer's characters: judged on the whole text, it is plainly ok.
PROMPT: Any = [{"role": "user", "content": f"say {REPLY}"}]
# The simulator's malformed event, as it is on the wire (its JSON has spaces, the
# simulator's own none: these bytes are in no valid event).
MALFORMED = b'data: {"choices": ['
# Paced, so that the events come in several reads: the one before content event 3 arrives
# after the first content was relayed to the client.
PACED = {"ttftSeconds": 0, "tokensPerSecond": 100}

# 1: before any content, while the arm is held back; 3: mid-stream, after the commit.
AT_EVENTS = pytest.mark.parametrize("at_event", [1, 3])


async def _malformed_setup(
    sim_server: SimFactory, proxy_server: ProxyFactory, at_event: int
) -> tuple[str, str]:
    """(simulator URL, proxy URL): one machine whose every stream carries a malformed event
    before its `at_event`-th content event."""
    fault = {"kind": "malformedEvent", "always": True, "atEvent": at_event}
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "reply": REPLY, "machines": [
            {"name": "m1", **PACED, "faults": [fault]}]}]}
    )  # fmt: skip
    proxy = await proxy_server(
        [
            machine_policy(sim.url, MODEL, [{"name": "m1"}]),
            role_table(role("agent", [MODEL], patience=30)),
        ]
    )
    return sim.url, proxy.url


async def _decisions(url: str, count: int) -> list[dict[str, Any]]:
    """The decision log once it holds at least `count` requests (oldest first)."""
    async with httpx.AsyncClient() as client:

        async def enough() -> list[dict[str, Any]] | None:
            response = await client.get(f"{url}/v1/rolegate/decisions")
            found: list[dict[str, Any]] = response.json()["decisions"]
            return found if len(found) >= count else None

        return await eventually(enough, what=f"{count} decisions in the log")


async def _state(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient() as client:
        state: dict[str, Any] = (await client.get(f"{url}/v1/rolegate/state")).json()
    return state


async def _metric(url: str, sample: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The values of one sample of `/metrics`, by label set."""
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{url}/metrics")).text
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == sample
    }


async def _malformed_counted(url: str) -> dict[tuple[tuple[str, str], ...], float]:
    return await _metric(url, "rolegate_malformed_events_total")


async def _fault_fired(sim_url: str, requests: int) -> None:
    records = await sim_records(sim_url)
    assert [(r["fault"], r["outcome"]) for r in records] == [
        ("malformedEvent", "completed")
    ] * requests


# --- one malformed event is skipped and counted, never fatal --------------------------------


@AT_EVENTS
async def test_a_malformed_event_is_skipped_and_counted_and_the_answer_is_whole(
    sim_server: SimFactory, proxy_server: ProxyFactory, at_event: int
) -> None:
    sim_url, proxy_url = await _malformed_setup(sim_server, proxy_server, at_event)
    async with openai.AsyncOpenAI(base_url=f"{proxy_url}/v1", api_key="x", max_retries=0) as ai:
        stream = await ai.chat.completions.create(model="agent", messages=PROMPT, stream=True)
        chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"

    (decision,) = await _decisions(proxy_url, 1)
    assert (decision["outcome"], decision["status"]) == ("answered", 200)
    assert [(a["machine"], a["result"]) for a in decision["arms"]] == [("m1", "ok")]
    assert (decision["verdict"], decision["finish_reason"]) == ("ok", "stop")
    assert decision["tokens_out"] == 6
    # No breaker took the machine out for it: every breaker the state lists is Closed (a
    # breaker is listed once a failure was charged to its key; none was), and none ever
    # moved.
    breakers = (await _state(proxy_url))["breakers"]
    assert [b for b in breakers if b["state"] != "Closed"] == []
    assert await _metric(proxy_url, "rolegate_breaker_transitions_total") == {}
    # Skipped, and counted once, for the provider that sent it.
    assert await _malformed_counted(proxy_url) == {(("provider", "agg"),): 1.0}
    await _fault_fired(sim_url, 1)


@AT_EVENTS
async def test_the_malformed_bytes_never_reach_the_client(
    sim_server: SimFactory, proxy_server: ProxyFactory, at_event: int
) -> None:
    """Read raw: every event the client gets is a JSON chunk (or the [DONE]), the bad one is
    not among them, and the answer's own events all are."""
    sim_url, proxy_url = await _malformed_setup(sim_server, proxy_server, at_event)
    payload = {"model": "agent", "messages": PROMPT, "stream": True}
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{proxy_url}/v1/chat/completions", json=payload)
    assert response.status_code == 200
    body = response.content
    assert MALFORMED not in body
    assert b'{"choices": [' not in body
    blocks = [b for b in body.split(b"\n\n") if b]
    assert all(block.startswith(b"data: ") for block in blocks), blocks
    assert blocks[-1] == b"data: [DONE]"
    chunks = [json.loads(block.removeprefix(b"data: ")) for block in blocks[:-1]]
    # The role chunk, six contents and the finish: nothing lost, nothing added.
    assert len(chunks) == 1 + 6 + 1
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == REPLY
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    (decision,) = await _decisions(proxy_url, 1)
    assert (decision["outcome"], decision["status"]) == ("answered", 200)
    assert await _malformed_counted(proxy_url) == {(("provider", "agg"),): 1.0}
    await _fault_fired(sim_url, 1)


# --- attempts are separated by a backoff ------------------------------------------------------


async def test_the_attempts_of_one_request_are_a_backoff_apart(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """Two models of the role fail (503) before the third answers: three attempts, each
    arriving at the simulator at least the backoff's lower bound after the one before (the
    jitter draws a factor in [0.5, 1), and the base doubles with every failure). A lower
    bound only grows on a loaded machine."""
    failing = {"kind": "serverError", "always": True, "status": 503}
    reply = "one two three"
    sim = await sim_server(
        {"seed": 1, "models": [
            {"name": "vendor/first", "reply": reply, "machines": [
                {"name": "m1", **PACED, "faults": [failing]}]},
            {"name": "vendor/second", "reply": reply, "machines": [
                {"name": "m2", **PACED, "faults": [failing]}]},
            {"name": "vendor/third", "reply": reply, "machines": [{"name": "m3", **PACED}]},
        ]}
    )  # fmt: skip
    models = ["vendor/first", "vendor/second", "vendor/third"]
    proxy = await proxy_server(
        [
            provider_policy(
                "agg", f"{sim.url}/v1", {"vendor/first": ["m1"], "vendor/second": ["m2"],
                                         "vendor/third": ["m3"]},
            ),
            role_table(role("agent", models, patience=30)),
        ]
    )  # fmt: skip
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0) as ai:
        completion = await ai.chat.completions.create(model="agent", messages=PROMPT)
    assert completion.choices[0].message.content == reply

    (decision,) = await _decisions(proxy.url, 1)
    assert (decision["outcome"], decision["status"]) == ("answered", 200)
    assert [(a["machine"], a["result"]) for a in decision["arms"]] == [
        ("m1", "server_error"),
        ("m2", "server_error"),
        ("m3", "ok"),
    ]
    records = await sim_records(sim.url)
    assert [(r["machine"], r["status"]) for r in records] == [
        ("m1", 503),
        ("m2", 503),
        ("m3", 200),
    ]
    arrivals = [r["arrived_monotonic"] for r in records]
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    # After the n-th failure the pause is at least backoffSeconds * 2**(n-1) * 0.5.
    first = RetrySpec().backoff_seconds
    floors = [first * 2**n * 0.5 for n in range(len(gaps))]
    assert all(gap >= floor for gap, floor in zip(gaps, floors, strict=True)), (gaps, floors)
