"""Bad input gets a 4xx in the OpenAI error shape naming the problem, and disturbs nothing (E2)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import pytest

from ..support import ProxyFactory, SimFactory, one_machine_sim, provider_policy, role, role_table

MODEL = "vendor/model-a"
REPLY = "one two three four five six seven eight nine ten " * 3
GOOD = {"model": "agent", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
async def proxy_url(sim_server: SimFactory, proxy_server: ProxyFactory) -> str:
    sim = await one_machine_sim(sim_server, MODEL, reply=REPLY, tokens_per_second=150)
    proxy = await proxy_server(
        [
            provider_policy("agg", f"{sim.url}/v1", {MODEL: ["m1"]}),
            role_table(role("agent", [MODEL]), role("batch", [MODEL])),
        ],
        max_body_bytes=64 * 1024,
    )
    return proxy.url


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


BAD_BODIES: list[tuple[bytes, int, str, str]] = [
    (b"{not json", 400, "invalid_json", "not valid JSON"),
    (b"\xff\xfe{}", 400, "invalid_encoding", "not UTF-8"),
    (b"[1, 2]", 400, "invalid_body", "must be a JSON object"),
    (
        b'{"messages": [{"role": "user", "content": "x"}]}',
        400,
        "missing_model",
        "your roles: agent, batch",
    ),
    (b'{"model": "agent"}', 400, "invalid_messages", "`messages` is required"),
    (b'{"model": "agent", "messages": ["hi"]}', 400, "invalid_messages", "messages[0]"),
    (
        b'{"model": "agent", "messages": [{"role": "user"}], "stream": "yes"}',
        400,
        "invalid_stream",
        "`stream` must be true or false",
    ),
    (
        b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}',
        404,
        "unknown_role",
        "Your roles: agent, batch",
    ),
]


@pytest.mark.parametrize(("body", "status", "code", "says"), BAD_BODIES)
async def test_bad_bodies_are_named(
    proxy_url: str, body: bytes, status: int, code: str, says: str
) -> None:
    async with httpx.AsyncClient() as client:
        response = await client.post(
            f"{proxy_url}/v1/chat/completions",
            content=body,
            headers={"Content-Type": "application/json"},
        )
    error = _error(response, status)
    assert error["code"] == code
    assert says in error["message"]


async def test_an_unknown_role_in_the_header_is_refused_without_repeating_it(
    proxy_url: str,
) -> None:
    async with httpx.AsyncClient() as client:
        response = await client.post(
            f"{proxy_url}/v1/chat/completions", json=GOOD, headers={"X-Rolegate-Role": "nope"}
        )
    error = _error(response, 404)
    assert "nope" not in response.text
    assert "X-Rolegate-Role" in error["message"]
    assert error["param"] == "X-Rolegate-Role"


async def test_the_header_selects_the_role_over_the_model_field(proxy_url: str) -> None:
    async with httpx.AsyncClient() as client:
        response = await client.post(
            f"{proxy_url}/v1/chat/completions",
            json={**GOOD, "model": "anything"},
            headers={"X-Rolegate-Role": "batch"},
        )
    assert response.status_code == 200
    assert response.headers["x-rolegate-role"] == "batch"


@pytest.mark.parametrize("chunked", [False, True])
async def test_an_oversized_body_is_413(proxy_url: str, chunked: bool) -> None:
    big = b'{"model": "agent", "messages": [{"role": "user", "content": "' + b"x" * 70_000 + b'"}]}'

    async def body_chunks() -> Any:
        for start in range(0, len(big), 8192):
            yield big[start : start + 8192]

    async with httpx.AsyncClient() as client:
        response = await client.post(
            f"{proxy_url}/v1/chat/completions",
            content=body_chunks() if chunked else big,
            headers={"Content-Type": "application/json"},
        )
    error = _error(response, 413)
    assert "65536-byte limit" in error["message"]
    assert "--max-body-bytes" in error["message"]


async def test_bad_requests_do_not_disturb_a_concurrent_stream(proxy_url: str) -> None:
    async def good_stream() -> str:
        text = []
        async with (
            httpx.AsyncClient() as client,
            client.stream(
                "POST", f"{proxy_url}/v1/chat/completions", json={**GOOD, "stream": True}
            ) as response,
        ):
            assert response.status_code == 200
            async for line in response.aiter_lines():
                text.append(line)
        return "\n".join(text)

    async def bad_requests() -> list[int]:
        statuses = []
        async with httpx.AsyncClient() as client:
            for body, *_ in BAD_BODIES * 3:
                response = await client.post(f"{proxy_url}/v1/chat/completions", content=body)
                statuses.append(response.status_code)
        return statuses

    streamed, statuses = await asyncio.gather(good_stream(), bad_requests())
    assert all(400 <= status < 500 for status in statuses)
    assert streamed.rstrip().endswith("data: [DONE]")
    assert '"error"' not in streamed


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port  # nothing listens here once the socket is closed


async def test_an_unreachable_upstream_is_502_naming_it(proxy_server: ProxyFactory) -> None:
    endpoint = f"http://127.0.0.1:{_closed_port()}/v1"
    proxy = await proxy_server(
        [
            provider_policy("down", endpoint, {MODEL: ["m1"]}),
            role_table(role("agent", [MODEL])),
        ]
    )
    async with httpx.AsyncClient() as client:
        for stream in (False, True):
            response = await client.post(
                f"{proxy.url}/v1/chat/completions", json={**GOOD, "stream": stream}
            )
            error = _error(response, 502)
            assert error["code"] == "upstream_unavailable"
            assert endpoint in error["message"]
            assert "cannot connect" in error["message"]
        # ... and the proxy itself is fine.
        assert (await client.get(f"{proxy.url}/healthz")).status_code == 200
