"""Answers are more than text (SPEC A2, E7), through one long-lived proxy, the simulator and
the real `openai` client, which puts streamed tool calls together the way agents do: a
cut, a stall or a rate move inside a tool call's arguments, an echoing continuation,
`max_tokens` across a handover, reasoning before content, parallel calls, a call `tool_choice`
forces, a call alone, broken calls, and, for random cut points anywhere in text and tool
calls, the assembled message is always the upstream's answer: valid arguments, no text twice.

Every case has its own model (and so its own breaker keys and affinity), served by machines
`a` (published fastest: it leads) and `b` (continues partial messages); the proxy and the
simulator serve them all, case after case.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rolegate_proxy.edge.server import RunningProxy
from rolegate_proxy.edge.server import start as start_proxy
from rolegate_proxy.edge.settings import ProxySettings
from rolegate_sim.scenario import parse_scenario
from rolegate_sim.server import RunningSim
from rolegate_sim.server import start as start_sim
from rolegate_sim.text import tokenize

from ..support import compile_objects, role, role_table

pytestmark = pytest.mark.asyncio(loop_scope="module")

TEXT = "I'll write it — café 日本 🎉 first, then read the notes. "
REASONING = "The user wants a poem in a file; write_file, then read_file."
WRITE = '{"path": "poem.txt", "content": "Roses — rouges,\\n日本の詩 🌹 \\"quoted\\""}'
READ = '{"path": "notes/é.md"}'
CALLS = [("write_file", WRITE), ("read_file", READ)]
PIECE_CHARS = 5
TOOLS: Any = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("write_file", "read_file")
]
PROMPT: Any = [{"role": "user", "content": "write the poem to poem.txt, then read my notes"}]
LONG = " ".join(f"w{i}—é" for i in range(40))
PLAIN = " ".join(f"word{i}" for i in range(40))
# About a second and a half of arguments at 100 pieces a second.
LONG_CALL = ("write_file", json.dumps({"path": "long.txt", "content": "la " * 250}))


def _pieces(arguments: str) -> int:
    """A call's events: its first, then one per fragment of its arguments."""
    return 1 + -(-len(arguments) // PIECE_CHARS)


TEXT_PIECES = len(tokenize(TEXT))
REASONING_PIECES = len(tokenize(REASONING))
SEAM_REPLY = "one xa\nb two three"
# Inside the first call's arguments, a few fragments in.
IN_WRITE = TEXT_PIECES + 4
IN_READ = TEXT_PIECES + _pieces(WRITE) + 3
ALL_PIECES = TEXT_PIECES + sum(_pieces(arguments) for _, arguments in CALLS)
# The cases break machines on purpose, again and again: no breaker may take one out.
LENIENT_BREAKER = {"novelSignatureCount": 10_000, "familiarSignatureCount": 10_000,
                   "rateMinSamples": 100}  # fmt: skip


@dataclass(frozen=True)
class Case:
    """One model of the simulator, and its role."""

    name: str
    a_faults: tuple[dict[str, Any], ...] = ()
    b_faults: tuple[dict[str, Any], ...] = ()
    reply: str = TEXT
    calls: tuple[tuple[str, str], ...] = tuple(CALLS)
    reasoning: str = ""
    a_speed: tuple[float, float] = (0.0, 0.0)  # the simulated machine's TTFT and rate
    # What the ProviderPolicy publishes of each (TTFT, tokens per second): `b` promises no
    # first token soon enough to race `a` for one, however slow a loaded machine makes it,
    # so each case's arms are the ones it is about.
    a_published: tuple[float, float] = (0.01, 1000.0)
    b_published: tuple[float, float] = (1.0, 200.0)
    b_echoes: bool = False
    b_reasons_again: bool = False
    b_declared_echo: bool = False
    a_continues: bool = False
    # Machine `b` serves the model too (else `a` is alone: a slow stream is kept).
    b: bool = True
    visibility: str = "Watched"

    @property
    def model(self) -> str:
        return f"case/{self.name}"


def fresh(kind: str, **params: Any) -> dict[str, Any]:
    """A fault on every request that does not continue a prefill: whichever machine leads
    breaks, the rescue is served."""
    return {"kind": kind, "always": True, "requests": "fresh", **params}


CASES = (
    Case("cut-in-arguments", (fresh("cut", afterTokens=IN_WRITE),)),
    Case("stall-in-arguments", (fresh("stall", afterTokens=IN_WRITE, seconds=30),)),
    Case("move-in-arguments", (fresh("rateCollapse", afterTokens=IN_WRITE, tokensPerSecond=2),)),
    Case("held-long", (fresh("stall", afterTokens=IN_WRITE, seconds=1.0),), b=False),
    # A long call written at the pace the machine publishes, a slower alternative beside it.
    Case(
        "steady-call",
        reply="Writing it. ",
        calls=(LONG_CALL,),
        a_speed=(0.0, 100.0),
        a_published=(0.01, 100.0),
        b_published=(0.05, 50.0),
    ),
    Case("echo", (fresh("cut", afterTokens=5),), b_echoes=True, b_declared_echo=True),
    Case("echo-undeclared", (fresh("cut", afterTokens=5),), b_echoes=True),
    Case("max-tokens", (fresh("cut", afterTokens=7),), reply=PLAIN, calls=()),
    Case("max-tokens-wide", (fresh("cut", afterTokens=2),), reply=LONG, calls=()),
    Case("max-tokens-reached", (fresh("cut", afterTokens=12),), reply=LONG, calls=()),
    Case("reasoning", (fresh("cut", afterTokens=REASONING_PIECES + 3),), reasoning=REASONING),
    Case("cut-in-reasoning", (fresh("cut", afterTokens=3),), reasoning=REASONING),
    Case(
        "reasons-again",
        (fresh("cut", afterTokens=REASONING_PIECES + 3),),
        reasoning=REASONING,
        b_reasons_again=True,
    ),
    Case("parallel", (fresh("cut", afterTokens=IN_READ),)),
    Case("forced", (fresh("cut", afterTokens=TEXT_PIECES + 3),)),
    Case("alone", (fresh("cut", afterTokens=4),), reply=""),
    Case("malformed-arguments", (fresh("malformedToolCall", flaw="arguments"),)),
    Case("undeclared-tool", (fresh("malformedToolCall", flaw="name"),)),
    Case("malformed-alone", (fresh("malformedToolCall", flaw="arguments"),), reply=""),
    Case("several-answers", (fresh("cut", afterTokens=5),)),
    Case("buffered", (fresh("cut", afterTokens=IN_WRITE),), visibility="Unwatched"),
    Case("stop-across-seam", (fresh("cut", afterTokens=2),), reply=SEAM_REPLY, calls=()),
    # Both machines break every fresh answer where a property example says: whichever
    # leads (the affinity pin moves), the other rescues it.
    Case("property", a_continues=True),
    Case("property-echo", b_echoes=True, b_declared_echo=True, a_continues=True),
)
CASE = {case.name: case for case in CASES}


def _sim_model(case: Case) -> dict[str, Any]:
    ttft, rate = case.a_speed
    echo = {"echoesPrefill": True} if case.b_echoes else {}
    if case.b_reasons_again:
        echo["reasonsAgain"] = True
    machines = [
        {"name": "a", "ttftSeconds": ttft, "tokensPerSecond": rate, "faults": case.a_faults,
         "continuesPartialMessage": case.a_continues, "echoesPrefill": case.b_echoes},
        {"name": "b", "ttftSeconds": 0, "tokensPerSecond": 0, "faults": case.b_faults,
         "continuesPartialMessage": True, **echo},
    ]  # fmt: skip
    return {
        "name": case.model,
        "reply": case.reply,
        "reasoning": case.reasoning,
        "argumentPieceChars": PIECE_CHARS,
        "toolCalls": [{"name": name, "arguments": arguments} for name, arguments in case.calls],
        "machines": machines if case.b else machines[:1],
    }


def _policy_machines(case: Case) -> list[dict[str, Any]]:
    echo = case.b_declared_echo
    (a_ttft, a_rate), (b_ttft, b_rate) = case.a_published, case.b_published
    machines = [
        {"name": "a", "ttftSeconds": a_ttft, "tokensPerSecond": a_rate,
         "continuesPartialMessage": case.a_continues, "echoesPartialMessage": echo},
        {"name": "b", "ttftSeconds": b_ttft, "tokensPerSecond": b_rate,
         "continuesPartialMessage": True, "echoesPartialMessage": echo},
    ]  # fmt: skip
    return machines if case.b else machines[:1]


@dataclass
class Rig:
    sim: RunningSim
    proxy: RunningProxy
    seen: int = 0  # the simulator's last record before the case at hand


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def rig() -> AsyncIterator[Rig]:
    sim = await start_sim(
        parse_scenario({"seed": 5, "models": [_sim_model(case) for case in CASES]}),
        "127.0.0.1",
        0,
    )
    policy = {
        "apiVersion": "rolegate.dev/v1alpha1",
        "kind": "ProviderPolicy",
        "metadata": {"name": "sim", "namespace": "test"},
        "spec": {
            "endpoint": f"{sim.url}/v1",
            "dialect": "Aggregator",
            "breaker": LENIENT_BREAKER,
            "models": [{"name": case.model, "machines": _policy_machines(case)} for case in CASES],
        },
    }
    roles = [
        {**role(case.name, [case.model], visibility=case.visibility), "ruling": "Order"}
        for case in CASES
    ]
    try:
        config = compile_objects([policy, role_table(*roles)])
    except BaseException:
        await sim.stop()
        raise
    proxy = await start_proxy(
        ProxySettings(
            host="127.0.0.1", port=0, explore_share=0.0, random_seed=0, keepalive_seconds=0.2
        ),
        config,
    )
    yield Rig(sim, proxy)
    await proxy.stop()
    await sim.stop()


@dataclass
class Answer:
    """What the client assembled, as an agent does."""

    content: str = ""
    reasoning: str = ""
    calls: dict[int, dict[str, str]] = field(default_factory=dict)
    finish: str | None = None
    usage: Any = None
    chunks: int = 0
    # The ids of the chunks that carried text: whose events they are.
    text_ids: set[str] = field(default_factory=set)

    @property
    def named_calls(self) -> list[tuple[str, str]]:
        return [(call["name"], call["arguments"]) for call in self.calls.values()]


async def ask(rig: Rig, case: str, *, stream: bool = True, **extra: Any) -> Answer:
    """One request of the case's role, with the tools declared."""
    async with httpx.AsyncClient() as http:
        known = (await http.get(f"{rig.sim.url}/_sim/requests")).json()
        rig.seen = known[-1]["seq"] if known else 0
    async with openai.AsyncOpenAI(
        base_url=f"{rig.proxy.url}/v1", api_key="x", max_retries=0
    ) as client:
        extra.setdefault("tools", TOOLS)
        if not stream:
            completion = await client.chat.completions.create(model=case, messages=PROMPT, **extra)
            message = completion.choices[0].message
            answer = Answer(message.content or "", finish=completion.choices[0].finish_reason)
            for index, call in enumerate(message.tool_calls or []):
                assert call.type == "function"
                answer.calls[index] = {"id": call.id, "name": call.function.name,
                                       "arguments": call.function.arguments}  # fmt: skip
            return answer
        answer = Answer()
        chunks = await client.chat.completions.create(
            model=case, messages=PROMPT, stream=True,
            stream_options={"include_usage": True}, **extra,
        )  # fmt: skip
        async for chunk in chunks:
            answer.chunks += 1
            answer.usage = chunk.usage or answer.usage
            for choice in chunk.choices:
                delta = choice.delta
                answer.content += delta.content or ""
                if delta.content:
                    answer.text_ids.add(chunk.id)
                answer.reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
                # What agents do: a call's first delta opens it, later ones extend it.
                for part in delta.tool_calls or []:
                    call = answer.calls.setdefault(
                        part.index, {"id": "", "name": "", "arguments": ""}
                    )
                    call["id"] += part.id or ""
                    if part.function is not None:
                        call["name"] += part.function.name or ""
                        call["arguments"] += part.function.arguments or ""
                answer.finish = choice.finish_reason or answer.finish
        return answer


async def records(rig: Rig) -> list[dict[str, Any]]:
    """The simulator's records of the case at hand."""
    async with httpx.AsyncClient() as http:
        response = await http.get(f"{rig.sim.url}/_sim/requests", params={"since": rig.seen})
        found: list[dict[str, Any]] = response.json()
        return found


def assert_sound(answer: Answer, calls: list[tuple[str, str]] = CALLS) -> None:
    """The calls the upstream made, each once, whole, with arguments that parse."""
    assert answer.named_calls == calls
    for call in answer.calls.values():
        json.loads(call["arguments"])
    assert len({call["id"] for call in answer.calls.values()}) == len(calls)


async def test_a_cut_inside_tool_call_arguments_is_rescued_invisibly(rig: Rig) -> None:
    answer = await ask(rig, "cut-in-arguments")
    assert answer.content == TEXT  # the text streamed once; the calls came whole
    assert_sound(answer)
    assert answer.finish == "tool_calls"
    first, rescue = await records(rig)
    assert (first["machine"], first["outcome"], first["tokens_sent"]) == ("a", "cut", IN_WRITE)
    assert (rescue["machine"], rescue["continued_partial"]) == ("b", True)
    # The continuation was asked from the text, not from the call the client never saw.
    assert rescue["tool_calls_sent"] == 2


async def test_a_stall_inside_tool_call_arguments_is_rescued_long_before_the_idle_limit(
    rig: Rig,
) -> None:
    started = time.monotonic()
    answer = await ask(rig, "stall-in-arguments")
    assert time.monotonic() - started < 5.0  # silence is evidence, arguments or not
    assert answer.content == TEXT
    assert_sound(answer)
    first, rescue = await records(rig)
    assert (first["machine"], rescue["machine"], rescue["continued_partial"]) == ("a", "b", True)


async def test_a_rate_move_during_a_tool_call_replaces_the_call_it_held(rig: Rig) -> None:
    answer = await ask(rig, "move-in-arguments", extra_headers={"X-Request-Id": "move-1"})
    assert answer.content == TEXT
    assert_sound(answer)
    (outcome,) = rig.proxy.state.decisions.recent(request_id="move-1")
    assert [(arm.machine, arm.result.value) for arm in outcome.arms] == [
        ("a", "moved"), ("b", "ok")
    ]  # fmt: skip
    first, continued = await records(rig)
    # Moved while writing the call: its arguments counted as output for the rate test,
    # and what was held of it was dropped.
    assert TEXT_PIECES < first["tokens_sent"] < ALL_PIECES
    assert continued["continued_partial"]


async def test_a_long_call_written_at_a_healthy_pace_is_output_not_silence(rig: Rig) -> None:
    """A stream busy writing arguments produces: it is neither stalled nor moved."""
    answer = await ask(rig, "steady-call", extra_headers={"X-Request-Id": "steady"})
    assert_sound(answer, [LONG_CALL])
    (outcome,) = rig.proxy.state.decisions.recent(request_id="steady")
    assert [(arm.machine, arm.result.value, arm.act) for arm in outcome.arms] == [
        ("a", "ok", None)
    ]  # fmt: skip


async def test_an_echoing_continuation_is_trimmed_so_no_text_comes_twice(rig: Rig) -> None:
    answer = await ask(rig, "echo")
    assert answer.content == TEXT
    assert_sound(answer)
    # The trimmed event is the upstream's own, changed only in its text (its id, and all
    # else it said: logprobs, a fingerprint), never one rolegate made up.
    assert len(answer.text_ids) == 2
    assert all(chunk_id.startswith("gen-") for chunk_id in answer.text_ids)
    _, rescue = await records(rig)
    assert (rescue["machine"], rescue["echoed_prefill"]) == ("b", True)


async def test_an_echo_from_a_machine_not_declared_to_echo_is_not_guessed_at(rig: Rig) -> None:
    """Trimming is a declaration, never a guess: the undeclared echo reaches the client
    (the ProviderPolicy must say `echoesPartialMessage`), and no text is ever cut."""
    answer = await ask(rig, "echo-undeclared")
    delivered = "".join(tokenize(TEXT)[:5])
    assert answer.content == delivered + TEXT


async def test_max_tokens_holds_across_a_handover(rig: Rig) -> None:
    answer = await ask(rig, "max-tokens", tools=None, max_tokens=20)
    # Exactly what one machine would write under the same limit.
    assert answer.content == "".join(tokenize(PLAIN)[:20])
    assert answer.finish == "length"
    assert answer.usage.completion_tokens == 20
    assert answer.usage.model_extra["estimated"] is True
    _, rescue = await records(rig)
    assert (rescue["machine"], rescue["tokens_sent"]) == ("b", 13)


async def test_max_tokens_is_never_exceeded_whatever_the_text_costs(rig: Rig) -> None:
    """Two pieces of `w0—é ` were delivered: each may have been written in byte tokens (one
    a byte of its `—` and `é`), so the continuation is asked for what is left of the limit
    after the most they can have been, and the answer stops short of it rather than past."""
    answer = await ask(rig, "max-tokens-wide", tools=None, max_tokens=20)
    _, rescue = await records(rig)
    at_most = 20 - 2 * (1 + 2 + 1)  # two pieces, and each one's two wide bytes and one
    assert rescue["tokens_sent"] == at_most
    assert answer.content == "".join(tokenize(LONG)[: 2 + at_most])
    assert answer.finish == "length"


async def test_an_answer_that_broke_at_its_token_limit_ends_there(rig: Rig) -> None:
    """Nothing is left of the limit: no machine is asked for more."""
    answer = await ask(rig, "max-tokens-reached", tools=None, max_tokens=12,
                       extra_headers={"X-Request-Id": "at-limit"})  # fmt: skip
    assert answer.content == "".join(tokenize(LONG)[:12])
    assert answer.finish == "length"
    assert [r["machine"] for r in await records(rig)] == ["a"]
    (outcome,) = rig.proxy.state.decisions.recent(request_id="at-limit")
    assert outcome.outcome.value == "answered"


async def test_reasoning_before_content_is_never_spliced_into_it(rig: Rig) -> None:
    answer = await ask(rig, "reasoning")
    assert answer.reasoning == REASONING
    assert answer.content == TEXT
    assert_sound(answer)
    assert [r["machine"] for r in await records(rig)] == ["a", "b"]


async def test_a_continuation_that_thinks_again_is_not_heard_after_the_content(
    rig: Rig,
) -> None:
    """Its second reasoning would land in the client's reasoning after the content began:
    held back (the client had the first machine's)."""
    answer = await ask(rig, "reasons-again")
    assert answer.reasoning == REASONING
    assert answer.content == TEXT
    assert_sound(answer)
    _, rescue = await records(rig)
    assert (rescue["machine"], rescue["tokens_sent"]) == ("b", ALL_PIECES + REASONING_PIECES - 3)


async def test_a_break_during_reasoning_starts_the_answer_afresh(rig: Rig) -> None:
    """No content had reached the client: the next machine is sent the plain request, and
    its reasoning follows the reasoning the client already had."""
    answer = await ask(rig, "cut-in-reasoning")
    assert answer.content == TEXT
    assert answer.reasoning == "".join(tokenize(REASONING)[:3]) + REASONING
    assert_sound(answer)
    _, second = await records(rig)
    assert (second["machine"], second["continued_partial"]) == ("b", False)


async def test_parallel_calls_broken_in_the_second_arrive_each_once(rig: Rig) -> None:
    answer = await ask(rig, "parallel")
    assert answer.content == TEXT
    assert_sound(answer)
    broken, _ = await records(rig)
    assert broken["tokens_sent"] == IN_READ


async def test_a_call_tool_choice_forces_is_rescued_like_any(rig: Rig) -> None:
    forced = {"type": "function", "function": {"name": "read_file"}}
    answer = await ask(rig, "forced", tool_choice=forced)
    assert answer.content == TEXT
    assert_sound(answer, [("read_file", READ)])


async def test_a_call_alone_that_breaks_is_answered_afresh_unseen(rig: Rig) -> None:
    answer = await ask(rig, "alone")
    assert answer.content == ""
    assert_sound(answer)
    first, second = await records(rig)
    assert (first["outcome"], second["machine"], second["continued_partial"]) == (
        "cut", "b", False
    )  # fmt: skip


@pytest.mark.parametrize(
    ("case", "signature"),
    [("malformed-arguments", "tool_arguments_not_json"), ("undeclared-tool", "undeclared_tool")],
)
async def test_a_broken_call_is_a_malformed_verdict_and_replaced(
    rig: Rig, case: str, signature: str
) -> None:
    answer = await ask(rig, case, extra_headers={"X-Request-Id": case})
    assert answer.content == TEXT
    assert_sound(answer)
    (outcome,) = rig.proxy.state.decisions.recent(request_id=case)
    assert [(arm.machine, arm.result.value) for arm in outcome.arms] == [
        ("a", "malformed_tool_call"), ("b", "ok")
    ]  # fmt: skip
    verdicts = rig.proxy.state.dispatcher.verdicts.rows()
    rows = [row for row in verdicts if row.model == CASE[case].model and row.machine == "a"]
    assert [(row.verdict.value, row.signature, row.attributable) for row in rows] == [
        ("malformed", signature, True)
    ]


async def test_a_broken_call_in_a_non_streamed_answer_is_replaced(rig: Rig) -> None:
    answer = await ask(rig, "malformed-alone", stream=False)
    assert answer.content == ""
    assert_sound(answer)
    assert [r["machine"] for r in await records(rig)] == ["a", "b"]


async def test_several_answers_are_never_spliced_from_two_machines(rig: Rig) -> None:
    with pytest.raises(openai.APIError, match="incomplete"):
        await ask(rig, "several-answers", n=2)
    assert [r["machine"] for r in await records(rig)] == ["a"]


async def test_a_buffered_answer_broken_inside_a_call_goes_back_to_its_text(rig: Rig) -> None:
    answer = await ask(rig, "buffered")
    assert answer.content == TEXT
    assert_sound(answer)


async def test_a_stop_sequence_across_the_seam_ends_the_answer(rig: Rig) -> None:
    # `a\nb` begins in what was delivered (`one xa\n`) and ends in the continuation.
    answer = await ask(rig, "stop-across-seam", tools=None, stop=["a\nb"])
    assert answer.content == "one xa\n"
    assert answer.finish == "stop"


async def test_the_held_answer_keeps_the_caller_hearing_from_us(rig: Rig) -> None:
    """While a call is held, a slow machine's silence is filled with keep-alive comments
    (the caller's idle timers), never with a piece of the call."""
    raw = b""
    body = {"model": "held-long", "messages": PROMPT, "tools": TOOLS, "stream": True}
    async with (
        httpx.AsyncClient(timeout=30) as http,
        http.stream("POST", f"{rig.proxy.url}/v1/chat/completions", json=body) as response,
    ):
        async for data in response.aiter_bytes():
            raw += data
    events = [event for event in raw.split(b"\n\n") if event]
    first_call = next(i for i, e in enumerate(events) if b"tool_calls" in e)
    comments = [i for i, e in enumerate(events) if e.startswith(b":")]
    assert comments
    assert all(i < first_call for i in comments)
    # Every call's events went out together, after the last keep-alive.
    assert all(b"tool_calls" in e or b"finish_reason" in e or b"usage" in e or e == b"data: [DONE]"
               for e in events[first_call:])  # fmt: skip


# Text and calls with multi-byte characters throughout: a cut lands next to any of them.
@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(cut=st.integers(1, ALL_PIECES - 1), echo=st.booleans())
async def test_wherever_a_stream_breaks_the_client_assembles_the_upstreams_answer(
    rig: Rig, cut: int, echo: bool
) -> None:
    case = "property-echo" if echo else "property"
    faults = [fresh("cut", afterTokens=cut)]
    async with httpx.AsyncClient() as http:
        for machine in ("a", "b"):
            url = f"{rig.sim.url}/_sim/machines/{CASE[case].model}/{machine}/faults"
            (await http.put(url, json=faults)).raise_for_status()
    answer = await ask(rig, case)
    assert answer.content.encode() == TEXT.encode()  # each byte once, in place
    assert_sound(answer)
    assert answer.finish == "tool_calls"
    # The break happened where it was drawn, and (some text had reached the client
    # wherever the cut) the rescue went on from it. A loaded machine may add an arm: a
    # late first token raced, say; what the client assembled is the property.
    found = await records(rig)
    assert [r["tokens_sent"] for r in found if r["outcome"] == "cut"] == [cut]
    assert found[-1]["continued_partial"]
