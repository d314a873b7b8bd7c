"""Answers beyond text: reasoning before the reply and tool calls after it, as thinking
and agentic models stream them, on the wire and through the openai client."""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageFunctionToolCall, ChatCompletionToolParam

from .simclient import (
    MODEL,
    REPLY,
    USER,
    StartSim,
    body,
    chat,
    finished_record,
    machine,
    parse_sse,
    raw_post,
    records,
    scenario,
)

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


# --- tool calls ----------------------------------------------------------------------------

WEATHER_ARGS = '{"city": "Paris", "unit": "c"}'  # 30 characters: five fragments of 7
TIME_ARGS = '{"tz":"Europe/Paris"}'  # 21 characters: three fragments of 7
AGENT = {
    "reasoning": "need the weather",  # three pieces
    "toolCalls": [
        {"name": "get_weather", "arguments": WEATHER_ARGS},
        {"name": "get_time", "arguments": TIME_ARGS, "id": "call_custom"},
    ],
    "argumentPieceChars": 7,
}
AGENT_REPLY = "Let me check."  # three tokens
TOOLS: list[ChatCompletionToolParam] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
# 3 reasoning + 3 content + (1 + 5) + (1 + 3) tool call events.
AGENT_PIECES = 16


def _fragments(text: str, size: int = 7) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


async def _agent(start_sim: StartSim, *faults: dict[str, Any], **fields: Any) -> str:
    sim = await start_sim(
        scenario(machine("a", *faults), reply=AGENT_REPLY, model_fields={**AGENT, **fields})
    )
    return sim.url


