"""A client that reads slowly is not the machine's fault (SPEC E8, issue 30).

A client that stops reading stops the upstream too, by back-pressure: the proxy's writes
wait, it reads no more from the upstream, and the upstream's writes wait in turn. Measured
before the fix: such streams came out `late`, and three slow readers lowered a machine's
believed rate from 4,790 to 3,506 tokens/s. Here the client reads nothing for 4 s of a
6 MB stream (a receive buffer of 4 KiB, so the wait reaches the proxy at once); the
arms must end answered on time, and the machine's believed rate must not move.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import openai

from rolegate_proxy.core.outcomes import ArmResult
from rolegate_proxy.edge.server import RunningProxy

from ..support import ProxyFactory, SimFactory, outcomes, role, role_table, state_belief

MODEL = "vendor/fast"
# 6,000 tokens of 1,000 letters: 6 MB of stream, more than the sockets' buffers hold,
# at the rate the finding was measured at (a normal reader keeps up with it).
TOKENS = 6_000
WORD = "w" * 1000
RATE = 5_000.0
# Longer than the role's patience: an arm charged with it would be late.
HOLD_SECONDS = 4.0
PATIENCE = 3.0


def _policy(sim_url: str) -> dict[str, Any]:
    machine = {"name": "m1", "ttftSeconds": 0.01, "tokensPerSecond": RATE}
    return {
        "apiVersion": "rolegate.dev/v1alpha1",
        "kind": "ProviderPolicy",
        "metadata": {"name": "sim", "namespace": "test"},
        "spec": {
            "endpoint": f"{sim_url}/v1",
            "dialect": "Aggregator",
            "models": [{"name": MODEL, "machines": [machine]}],
        },
    }


async def _read_normally(proxy: RunningProxy) -> int:
    """One stream read as fast as it comes (the openai client): its content pieces."""
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0) as c:
        stream = await c.chat.completions.create(
            model="agent", messages=[{"role": "user", "content": "go"}], stream=True
        )
        pieces = 0
        async for chunk in stream:
            pieces += bool(chunk.choices and chunk.choices[0].delta.content)
        return pieces


async def _read_after_holding(proxy: RunningProxy) -> bytes:
    """One stream whose client reads nothing for HOLD_SECONDS after the status line, then
    all of it: its whole body."""
    loop = asyncio.get_running_loop()
    host, port = proxy.url.removeprefix("http://").split(":")
    body = b'{"model": "agent", "stream": true, "messages": [{"role": "user", "content": "go"}]}'
    head = (
        f"POST /v1/chat/completions HTTP/1.0\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # A small receive window: the proxy's writes wait as soon as its buffers are full.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await loop.sock_connect(sock, (host, int(port)))
        await loop.sock_sendall(sock, head + body)
        received = bytearray(await loop.sock_recv(sock, 1024))  # the status line, at least
        assert b" 200 " in received[:20], bytes(received[:100])
        await asyncio.sleep(HOLD_SECONDS)  # the fault itself: a client that reads nothing
        while data := await loop.sock_recv(sock, 1 << 20):
            received += data
    return bytes(received)


def _content(body: bytes) -> str:
    """The text a stream's body carries (an HTTP/1.0 request: no chunked framing in it)."""
    text = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text)


async def test_a_client_that_reads_nothing_for_a_while_is_not_charged_to_the_machine(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    reply = " ".join([WORD] * TOKENS)
    machine = {"name": "m1", "ttftSeconds": 0.01, "tokensPerSecond": RATE}
    sim = await sim_server({"seed": 1, "models": [{"name": MODEL, "reply": reply,
                                                   "machines": [machine]}]})  # fmt: skip
    proxy = await proxy_server(
        [_policy(sim.url), role_table(role("agent", [MODEL], patience=PATIENCE))]
    )
    published = await state_belief(proxy.url, "m1")
    # Read at the client's full pace, streams teach their gaps: the belief moves.
    for _ in range(3):
        assert await _read_normally(proxy) == TOKENS
    taught = await state_belief(proxy.url, "m1")
    assert taught["expected_tokens_per_second"] != published["expected_tokens_per_second"]

    for _ in range(3):
        body = await _read_after_holding(proxy)
        assert body.rstrip().endswith(b"data: [DONE]"), body[-200:]
        assert _content(body).split() == [WORD] * TOKENS

    after = await state_belief(proxy.url, "m1")
    # Unchanged but for forgetting, which moves it by thousandths of a percent meanwhile
    # (charged with the holds, it fell by a quarter).
    rate, was = after["expected_tokens_per_second"], taught["expected_tokens_per_second"]
    assert abs(rate - was) / was < 0.01, (was, rate)
    slow = (await outcomes(proxy, 6))[-3:]
    for outcome in slow:
        (arm,) = outcome.arms
        # On time, though the client took longer than its patience to read it.
        assert arm.result is ArmResult.OK, arm
        assert outcome.latency_seconds > PATIENCE
