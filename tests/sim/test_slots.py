"""Machines with few slots (a single-slot llama.cpp server): at most `slots` answers at once,
the rest wait in arrival order before their first byte; a waiter whose client leaves leaves
the queue. The wait shows in the records (`queued_seconds`, `queued_behind`) and the queue in
`GET /_sim/machines`. Also: each record's body fingerprint."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from rolegate_sim.scenario import ScenarioError, parse_scenario

from ..waiting import eventually
from .simclient import REPLY, StartSim, body, chat, machine, records, scenario

# Six tokens: the first after 0.1 s, then one every 0.04 s: an answer takes 0.3 s.
TTFT, RATE = 0.1, 25.0
ANSWER_SECONDS = TTFT + 5 / RATE


async def _queue(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/_sim/machines") as response:
        assert response.status == 200
        (only,) = await response.json()
        return dict(only)


async def _queue_reaches(
    http: aiohttp.ClientSession, url: str, *, busy: int, waiting: int
) -> dict[str, Any]:
    async def reached() -> dict[str, Any] | None:
        queue = await _queue(http, url)
        return queue if (queue["busy"], queue["waiting"]) == (busy, waiting) else None

    return await eventually(reached, what=f"{busy} answering and {waiting} waiting")


async def _first_content_after(http: aiohttp.ClientSession, url: str, payload: Any) -> float:
    """Seconds from sending a streamed request to its first content token."""
    sent = time.monotonic()
    async with http.post(f"{url}/v1/chat/completions", json=payload) as response:
        assert response.status == 200
        async for line in response.content:
            if b'"content":"' in line and b'"content":""' not in line:
                first = time.monotonic() - sent
                await response.read()
                return first
    raise AssertionError("no content arrived")


def _began(record: dict[str, Any]) -> float:
    """When the simulator began answering a request (its arrival, then its queue)."""
    return float(record["arrived_monotonic"]) + float(record["queued_seconds"])


async def _in_arrival_order(
    http: aiohttp.ClientSession, url: str, payloads: list[Any], *, limit: int
) -> list[asyncio.Task[float]]:
    """Each request sent once the one before it is answering or queued, so the arrival
    order is the list's."""
    tasks = []
    for i, payload in enumerate(payloads):
        tasks.append(asyncio.create_task(_first_content_after(http, url, payload)))
        await _queue_reaches(http, url, busy=min(i + 1, limit), waiting=max(0, i + 1 - limit))
    return tasks


