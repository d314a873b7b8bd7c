"""Answers beyond text: reasoning before the reply, as thinking models stream it, on the
wire and through the openai client."""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import openai
import pytest

from .simclient import MODEL, REPLY, USER, StartSim, body, chat, machine, records, scenario

MODEL_FIELDS_THINKING = {"reasoning": "let me think — 日本 ok"}
THINKING = ["let ", "me ", "think ", "— ", "日本 ", "ok"]  # its six pieces
REPLY_TOKENS = ["one ", "two ", "three ", "four ", "five ", "six"]


def _thinking(**fields: Any) -> dict[str, Any]:
    return {**MODEL_FIELDS_THINKING, **fields}


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
async def test_a_thinking_model_streams_its_reasoning_then_its_reply(
    start_sim: StartSim, http: aiohttp.ClientSession, field: str
) -> None:
    sim = await start_sim(scenario(machine("a"), model_fields=_thinking(reasoningField=field)))
    reply = await chat(http, sim.url, body(stream=True, stream_options={"include_usage": True}))
    deltas = reply.deltas
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1:7] == [{field: piece} for piece in THINKING]
    assert deltas[7:13] == [{"content": token} for token in REPLY_TOKENS]
    assert deltas[13:] == [{}]
    assert reply.chunks[-2]["choices"][0]["finish_reason"] == "stop"
    # Every chunk has the same head as a plain answer's.
    assert {(c["id"], c["model"], c["provider"]) for c in reply.chunks} == {
        (reply.chunks[0]["id"], reply.chunks[0]["model"], "a")
    }
    # Raw UTF-8 on the wire, never escaped, exactly as for content.
    assert f'{{"{field}":"日本 "}}'.encode() in reply.raw
    # A reasoning piece counts as a token: usage, and the record.
    assert reply.events[-2]["usage"]["completion_tokens"] == 12
    (record,) = await records(http, sim.url)
    assert (record["tokens_sent"], record["outcome"]) == (12, "completed")


async def test_a_non_streamed_answer_carries_the_reasoning_beside_the_content(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a"), model_fields=_thinking()))
    answer = (await chat(http, sim.url, body())).json()
    assert answer["choices"] == [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": REPLY,
                "reasoning_content": "".join(THINKING),
            },
            "finish_reason": "stop",
        }
    ]
    assert answer["usage"]["completion_tokens"] == 12
    (record,) = await records(http, sim.url)
    assert record["tokens_sent"] == 12


async def test_max_tokens_counts_reasoning_pieces(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a"), model_fields=_thinking()))
    inside = await chat(http, sim.url, body(stream=True, max_tokens=4))
    assert inside.deltas[1:] == [{"reasoning_content": p} for p in THINKING[:4]] + [{}]
    assert inside.chunks[-1]["choices"][0]["finish_reason"] == "length"
    past = await chat(http, sim.url, body(stream=True, max_tokens=8))
    assert past.deltas[7:] == [{"content": "one "}, {"content": "two "}, {}]
    plain = (await chat(http, sim.url, body(max_tokens=4))).json()
    assert plain["choices"][0]["message"] == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "let me think — ",
    }
    assert plain["choices"][0]["finish_reason"] == "length"
    assert plain["usage"]["completion_tokens"] == 4
    assert [r["tokens_sent"] for r in await records(http, sim.url)] == [4, 8, 4]


async def test_the_first_reasoning_piece_is_what_the_ttft_delays(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(
        scenario(machine("a", ttftSeconds=0.4, tokensPerSecond=50), model_fields=_thinking())
    )
    arrivals: list[tuple[float, bytes]] = []
    started = time.perf_counter()
    async with http.post(f"{sim.url}/v1/chat/completions", json=body(stream=True)) as response:
        async for line in response.content:
            if line.startswith(b"data: {"):
                arrivals.append((time.perf_counter() - started, line))
    role_at, first_at = arrivals[0][0], arrivals[1][0]
    assert b'"reasoning_content":"let "' in arrivals[1][1]
    assert first_at >= 0.4 - 0.01
    assert role_at < first_at / 2
    # Twelve pieces paced at 50 a second: eleven intervals after the first.
    assert arrivals[12][0] >= 0.4 + 11 / 50 - 0.01


async def test_mojibake_garbles_the_reasoning_too(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(
        scenario(machine("a", {"kind": "mojibake", "always": True}), model_fields=_thinking())
    )
    message = (await chat(http, sim.url, body())).json()["choices"][0]["message"]
    clean = "".join(THINKING)
    assert message["reasoning_content"] == clean.encode().decode("latin-1")


async def test_the_openai_client_reads_the_reasoning_from_the_deltas_extra_fields(
    start_sim: StartSim,
) -> None:
    sim = await start_sim(scenario(machine("a"), model_fields=_thinking()))
    async with openai.AsyncOpenAI(base_url=f"{sim.url}/v1", api_key="x", max_retries=0) as client:
        stream = await client.chat.completions.create(model=MODEL, messages=USER, stream=True)
        thought, said = [], []
        async for chunk in stream:
            delta = chunk.choices[0].delta
            thought.append((delta.model_extra or {}).get("reasoning_content") or "")
            said.append(delta.content or "")
        assert "".join(thought) == "".join(THINKING)
        assert "".join(said) == REPLY
        completion = await client.chat.completions.create(model=MODEL, messages=USER)
        message = completion.choices[0].message
        assert (message.model_extra or {})["reasoning_content"] == "".join(THINKING)
        assert message.content == REPLY


async def test_a_continuation_sends_no_reasoning(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(
        scenario(machine("a", continuesPartialMessage=True), model_fields=_thinking())
    )
    prefill = [*USER, {"role": "assistant", "content": "one two thr"}]
    streamed = await chat(http, sim.url, body(stream=True, messages=prefill))
    assert streamed.deltas[1:] == [{"content": t} for t in ("ee ", "four ", "five ", "six")] + [{}]
    message = (await chat(http, sim.url, body(messages=prefill))).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "ee four five six"}
    # A prefill the machine cannot continue: the whole answer, thinking included.
    other = [*USER, {"role": "assistant", "content": "zebra"}]
    whole = await chat(http, sim.url, body(stream=True, messages=other))
    assert whole.deltas[1] == {"reasoning_content": "let "}
    flags = [r["continued_partial"] for r in await records(http, sim.url)]
    assert flags == [True, True, False]
