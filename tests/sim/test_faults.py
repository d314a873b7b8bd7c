"""Every fault kind, streamed and not, as a client on the wire sees it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from typing import Any

import aiohttp
import openai
import pytest

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

NON_ASCII = "a — café 日本 🎉 z"  # 1-, 2-, 3- and 4-byte UTF-8 sequences
# asyncio may wake a timer up to a clock tick early; lower bounds allow for that.
EARLY = 0.01


def always(kind: str, **params: Any) -> dict[str, Any]:
    return {"kind": kind, "always": True, **params}


async def one_machine(start_sim: StartSim, *faults: dict[str, Any], **settings: Any) -> str:
    reply = settings.pop("reply", REPLY)
    sim = await start_sim(scenario(machine("a", *faults, **settings), reply=reply))
    return sim.url


# --- errors before any answer ------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
async def test_rate_limit_is_a_429_with_retry_after(
    start_sim: StartSim, http: aiohttp.ClientSession, stream: bool
) -> None:
    url = await one_machine(start_sim, always("rateLimit", retryAfterSeconds=4))
    reply = await chat(http, url, body(stream=stream))
    assert reply.status == 429
    assert reply.headers["Retry-After"] == "4"
    assert reply.headers["Content-Type"] == "application/json"
    assert reply.json()["provider"] == "a"  # the machine that refused is named
    error = reply.json()["error"]
    assert error["type"] == "rate_limit_error"
    assert error["code"] == 429
    assert set(error) == {"message", "type", "param", "code"}
    record = (await records(http, url))[-1]
    assert (record["fault"], record["outcome"], record["status"]) == (
        "rateLimit",
        "error_status",
        429,
    )


async def test_rate_limit_without_retry_after_sends_no_header(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await one_machine(start_sim, always("rateLimit"))
    reply = await chat(http, url, body())
    assert reply.status == 429
    assert "Retry-After" not in reply.headers


@pytest.mark.parametrize(
    ("params", "status"), [({}, 503), ({"status": 500}, 500), ({"status": 400}, 400)]
)
async def test_server_error_status(
    start_sim: StartSim, http: aiohttp.ClientSession, params: dict[str, Any], status: int
) -> None:
    url = await one_machine(start_sim, always("serverError", **params))
    for stream in (True, False):
        reply = await chat(http, url, body(stream=stream))
        assert reply.status == status
        assert reply.json()["error"]["code"] == status


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(
    ("fault", "status"),
    [
        (always("serverError", status=401, errorCode="invalid_api_key"), 401),
        (always("rateLimit", errorCode="rate_limit_exceeded"), 429),
    ],
)
async def test_an_error_carries_the_message_code_and_type_it_is_given(
    start_sim: StartSim,
    http: aiohttp.ClientSession,
    fault: dict[str, Any],
    status: int,
    stream: bool,
) -> None:
    text = "Incorrect API key provided: sk-echoed — for “café”"
    given = {**fault, "message": text, "errorType": "vendor_error"}
    url = await one_machine(start_sim, given)
    reply = await chat(http, url, body(stream=stream))
    assert reply.status == status
    assert reply.json()["error"] == {
        "message": text, "type": "vendor_error", "param": None, "code": fault["errorCode"]
    }  # fmt: skip
    # The control endpoint writes them back as a scenario would.
    async with http.get(f"{url}/_sim/machines/{MODEL}/a/faults") as faults:
        assert (await faults.json())[0]["errorCode"] == fault["errorCode"]


async def test_a_stream_error_carries_the_code_and_type_it_is_given(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    fault = always(
        "streamError", afterTokens=1, message="boom", errorCode="server_error", errorType="x"
    )
    url = await one_machine(start_sim, fault)
    reply = await chat(http, url, body(stream=True))
    assert reply.events[-1] == {"error": {"message": "boom", "code": "server_error", "type": "x"}}
    # Not streamed: an HTTP error with the fault's `code` as its status.
    plain = await chat(http, url, body())
    assert plain.status == 502
    assert plain.json()["error"] == {
        "message": "boom", "type": "x", "param": None, "code": "server_error"
    }  # fmt: skip


async def test_the_openai_client_sees_a_rate_limit_error(start_sim: StartSim) -> None:
    url = await one_machine(start_sim, always("rateLimit", retryAfterSeconds=1))
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(model=MODEL, messages=USER)


@pytest.mark.parametrize("stream", [True, False])
async def test_reset_aborts_the_connection_without_an_http_byte(
    start_sim: StartSim, http: aiohttp.ClientSession, stream: bool
) -> None:
    sim = await start_sim(scenario(machine("a", always("reset"))))
    exchange = await raw_post(sim.port, body(stream=stream))
    assert exchange.reset
    assert exchange.raw == b""
    record = await finished_record(http, sim.url)
    assert (record["fault"], record["outcome"], record["status"]) == ("reset", "reset", None)


async def test_reset_reaches_aiohttp_as_a_connection_error(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await one_machine(start_sim, always("reset"))
    with pytest.raises(aiohttp.ClientConnectionError):
        await chat(http, url, body())


async def test_no_response_until_the_client_gives_up(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await one_machine(start_sim, always("noResponse"))
    started = time.perf_counter()
    with pytest.raises(asyncio.TimeoutError):
        await chat(http, url, body(stream=True), timeout=aiohttp.ClientTimeout(total=0.2))
    assert time.perf_counter() - started < 1
    record = await finished_record(http, url)
    assert (record["fault"], record["outcome"], record["status"]) == (
        "noResponse",
        "client_disconnected",
        None,
    )


async def test_no_response_is_bounded_by_seconds_then_closes_silently(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a", always("noResponse", seconds=0.1))))
    started = time.perf_counter()
    exchange = await raw_post(sim.port, body())
    assert 0.1 - EARLY <= time.perf_counter() - started < 1
    assert exchange.raw == b""
    record = await finished_record(http, sim.url)
    assert record["outcome"] == "no_response"


# --- timing faults ----------------------------------------------------------------------


async def _content_arrivals(
    http: aiohttp.ClientSession, url: str, payload: dict[str, Any]
) -> list[float]:
    arrivals: list[float] = []
    started = time.perf_counter()
    async with http.post(f"{url}/v1/chat/completions", json=payload) as response:
        async for line in response.content:
            if b'"delta":{"content":"' in line:
                arrivals.append(time.perf_counter() - started)
    return arrivals


async def test_late_first_token_overrides_ttft(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await one_machine(
        start_sim, always("lateFirstToken", seconds=1.0), ttftSeconds=0.01, tokensPerSecond=0
    )
    arrivals = await _content_arrivals(http, url, body(stream=True))
    assert len(arrivals) == 6
    assert arrivals[0] >= 1.0 - EARLY
    # Then the rest at once: a contrast, not a figure (a loaded machine stretches both).
    assert arrivals[-1] - arrivals[0] < arrivals[0] / 2
    started = time.perf_counter()
    await chat(http, url, body())
    assert time.perf_counter() - started >= 1.0 - EARLY


async def test_stall_pauses_after_some_tokens_then_resumes(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await one_machine(start_sim, always("stall", afterTokens=2, seconds=1.0))
    arrivals = await _content_arrivals(http, url, body(stream=True))
    assert len(arrivals) == 6
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert gaps[1] >= 1.0 - EARLY  # between token 2 and token 3
    assert max(gaps[:1] + gaps[2:]) < gaps[1] / 2
    record = await finished_record(http, url)
    assert (record["fault"], record["outcome"]) == ("stall", "completed")


async def test_a_client_that_gives_up_during_a_stall_is_recorded(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await one_machine(start_sim, always("stall", afterTokens=3))  # default 300 s
    with pytest.raises(asyncio.TimeoutError):
        await chat(http, url, body(stream=True), timeout=aiohttp.ClientTimeout(sock_read=0.2))
    record = await finished_record(http, url)
    assert (record["outcome"], record["tokens_sent"]) == ("client_disconnected", 3)


async def test_rate_collapse_slows_the_tail(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await one_machine(start_sim, always("rateCollapse", afterTokens=3, tokensPerSecond=4))
    arrivals = await _content_arrivals(http, url, body(stream=True))
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert all(g >= 0.25 - EARLY for g in gaps[2:])  # then 1/4 s apart
    assert max(gaps[:2]) < min(gaps[2:]) / 2  # the first three tokens at full speed


# --- broken streams ---------------------------------------------------------------------


async def test_cut_closes_mid_stream_without_finish_or_done(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await one_machine(start_sim, always("cut", afterTokens=2))
    lines: list[bytes] = []
    async with http.post(f"{url}/v1/chat/completions", json=body(stream=True)) as response:
        assert response.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await _read_lines(response, lines)
    received = b"".join(lines)
    assert received.count(b'"delta":{"content":"') == 2
    assert b'finish_reason":"' not in received
    assert b"[DONE]" not in received
    record = await finished_record(http, url)
    assert (record["fault"], record["outcome"], record["tokens_sent"]) == ("cut", "cut", 2)


async def _read_lines(response: aiohttp.ClientResponse, into: list[bytes]) -> None:
    async for line in response.content:
        into.append(line)


async def test_cut_on_a_non_streamed_call_drops_the_connection(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(scenario(machine("a", always("cut"))))
    exchange = await raw_post(sim.port, body())
    assert exchange.raw == b""
    assert (await finished_record(http, sim.url))["outcome"] == "cut"


async def test_no_done_ends_the_stream_after_finish_reason(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await one_machine(start_sim, always("noDone"))
    reply = await chat(http, url, body(stream=True, stream_options={"include_usage": True}))
    assert reply.text == REPLY
    assert reply.chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert "usage" in reply.chunks[-1]
    assert "[DONE]" not in reply.events
    assert (await finished_record(http, url))["outcome"] == "completed"
    # Nothing to omit without a stream: a normal answer.
    assert (await chat(http, url, body())).json()["choices"][0]["message"]["content"] == REPLY


async def test_stream_error_sends_an_error_event_then_ends(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await one_machine(start_sim, always("streamError", afterTokens=3, message="boom"))
    reply = await chat(http, url, body(stream=True))
    assert reply.status == 200
    assert reply.text == "one two three "
    assert reply.events[-1] == {"error": {"message": "boom", "code": 502}}
    assert not any(c["choices"][0]["finish_reason"] for c in reply.chunks)
    record = await finished_record(http, url)
    assert (record["outcome"], record["tokens_sent"]) == ("stream_error", 3)


async def test_stream_error_reaches_the_openai_client_as_an_api_error(start_sim: StartSim) -> None:
    url = await one_machine(
        start_sim, always("streamError", afterTokens=1, message="upstream died")
    )
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        stream = await client.chat.completions.create(model=MODEL, messages=USER, stream=True)
        with pytest.raises(openai.APIError, match="upstream died"):
            await _drain(stream)


async def _drain(stream: openai.AsyncStream[Any]) -> None:
    async for _ in stream:
        pass


async def test_stream_error_on_a_non_streamed_call_is_an_http_error(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await one_machine(start_sim, always("streamError", code=502))
    reply = await chat(http, url, body())
    assert reply.status == 502
    assert reply.json()["error"]["code"] == 502


# --- degraded answers -------------------------------------------------------------------


async def test_empty_answers(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    url = await one_machine(start_sim, always("empty"))
    streamed = await chat(http, url, body(stream=True))
    role, finish = streamed.chunks
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert finish["choices"][0]["delta"] == {"content": ""}
    assert finish["choices"][0]["finish_reason"] == "stop"
    assert streamed.events[-1] == "[DONE]"
    plain = (await chat(http, url, body())).json()
    assert plain["choices"][0]["message"]["content"] == ""
    assert plain["usage"]["completion_tokens"] == 0


async def test_empty_answers_still_wait_for_ttft(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await one_machine(start_sim, always("empty"), ttftSeconds=0.15)
    for stream in (True, False):
        started = time.perf_counter()
        await chat(http, url, body(stream=stream))
        assert time.perf_counter() - started >= 0.15 - EARLY


async def test_mojibake_double_encodes_like_a_latin1_fallback(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await one_machine(start_sim, always("mojibake"), reply=NON_ASCII)
    mangled = NON_ASCII.encode("utf-8").decode("latin-1")
    streamed = await chat(http, url, body(stream=True))
    # The em dash arrives as U+00E2 U+0080 U+0094, i.e. these bytes on the wire.
    assert bytes.fromhex("c3a2c280c294") in streamed.raw
    assert streamed.text == mangled
    assert len(streamed.chunks) == 2 + len(NON_ASCII.split())
    plain = await chat(http, url, body())
    assert bytes.fromhex("c3a2c280c294") in plain.raw
    assert plain.json()["choices"][0]["message"]["content"] == mangled


async def test_replacement_characters_are_injected(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await one_machine(start_sim, always("replacementChar"), reply=NON_ASCII)
    streamed = await chat(http, url, body(stream=True))
    assert streamed.text == "a \ufffd caf\ufffd \ufffd\ufffd \ufffd z"
    assert "\ufffd".encode() in streamed.raw


async def test_replacement_characters_show_up_even_in_ascii_replies(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await one_machine(start_sim, always("replacementChar"))
    content = (await chat(http, url, body())).json()["choices"][0]["message"]["content"]
    assert content == "one\ufffd two three four five six"


# --- transport shaping ------------------------------------------------------------------


async def test_split_writes_split_multibyte_characters_across_network_reads(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    split = {"kind": "splitWrites", "always": True, "pauseSeconds": 0.02}
    sim = await start_sim(scenario(machine("a", split), reply=NON_ASCII))
    exchange = await raw_post(sim.port, body(stream=True))
    assert exchange.status == 200
    chunks = exchange.chunks()
    # Each multi-byte character was cut after its lead byte: a write ends mid-character...
    assert sum(1 for c in chunks if c[-1] >= 0xC0) >= 5
    # ...and so did real network reads, not just HTTP chunks.
    assert exchange.read_boundaries_inside_characters() >= 3
    # Reassembled, the bytes are exactly those of an unsplit answer.
    events = b"".join(chunks).decode("utf-8")
    assert "".join(e for e in events.split("\n\n")).count("data: ") == 2 + 6 + 1
    reassembled = [line for line in events.split("\n\n") if '"delta":{"content":"' in line]
    assert "".join(line.split('"content":"')[1].split('"}')[0] for line in reassembled) == NON_ASCII
    record = await finished_record(http, sim.url)
    assert (record["split_writes"], record["fault"]) == (True, None)


async def test_split_writes_with_a_fixed_piece_size(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    split = {"kind": "splitWrites", "always": True, "pieceBytes": 5, "pauseSeconds": 0}
    sim = await start_sim(scenario(machine("a", split), reply=NON_ASCII))
    exchange = await raw_post(sim.port, body(stream=True))
    sizes = [len(c) for c in exchange.chunks()]
    assert max(sizes) == 5
    assert sizes.count(5) > len(sizes) // 2
    unsplit = await chat(http, sim.url, body(stream=True))
    assert unsplit.text == NON_ASCII


async def test_split_writes_apply_to_non_streamed_bodies(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    split = {"kind": "splitWrites", "always": True, "pauseSeconds": 0.02}
    sim = await start_sim(scenario(machine("a", split), reply=NON_ASCII))
    exchange = await raw_post(sim.port, body())
    assert "Content-Length" in exchange.head_and_body()[0]
    assert exchange.read_boundaries_inside_characters() >= 3
    reply = await chat(http, sim.url, body())
    assert reply.json()["choices"][0]["message"]["content"] == NON_ASCII


async def test_split_writes_combine_with_the_fault_that_fired(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    split = {"kind": "splitWrites", "always": True, "pauseSeconds": 0}
    url = await one_machine(start_sim, split, always("mojibake"), reply=NON_ASCII)
    reply = await chat(http, url, body(stream=True))
    assert reply.text == NON_ASCII.encode().decode("latin-1")
    record = await finished_record(http, url)
    assert (record["fault"], record["split_writes"]) == ("mojibake", True)


# --- triggers and determinism -----------------------------------------------------------


async def test_the_first_fault_that_fires_applies(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await one_machine(
        start_sim,
        {"kind": "rateLimit", "schedule": [2]},
        always("serverError", status=500),
        always("rateLimit"),
    )
    statuses = [(await chat(http, url, body())).status for _ in range(3)]
    assert statuses == [500, 429, 500]


async def test_a_schedule_fires_on_exactly_those_request_numbers(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await one_machine(start_sim, {"kind": "serverError", "schedule": [2, 4, 5]})
    statuses = [(await chat(http, url, body())).status for _ in range(6)]
    assert statuses == [200, 503, 200, 503, 503, 200]


async def _fault_sequence(http: aiohttp.ClientSession, url: str, n: int) -> list[int]:
    return [(await chat(http, url, body())).status for _ in range(n)]


def _coin_flips(seed: int) -> dict[str, Any]:
    flaky = [
        {"kind": "rateLimit", "probability": 0.3},
        {"kind": "serverError", "probability": 0.3},
    ]
    return scenario(machine("a", *flaky), seed=seed)


async def test_the_same_seed_gives_the_same_fault_sequence(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    first = await start_sim(_coin_flips(seed=11))
    second = await start_sim(_coin_flips(seed=11))
    other = await start_sim(_coin_flips(seed=12))
    sequence = await _fault_sequence(http, first.url, 30)
    assert {200, 429, 503} <= set(sequence)
    assert await _fault_sequence(http, second.url, 30) == sequence
    assert await _fault_sequence(http, other.url, 30) != sequence
    # A reset replays the sequence from request 1.
    async with http.post(f"{first.url}/_sim/reset") as response:
        assert response.status == 200
    assert await _fault_sequence(http, first.url, 30) == sequence


async def test_concurrency_does_not_change_which_request_gets_which_fault(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    serial = await start_sim(_coin_flips(seed=5))
    concurrent = await start_sim(_coin_flips(seed=5))
    expected = await _fault_sequence(http, serial.url, 20)
    await asyncio.gather(*(chat(http, concurrent.url, body()) for _ in range(20)))
    # Compare by each request's number on the machine, which is what faults key on.
    recorded = sorted(
        (r["machine_request"], r["status"]) for r in await records(http, concurrent.url)
    )
    assert [status for _, status in recorded] == expected


# --- connection behaviours the proxy's request path must survive -----------------------


async def test_linger_after_done_keeps_the_body_open_after_the_complete_answer(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await one_machine(start_sim, {"kind": "lingerAfterDone", "always": True, "seconds": 1})
    async with http.post(f"{url}/v1/chat/completions", json=body(stream=True)) as response:
        received = b""
        while not received.endswith(b"data: [DONE]\n\n"):
            received += await response.content.readany()
        # The answer is complete, yet the body has not ended.
        assert not response.content.at_eof()
        read_rest = asyncio.ensure_future(response.content.read())
        done, _ = await asyncio.wait({read_rest}, timeout=0.3)
        assert not done
        assert await read_rest == b""
    assert (await finished_record(http, url))["outcome"] == "completed"


async def test_multi_line_events_carry_each_chunk_over_two_data_lines(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await one_machine(start_sim, always("multiLineEvents"))
    reply = await chat(http, url, body(stream=True, stream_options={"include_usage": True}))
    blocks = [b for b in reply.raw.decode().split("\n\n") if b and b != "data: [DONE]"]
    assert blocks
    assert all(block.count("\ndata: ") == 1 for block in blocks)
    # Joined as SSE prescribes, every event is the whole chunk.
    assert reply.text == REPLY
    assert reply.events[-2]["usage"]["completion_tokens"] == 6


MALFORMED = 'data: {"choices": ['


@pytest.mark.parametrize(("at_event", "before"), [(1, 0), (3, 2), (6, 5), (7, 6), (99, 6)])
async def test_a_malformed_event_is_inserted_before_the_nth_content_event(
    start_sim: StartSim, http: aiohttp.ClientSession, at_event: int, before: int
) -> None:
    """`before`: how many of REPLY's six content events precede the malformed one (past the
    last, it comes just before the finish chunk)."""
    url = await one_machine(start_sim, always("malformedEvent", atEvent=at_event))
    reply = await chat(http, url, body(stream=True, stream_options={"include_usage": True}))
    assert reply.status == 200
    blocks = [b for b in reply.raw.decode().split("\n\n") if b]
    assert blocks.count(MALFORMED) == 1
    index = blocks.index(MALFORMED)
    with pytest.raises(json.JSONDecodeError):
        json.loads(MALFORMED.removeprefix("data: "))
    # Everything else is the normal answer, whole: role, six contents, finish, usage, [DONE].
    rest = parse_sse("".join(f"{b}\n\n" for b in blocks if b != MALFORMED).encode())
    assert len(rest) == 1 + 6 + 3
    assert rest[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert index == 1 + before  # after the role chunk and `before` content events
    contents = [e["choices"][0]["delta"]["content"] for e in rest[1:7]]
    assert "".join(contents) == REPLY
    assert rest[7]["choices"][0]["finish_reason"] == "stop"
    assert rest[-1] == "[DONE]"
    record = await finished_record(http, url)
    assert (record["fault"], record["outcome"], record["tokens_sent"]) == (
        "malformedEvent",
        "completed",
        6,
    )


async def test_a_malformed_event_goes_out_in_its_place_on_a_paced_stream(
    start_sim: StartSim,
) -> None:
    """Paced tokens leave one write each: the bad event travels with the token it precedes,
    after the earlier ones were on the wire."""
    sim = await start_sim(
        scenario(machine("a", always("malformedEvent", atEvent=2), tokensPerSecond=100))
    )
    exchange = await raw_post(sim.port, body(stream=True))
    chunks = exchange.chunks()
    (carrier,) = [c for c in chunks if MALFORMED.encode() in c]
    assert carrier.startswith(MALFORMED.encode() + b"\n\n")
    assert b'"content":"two "' in carrier
    assert b'"content":"one "' in b"".join(chunks[: chunks.index(carrier)])


async def test_a_malformed_event_fault_leaves_a_non_streamed_answer_alone(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await one_machine(start_sim, always("malformedEvent", atEvent=1))
    reply = await chat(http, url, body())
    assert reply.status == 200
    assert reply.json()["choices"][0]["message"]["content"] == REPLY
    record = await finished_record(http, url)
    assert (record["fault"], record["outcome"]) == ("malformedEvent", "completed")


async def test_a_request_on_a_connection_closed_for_idleness_is_reset_unanswered(
    start_sim: StartSim,
) -> None:
    sim = await start_sim(scenario(machine("a"), idleCloseSeconds=0.05))
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        assert (await chat(session, sim.url, body())).status == 200
        idle_until = time.monotonic() + 0.1
        await asyncio.sleep(idle_until - time.monotonic())  # the idleness is the stimulus
        with pytest.raises(aiohttp.ClientConnectionError):
            await chat(session, sim.url, body())
        # A fresh connection is answered.
        assert (await chat(session, sim.url, body())).status == 200
    async with aiohttp.ClientSession() as session:
        outcomes = [r["outcome"] for r in await records(session, sim.url)]
    assert outcomes == ["completed", "idle_closed", "completed"]


# --- what issue 13's rescue needs ---------------------------------------------------------


async def test_an_outage_window_fails_requests_only_while_it_lasts(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    outage = {"kind": "serverError", "status": 503, "duringSeconds": [0, 0.4]}
    url = await one_machine(start_sim, outage)
    assert (await chat(http, url, body())).status == 503
    await asyncio.sleep(0.45)  # the stimulus: the window's end
    assert (await chat(http, url, body())).status == 200


async def test_an_outage_window_starts_when_the_faults_are_put(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await one_machine(start_sim)
    await asyncio.sleep(0.3)
    window = [{"kind": "serverError", "status": 503, "duringSeconds": [0, 60]}]
    async with http.put(f"{url}/_sim/machines/{MODEL}/a/faults", json=window) as response:
        assert response.status == 200
    assert (await chat(http, url, body())).status == 503


async def test_keep_alive_comments_go_out_until_the_first_token(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    comments = always("keepAliveComments", seconds=0.5, everySeconds=0.1)
    url = await one_machine(start_sim, comments)
    started = time.monotonic()
    first_content = None
    raw = b""
    async with http.post(f"{url}/v1/chat/completions", json=body(stream=True)) as response:
        async for data in response.content.iter_any():
            raw += data
            if first_content is None and b'"delta":{"content":"' in data:
                first_content = time.monotonic() - started
    assert first_content is not None
    assert first_content >= 0.5 - EARLY
    assert raw.count(b": OPENROUTER PROCESSING\n\n") >= 4
    assert raw.index(b": OPENROUTER PROCESSING") < raw.index(b'"delta":{"content":"')
    events = parse_sse(b"".join(b for b in raw.split(b": OPENROUTER PROCESSING\n\n")))
    assert (
        "".join(
            e["choices"][0]["delta"].get("content", "")
            for e in events
            if isinstance(e, dict) and e.get("choices")
        )
        == REPLY
    )


async def test_keep_alive_comments_delay_a_non_streamed_answer(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await one_machine(start_sim, always("keepAliveComments", seconds=0.3))
    started = time.monotonic()
    reply = await chat(http, url, body())
    assert time.monotonic() - started >= 0.3 - EARLY
    assert reply.json()["choices"][0]["message"]["content"] == REPLY


async def test_refuse_prefill_answers_400_to_a_prefilled_request_only(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await one_machine(start_sim, always("refusePrefill"), continuesPartialMessage=True)
    prefilled = body(messages=[*USER, {"role": "assistant", "content": REPLY[:5]}])
    refused = await chat(http, url, prefilled)
    assert refused.status == 400
    assert refused.json()["error"]["type"] == "invalid_request_error"
    assert (await chat(http, url, body())).status == 200
    kinds = [(r["fault"], r["status"]) for r in await records(http, url)]
    assert kinds == [("refusePrefill", 400), (None, 200)]


async def test_no_usage_ignores_include_usage(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    url = await one_machine(start_sim, always("noUsage"))
    reply = await chat(http, url, body(stream=True, stream_options={"include_usage": True}))
    assert reply.text == REPLY
    assert not any(isinstance(e, dict) and "usage" in e for e in reply.events)
    assert reply.events[-1] == "[DONE]"


@pytest.mark.parametrize("stream", [True, False])
async def test_a_stall_then_close_drops_the_connection_after_the_silence(
    start_sim: StartSim, http: aiohttp.ClientSession, stream: bool
) -> None:
    url = await one_machine(start_sim, always("stall", afterTokens=2, seconds=0.3, thenClose=True))
    started = time.monotonic()
    with pytest.raises(aiohttp.ClientPayloadError if stream else aiohttp.ServerDisconnectedError):
        await chat(http, url, body(stream=stream))
    assert time.monotonic() - started >= 0.3 - EARLY
    record = await finished_record(http, url)
    assert (record["outcome"], record["tokens_sent"]) == ("cut", 2 if stream else 0)


@pytest.mark.parametrize(
    ("requests", "fresh_cut", "continuation_cut"),
    [("all", True, True), ("fresh", True, False), ("continuations", False, True)],
)
async def test_a_fault_hits_only_the_requests_it_names(
    start_sim: StartSim,
    http: aiohttp.ClientSession,
    requests: str,
    fresh_cut: bool,
    continuation_cut: bool,
) -> None:
    fault = always("cut", afterTokens=2, requests=requests)
    sim = await start_sim(scenario(machine("a", fault, continuesPartialMessage=True)))
    prefill: Any = {"role": "assistant", "content": "one "}
    for messages, cut in ((USER, fresh_cut), ([*USER, prefill], continuation_cut)):
        lines: list[bytes] = []
        payload = body(messages=messages, stream=True)
        async with http.post(f"{sim.url}/v1/chat/completions", json=payload) as response:
            with contextlib.suppress(aiohttp.ClientPayloadError):
                await _read_lines(response, lines)
        assert (b"[DONE]" not in b"".join(lines)) == cut
        record = await finished_record(http, sim.url)
        assert record["outcome"] == ("cut" if cut else "completed")