async def test_a_stream_with_reasoning_text_and_two_parallel_tool_calls(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await _agent(start_sim)
    reply = await chat(
        http, url, body(stream=True, tools=TOOLS, stream_options={"include_usage": True})
    )
    first_id = f"call_0_{reply.chunks[0]['id'][4:12]}"
    assert reply.deltas == [
        {"role": "assistant", "content": ""},
        *({"reasoning_content": p} for p in ("need ", "the ", "weather")),
        *({"content": t} for t in ("Let ", "me ", "check.")),
        {"tool_calls": [{"index": 0, "id": first_id, "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        *({"tool_calls": [{"index": 0, "function": {"arguments": f}}]}
          for f in _fragments(WEATHER_ARGS)),
        {"tool_calls": [{"index": 1, "id": "call_custom", "type": "function",
                         "function": {"name": "get_time", "arguments": ""}}]},
        *({"tool_calls": [{"index": 1, "function": {"arguments": f}}]}
          for f in _fragments(TIME_ARGS)),
        {},
    ]  # fmt: skip
    assert reply.tool_calls == [
        {"id": first_id, "name": "get_weather", "arguments": WEATHER_ARGS},
        {"id": "call_custom", "name": "get_time", "arguments": TIME_ARGS},
    ]
    assert (reply.reasoning, reply.text) == ("need the weather", AGENT_REPLY)
    assert reply.finish_reason == "tool_calls"
    assert reply.events[-2]["usage"]["completion_tokens"] == AGENT_PIECES
    assert reply.events[-1] == "[DONE]"
    # The chunk head is a plain answer's: one id, the model, the machine.
    assert {(c["id"], c["object"], c["provider"]) for c in reply.chunks} == {
        (reply.chunks[0]["id"], "chat.completion.chunk", "a")
    }
    (record,) = await records(http, url)
    assert (record["tokens_sent"], record["tool_calls_sent"]) == (AGENT_PIECES, 2)


async def test_the_openai_client_puts_the_streamed_calls_together(start_sim: StartSim) -> None:
    url = await _agent(start_sim)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=USER,
            tools=TOOLS,
            stream=True,
        )
        thought, said, finish = [], [], None
        calls: dict[int, dict[str, str]] = {}
        async for chunk in stream:
            choice = chunk.choices[0]
            thought.append((choice.delta.model_extra or {}).get("reasoning_content") or "")
            said.append(choice.delta.content or "")
            # What agents do: a call's first delta opens it, later ones extend its arguments.
            for part in choice.delta.tool_calls or []:
                call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += part.id or ""
                if part.function is not None:
                    call["name"] += part.function.name or ""
                    call["arguments"] += part.function.arguments or ""
            finish = choice.finish_reason or finish
        assert ("".join(thought), "".join(said), finish) == (
            "need the weather",
            AGENT_REPLY,
            "tool_calls",
        )
        assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
        assert [calls[i]["arguments"] for i in sorted(calls)] == [WEATHER_ARGS, TIME_ARGS]
        assert calls[0]["id"].startswith("call_0_")
        assert calls[1]["id"] == "call_custom"

        completion = await client.chat.completions.create(
            model=MODEL,
            messages=USER,
            tools=TOOLS,
        )
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "tool_calls"
        assert message.content == AGENT_REPLY
        assert (message.model_extra or {})["reasoning_content"] == "need the weather"
        function_calls = [
            call
            for call in message.tool_calls or []
            if isinstance(call, ChatCompletionMessageFunctionToolCall)
        ]
        assert [(c.id, c.function.name, c.function.arguments) for c in function_calls] == [
            (f"call_0_{completion.id[4:12]}", "get_weather", WEATHER_ARGS),
            ("call_custom", "get_time", TIME_ARGS),
        ]


async def test_a_non_streamed_answer_with_tool_calls(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await _agent(start_sim)
    answer = (await chat(http, url, body(tools=TOOLS))).json()
    assert answer["choices"] == [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": AGENT_REPLY,
                "reasoning_content": "need the weather",
                "tool_calls": [
                    {
                        "id": f"call_0_{answer['id'][4:12]}",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": WEATHER_ARGS},
                    },
                    {
                        "id": "call_custom",
                        "type": "function",
                        "function": {"name": "get_time", "arguments": TIME_ARGS},
                    },
                ],
            },
            "finish_reason": "tool_calls",
        }
    ]
    assert answer["usage"]["completion_tokens"] == AGENT_PIECES
    (record,) = await records(http, url)
    assert (record["tokens_sent"], record["tool_calls_sent"]) == (AGENT_PIECES, 2)


async def test_calls_without_text_have_null_content(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(
        scenario(machine("a"), reply="", model_fields={"toolCalls": AGENT["toolCalls"]})
    )
    message = (await chat(http, sim.url, body(tools=TOOLS))).json()["choices"][0]["message"]
    assert message["content"] is None
    assert "reasoning_content" not in message  # the model does not reason
    assert [call["function"]["name"] for call in message["tool_calls"]] == [
        "get_weather",
        "get_time",
    ]
    streamed = await chat(http, sim.url, body(stream=True, tools=TOOLS))
    # Straight from the role chunk to the first call.
    assert streamed.deltas[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert streamed.text == ""


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        ({}, ["get_weather", "get_time"]),
        ({"tool_choice": "auto"}, ["get_weather", "get_time"]),
        ({"tool_choice": "required"}, ["get_weather", "get_time"]),
        ({"tool_choice": "none"}, []),
        ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, ["get_time"]),
        ({"tool_choice": {"type": "function", "function": {"name": "search"}}}, []),
        ({"parallel_tool_calls": False}, ["get_weather"]),
        ({"parallel_tool_calls": True}, ["get_weather", "get_time"]),
        (
            {
                "parallel_tool_calls": False,
                "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            },
            ["get_time"],
        ),
    ],
)
@pytest.mark.parametrize("stream", [True, False])
async def test_tool_choice_and_parallel_tool_calls_decide_the_calls(
    start_sim: StartSim,
    http: aiohttp.ClientSession,
    fields: dict[str, Any],
    names: list[str],
    stream: bool,
) -> None:
    url = await _agent(start_sim)
    reply = await chat(http, url, body(stream=stream, tools=TOOLS, **fields))
    if stream:
        calls, finish = reply.tool_calls, reply.finish_reason
        assert [c["name"] for c in calls] == names
        assert reply.text == AGENT_REPLY
    else:
        choice = reply.json()["choices"][0]
        calls, finish = choice["message"].get("tool_calls", []), choice["finish_reason"]
        assert [c["function"]["name"] for c in calls] == names
        assert choice["message"]["content"] == AGENT_REPLY
    # Indexes number the calls sent, from 0, whichever were left out.
    if stream and names:
        indexes = {part["index"] for delta in reply.deltas for part in delta.get("tool_calls", [])}
        assert sorted(indexes) == list(range(len(names)))
    assert finish == ("tool_calls" if names else "stop")
    (record,) = await records(http, url)
    assert record["tool_calls_sent"] == len(names)


@pytest.mark.parametrize("tools", [None, []])
async def test_no_tools_declared_means_no_calls(
    start_sim: StartSim, http: aiohttp.ClientSession, tools: list[Any] | None
) -> None:
    url = await _agent(start_sim)
    fields = {} if tools is None else {"tools": tools}
    streamed = await chat(http, url, body(stream=True, **fields))
    assert (streamed.tool_calls, streamed.finish_reason) == ([], "stop")
    assert (streamed.reasoning, streamed.text) == ("need the weather", AGENT_REPLY)
    message = (await chat(http, url, body(**fields))).json()["choices"][0]["message"]
    assert "tool_calls" not in message
    assert message["content"] == AGENT_REPLY
    assert [r["tokens_sent"] for r in await records(http, url)] == [6, 6]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tools": {"type": "function"}}, "`tools` must be a list"),
        ({"tool_choice": {"type": "function"}}, "must name a function"),
        ({"tool_choice": 3}, "`tool_choice` must be"),
        ({"parallel_tool_calls": "no"}, "`parallel_tool_calls` must be a boolean"),
    ],
)
async def test_malformed_tool_fields_are_a_400(
    start_sim: StartSim, http: aiohttp.ClientSession, fields: dict[str, Any], message: str
) -> None:
    url = await _agent(start_sim)
    reply = await chat(http, url, body(**fields))
    assert reply.status == 400
    assert message in reply.json()["error"]["message"]
    assert reply.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("limit", [9, 12])
