"""The shape of answers: chat.completion and chat.completion.chunk as OpenRouter sends them."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import pytest

from rolegate_sim.scenario import DEFAULT_REPLY

from .simclient import MODEL, REPLY, USER, StartSim, body, chat, machine, records, scenario


async def test_a_stream_has_role_then_one_chunk_per_token_then_finish_then_done(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a")))
    reply = await chat(http, sim.url, body(stream=True))
    assert reply.status == 200
    # OpenRouter's default: no charset parameter at all.
    assert reply.headers["Content-Type"] == "text/event-stream"
    events = reply.events
    assert events[-1] == "[DONE]"
    chunks = reply.chunks
    assert len(chunks) == 1 + 6 + 1  # role, six tokens, finish
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]] == [
        "one ",
        "two ",
        "three ",
        "four ",
        "five ",
        "six",
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk"
        assert chunk["model"] == MODEL
        assert chunk["provider"] == "a"
        assert chunk["id"] == chunks[0]["id"]
        assert chunk["id"].startswith("gen-")
        assert abs(chunk["created"] - time.time()) < 60
    assert reply.text == REPLY
    # No usage unless asked for.
    assert not any("usage" in c for c in chunks)
    (record,) = await records(http, sim.url)
    assert record["outcome"] == "completed"
    assert record["tokens_sent"] == 6
    assert record["stream"] is True


async def test_include_usage_adds_a_usage_chunk_before_done(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a")))
    messages = [{"role": "system", "content": "x" * 40}, {"role": "user", "content": "y" * 20}]
    payload = {**body(stream=True), "messages": messages, "stream_options": {"include_usage": True}}
    events = (await chat(http, sim.url, payload)).events
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["provider"] == "a"
    assert usage_chunk["usage"] == {"prompt_tokens": 15, "completion_tokens": 6, "total_tokens": 21}


async def test_a_non_streamed_answer(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(scenario(machine("a")))
    reply = await chat(http, sim.url, body())
    assert reply.status == 200
    assert reply.headers["Content-Type"] == "application/json"
    answer = reply.json()
    assert answer["object"] == "chat.completion"
    assert answer["id"].startswith("gen-")
    assert answer["model"] == MODEL
    assert answer["provider"] == "a"
    assert answer["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": REPLY}, "finish_reason": "stop"}
    ]
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    (record,) = await records(http, sim.url)
    assert (record["outcome"], record["tokens_sent"], record["stream"]) == ("completed", 6, False)


async def test_non_ascii_travels_as_raw_utf8_never_escaped(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim({"models": [{"name": MODEL, "machines": [{"name": "a"}]}]})
    for stream in (True, False):
        reply = await chat(http, sim.url, body(stream=stream))
        assert "—".encode() in reply.raw  # e2 80 94
        assert "🎉".encode() in reply.raw
        assert b"\\u" not in reply.raw
        text = reply.text if stream else reply.json()["choices"][0]["message"]["content"]
        assert text == DEFAULT_REPLY


async def test_charset_utf8_is_declared_when_asked(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a"), charset="utf-8"))
    streamed = await chat(http, sim.url, body(stream=True))
    assert streamed.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    plain = await chat(http, sim.url, body())
    assert plain.headers["Content-Type"] == "application/json; charset=utf-8"


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_max_tokens_caps_the_answer_with_finish_reason_length(
    start_sim: StartSim, http: aiohttp.ClientSession, field: str
) -> None:
    sim = await start_sim(scenario(machine("a")))
    streamed = await chat(http, sim.url, body(stream=True, **{field: 2}))
    assert streamed.text == "one two "
    assert streamed.chunks[-1]["choices"][0]["finish_reason"] == "length"
    plain = (await chat(http, sim.url, body(**{field: 2}))).json()
    assert plain["choices"][0]["message"]["content"] == "one two "
    assert plain["choices"][0]["finish_reason"] == "length"
    assert plain["usage"]["completion_tokens"] == 2
    enough = (await chat(http, sim.url, body(**{field: 6}))).json()
    assert enough["choices"][0]["finish_reason"] == "stop"


async def test_max_completion_tokens_wins_over_max_tokens(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a")))
    answer = (await chat(http, sim.url, body(max_tokens=1, max_completion_tokens=3))).json()
    assert answer["usage"]["completion_tokens"] == 3


async def test_the_openai_client_reads_both_shapes(start_sim: StartSim) -> None:
    sim = await start_sim(scenario(machine("a"), machine("b")))
    async with openai.AsyncOpenAI(base_url=f"{sim.url}/v1", api_key="x", max_retries=0) as client:
        completion = await client.chat.completions.create(
            model=MODEL, messages=USER, extra_body={"provider": {"order": ["b"]}}
        )
        assert completion.choices[0].message.content == REPLY
        assert (completion.model_extra or {})["provider"] == "b"
        stream = await client.chat.completions.create(
            model=MODEL, messages=USER, stream=True, stream_options={"include_usage": True}
        )
        pieces, usage = [], None
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
            if chunk.usage is not None:
                usage = chunk.usage
        assert "".join(pieces) == REPLY
        assert usage is not None
        assert usage.completion_tokens == 6


async def test_openrouters_api_v1_path_is_served_too(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a")))
    async with http.post(f"{sim.url}/api/v1/chat/completions", json=body()) as response:
        assert response.status == 200
        assert (await response.json())["provider"] == "a"


async def test_ttft_and_tokens_per_second_pace_the_stream(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a", ttftSeconds=1.0, tokensPerSecond=5)))
    arrivals: list[float] = []
    started = time.perf_counter()
    async with http.post(f"{sim.url}/v1/chat/completions", json=body(stream=True)) as response:
        headers_at = time.perf_counter() - started
        async for line in response.content:
            if line.startswith(b'data: {"id"') and b'"content":"' in line and b'""' not in line:
                arrivals.append(time.perf_counter() - started)
    assert len(arrivals) == 6
    # Content waits for the TTFT, then five intervals of 1/5 s between six tokens: lower
    # bounds from the start, which a loaded machine only ever stretches.
    assert arrivals[0] >= 1.0 - 0.01
    assert arrivals[-1] >= 1.0 + 5 / 5 - 0.01
    # Headers (and the role chunk) come at once, not after the TTFT.
    assert headers_at < arrivals[0] / 2


async def test_a_non_streamed_answer_takes_as_long_as_generating_it(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a", ttftSeconds=0.05, tokensPerSecond=50)))
    started = time.perf_counter()
    await chat(http, sim.url, body())
    assert time.perf_counter() - started >= 0.05 + 5 / 50 - 0.01


async def test_jitter_varies_ttft_within_its_bounds(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a", ttftSeconds=0.5, jitter=0.5)))
    loop = asyncio.get_running_loop()

    async def ttft() -> float:
        started = loop.time()
        await chat(http, sim.url, body(max_tokens=1))
        return loop.time() - started

    first = [await ttft() for _ in range(4)]
    assert all(t >= 0.25 - 0.01 for t in first)  # never below ttft x (1 - jitter)
    assert max(first) - min(first) > 0.003  # it does vary


async def test_a_capable_machine_continues_a_partial_assistant_message(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("cont", continuesPartialMessage=True), machine("plain")))
    prefill = [*USER, {"role": "assistant", "content": "one two thr"}]
    continued = await chat(
        http, sim.url, body(stream=True, messages=prefill, provider={"order": ["cont"]})
    )
    assert continued.text == "ee four five six"
    plain = await chat(http, sim.url, body(messages=prefill, provider={"order": ["cont"]}))
    assert plain.json()["choices"][0]["message"]["content"] == "ee four five six"
    # A prefill the reply does not start with: the whole reply, from the start.
    other = [*USER, {"role": "assistant", "content": [{"type": "text", "text": "zebra"}]}]
    whole = await chat(http, sim.url, body(messages=other, provider={"order": ["cont"]}))
    assert whole.json()["choices"][0]["message"]["content"] == REPLY
    # A machine without the capability ignores the prefill.
    ignored = await chat(http, sim.url, body(messages=prefill, provider={"order": ["plain"]}))
    assert ignored.json()["choices"][0]["message"]["content"] == REPLY
    flags = [r["continued_partial"] for r in await records(http, sim.url)]
    assert flags == [True, True, False, False]


async def test_healthz_and_models(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(scenario(machine("a")))
    async with http.get(f"{sim.url}/healthz") as response:
        assert response.status == 200
        assert await response.json() == {"status": "ok"}
    async with http.get(f"{sim.url}/v1/models") as response:
        assert [m["id"] for m in (await response.json())["data"]] == [MODEL]
