"""The client connections' limits (edge/connections.py), over real sockets: a request head
or body that trickles in is cut off at its limit, an idle kept-alive connection is closed,
a connection over the bound is answered 503 and closed, and none of it touches a stream
that runs longer than every limit.

The limits are set small (half a second) so that each test runs in a few seconds; the
margins are generous, for a loaded two-core machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httpx

from rolegate_proxy.edge.connections import GuardedServer
from rolegate_proxy.edge.server import RunningProxy

from ..support import ProxyFactory, SimFactory, one_machine_sim, provider_policy, role, role_table
from ..waiting import eventually

MODEL = "vendor/model-a"
CHAT = "/v1/chat/completions"
LIMIT = 0.5
# How late past its limit a close may come on a loaded machine.
MARGIN = 3.0
GOOD = {"model": "agent", "messages": [{"role": "user", "content": "hi"}]}
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n"


async def _proxy(
    sim_server: SimFactory, proxy_server: ProxyFactory, *, tokens_per_second: float = 500,
    reply: str = "one two three", **settings: Any,
) -> RunningProxy:  # fmt: skip
    sim = await one_machine_sim(sim_server, MODEL, reply=reply, tokens_per_second=tokens_per_second)
    return await proxy_server(
        [
            provider_policy("agg", f"{sim.url}/v1", {MODEL: ["m1"]}),
            role_table(role("agent", [MODEL])),
        ],
        **settings,
    )


@contextlib.asynccontextmanager
async def _connection(
    proxy: RunningProxy,
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    address = urlsplit(proxy.url)
    assert address.hostname is not None
    assert address.port is not None
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def _trickle(writer: asyncio.StreamWriter, chunks: list[bytes], every: float) -> None:
    """Send `chunks` one at a time, `every` seconds apart (the slow client under test), until
    they run out or the proxy has closed the connection."""
    for chunk in chunks:
        if writer.is_closing():
            return
        try:
            writer.write(chunk)
            await writer.drain()
        except ConnectionError:
            return
        await asyncio.sleep(every)


async def _until_closed(reader: asyncio.StreamReader, within: float) -> bytes:
    """Everything the proxy sends until it closes the connection; fails if it never does."""
    received = b""
    try:
        async with asyncio.timeout(within):
            while chunk := await reader.read(65536):
                received += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"the proxy kept the connection open past {within} s") from None
    return received


def _error(received: bytes, status: int) -> dict[str, Any]:
    """The answer's OpenAI-shaped error, once it is `status` and closes its connection."""
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    assert int(status_line.split()[1]) == status, received
    headers = {n.strip().lower(): v.strip() for n, _, v in (ln.partition(":") for ln in lines)}
    assert headers["content-type"].startswith("application/json"), headers
    assert headers["connection"].lower() == "close", headers
    document = json.loads(body)
    assert set(document) == {"error"}, document
    error: dict[str, Any] = document["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


async def _served(proxy: RunningProxy) -> bool:
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{proxy.url}{CHAT}", json=GOOD)
    return response.status_code == 200 and bool(response.json()["choices"][0]["message"]["content"])


# --- the head -------------------------------------------------------------------------------


async def test_slow_loris_connections_are_closed_at_the_header_limit_while_others_are_served(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    proxy = await _proxy(
        sim_server, proxy_server, header_timeout_seconds=LIMIT, idle_timeout_seconds=60
    )
    # Header lines a tenth of a second apart, for far longer than the limit.
    lines = [HEAD, *(f"X-Slow-{i}: {i}\r\n".encode() for i in range(200))]

    async def slow_client() -> tuple[float, bytes]:
        async with _connection(proxy) as (reader, writer):
            opened = time.monotonic()
            trickling = asyncio.create_task(_trickle(writer, lines, every=0.1))
            try:
                received = await _until_closed(reader, LIMIT + MARGIN)
            finally:
                trickling.cancel()
            return time.monotonic() - opened, received

    slow = [asyncio.create_task(slow_client()) for _ in range(50)]
    # Meanwhile an ordinary request, on a connection of its own, is served.
    assert await _served(proxy)
    for took, received in await asyncio.gather(*slow):
        assert took <= LIMIT + MARGIN
        error = _error(received, 408)
        assert error["code"] == "header_timeout", error
        assert "--header-timeout-seconds" in error["message"], error
    assert await _served(proxy)


async def test_a_connection_that_sends_nothing_is_closed_at_the_header_limit_without_an_answer(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    proxy = await _proxy(
        sim_server, proxy_server, header_timeout_seconds=LIMIT, idle_timeout_seconds=60
    )
    async with _connection(proxy) as (reader, _):
        # Nothing was asked: nothing is answered (a 408 could pass for the next answer).
        assert await _until_closed(reader, LIMIT + MARGIN) == b""


async def _answered_healthz(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: proxy\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )  # fmt: skip
    await reader.readexactly(length)


async def test_each_head_on_a_kept_alive_connection_has_the_limit_from_its_first_byte(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    proxy = await _proxy(
        sim_server, proxy_server, header_timeout_seconds=LIMIT, idle_timeout_seconds=60
    )
    lines = [HEAD, *(f"X-Slow-{i}: {i}\r\n".encode() for i in range(200))]
    # The next head begins while the limit of the connection's first one is still running
    # (so its check comes before this head's limit), or after it ran out on an idle
    # connection (so nothing checks until this head begins).
    for opening_pause, idle in ((LIMIT * 0.6, 0.0), (0.0, LIMIT * 2)):
        async with _connection(proxy) as (reader, writer):
            await asyncio.sleep(opening_pause)
            await _answered_healthz(reader, writer)
            await asyncio.sleep(idle)
            began = time.monotonic()
            trickling = asyncio.create_task(_trickle(writer, lines, every=0.1))
            try:
                received = await _until_closed(reader, LIMIT + MARGIN)
            finally:
                trickling.cancel()
            took = time.monotonic() - began
        # Closed at this head's limit: not at the first one's, nor never.
        assert LIMIT * 0.8 <= took <= LIMIT + MARGIN, (opening_pause, idle, took)
        assert _error(received, 408)["code"] == "header_timeout"


# --- the body -------------------------------------------------------------------------------


async def test_a_body_that_trickles_in_is_answered_408_and_its_connection_closed(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    proxy = await _proxy(
        sim_server, proxy_server, body_timeout_seconds=LIMIT, header_timeout_seconds=60
    )
    body = json.dumps(GOOD).encode()
    head = HEAD + f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    async with _connection(proxy) as (reader, writer):
        writer.write(head)
        # One byte a tenth of a second: the whole body would take seconds.
        trickling = asyncio.create_task(
            _trickle(writer, [body[i : i + 1] for i in range(len(body))], every=0.1)
        )
        try:
            received = await _until_closed(reader, LIMIT + MARGIN)
        finally:
            trickling.cancel()
    error = _error(received, 408)
    assert error["code"] == "body_timeout", error
    assert "--body-timeout-seconds" in error["message"], error
    assert await _served(proxy)


# --- idle keep-alive ------------------------------------------------------------------------


async def test_an_idle_kept_alive_connection_is_closed_at_the_idle_limit(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    proxy = await _proxy(
        sim_server, proxy_server, idle_timeout_seconds=LIMIT, header_timeout_seconds=60
    )
    async with _connection(proxy) as (reader, writer):
        await _answered_healthz(reader, writer)
        answered = time.monotonic()
        # Kept alive, then idle: closed once the idle limit is past, not before.
        assert await _until_closed(reader, LIMIT + MARGIN) == b""
        assert time.monotonic() - answered >= LIMIT * 0.8


# --- the bound ------------------------------------------------------------------------------


async def test_a_connection_over_the_bound_is_answered_503_and_closed_until_one_is_freed(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    proxy = await _proxy(
        sim_server, proxy_server, max_connections=3, header_timeout_seconds=60,
        idle_timeout_seconds=60,
    )  # fmt: skip
    server = proxy.api.runner.server
    assert isinstance(server, GuardedServer)
    async with contextlib.AsyncExitStack() as held:
        for _ in range(3):
            await held.enter_async_context(_connection(proxy))

        async def all_held() -> bool:
            return server.open == 3

        await eventually(all_held, what="the proxy holds the three connections")
        async with _connection(proxy) as (reader, writer):
            body = json.dumps(GOOD).encode()
            writer.write(HEAD + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            received = await _until_closed(reader, MARGIN)
        error = _error(received, 503)
        assert error["code"] == "too_many_connections", error
        assert error["type"] == "service_unavailable", error
        assert "--max-connections" in error["message"], error
        assert "retry later" in error["message"], error
    # The three are closed: their places free up, and requests are served again.
    await eventually(lambda: _served(proxy), what="a request served once connections are freed")
    assert server.open <= 3


# --- a stream -------------------------------------------------------------------------------


async def test_a_stream_longer_than_every_limit_completes(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    # 30 tokens at 10 a second: three seconds, six times each limit.
    reply = " ".join(f"t{i}" for i in range(30))
    proxy = await _proxy(
        sim_server, proxy_server, reply=reply, tokens_per_second=10,
        header_timeout_seconds=LIMIT, body_timeout_seconds=LIMIT, idle_timeout_seconds=LIMIT,
    )  # fmt: skip
    started = time.monotonic()
    content = ""
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream("POST", f"{proxy.url}{CHAT}", json={**GOOD, "stream": True}) as response,
    ):
        assert response.status_code == 200
        events = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    for event in events[:-1]:
        for choice in json.loads(event[len("data: ") :]).get("choices", []):
            content += choice.get("delta", {}).get("content") or ""
    assert content == reply
    assert time.monotonic() - started > 4 * LIMIT
