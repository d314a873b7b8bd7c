"""Routing through a role's models and providers, and faults a client must not see as success."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from ..support import (
    ProxyFactory,
    SimFactory,
    provider_policy,
    role,
    role_table,
    sim_records,
    wait_for_sim_record,
)

A = "vendor/model-a"
B = "vendor/model-b"
REPLY = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"
GOOD: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}


def _machine(name: str, *faults: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ttftSeconds": 0, "tokensPerSecond": 0, "faults": list(faults)}


def _scenario(a_machines: list[dict[str, Any]], b_machines: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "seed": 3,
        "models": [
            {"name": A, "reply": REPLY, "machines": a_machines},
            {"name": B, "reply": REPLY, "machines": b_machines},
        ],
    }


async def _proxy(
    sim_server: SimFactory,
    proxy_server: ProxyFactory,
    a_machines: list[dict[str, Any]],
    b_machines: list[dict[str, Any]],
    **role_fields: Any,
) -> tuple[str, str]:
    sim = await sim_server(_scenario(a_machines, b_machines))
    proxy = await proxy_server(
        [
            provider_policy(
                "agg",
                f"{sim.url}/v1",
                {A: [m["name"] for m in a_machines], B: [m["name"] for m in b_machines]},
            ),
            role_table(role("agent", [A, B], **role_fields)),
        ]
    )
    return proxy.url, sim.url


@pytest.mark.parametrize("stream", [False, True])
async def test_the_next_model_serves_when_no_machine_of_the_first_can(
    sim_server: SimFactory, proxy_server: ProxyFactory, stream: bool
) -> None:
    failing = {"kind": "serverError", "always": True, "status": 503}
    url, _ = await _proxy(sim_server, proxy_server, [_machine("a1", failing)], [_machine("b1")])
    async with httpx.AsyncClient() as client:
        response = await client.post(
            f"{url}/v1/chat/completions", json={**GOOD, "model": "agent", "stream": stream}
        )
    assert response.status_code == 200
    assert response.headers["x-rolegate-model"] == B
    assert response.headers["x-rolegate-machine"] == "b1"
    assert response.headers["x-rolegate-role"] == "agent"
    if not stream:
        assert response.json()["model"] == B


@pytest.mark.parametrize(
    ("role_fields", "expected"),
    [
        (
            {"visibility": "Watched", "ruling": "Auto"},
            {"order": ["a1", "a2"], "allow_fallbacks": True},
        ),
        (
            {"visibility": "Unwatched", "patience": 3, "ruling": "Auto"},
            {"only": ["a1", "a2"], "allow_fallbacks": False},
        ),
        (
            {"visibility": "Unwatched", "patience": 3, "ruling": "Order"},
            {"order": ["a1", "a2"], "allow_fallbacks": True},
        ),
    ],
)
async def test_the_aggregator_receives_the_ruling(
    sim_server: SimFactory,
    proxy_server: ProxyFactory,
    role_fields: dict[str, Any],
    expected: dict[str, Any],
) -> None:
    url, sim_url = await _proxy(
        sim_server, proxy_server, [_machine("a1"), _machine("a2")], [_machine("b1")], **role_fields
    )
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{url}/v1/chat/completions", json={**GOOD, "model": "agent"})
    assert response.status_code == 200
    (record,) = await sim_records(sim_url)
    sent = {k: v for k, v in record["provider"].items() if v is not None}
    assert sent == expected


async def test_a_direct_provider_gets_no_provider_field(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    sim = await sim_server(_scenario([_machine("direct")], [_machine("b1")]))
    proxy = await proxy_server(
        [
            provider_policy("direct", f"{sim.url}/v1", {A: ["direct"]}, dialect="OpenAI"),
            role_table(role("agent", [A])),
        ]
    )
    caller = {"only": ["direct"], "data_collection": "deny", "zdr": True}
    async with httpx.AsyncClient() as client:
        response = await client.post(
            f"{proxy.url}/v1/chat/completions",
            json={**GOOD, "model": "agent", "provider": caller},
        )
        assert response.status_code == 200
        assert response.headers["x-rolegate-machine"] == "direct"
        (record,) = await sim_records(sim.url)
        # The caller's own `provider` field is not forwarded to a plain OpenAI server: it
        # routes nothing there.
        assert record["provider"] is None
        # Its narrowing still holds: a direct provider's one machine is named like any.
        response = await client.post(
            f"{proxy.url}/v1/chat/completions",
            json={**GOOD, "model": "agent", "provider": {"ignore": ["direct"]}},
        )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "provider.ignore"
    assert len(await sim_records(sim.url)) == 1


@pytest.mark.parametrize(
    ("fault", "says"),
    [
        ({"kind": "cut", "always": True, "afterTokens": 3}, "cut"),
        ({"kind": "streamError", "always": True, "afterTokens": 3}, "error mid-stream"),
    ],
)
async def test_a_broken_stream_after_content_ends_with_an_error_not_a_silent_success(
    sim_server: SimFactory, proxy_server: ProxyFactory, fault: dict[str, Any], says: str
) -> None:
    url, _ = await _proxy(sim_server, proxy_server, [_machine("a1", fault)], [_machine("b1")])
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        stream = await client.chat.completions.create(model="agent", stream=True, **GOOD)
        received: list[str] = []
        with pytest.raises(openai.APIError, match="incomplete") as caught:
            await _drain(stream, received)
    assert says in str(caught.value)
    assert "".join(received)  # content had reached the client before the break


async def _drain(stream: Any, received: list[str]) -> None:
    async for chunk in stream:
        if chunk.choices:
            received.append(chunk.choices[0].delta.content or "")


@pytest.mark.parametrize(
    "fault",
    [
        {"kind": "streamError", "always": True, "afterTokens": 0},
        {"kind": "cut", "always": True, "afterTokens": 0},
        {"kind": "reset", "always": True},
        {"kind": "rateLimit", "always": True, "retryAfterSeconds": 1},
    ],
)
async def test_a_failure_before_any_content_moves_to_the_next_model_unseen(
    sim_server: SimFactory, proxy_server: ProxyFactory, fault: dict[str, Any]
) -> None:
    url, _ = await _proxy(sim_server, proxy_server, [_machine("a1", fault)], [_machine("b1")])
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        stream = await client.chat.completions.create(model="agent", stream=True, **GOOD)
        text = "".join(
            [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
        )
    assert text == REPLY


async def test_every_upstream_rate_limited_is_a_429_with_retry_after(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    # Retry-After longer than the patience: not waited out, the client hears at once.
    limited = {"kind": "rateLimit", "always": True, "retryAfterSeconds": 7}
    url, _ = await _proxy(
        sim_server, proxy_server, [_machine("a1", limited)], [_machine("b1", limited)], patience=5
    )
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{url}/v1/chat/completions", json={**GOOD, "model": "agent"})
    assert response.status_code == 429
    assert response.headers["retry-after"] == "7"
    assert "rate limited" in response.json()["error"]["message"]


async def test_an_upstream_400_is_returned_not_retried(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    rejected = {"kind": "serverError", "always": True, "status": 400}
    url, sim_url = await _proxy(
        sim_server, proxy_server, [_machine("a1", rejected)], [_machine("b1")]
    )
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{url}/v1/chat/completions", json={**GOOD, "model": "agent"})
    assert response.status_code == 400
    assert "rejected the request" in response.json()["error"]["message"]
    assert len(await sim_records(sim_url)) == 1


async def test_endpoints_list_roles_and_report_readiness(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    url, _ = await _proxy(sim_server, proxy_server, [_machine("a1")], [_machine("b1")])
    async with httpx.AsyncClient() as client:
        models = (await client.get(f"{url}/v1/models")).json()
        ready = await client.get(f"{url}/readyz")
        health = await client.get(f"{url}/healthz")
    assert [m["id"] for m in models["data"]] == ["agent"]
    assert models["data"][0]["rolegate"]["models"] == [A, B]
    assert ready.status_code == 200
    assert ready.json()["config_hash"].startswith("sha256:")
    assert health.status_code == 200


async def test_a_record_is_finalised_for_each_request(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    url, sim_url = await _proxy(sim_server, proxy_server, [_machine("a1")], [_machine("b1")])
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        await client.chat.completions.create(model="agent", **GOOD)
    record = await wait_for_sim_record(sim_url, lambda r: r["outcome"] != "in_progress")
    assert record["outcome"] == "completed"
    assert record["machine"] == "a1"
