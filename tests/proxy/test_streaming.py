"""Acceptance: non-ASCII text round-trips byte-exact through the proxy (SPEC A1, E1)."""

from __future__ import annotations

import json

import httpx
import openai

from ..support import (
    ProxyFactory,
    SimFactory,
    provider_policy,
    role,
    role_table,
    wait_for_sim_record,
)

# An em dash, accented Latin, Japanese and an emoji: one-, two-, three- and four-byte UTF-8.
TEXT = "Résumé — naïve café; 日本語のテキストです。 Rocket 🚀 launched, ½ done ✓."
MODEL = "vendor/model-a"


def _scenario(**machine: object) -> dict[str, object]:
    return {
        "seed": 1,
        "models": [
            {
                "name": MODEL,
                "reply": TEXT,
                "machines": [{"name": "m1", "ttftSeconds": 0, "tokensPerSecond": 0, **machine}],
            }
        ],
    }


async def _setup(
    sim_server: SimFactory, proxy_server: ProxyFactory, **machine: object
) -> tuple[str, str]:
    sim = await sim_server(_scenario(**machine))
    proxy = await proxy_server(
        [
            provider_policy("agg", f"{sim.url}/v1", {MODEL: ["m1"]}),
            role_table(role("agent", [MODEL])),
        ]
    )
    return proxy.url, sim.url


SPLIT = {
    "faults": [{"kind": "splitWrites", "always": True, "pieceBytes": 3, "pauseSeconds": 0.002}]
}


async def test_streamed_non_ascii_arrives_byte_exact_through_the_openai_client(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    url, _ = await _setup(sim_server, proxy_server, **SPLIT)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="agent", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        pieces = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
    received = "".join(pieces)
    assert received.encode("utf-8") == TEXT.encode("utf-8")


async def test_the_upstream_sends_no_charset_and_the_proxy_declares_utf8(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    url, _ = await _setup(sim_server, proxy_server, **SPLIT)
    body = {"model": "agent", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with (
        httpx.AsyncClient() as client,
        client.stream("POST", f"{url}/v1/chat/completions", json=body) as response,
    ):
        assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
        assert response.headers["x-rolegate-machine"] == "m1"
        raw = b"".join([chunk async for chunk in response.aiter_raw()])
    # The proxy forwards the provider's own bytes: UTF-8, never re-escaped or re-encoded.
    contents: list[str] = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: {"):
            payload = json.loads(block[len(b"data: ") :].decode("utf-8"))
            contents.extend(c["delta"].get("content") or "" for c in payload["choices"])
    assert "".join(contents) == TEXT
    assert b"\\u" not in raw
    assert raw.endswith(b"data: [DONE]\n\n")
    # And the metric notes the provider that omitted the charset (noted, never failed).
    async with httpx.AsyncClient() as client:
        metrics = (await client.get(f"{url}/metrics")).text
    assert 'rolegate_upstream_missing_charset_total{provider="agg"} 1.0' in metrics


async def test_non_streamed_non_ascii_arrives_byte_exact(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    url, _ = await _setup(sim_server, proxy_server, **SPLIT)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="agent", messages=[{"role": "user", "content": "hi"}]
        )
        completion = raw.parse()
    assert (completion.choices[0].message.content or "").encode("utf-8") == TEXT.encode("utf-8")
    assert completion.model == MODEL  # the model that served, not the role
    assert raw.headers["x-rolegate-machine"] == "m1"
    assert raw.headers["x-rolegate-provider"] == "agg"


async def test_a_client_that_disconnects_mid_stream_cancels_the_upstream(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    url, sim_url = await _setup(sim_server, proxy_server, tokensPerSecond=20)
    body = {"model": "agent", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with (
        httpx.AsyncClient() as client,
        client.stream("POST", f"{url}/v1/chat/completions", json=body) as response,
    ):
        async for _ in response.aiter_raw():
            break  # one read of content, then the client walks away
    record = await wait_for_sim_record(sim_url, lambda r: r["outcome"] != "in_progress")
    assert record["outcome"] == "client_disconnected"
    assert int(record["tokens_sent"]) < len(TEXT.split())


async def test_stream_options_include_usage_is_honoured(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    url, _ = await _setup(sim_server, proxy_server)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="agent",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = [chunk.usage async for chunk in stream if chunk.usage is not None]
    assert usage
    assert usage[-1].completion_tokens > 0
