"""The /_sim control API: request records, reset, runtime faults; and disconnect accounting."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from rolegate_sim.server import SIM_STATE

from ..waiting import eventually
from .simclient import (
    MODEL,
    REPLY,
    StartSim,
    body,
    chat,
    finished_record,
    machine,
    records,
    scenario,
)

FAULTS_URL = "{url}/_sim/machines/" + MODEL + "/{machine}/faults"


async def _put_faults(
    http: aiohttp.ClientSession, url: str, machine_name: str, faults: Any
) -> tuple[int, Any]:
    data = faults if isinstance(faults, bytes) else json.dumps(faults).encode()
    async with http.put(FAULTS_URL.format(url=url, machine=machine_name), data=data) as response:
        return response.status, await response.json()


async def test_records_describe_each_request_in_arrival_order_without_any_text(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(
        scenario(machine("a"), machine("b", {"kind": "rateLimit", "always": True}))
    )
    secret_prompt = [{"role": "user", "content": "the secret prompt"}]
    await chat(http, sim.url, body(messages=secret_prompt, stream=True))
    await chat(http, sim.url, body(messages=secret_prompt, provider={"only": ["b"]}))
    first, second = await records(http, sim.url)
    assert first["seq"] == 1
    assert second["seq"] == 2
    assert first["model"] == MODEL
    assert (first["machine"], first["stream"], first["fault"]) == ("a", True, None)
    assert (first["outcome"], first["status"], first["tokens_sent"]) == ("completed", 200, 6)
    assert first["started_at"] <= first["ended_at"] <= time.time()
    assert abs(first["started_at"] - time.time()) < 60
    assert first["machine_request"] == 1
    assert (second["machine"], second["fault"], second["outcome"]) == (
        "b",
        "rateLimit",
        "error_status",
    )
    assert second["provider"]["only"] == ["b"]
    dumped = json.dumps([first, second])
    assert "secret" not in dumped
    assert "three" not in dumped  # nothing of the reply either


async def test_records_carry_the_monotonic_time_of_arrival(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    """In-process the simulator's monotonic clock is ours: each arrival lies between the
    moment its request was sent and the moment its answer came back, so the second request,
    sent after the first's answer, arrived at least that answer's TTFT later."""
    ttft = 0.1
    sim = await start_sim(scenario(machine("a", ttftSeconds=ttft)))
    sent = time.monotonic()
    await chat(http, sim.url, body())
    between = time.monotonic()
    await chat(http, sim.url, body(stream=True))
    answered = time.monotonic()
    first, second = await records(http, sim.url)
    assert sent <= first["arrived_monotonic"] <= between <= second["arrived_monotonic"]
    assert second["arrived_monotonic"] <= answered
    # asyncio may wake a timer up to a clock tick early.
    assert second["arrived_monotonic"] - first["arrived_monotonic"] >= ttft - 0.01


async def test_records_since_a_sequence_number(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a")))
    for _ in range(3):
        await chat(http, sim.url, body())
    async with http.get(f"{sim.url}/_sim/requests", params={"since": "2"}) as response:
        assert [r["seq"] for r in await response.json()] == [3]
    async with http.get(f"{sim.url}/_sim/requests", params={"since": "x"}) as response:
        assert response.status == 400


async def test_the_record_limit_keeps_the_newest(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a"), recordLimit=2))
    for _ in range(3):
        await chat(http, sim.url, body())
    assert [r["seq"] for r in await records(http, sim.url)] == [2, 3]


async def test_a_client_disconnect_mid_stream_is_recorded(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a", tokensPerSecond=20)))
    async with http.post(f"{sim.url}/v1/chat/completions", json=body(stream=True)) as response:
        seen = 0
        async for line in response.content:
            seen += b'"content":"' in line and b'"role"' not in line
            if seen == 2:
                break
        response.close()  # walk away mid-stream
    record = await finished_record(http, sim.url)
    assert record["outcome"] == "client_disconnected"
    assert 2 <= record["tokens_sent"] < 6
    assert record["ended_at"] is not None
    # The handler really stopped: nothing more is sent or counted. (A window in which a
    # handler that kept going would send three more tokens; a slow machine can only make
    # the window show less, never fail the test falsely.)
    await asyncio.sleep(0.15)
    assert (await records(http, sim.url))[-1]["tokens_sent"] == record["tokens_sent"]


async def test_a_client_that_gives_up_before_a_non_streamed_answer_is_recorded(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a", ttftSeconds=5)))
    try:
        await chat(http, sim.url, body(), timeout=aiohttp.ClientTimeout(total=0.1))
    except TimeoutError:
        pass
    else:
        raise AssertionError("the request should have timed out")
    record = await finished_record(http, sim.url)
    assert (record["outcome"], record["tokens_sent"]) == ("client_disconnected", 0)


async def test_a_client_that_leaves_while_sending_its_body_is_recorded(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a")))
    _, writer = await asyncio.open_connection("127.0.0.1", sim.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: sim\r\nContent-Length: 1000\r\n\r\n{"
    )
    await writer.drain()

    async def arrived() -> bool:
        return bool(await records(http, sim.url))

    await eventually(arrived, what="the request to reach the simulator")
    writer.close()
    await writer.wait_closed()
    record = await finished_record(http, sim.url)
    assert (record["outcome"], record["status"]) == ("client_disconnected", None)


async def test_stopping_with_a_stream_in_flight_is_quick_and_recorded(
    start_sim: StartSim,
) -> None:
    sim = await start_sim(scenario(machine("a", {"kind": "stall", "always": True})))
    state_records: list[Any] = []
    async with aiohttp.ClientSession() as http:
        response = await http.post(f"{sim.url}/v1/chat/completions", json=body(stream=True))
        await response.content.readline()  # the stream is open and stalled
        state_records = await records(http, sim.url)
        started = time.perf_counter()
        await sim.stop()
        assert time.perf_counter() - started < 1
        response.close()
    assert state_records[-1]["outcome"] == "in_progress"
    # The server is gone, but its app (and the state in it) is still there to inspect.
    (record,) = sim.app[SIM_STATE].records
    assert record.outcome == "server_stopped"


async def test_reset_clears_records_and_counters_but_keeps_runtime_faults(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a")))
    status, _ = await _put_faults(http, sim.url, "a", [{"kind": "rateLimit", "schedule": [1]}])
    assert status == 200
    assert (await chat(http, sim.url, body())).status == 429
    assert (await chat(http, sim.url, body())).status == 200
    async with http.post(f"{sim.url}/_sim/reset") as response:
        assert response.status == 200
    assert await records(http, sim.url) == []
    # The counter is back to 1, so the runtime schedule fires again.
    assert (await chat(http, sim.url, body())).status == 429
    (record,) = await records(http, sim.url)
    assert (record["seq"], record["machine_request"]) == (1, 1)


async def test_reset_can_restore_the_scenarios_faults(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a", {"kind": "serverError", "schedule": [1]})))
    await _put_faults(http, sim.url, "a", [{"kind": "rateLimit", "always": True}])
    assert (await chat(http, sim.url, body())).status == 429
    async with http.post(f"{sim.url}/_sim/reset", params={"faults": "restore"}) as response:
        assert response.status == 200
    assert [(await chat(http, sim.url, body())).status for _ in range(2)] == [503, 200]
    async with http.post(f"{sim.url}/_sim/reset", params={"faults": "nope"}) as response:
        assert response.status == 400


async def test_faults_can_be_replaced_at_runtime(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a"), machine("b")))
    status, applied = await _put_faults(
        http, sim.url, "a", [{"kind": "rateLimit", "always": True, "retryAfterSeconds": 2}]
    )
    assert status == 200
    assert applied == [{"kind": "rateLimit", "always": True, "retryAfterSeconds": 2}]
    reply = await chat(http, sim.url, body())
    assert (reply.status, reply.headers["Retry-After"]) == (429, "2")
    async with http.get(FAULTS_URL.format(url=sim.url, machine="a")) as response:
        assert [f["kind"] for f in await response.json()] == ["rateLimit"]
    # Down at runtime: the aggregator falls back to b.
    await _put_faults(http, sim.url, "a", [{"kind": "down", "always": True}])
    assert (await chat(http, sim.url, body())).json()["provider"] == "b"
    # An empty list clears them.
    assert (await _put_faults(http, sim.url, "a", []))[0] == 200
    reply = await chat(http, sim.url, body())
    assert (reply.json()["provider"], reply.json()["choices"][0]["message"]["content"]) == (
        "a",
        REPLY,
    )


async def test_bad_runtime_faults_are_400_with_the_field_and_leave_faults_unchanged(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a", {"kind": "serverError", "always": True})))
    status, problem = await _put_faults(
        http, sim.url, "a", [{"kind": "stall", "always": True}, {"kind": "cut", "probability": 2}]
    )
    assert status == 400
    message = problem["error"]["message"]
    assert "faults[1].probability" in message
    assert "less than or equal to 1" in message
    for bad in (b"{not json", b'{"kind": "cut"}'):
        status, problem = await _put_faults(http, sim.url, "a", bad)
        assert status == 400
        assert "JSON list of faults" in problem["error"]["message"]
    assert (await chat(http, sim.url, body())).status == 503


async def test_unknown_machines_and_models_are_404(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a")))
    status, problem = await _put_faults(http, sim.url, "zzz", [])
    assert status == 404
    assert "no machine 'zzz'" in problem["error"]["message"]
    async with http.put(f"{sim.url}/_sim/machines/other/model/a/faults", data=b"[]") as response:
        assert response.status == 404
        assert "unknown model 'other/model'" in (await response.json())["error"]["message"]
