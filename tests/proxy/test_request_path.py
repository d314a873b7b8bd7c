"""The request path's findings (issue 12), each through the real proxy, the real simulator
and real clients: what the client, our connection pool or an upstream's timing does is never
blamed on the upstream; a complete answer is answered; probes come back; non-streamed
answers teach; decisions say everything; SSE events arrive whole.

Everything is read back over the proxy's public HTTP surfaces (`/v1/rolegate/decisions`,
`/v1/rolegate/state`, `/metrics`) and the simulator's request records.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import httpx
import openai
import pytest

from rolegate_proxy.core.beliefs import MachineKey

from ..support import (
    ProxyFactory,
    SimFactory,
    machine_policy,
    role,
    role_table,
    sim_records,
    state_belief,
    wait_for_sim_record,
)
from ..waiting import eventually

MODEL = "vendor/model-a"
OTHER = "vendor/model-b"
PROMPT: Any = [{"role": "user", "content": "write the next step"}]
INSTANT = {"ttftSeconds": 0, "tokensPerSecond": 0}


async def _decisions(url: str, count: int, within: float = 15.0) -> list[dict[str, Any]]:
    """The decision log once it holds at least `count` requests (oldest first)."""
    async with httpx.AsyncClient() as client:

        async def enough() -> list[dict[str, Any]] | None:
            found: list[dict[str, Any]] = (await client.get(f"{url}/v1/rolegate/decisions")).json()[
                "decisions"
            ]
            return found if len(found) >= count else None

        return await eventually(enough, what=f"{count} decisions in the log", within=within)


async def _breakers(url: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient() as client:
        state = (await client.get(f"{url}/v1/rolegate/state")).json()
    breakers: list[dict[str, Any]] = state["breakers"]
    return breakers


def _tripped(breakers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [b for b in breakers if b["state"] != "Closed"]


async def _set_faults(sim_url: str, model: str, machine: str, faults: list[Any]) -> None:
    async with httpx.AsyncClient() as client:
        response = await client.put(
            f"{sim_url}/_sim/machines/{model}/{machine}/faults", json=faults
        )
        response.raise_for_status()


async def _post(session: aiohttp.ClientSession, url: str, **body: Any) -> int:
    payload = {"model": "agent", "messages": PROMPT, **body}
    async with session.post(f"{url}/v1/chat/completions", json=payload) as response:
        await response.read()
        return response.status


# --- 1: a client that leaves is the client's doing ---------------------------------------


# A reply many times one read of the proxy's (asyncio reads 256 KiB at a time), sent at
# once: about 3 MB, still less than loopback's socket buffers hold, so the proxy never
# waits on a client that reads no more.
_FLOOD_REPLY = " ".join(f"t{i}" + "x" * 1000 for i in range(3000))


class _Leaver(asyncio.Protocol):
    """A streaming client that leaves once the first content reached it: it shuts its side
    of the connection (FIN) and reads no more.

    aiohttp takes the FIN for the client gone and closes the transport, but the loss that
    cancels the handler is reported only on the loop's next turn. While the upstream still
    floods in, the relay is woken in the turn that sees the FIN (the upstream socket is
    ready before it) and writes to the closing transport first: the write raises
    `ClientConnectionResetError` ("Cannot write to closing transport"), an
    `aiohttp.ClientError` like the upstream's own. (A client that closes outright sends RST,
    which the proxy's next write meets inside the socket and reports on the next turn
    instead, so the cancel wins: the FIN held open is the window a real network's round
    trip opens before the RST comes back.)"""

    def __init__(self, request: bytes) -> None:
        self._request = request
        self._received = b""
        self._transport: asyncio.Transport | None = None
        self.left: asyncio.Future[asyncio.Transport] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        if self.left.done() or self._transport is None:
            return
        self._received += data
        if not self._received.startswith(b"HTTP/1.1 200 "):
            if b"\r\n" in self._received:
                self.left.set_exception(AssertionError(self._received[:300]))
            return
        if b'"content":"t' in self._received:
            # Gone, in this very callback: the answer is half read, the FIN is on its way.
            self._transport.pause_reading()
            self._transport.write_eof()
            self.left.set_result(self._transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.left.done():
            self.left.set_exception(
                AssertionError(f"the proxy closed before any content: {self._received[:300]!r}")
            )


async def _leave_after_first_content(host: str, port: int) -> asyncio.Transport:
    body = json.dumps({"model": "agent", "messages": PROMPT, "stream": True}).encode()
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    loop = asyncio.get_running_loop()
    transport, leaver = await loop.create_connection(lambda: _Leaver(request), host, port)
    try:
        return await leaver.left
    except BaseException:
        transport.close()
        raise


async def test_clients_leaving_mid_stream_never_trip_a_healthy_upstream(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "reply": _FLOOD_REPLY, "machines": [
            {"name": "m1", **INSTANT}]}]}
    )  # fmt: skip
    proxy = await proxy_server(
        [
            machine_policy(sim.url, MODEL, [{"name": "m1"}]),
            role_table(role("agent", [MODEL], patience=60)),
        ]
    )
    leavers = 3
    gone: list[asyncio.Transport] = []
    try:
        for count in range(1, leavers + 1):
            gone.append(await _leave_after_first_content(proxy.host, proxy.port))
            # Each request is over before the next leaves (its connection still half open).
            await _decisions(proxy.url, count)
    finally:
        for transport in gone:
            transport.close()
    decisions = await _decisions(proxy.url, leavers)
    assert [(d["outcome"], d["status"]) for d in decisions] == [("cancelled", 499)] * leavers
    assert [[a["result"] for a in d["arms"]] for d in decisions] == [["cancelled"]] * leavers
    assert _tripped(await _breakers(proxy.url)) == []
    # The upstream is as healthy as it was: every later request is answered.
    async with aiohttp.ClientSession() as session:
        statuses = await asyncio.gather(
            *(_post(session, proxy.url, max_tokens=3) for _ in range(20))
        )
    assert statuses == [200] * 20


async def test_a_stream_the_proxy_stops_for_is_the_shutdowns_not_the_upstreams(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """A stream still open when the grace period ends is cancelled by the shutdown: the
    arm's end says so (not \"the client went away\"), it teaches the ledger what it
    showed, and no breaker is charged."""
    reply = " ".join(f"w{i}" for i in range(400))
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "reply": reply, "machines": [
            {"name": "m1", "ttftSeconds": 0, "tokensPerSecond": 20}]}]}
    )  # fmt: skip
    proxy = await proxy_server(
        [
            machine_policy(sim.url, MODEL, [{"name": "m1", "ttftSeconds": 0.1,
                                             "tokensPerSecond": 20}]),
            role_table(role("agent", [MODEL], patience=60)),
        ],
        shutdown_grace_seconds=0.2,
    )  # fmt: skip
    payload = {"model": "agent", "messages": PROMPT, "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{proxy.url}/v1/chat/completions", json=payload) as response,
    ):
        assert response.status == 200
        received = b""
        while b'"content":"w' not in received:
            received += await response.content.readany()
        await proxy.stop()
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.content.read()  # the rest never comes: the stream is cut
    (outcome,) = proxy.state.decisions.recent()
    assert (outcome.outcome.value, outcome.status) == ("cancelled", 499)
    ((result, detail),) = [(arm.result.value, arm.detail) for arm in outcome.arms]
    assert result == "cancelled"
    assert detail == "the proxy shut down mid-stream"
    dispatcher = proxy.state.dispatcher
    belief = dispatcher.ledger.belief_of(MachineKey("agg", MODEL, "m1"), dispatcher.now())
    assert belief is not None
    assert belief.sightings == 1
    assert [b.key for b in dispatcher.breakers.snapshot(dispatcher.now())
            if b.state.value != "Closed"] == []  # fmt: skip


# --- affinity (SPEC B3) -------------------------------------------------------------------


async def test_the_machine_that_answered_leads_the_roles_next_request(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """m1 leads on the sheet; the aggregator finds it down once and serves from m2. From
    then on m2 leads the role's order (the pin) although m1 is faster on paper and up: not
    so much faster that the pin would be a reason to stay slow (B3; test_fast_machine.py)."""
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "machines": [
            {"name": "m1", **INSTANT, "faults": [{"kind": "down", "schedule": [1]}]},
            {"name": "m2", **INSTANT}]}]}
    )  # fmt: skip
    sheets = [
        {"name": "m1", "ttftSeconds": 0.05, "tokensPerSecond": 200},
        {"name": "m2", "ttftSeconds": 0.06, "tokensPerSecond": 180},
    ]
    # A wide tolerance: one clean answer of m2 never puts m1 a quality tier behind it, so
    # only the pin can put m2 first.
    agent = {**role("agent", [MODEL]), "qualityTolerance": 1.0}
    proxy = await proxy_server([machine_policy(sim.url, MODEL, sheets), role_table(agent)])
    async with aiohttp.ClientSession() as session:
        for _ in range(4):
            assert await _post(session, proxy.url, model="agent", messages=PROMPT) == 200
    decisions = await _decisions(proxy.url, 4)
    assert [d["machine"] for d in decisions] == ["m2"] * 4
    asked_first = [r["provider"]["order"][0] for r in await sim_records(sim.url)]
    assert asked_first == ["m1", "m2", "m2", "m2"]


# --- 2: the complete answer is the end of the request ------------------------------------


async def test_a_complete_stream_is_answered_though_the_upstream_lingers_after_done(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    linger = 5.0
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "reply": "one two three", "machines": [
            {"name": "m1", **INSTANT,
             "faults": [{"kind": "lingerAfterDone", "always": True, "seconds": linger}]}]}]}
    )  # fmt: skip
    proxy = await proxy_server(
        [
            machine_policy(sim.url, MODEL, [{"name": "m1"}]),
            role_table(role("agent", [MODEL], patience=60)),
        ]
    )
    requests = 5
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0) as ai:
        for _ in range(requests):
            stream = await ai.chat.completions.create(
                model="agent", messages=PROMPT, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            assert text == "one two three"
    decisions = await _decisions(proxy.url, requests)
    for decision in decisions:
        assert (decision["outcome"], decision["status"]) == ("answered", 200)
        assert [a["result"] for a in decision["arms"]] == ["ok"]
        assert decision["tokens_out"] == 3
        assert decision["verdict"] == "ok"
        # Answered when the client had it all, not when the upstream closed.
        assert decision["latency_seconds"] < linger
    # Every answer taught the ledger and reached the breaker as a success.
    assert (await state_belief(proxy.url, "m1"))["sightings"] >= requests
    async with httpx.AsyncClient() as client:
        metrics = (await client.get(f"{proxy.url}/metrics")).text
    assert 'status="499"' not in metrics
    # Nothing more was read after [DONE]: the proxy let go of the lingering upstream.
    records = await sim_records(sim.url)
    assert [r["outcome"] for r in records] == ["client_disconnected"] * requests


# --- 3: probes come back, one at a time --------------------------------------------------


BREAKER_FAST = {"cooldownSeconds": 1, "maxCooldownSeconds": 1, "jitterFraction": 0}


async def _wait_phase(url: str, phase: str, *, machine: str | None = None) -> None:
    async def reached() -> bool:
        return any(b["state"] == phase and b["machine"] == machine for b in await _breakers(url))

    await eventually(reached, what=f"a breaker {phase}", within=15.0)


async def test_a_probe_whose_client_left_is_given_back_at_once(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """A (provider, model) trip: its probe's client leaves while the upstream hangs; the
    next request probes at once (it is not refused for the lease's 120 s)."""
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "reply": "fine", "machines": [
            {"name": "m1", **INSTANT, "faults": [{"kind": "empty", "schedule": [1, 2]}]}]}]}
    )  # fmt: skip
    policy = machine_policy(sim.url, MODEL, [{"name": "m1"}])
    policy["spec"]["breaker"] = BREAKER_FAST
    proxy = await proxy_server([policy, role_table(role("agent", [MODEL], patience=60))])
    async with aiohttp.ClientSession() as session:
        assert [await _post(session, proxy.url) for _ in range(2)] == [502, 502]
        assert [b["reason"] for b in _tripped(await _breakers(proxy.url))] == ["EmptyResponses"]
        await _wait_phase(proxy.url, "HalfOpen")
        await _set_faults(sim.url, MODEL, "m1", [{"kind": "noResponse", "always": True}])
        probe = asyncio.create_task(_post(session, proxy.url))
        await wait_for_sim_record(sim.url, lambda r: r["fault"] == "noResponse")
        probe.cancel()  # the probe's client is gone while the upstream works
        await asyncio.gather(probe, return_exceptions=True)
        await _set_faults(sim.url, MODEL, "m1", [])
        assert await _post(session, proxy.url) == 200
    assert _tripped(await _breakers(proxy.url)) == []
    assert [r["machine"] for r in await sim_records(sim.url)] == ["m1"] * 4