async def test_a_single_slot_machine_answers_one_stream_at_a_time_in_arrival_order(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a", ttftSeconds=TTFT, tokensPerSecond=RATE, slots=1)))
    tasks = await _in_arrival_order(http, sim.url, [body(stream=True)] * 3, limit=1)
    firsts = await asyncio.gather(*tasks)
    first, second, third = await records(http, sim.url)
    assert [r["queued_behind"] for r in (first, second, third)] == [0, 1, 2]
    assert first["queued_seconds"] < 0.05
    # One at a time: each began once the answer before it had run its whole course (the
    # simulator's paces only ever run late, so these bounds hold on a loaded machine too).
    begun = [_began(r) for r in (first, second, third)]
    assert begun[1] - begun[0] >= ANSWER_SECONDS - 0.02
    assert begun[2] - begun[1] >= ANSWER_SECONDS - 0.02
    # And each client saw its first token only after its queue and its own TTFT.
    assert firsts[1] >= second["queued_seconds"] + TTFT - 0.02
    assert firsts[2] >= third["queued_seconds"] + TTFT - 0.02
    assert all(r["outcome"] == "completed" and r["tokens_sent"] == 6 for r in (first, second))
    assert (await _queue(http, sim.url))["busy"] == 0


async def test_a_queued_non_streamed_request_is_answered_that_much_later(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a", ttftSeconds=TTFT, tokensPerSecond=RATE, slots=1)))
    ahead = asyncio.create_task(chat(http, sim.url, body()))
    await _queue_reaches(http, sim.url, busy=1, waiting=0)
    sent = time.monotonic()
    reply = await chat(http, sim.url, body())
    took = time.monotonic() - sent
    assert (await ahead).json()["choices"][0]["message"]["content"] == REPLY
    assert reply.json()["choices"][0]["message"]["content"] == REPLY
    first, queued = await records(http, sim.url)
    assert queued["queued_behind"] == 1
    assert took >= queued["queued_seconds"] + ANSWER_SECONDS - 0.02
    assert _began(queued) - _began(first) >= ANSWER_SECONDS - 0.02


async def test_two_slots_answer_two_at_once_and_queue_the_third(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a", ttftSeconds=TTFT, tokensPerSecond=RATE, slots=2)))
    tasks = await _in_arrival_order(http, sim.url, [body(stream=True)] * 3, limit=2)
    firsts = await asyncio.gather(*tasks)
    found = await records(http, sim.url)
    assert [r["queued_behind"] for r in found] == [0, 0, 2]
    # Two at once; the third began only when one of them had run its whole answer.
    assert [r["queued_seconds"] < 0.05 for r in found] == [True, True, False]
    assert _began(found[2]) - min(_began(r) for r in found[:2]) >= ANSWER_SECONDS - 0.02
    assert firsts[2] >= found[2]["queued_seconds"] + TTFT - 0.02


async def test_a_machine_without_slots_never_queues(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a", ttftSeconds=TTFT, tokensPerSecond=RATE)))
    firsts = await asyncio.gather(*(_first_content_after(http, sim.url, body(stream=True))
                                    for _ in range(4)))  # fmt: skip
    assert min(firsts) >= TTFT - 0.02
    found = await records(http, sim.url)
    assert [r["queued_behind"] for r in found] == [0] * 4
    assert all(r["queued_seconds"] < 0.05 for r in found)
    assert (await _queue(http, sim.url))["slots"] is None


async def test_a_waiter_whose_client_leaves_leaves_the_queue(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    """B gives up while A holds the only slot; C, queued behind A alone, starts as soon as A
    ends: B is never answered and never delays anyone."""
    slow = 0.5  # A's answer: 6 tokens, the first at once, then five at 10 tok/s
    sim = await start_sim(scenario(machine("a", tokensPerSecond=10, slots=1)))
    a = asyncio.create_task(_first_content_after(http, sim.url, body(stream=True)))
    await _queue_reaches(http, sim.url, busy=1, waiting=0)
    b = asyncio.create_task(_first_content_after(http, sim.url, body(stream=True)))
    await _queue_reaches(http, sim.url, busy=1, waiting=1)
    b.cancel()  # the client closes its connection
    with pytest.raises(asyncio.CancelledError):
        await b
    await _queue_reaches(http, sim.url, busy=1, waiting=0)
    c = await _first_content_after(http, sim.url, body(stream=True))
    await a
    first, left, third = await records(http, sim.url)
    assert (left["outcome"], left["tokens_sent"]) == ("client_disconnected", 0)
    assert third["queued_behind"] == 1
    # C waited for A alone: it began once A's answer had run, well before A's and B's
    # would have (twice `slow`).
    assert slow - 0.02 <= _began(third) - _began(first) < 2 * slow - 0.1
    assert c >= third["queued_seconds"]
    assert first["outcome"] == "completed"


async def test_a_refusal_does_not_wait_for_a_slot(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    """Only answers take slots: a 429 comes at once, as a busy server's refusal does."""
    limited = {"kind": "rateLimit", "schedule": [2]}
    sim = await start_sim(scenario(machine("a", limited, tokensPerSecond=5, slots=1)))
    ahead = asyncio.create_task(chat(http, sim.url, body(stream=True)))
    await _queue_reaches(http, sim.url, busy=1, waiting=0)
    refused = await chat(http, sim.url, body(stream=True))
    assert refused.status == 429
    await ahead
    assert (await records(http, sim.url))[1]["queued_seconds"] == 0.0


async def test_records_fingerprint_the_request_body(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a")))
    await chat(http, sim.url, body())
    await chat(http, sim.url, body())
    await chat(http, sim.url, body(max_tokens=3))
    same, again, other = (r["body_sha256"] for r in await records(http, sim.url))
    assert same == again
    assert other != same
    assert len(same) == 16
    int(same, 16)


def test_slots_are_at_least_one() -> None:
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(scenario(machine("a", slots=0)), source="s.yaml")
    assert "models[0].machines[0].slots" in str(caught.value)
    assert "greater than or equal to 1" in str(caught.value)