async def test_max_tokens_cuts_inside_the_arguments(
    start_sim: StartSim, http: aiohttp.ClientSession, limit: int
) -> None:
    url = await _agent(start_sim)
    # Six pieces of reasoning and text, the call's first event, then fragments of it.
    fragments_sent = limit - 7
    cut_args = "".join(_fragments(WEATHER_ARGS)[:fragments_sent])
    streamed = await chat(
        http,
        url,
        body(stream=True, tools=TOOLS, max_tokens=limit, stream_options={"include_usage": True}),
    )
    assert [(c["name"], c["arguments"]) for c in streamed.tool_calls] == [("get_weather", cut_args)]
    assert streamed.finish_reason == "length"
    assert streamed.events[-2]["usage"]["completion_tokens"] == limit
    plain = (await chat(http, url, body(tools=TOOLS, max_tokens=limit))).json()
    (call,) = plain["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": cut_args}
    assert plain["choices"][0]["finish_reason"] == "length"
    assert plain["usage"]["completion_tokens"] == limit
    assert [(r["tokens_sent"], r["tool_calls_sent"]) for r in await records(http, url)] == [
        (limit, 1),
        (limit, 1),
    ]


async def test_max_tokens_at_the_second_calls_first_event(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await _agent(start_sim)
    # 12 pieces end the first call; the 13th is the second call's first event.
    streamed = await chat(http, url, body(stream=True, tools=TOOLS, max_tokens=13))
    assert streamed.tool_calls[1] == {"id": "call_custom", "name": "get_time", "arguments": ""}
    assert streamed.finish_reason == "length"
    exactly = await chat(http, url, body(stream=True, tools=TOOLS, max_tokens=AGENT_PIECES))
    assert exactly.finish_reason == "tool_calls"  # nothing was cut
    assert [r["tool_calls_sent"] for r in await records(http, url)] == [2, 2]


async def test_a_cut_inside_a_tool_call(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(
        scenario(
            machine("a", {"kind": "cut", "always": True, "afterTokens": 9}),
            reply=AGENT_REPLY,
            model_fields=AGENT,
        )
    )
    exchange = await raw_post(sim.port, body(stream=True, tools=TOOLS))
    assert exchange.status == 200
    events = parse_sse(exchange.body)
    deltas = [event["choices"][0]["delta"] for event in events]
    # The role chunk, then nine pieces: six of reasoning and text, the call's first event
    # and two fragments of its arguments; then nothing, not even a finish.
    assert len(deltas) == 10
    assert deltas[-1] == {"tool_calls": [{"index": 0, "function": {"arguments": ': "Pari'}}]}
    assert all(event["choices"][0]["finish_reason"] is None for event in events)
    record = await finished_record(http, sim.url)
    assert (record["outcome"], record["tokens_sent"], record["tool_calls_sent"]) == ("cut", 9, 1)


async def test_a_stream_error_and_a_malformed_event_land_between_argument_fragments(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await _agent(start_sim, {"kind": "streamError", "always": True, "afterTokens": 8})
    errored = await chat(http, url, body(stream=True, tools=TOOLS))
    assert errored.events[-1]["error"]["code"] == 502
    # The role chunk, then eight pieces: the call's first event and its first fragment.
    (call,) = errored.tool_calls
    assert (call["name"], call["arguments"]) == ("get_weather", '{"city"')
    url = await _agent(start_sim, {"kind": "malformedEvent", "always": True, "atEvent": 9})
    raw = (await chat(http, url, body(stream=True, tools=TOOLS))).raw
    blocks = raw.split(b"\n\n")
    bad = blocks.index(b'data: {"choices": [')
    # After the role chunk and eight pieces, before the ninth; nothing left out.
    assert bad == 9
    assert b'"arguments":": \\"Pari"' in blocks[bad + 1]
    (record,) = [r for r in await records(http, url) if r["fault"] == "malformedEvent"]
    assert record["tokens_sent"] == AGENT_PIECES


async def test_arguments_split_between_multibyte_characters_and_inside_escapes(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    arguments = '{"q": "café — 日本語 🎉\\n"}'
    call = {"name": "search", "arguments": arguments}
    sim = await start_sim(
        scenario(machine("a"), model_fields={"toolCalls": [call], "argumentPieceChars": 4})
    )
    tools = [{"type": "function", "function": {"name": "search"}}]
    streamed = await chat(http, sim.url, body(stream=True, tools=tools))
    fragments = [
        part["function"]["arguments"]
        for delta in streamed.deltas
        for part in delta.get("tool_calls", [])
        if "id" not in part
    ]
    assert fragments == ['{"q"', ': "c', "afé ", "— 日本", "語 🎉\\", 'n"}']
    # Characters, not bytes: every fragment is whole characters, sent as raw UTF-8.
    assert all(len(fragment) == 4 for fragment in fragments[:-1])
    assert "— 日本".encode() in streamed.raw
    assert b"\\u" not in streamed.raw
    assert streamed.tool_calls[0]["arguments"] == arguments
    assert json.loads(streamed.tool_calls[0]["arguments"]) == {"q": "café — 日本語 🎉\n"}
    message = (await chat(http, sim.url, body(tools=tools))).json()["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["arguments"] == arguments


# --- continuing a prefilled assistant message ------------------------------------------------


def _prefilled(content: Any) -> list[Any]:
    return [*USER, {"role": "assistant", "content": content}]


async def test_an_echoing_machine_resends_the_prefill_then_continues(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(
        scenario(machine("echo", continuesPartialMessage=True, echoesPrefill=True), machine("b"))
    )
    streamed = await chat(http, sim.url, body(stream=True, messages=_prefilled("one two thr")))
    contents = [d["content"] for d in streamed.deltas[1:-1]]
    # As llama-server: the prefill again, in one event with the first new token, then the rest.
    assert contents == ["one two three ", "four ", "five ", "six"]
    assert streamed.text == REPLY
    plain = (await chat(http, sim.url, body(messages=_prefilled("one two thr")))).json()
    assert plain["choices"][0]["message"]["content"] == REPLY
    # The echo is not generated: the tokens are the rest's four.
    assert plain["usage"]["completion_tokens"] == 4
    capped = await chat(
        http, sim.url, body(stream=True, max_tokens=2, messages=_prefilled("one two thr"))
    )
    assert (capped.text, capped.finish_reason) == ("one two three four ", "length")
    # A list of text parts is its joined text.
    parts = _prefilled([{"type": "text", "text": "one "}, {"type": "text", "text": "two"}])
    joined = await chat(http, sim.url, body(stream=True, messages=parts))
    assert [d["content"] for d in joined.deltas[1:3]] == ["one two ", "three "]
    assert joined.text == REPLY
    # A prefill the reply does not start with: the whole reply, nothing echoed.
    whole = await chat(http, sim.url, body(stream=True, messages=_prefilled("zebra")))
    assert whole.text == REPLY
    flags = [
        (r["continued_partial"], r["echoed_prefill"], r["tokens_sent"])
        for r in await records(http, sim.url)
    ]
    # The parts' rest is " three four five six": a space, then four tokens.
    assert flags == [(True, True, 4)] * 2 + [(True, True, 2), (True, True, 5), (False, False, 6)]


async def test_a_machine_that_does_not_echo_sends_only_the_rest(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a", continuesPartialMessage=True)))
    streamed = await chat(http, sim.url, body(stream=True, messages=_prefilled("one two thr")))
    assert streamed.text == "ee four five six"
    (record,) = await records(http, sim.url)
    assert (record["continued_partial"], record["echoed_prefill"]) == (True, False)


@pytest.mark.parametrize("echo", [False, True])
async def test_a_continuation_ends_with_the_tool_calls(
    start_sim: StartSim, http: aiohttp.ClientSession, echo: bool
) -> None:
    sim = await start_sim(
        scenario(
            machine("a", continuesPartialMessage=True, echoesPrefill=echo),
            reply=AGENT_REPLY,
            model_fields=AGENT,
        )
    )
    streamed = await chat(
        http, sim.url, body(stream=True, tools=TOOLS, messages=_prefilled("Let me "))
    )
    # No reasoning mid-answer: the rest of the text (the echo with it), then both calls.
    assert streamed.deltas[1] == {"content": "Let me check." if echo else "check."}
    assert "tool_calls" in streamed.deltas[2]
    assert streamed.reasoning == ""
    assert [(c["name"], c["arguments"]) for c in streamed.tool_calls] == [
        ("get_weather", WEATHER_ARGS),
        ("get_time", TIME_ARGS),
    ]
    assert streamed.finish_reason == "tool_calls"
    message = (await chat(http, sim.url, body(tools=TOOLS, messages=_prefilled("Let me ")))).json()[
        "choices"
    ][0]["message"]
    assert message["content"] == ("Let me check." if echo else "check.")
    assert "reasoning_content" not in message
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == [WEATHER_ARGS, TIME_ARGS]
    # The whole reply prefilled: the calls are all that is left (after the echo, if any).
    done = await chat(
        http, sim.url, body(stream=True, tools=TOOLS, messages=_prefilled(AGENT_REPLY))
    )
    assert done.text == (AGENT_REPLY if echo else "")
    assert len(done.tool_calls) == 2
    calls_at = 1 + (1 if echo else 0)
    assert "tool_calls" in done.deltas[calls_at]
    # Without tools declared, the whole reply prefilled leaves nothing (or just the echo).
    nothing = await chat(http, sim.url, body(stream=True, messages=_prefilled(AGENT_REPLY)))
    assert (nothing.text, nothing.finish_reason) == (AGENT_REPLY if echo else "", "stop")
    echoed = 1 if echo else 0  # an echo with nothing new after it is a piece of its own
    assert [
        (r["continued_partial"], r["echoed_prefill"], r["tokens_sent"], r["tool_calls_sent"])
        for r in await records(http, sim.url)
    ] == [
        (True, echo, 1 + 10, 2),
        (True, echo, 1 + 10, 2),
        (True, echo, echoed + 10, 2),
        (True, echo, echoed, 0),
    ]


# --- the malformedToolCall fault -----------------------------------------------------------


def _malformed(flaw: str | None = None) -> dict[str, Any]:
    fault: dict[str, Any] = {"kind": "malformedToolCall", "always": True}
    return fault if flaw is None else {**fault, "flaw": flaw}


@pytest.mark.parametrize("flaw", [None, "arguments"])
async def test_malformed_arguments_lose_their_last_character(
    start_sim: StartSim, http: aiohttp.ClientSession, flaw: str | None
) -> None:
    url = await _agent(start_sim, _malformed(flaw))
    streamed = await chat(http, url, body(stream=True, tools=TOOLS))
    first, second = streamed.tool_calls
    assert first["arguments"] == WEATHER_ARGS[:-1] == '{"city": "Paris", "unit": "c"'
    with pytest.raises(json.JSONDecodeError):
        json.loads(first["arguments"])
    assert (first["name"], second["arguments"]) == ("get_weather", TIME_ARGS)  # the rest intact
    assert streamed.finish_reason == "tool_calls"
    message = (await chat(http, url, body(tools=TOOLS))).json()["choices"][0]["message"]
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == [
        WEATHER_ARGS[:-1],
        TIME_ARGS,
    ]
    assert [r["fault"] for r in await records(http, url)] == ["malformedToolCall"] * 2


async def test_a_malformed_name_calls_an_undeclared_function(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await _agent(start_sim, _malformed("name"))
    streamed = await chat(http, url, body(stream=True, tools=TOOLS))
    assert [(c["name"], c["arguments"]) for c in streamed.tool_calls] == [
        ("get_weather_undeclared", WEATHER_ARGS),
        ("get_time", TIME_ARGS),
    ]
    message = (await chat(http, url, body(tools=TOOLS))).json()["choices"][0]["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == [
        "get_weather_undeclared",
        "get_time",
    ]
    # The first call the request gets is the one broken.
    named = {"type": "function", "function": {"name": "get_time"}}
    only = await chat(http, url, body(stream=True, tools=TOOLS, tool_choice=named))
    assert [c["name"] for c in only.tool_calls] == ["get_time_undeclared"]


async def test_a_malformed_tool_call_fault_leaves_an_answer_without_calls_alone(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await _agent(start_sim, _malformed())
    streamed = await chat(http, url, body(stream=True))
    assert (streamed.text, streamed.tool_calls) == (AGENT_REPLY, [])
    refused = await chat(http, url, body(stream=True, tools=TOOLS, tool_choice="none"))
    assert (refused.text, refused.tool_calls) == (AGENT_REPLY, [])
    # Served as if it had not fired, as refusePrefill is on a request without a prefill.
    assert [r["fault"] for r in await records(http, url)] == [None, None]