async def test_a_half_open_machine_admits_exactly_one_probe(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """A machine-level trip on an aggregator: after the cooldown, ten concurrent requests
    reach the recovering machine once; the others are refused without being sent."""
    failing = {"kind": "serverError", "schedule": [1, 2], "status": 503}
    slow_probe = {"kind": "lateFirstToken", "always": True, "seconds": 1.0}
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "reply": "fine", "machines": [
            {"name": "m1", **INSTANT, "faults": [failing]}]}]}
    )  # fmt: skip
    policy = machine_policy(sim.url, MODEL, [{"name": "m1"}])
    policy["spec"]["breaker"] = BREAKER_FAST
    proxy = await proxy_server([policy, role_table(role("agent", [MODEL], patience=60))])
    async with aiohttp.ClientSession() as session:
        assert await _post(session, proxy.url) != 200
        assert await _post(session, proxy.url) != 200
        (tripped,) = _tripped(await _breakers(proxy.url))
        assert (tripped["scope"], tripped["machine"]) == ("Machine", "m1")
        await _set_faults(sim.url, MODEL, "m1", [slow_probe])
        await _wait_phase(proxy.url, "HalfOpen", machine="m1")
        before = len(await sim_records(sim.url))
        statuses = await asyncio.gather(*(_post(session, proxy.url) for _ in range(10)))
    after = (await sim_records(sim.url))[before:]
    assert [r["machine"] for r in after] == ["m1"]
    assert sorted(statuses) == [200] + [503] * 9
    assert _tripped(await _breakers(proxy.url)) == []


