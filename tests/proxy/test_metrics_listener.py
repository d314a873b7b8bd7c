"""The metrics listener (`--metrics-port`) holds its connections to the API port's limits
(issue 30, finding 4), through the same code (edge/server.py `guarded_runner`): a slow
loris is closed at the header limit while a scrape is served, a flood meets the bound
(counted apart from the API port's, so neither listener's flood refuses the other), and
what the listener refuses is answered in the OpenAI shape, repeating nothing of the
request. Real sockets against the real proxy's metrics listener.

The limits are set small so that each test runs in a few seconds; the margins are generous,
for a loaded two-core machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from rolegate_proxy.edge.connections import GuardedServer
from rolegate_proxy.edge.server import RunningProxy

from ..support import ProxyFactory, provider_policy, role, role_table
from ..waiting import eventually
from .test_connection_limits import _error, _trickle, _until_closed
from .test_error_shapes import MARKER, PARSER_ERRORS, _openai_error, _raw

MODEL = "vendor/model-a"
LIMIT = 0.5
MARGIN = 3.0
# The head of a scrape that never ends: its last header comes a byte at a time.
SCRAPE_HEAD = b"GET /metrics HTTP/1.1\r\nHost: proxy\r\n"


async def _proxy(proxy_server: ProxyFactory, **settings: Any) -> RunningProxy:
    """A proxy with a metrics port, and /metrics there only. Its provider is never asked."""
    settings.setdefault("metrics_on_api_port", False)
    proxy = await proxy_server(
        [
            provider_policy("agg", "http://127.0.0.1:9/v1", {MODEL: ["m1"]}),
            role_table(role("agent", [MODEL])),
        ],
        metrics_port=0,
        **settings,
    )
    assert proxy.metrics is not None
    return proxy


@contextlib.asynccontextmanager
async def _connection(url: str) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def _scraped(url: str) -> bool:
    """Whether a scrape of `url` gets the page (a refused connection does not)."""
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            page = await client.get(f"{url}/metrics")
    except httpx.HTTPError:
        return False
    return page.status_code == 200 and "rolegate_" in page.text


async def test_slow_loris_on_the_metrics_port_is_closed_at_the_header_limit_while_scrapes_go_on(
    proxy_server: ProxyFactory,
) -> None:
    proxy = await _proxy(proxy_server, header_timeout_seconds=LIMIT, idle_timeout_seconds=60)
    # The head a byte a twentieth of a second: far longer than the limit.
    trickle = [bytes([b]) for b in SCRAPE_HEAD + b"X-Slow: " + b"s" * 400]

    async def slow_client() -> tuple[float, bytes]:
        async with _connection(proxy.metrics_url) as (reader, writer):
            opened = time.monotonic()
            trickling = asyncio.create_task(_trickle(writer, trickle, every=0.05))
            try:
                received = await _until_closed(reader, LIMIT + MARGIN)
            finally:
                trickling.cancel()
            return time.monotonic() - opened, received

    # 100: within the listen backlog (128), so that no connect waits for a SYN retry.
    slow = [asyncio.create_task(slow_client()) for _ in range(100)]
    # Meanwhile an ordinary scrape, on a connection of its own, is served.
    assert await _scraped(proxy.metrics_url)
    for took, received in await asyncio.gather(*slow):
        assert took <= LIMIT + MARGIN
        error = _error(received, 408)
        assert error["code"] == "header_timeout", error
        assert "s" * 20 not in error["message"], error
    assert await _scraped(proxy.metrics_url)


async def test_the_metrics_port_holds_its_own_bound_and_a_flood_there_spares_the_api_port(
    proxy_server: ProxyFactory,
) -> None:
    bound = 20
    proxy = await _proxy(
        proxy_server, max_connections=bound, header_timeout_seconds=60, idle_timeout_seconds=60
    )
    assert proxy.metrics is not None
    server = proxy.metrics.runner.server
    assert isinstance(server, GuardedServer)
    async with contextlib.AsyncExitStack() as held:
        for _ in range(bound):
            _, writer = await held.enter_async_context(_connection(proxy.metrics_url))
            writer.write(SCRAPE_HEAD)  # a head begun, never finished

        async def all_held() -> bool:
            return server.open == bound

        await eventually(all_held, what="the metrics port holds the flood's connections")
        # One more is answered at once, 503, and closed; a scrape too, while the flood
        # holds every place.
        async with _connection(proxy.metrics_url) as (reader, writer):
            writer.write(SCRAPE_HEAD + b"\r\n")
            error = _error(await _until_closed(reader, MARGIN), 503)
        assert error["code"] == "too_many_connections", error
        assert not await _scraped(proxy.metrics_url)
        assert server.open == bound
        # The API port counts its own connections: it serves on.
        async with httpx.AsyncClient(timeout=10) as client:
            assert (await client.get(f"{proxy.url}/readyz")).status_code == 200
    # The flood gone, its places free up, and scrapes are served again.
    await eventually(lambda: _scraped(proxy.metrics_url), what="a scrape once the flood left")


@pytest.mark.parametrize(
    ("sent", "code"),
    [pytest.param(sent, code, id=what) for what, sent, code, _ in PARSER_ERRORS],
)
async def test_what_the_metrics_port_refuses_is_in_the_openai_shape_and_repeats_nothing(
    proxy_server: ProxyFactory, sent: bytes, code: str
) -> None:
    proxy = await _proxy(proxy_server)
    error = _openai_error(await _raw(proxy.metrics_url, sent), 400)  # and no MARKER in it
    assert error["code"] == code, error
    assert await _scraped(proxy.metrics_url)


@pytest.mark.parametrize(
    ("request_line", "status", "code"),
    [
        (f"GET /{MARKER} HTTP/1.1", 404, "unknown_url"),
        (f"POST /v1/chat/completions?{MARKER}=1 HTTP/1.1", 404, "unknown_url"),
        (f"DELETE /metrics?{MARKER} HTTP/1.1", 405, "method_not_allowed"),
    ],
)
async def test_a_path_or_method_the_metrics_port_does_not_serve_is_named_not_echoed(
    proxy_server: ProxyFactory, request_line: str, status: int, code: str
) -> None:
    proxy = await _proxy(proxy_server)
    sent = f"{request_line}\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    error = _openai_error(await _raw(proxy.metrics_url, sent), status)
    assert error["code"] == code, error
    # It names what the listener serves, and only that.
    assert "GET /metrics" in error["message"], error
    assert "/v1/chat/completions" not in error["message"], error
