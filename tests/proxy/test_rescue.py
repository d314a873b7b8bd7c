"""Rescue after content (SPEC E4, E5), through the real proxy, simulator and openai client:
whatever breaks a stream once content reached the client, the rest of the answer comes from
a machine that continues partial messages, spliced into the same stream; the end of an
answer is its final chunk; usage the client asked for always arrives."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rolegate_sim.text import tokenize

from ..fault_cases import DEFAULTS, Case, always, ask, rig
from ..support import (
    ProxyFactory,
    SimFactory,
    machine_policy,
    provider_policy,
    role,
    role_table,
    sim_records,
)

MODEL = "vendor/model-a"
SECOND = "vendor/model-b"
# Long enough to cut in the middle; multi-byte characters throughout.
REPLY = " ".join(f"w{i}—é日🎉" for i in range(60))
PROMPT: Any = [{"role": "user", "content": "count"}]
FIGURES = {"ttftSeconds": 0.01, "tokensPerSecond": 100}


def _machine(name: str, *faults: dict[str, Any], continues: bool = False) -> dict[str, Any]:
    return {"name": name, "ttftSeconds": 0, "tokensPerSecond": 0, "faults": list(faults),
            "continuesPartialMessage": continues}  # fmt: skip


def _published(name: str, *, continues: bool = False) -> dict[str, Any]:
    return {"name": name, **FIGURES, "continuesPartialMessage": continues}


async def _stream(url: str, model: str = "agent", **extra: Any) -> tuple[str, list[Any]]:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model=model, messages=PROMPT, stream=True, **extra
        )
        chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


async def _one_model(
    sim_server: SimFactory,
    proxy_server: ProxyFactory,
    machines: list[dict[str, Any]],
    published: list[dict[str, Any]],
) -> tuple[str, str]:
    sim = await sim_server({"seed": 3, "models": [
        {"name": MODEL, "reply": REPLY, "machines": machines}]})  # fmt: skip
    proxy = await proxy_server(
        [machine_policy(sim.url, MODEL, published), role_table(role("agent", [MODEL]))]
    )
    return proxy.url, sim.url


BREAKS = [
    {"kind": "cut", "always": True, "afterTokens": 17},
    {"kind": "streamError", "always": True, "afterTokens": 17},
    {"kind": "stall", "always": True, "afterTokens": 17, "seconds": 30, "thenClose": True},
]


@pytest.mark.parametrize("fault", BREAKS, ids=lambda f: str(f["kind"]))
async def test_a_stream_that_breaks_after_content_is_continued_by_another_machine(
    sim_server: SimFactory, proxy_server: ProxyFactory, fault: dict[str, Any]
) -> None:
    url, sim_url = await _one_model(
        sim_server, proxy_server,
        [_machine("m1", fault), _machine("m2", continues=True)],
        [_published("m1"), _published("m2", continues=True)],
    )  # fmt: skip
    started = time.monotonic()
    text, _ = await _stream(url)
    assert text == REPLY  # byte-exact: nothing duplicated, nothing lost
    # A stall is acted on by its silence, long before the 30 s idle limit.
    assert time.monotonic() - started < 5.0
    first, rescue = await sim_records(sim_url)
    assert (first["machine"], first["tokens_sent"]) == ("m1", 17)
    assert (rescue["machine"], rescue["continued_partial"]) == ("m2", True)


async def test_the_next_model_continues_when_the_same_model_has_no_such_machine(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    sim = await sim_server({"seed": 3, "models": [
        {"name": MODEL, "reply": REPLY, "machines": [
            _machine("m1", {"kind": "cut", "always": True, "afterTokens": 9}),
            _machine("plain")]},
        {"name": SECOND, "reply": REPLY, "machines": [_machine("c1", continues=True)]},
    ]})  # fmt: skip
    proxy = await proxy_server([
        machine_policy(sim.url, MODEL, [_published("m1"), _published("plain")]),
        machine_policy(sim.url, SECOND, [_published("c1", continues=True)], name="other"),
        role_table(role("agent", [MODEL, SECOND])),
    ])  # fmt: skip
    text, chunks = await _stream(proxy.url)
    assert text == REPLY
    records = await sim_records(sim.url)
    # The machine that cannot continue a prefill is never sent one.
    assert [r["machine"] for r in records] == ["m1", "c1"]
    assert records[1]["continued_partial"]
    assert {c.model for c in chunks if c.choices and c.choices[0].delta.content} == {MODEL, SECOND}


async def test_a_machine_refusing_the_prefill_is_not_the_answer_while_another_can_continue(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    refuses = {"kind": "refusePrefill", "always": True}
    url, sim_url = await _one_model(
        sim_server, proxy_server,
        [_machine("m1", {"kind": "cut", "always": True, "afterTokens": 5}),
         _machine("liar", refuses, continues=True), _machine("m3", continues=True)],
        [{**_published("m1"), "tokensPerSecond": 400},
         {**_published("liar", continues=True), "tokensPerSecond": 200},
         _published("m3", continues=True)],
    )  # fmt: skip
    text, _ = await _stream(url)
    assert text == REPLY
    records = await sim_records(sim_url)
    assert [(r["machine"], r["status"]) for r in records] == [
        ("m1", 200),
        ("liar", 400),
        ("m3", 200),
    ]


async def test_with_nobody_to_continue_the_client_gets_a_clear_error_event(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    refuses = {"kind": "refusePrefill", "always": True}
    url, _sim_url = await _one_model(
        sim_server, proxy_server,
        [_machine("m1", {"kind": "cut", "always": True, "afterTokens": 5}),
         _machine("liar", refuses, continues=True)],
        [{**_published("m1"), "tokensPerSecond": 400}, _published("liar", continues=True)],
    )  # fmt: skip
    with pytest.raises(openai.APIError, match="incomplete") as caught:
        await _stream(url)
    # In our words, with no upstream text.
    assert "Assistant message prefill" not in str(caught.value)
    async with httpx.AsyncClient() as client:
        decisions = (await client.get(f"{url}/v1/rolegate/decisions")).json()["decisions"]
    (decision,) = decisions
    assert decision["outcome"] == "incomplete"
    assert [a["result"] for a in decision["arms"]] == ["broken_stream", "request_fault"]


async def test_a_complete_stream_without_done_is_answered_and_noted(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    url, _ = await _one_model(
        sim_server, proxy_server,
        [_machine("m1", {"kind": "noDone", "always": True})], [_published("m1")],
    )  # fmt: skip
    text, chunks = await _stream(url, stream_options={"include_usage": True})
    assert text == REPLY
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.completion_tokens == 60  # the upstream's own, forwarded
    async with httpx.AsyncClient() as client:
        metrics = (await client.get(f"{url}/metrics")).text
        decisions = (await client.get(f"{url}/v1/rolegate/decisions")).json()["decisions"]
    assert 'rolegate_upstream_missing_done_total{provider="agg"} 1.0' in metrics
    assert decisions[0]["outcome"] == "answered"
    assert [a["result"] for a in decisions[0]["arms"]] == ["ok"]


async def test_usage_the_upstream_does_not_send_is_estimated_and_says_so(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    url, _ = await _one_model(
        sim_server, proxy_server,
        [_machine("m1", {"kind": "noUsage", "always": True})], [_published("m1")],
    )  # fmt: skip
    text, chunks = await _stream(url, stream_options={"include_usage": True})
    assert text == REPLY
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.completion_tokens == 60
    assert usage.prompt_tokens >= 1
    assert usage.model_extra == {"estimated": True}
    async with httpx.AsyncClient() as client:
        metrics = (await client.get(f"{url}/metrics")).text
    assert 'rolegate_upstream_missing_usage_total{provider="agg"} 1.0' in metrics
    # Not asked for: none sent.
    _, plain = await _stream(url)
    assert all(c.usage is None for c in plain)


async def test_a_spliced_answer_reports_one_usage_for_the_whole_answer(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    url, _ = await _one_model(
        sim_server, proxy_server,
        [_machine("m1", {"kind": "cut", "always": True, "afterTokens": 20}),
         _machine("m2", continues=True)],
        [_published("m1"), _published("m2", continues=True)],
    )  # fmt: skip
    text, chunks = await _stream(url, stream_options={"include_usage": True})
    assert text == REPLY
    usages = [c.usage for c in chunks if c.usage is not None]
    assert len(usages) == 1
    assert usages[0].completion_tokens == 60
    assert usages[0].model_extra == {"estimated": True}


async def test_a_direct_provider_continues_another_providers_answer(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """A break on an aggregator continued by a plain OpenAI-compatible server of the same
    model that declares it continues partial messages."""
    sim = await sim_server(
        {
            "seed": 3,
            "models": [
                {
                    "name": MODEL,
                    "reply": REPLY,
                    "machines": [
                        _machine("m1", {"kind": "streamError", "always": True, "afterTokens": 30})
                    ],
                }
            ],
        }
    )
    server = await sim_server(
        {
            "seed": 3,
            "models": [
                {"name": MODEL, "reply": REPLY, "machines": [_machine("only", continues=True)]}
            ],
        }
    )
    direct = provider_policy("direct", f"{server.url}/v1", {MODEL: ["direct"]}, dialect="OpenAI")
    direct["spec"]["models"][0]["machines"] = [_published("direct", continues=True)]
    proxy = await proxy_server([
        machine_policy(sim.url, MODEL, [{**_published("m1"), "tokensPerSecond": 400}]), direct,
        role_table(role("agent", [MODEL], ruling="Order")),
    ])  # fmt: skip
    text, _ = await _stream(proxy.url)
    assert text == REPLY
    (continued,) = await sim_records(server.url)
    assert continued["continued_partial"]


# Words of one- to four-byte characters, combining marks among them: a cut lands next to
# any of them.
WORD = st.text(alphabet="ab—é日🎉\u0301Ωx", min_size=1, max_size=5)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(words=st.lists(WORD, min_size=3, max_size=30), data=st.data())
async def test_a_splice_is_byte_exact_wherever_the_stream_breaks(
    words: list[str], data: st.DataObject
) -> None:
    reply = " ".join(words)
    cut_after = data.draw(st.integers(1, len(tokenize(reply)) - 1), label="cut after token")
    case = Case("cut", [always("cut", afterTokens=cut_after)])
    fresh = await rig(case, DEFAULTS, reply=reply)
    try:
        outcome = await ask(fresh.proxy.url)
        outcome.records = await sim_records(fresh.sim.url)
    finally:
        await fresh.stop()
    assert outcome.attempts == ["p1 200", "f1 200 continued"]
    # Nothing duplicated, nothing lost, every byte of every character where it belongs.
    assert outcome.text is not None
    assert outcome.text.encode("utf-8") == reply.encode("utf-8")