# --- 4: our connection pool is nobody's fault --------------------------------------------


async def test_pooled_connections_the_upstream_closed_are_retried_and_trip_nothing(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    idle_close = 0.2
    sim = await sim_server(
        {"seed": 1, "idleCloseSeconds": idle_close, "models": [
            {"name": MODEL, "reply": "fine", "machines": [{"name": "m1", **INSTANT}]}]}
    )  # fmt: skip
    proxy = await proxy_server(
        [
            machine_policy(sim.url, MODEL, [{"name": "m1"}]),
            role_table(role("agent", [MODEL], patience=60)),
        ]
    )
    rounds = 8
    statuses = []
    async with aiohttp.ClientSession() as session:
        for _ in range(rounds):
            statuses.append(await _post(session, proxy.url, stream=True))
            # Idle past the upstream's keep-alive: the idleness is the stimulus itself.
            await asyncio.sleep(idle_close * 1.5)
    assert statuses == [200] * rounds
    # A round that found a pooled connection met one the upstream had closed (a round after
    # a fresh retry opens a new one: every other round)...
    lost = [r["outcome"] for r in await sim_records(sim.url)].count("idle_closed")
    assert lost >= rounds // 2 - 1
    decisions = await _decisions(proxy.url, rounds)
    arms = [[a["result"] for a in d["arms"]] for d in decisions]
    # ...and was sent again at once on a fresh one, charged to nobody.
    assert arms.count(["stale_connection", "ok"]) == lost
    assert arms.count(["ok"]) == rounds - lost
    assert _tripped(await _breakers(proxy.url)) == []


# --- 5: non-streamed answers teach --------------------------------------------------------


async def test_non_streamed_answers_correct_a_wrong_published_figure(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """The machine writes 3x slower than it publishes; a role that never streams still
    learns it."""
    reply = " ".join(f"w{i}" for i in range(20))
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "reply": reply, "machines": [
            {"name": "m1", "ttftSeconds": 0.15, "tokensPerSecond": 100}]}]}
    )  # fmt: skip
    published = {"name": "m1", "ttftSeconds": 0.05, "tokensPerSecond": 300}
    proxy = await proxy_server(
        [machine_policy(sim.url, MODEL, [published]), role_table(role("agent", [MODEL]))]
    )
    sheet = await state_belief(proxy.url, "m1")
    assert sheet["expected_tokens_per_second"] == pytest.approx(300)
    async with aiohttp.ClientSession() as session:
        for _ in range(12):
            assert await _post(session, proxy.url) == 200
    learned = await state_belief(proxy.url, "m1")
    assert learned["sightings"] >= 12
    # Whole answers take ~0.34 s against the published shape's 0.12 s for 20 tokens: their
    # pace is learned, and the time routing expects rises with it (SPEC B7)...
    assert learned["expected_answer_pace"] > 2.0
    # ...while no per-token gap or first token is made up from them.
    assert learned["expected_tokens_per_second"] == pytest.approx(300)
    assert learned["expected_ttft_seconds"] == pytest.approx(sheet["expected_ttft_seconds"])
    dispatcher = proxy.state.dispatcher
    belief = dispatcher.ledger.belief_of(MachineKey("agg", MODEL, "m1"), dispatcher.now())
    assert belief is not None
    shape = 0.05 + 20 / 300  # the published figures' time for 20 tokens
    assert belief.expected_seconds(20) > 2 * shape  # type: ignore[operator]


async def test_a_machine_known_only_from_non_streamed_answers_gets_a_belief(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """The aggregator serves from a machine the policy never listed."""
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "reply": "fine", "machines": [
            {"name": "unlisted", "ttftSeconds": 0.05, "tokensPerSecond": 0}]}]}
    )  # fmt: skip
    proxy = await proxy_server(
        [
            machine_policy(sim.url, MODEL, [{"name": "m1"}]),
            role_table(role("agent", [MODEL], ruling="Order")),
        ]
    )
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            assert await _post(session, proxy.url) == 200
    belief = await state_belief(proxy.url, "unlisted")
    assert belief["sightings"] >= 3
    assert belief["expected_ttft_seconds"] is not None


# --- 8: decisions say everything -----------------------------------------------------------


async def test_a_candidate_refused_by_a_breaker_is_on_the_decision_though_another_served(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    sim = await sim_server(
        {"seed": 1, "models": [
            {"name": MODEL, "reply": "fine", "machines": [{"name": "m1", **INSTANT}]},
            {"name": OTHER, "reply": "fine", "machines": [
                {"name": "m1", **INSTANT, "faults": [{"kind": "empty", "always": True}]}]}]}
    )  # fmt: skip
    policy = machine_policy(sim.url, MODEL, [{"name": "m1"}])
    policy["spec"]["models"].append({"name": OTHER, "machines": [{"name": "m1"}]})
    proxy = await proxy_server(
        [policy, role_table(role("broken", [OTHER]), role("agent", [MODEL, OTHER]))]
    )
    async with aiohttp.ClientSession() as session:
        payload = {"model": "broken", "messages": PROMPT}
        for _ in range(2):
            async with session.post(f"{proxy.url}/v1/chat/completions", json=payload) as response:
                assert response.status == 502
        (tripped,) = _tripped(await _breakers(proxy.url))
        assert tripped["model"] == OTHER
        assert await _post(session, proxy.url) == 200
    served = (await _decisions(proxy.url, 3))[-1]
    assert served["model"] == MODEL
    skipped = [(s["model"], s["reason"]) for s in served["skipped"]]
    assert [model for model, _ in skipped] == [OTHER]
    assert "EmptyResponses" in skipped[0][1] or "empty" in skipped[0][1]


async def test_a_rate_act_that_cannot_move_is_recorded_as_kept(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """The stream is far slower than a machine that cannot continue a partial message: it
    is kept (never cut for slowness), and the act says so."""
    reply = " ".join(f"t{i}" for i in range(60))
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "reply": reply, "machines": [
            {"name": "fast", "ttftSeconds": 0.05, "tokensPerSecond": 90,
             "faults": [{"kind": "down", "schedule": [1]}]},
            {"name": "slow", "ttftSeconds": 0.05, "tokensPerSecond": 6}]}]}
    )  # fmt: skip
    proxy = await proxy_server(
        [
            machine_policy(sim.url, MODEL, [
                {"name": "fast", "ttftSeconds": 0.1, "tokensPerSecond": 90},
                {"name": "slow", "ttftSeconds": 0.1, "tokensPerSecond": 60}]),
            role_table(role("agent", [MODEL], patience=600)),
        ]
    )  # fmt: skip
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0) as ai:
        stream = await ai.chat.completions.create(model="agent", messages=PROMPT, stream=True)
        assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == (
            reply
        )
    (decision,) = await _decisions(proxy.url, 1)
    assert [(a["machine"], a["result"], a["act"]) for a in decision["arms"]] == [
        ("slow", "ok", "kept")
    ]
    async with httpx.AsyncClient() as client:
        metrics = (await client.get(f"{proxy.url}/metrics")).text
    assert [
        line for line in metrics.splitlines()
        if line.startswith("rolegate_acts_total") and 'done="kept"' in line
    ]  # fmt: skip


# --- 9: SSE events arrive whole ------------------------------------------------------------


async def test_multi_line_data_events_reach_the_client_whole(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    reply = "Sure — café, 日本語 🎉 done."
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "reply": reply, "machines": [
            {"name": "m1", **INSTANT, "faults": [{"kind": "multiLineEvents", "always": True}]}]}]}
    )  # fmt: skip
    proxy = await proxy_server(
        [
            machine_policy(sim.url, MODEL, [{"name": "m1"}]),
            role_table(role("agent", [MODEL])),
        ]
    )
    # The prompt holds the answer's characters: judged on the whole text, it is plainly ok.
    prompt: Any = [{"role": "user", "content": f"say {reply}"}]
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0) as ai:
        stream = await ai.chat.completions.create(
            model="agent", messages=prompt, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply
    assert chunks[-1].usage is not None
    (decision,) = await _decisions(proxy.url, 1)
    assert (decision["outcome"], decision["verdict"]) == ("answered", "ok")
