"""Buffered delivery (SPEC E5), through the real proxy, simulator and openai client: a role
nobody watches gets only a complete, judged answer; what fails is replaced unseen, and a
streaming caller hears SSE comments meanwhile."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest

from ..support import ProxyFactory, SimFactory, provider_policy, role, role_table, sim_records

MODEL = "vendor/model-a"
SECOND = "vendor/model-b"
REPLY = "one two three four five six seven eight — café 日本 🎉"
PROMPT: Any = [{"role": "user", "content": "say it"}]
FIGURES = {"ttftSeconds": 0.05, "tokensPerSecond": 100}


def _bad(*faults: dict[str, Any]) -> dict[str, Any]:
    return {"name": "bad", "ttftSeconds": 0, "tokensPerSecond": 0, "faults": list(faults)}


async def _proxy(
    sim_server: SimFactory,
    proxy_server: ProxyFactory,
    fault: dict[str, Any],
    *,
    visibility: str = "Unwatched",
    **settings: Any,
) -> tuple[str, str]:
    sim = await sim_server({"seed": 4, "models": [
        {"name": MODEL, "reply": REPLY, "machines": [_bad(fault)]},
        {"name": SECOND, "reply": REPLY, "machines": [{"name": "good"}]},
    ]})  # fmt: skip
    policy = provider_policy("agg", f"{sim.url}/v1", {MODEL: ["bad"], SECOND: ["good"]})
    for model in policy["spec"]["models"]:
        # Published figures: a silence can be judged against them (SPEC B5).
        model["machines"] = [{**m, **FIGURES} for m in model["machines"]]
    proxy = await proxy_server(
        [policy, role_table(role("batch", [MODEL, SECOND], patience=20, visibility=visibility))],
        **settings,
    )
    return proxy.url, sim.url


async def _stream(url: str) -> str:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        stream = await client.chat.completions.create(model="batch", messages=PROMPT, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


HIDDEN = [
    {"kind": "mojibake", "always": True},
    {"kind": "replacementChar", "always": True},
    {"kind": "cut", "always": True, "afterTokens": 3},
    {"kind": "streamError", "always": True, "afterTokens": 3},
    {"kind": "stall", "always": True, "afterTokens": 3, "seconds": 30, "thenClose": True},
]


@pytest.mark.parametrize("fault", HIDDEN, ids=lambda f: str(f["kind"]))
async def test_an_unwatched_role_gets_only_a_complete_judged_answer(
    sim_server: SimFactory, proxy_server: ProxyFactory, fault: dict[str, Any]
) -> None:
    url, sim_url = await _proxy(sim_server, proxy_server, fault)
    assert await _stream(url) == REPLY  # the fallback's, whole; nothing of the bad one
    machines = [r["machine"] for r in await sim_records(sim_url)]
    assert machines[0] == "bad"
    assert machines[-1] == "good"


async def test_a_held_stream_that_goes_silent_moves_afresh_at_once(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """Silence is evidence (B5): a held stream that stops is replaced, from the start, by a
    machine that need not continue partial messages, long before its idle limit."""
    stall = {"kind": "stall", "always": True, "afterTokens": 3, "seconds": 30}
    url, sim_url = await _proxy(sim_server, proxy_server, stall)
    started = time.monotonic()
    assert await _stream(url) == REPLY
    assert time.monotonic() - started < 3.0
    assert [r["machine"] for r in await sim_records(sim_url)] == ["bad", "good"]


async def test_a_watched_role_sees_what_a_buffered_one_is_spared(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """The control: the same cut, live, reaches the client as a clear error."""
    url, _ = await _proxy(
        sim_server, proxy_server, {"kind": "cut", "always": True, "afterTokens": 3},
        visibility="Watched",
    )  # fmt: skip
    with pytest.raises(openai.APIError, match="incomplete"):
        await _stream(url)


async def test_a_held_answer_is_kept_alive_with_comments_then_sent_whole(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    late = {"kind": "lateFirstToken", "always": True, "seconds": 1.0}
    sim = await sim_server({"seed": 4, "models": [
        {"name": MODEL, "reply": REPLY, "machines": [_bad(late)]}]})  # fmt: skip
    proxy = await proxy_server(
        [
            provider_policy("agg", f"{sim.url}/v1", {MODEL: ["bad"]}),
            role_table(role("batch", [MODEL], patience=10, visibility="Unwatched")),
        ],
        keepalive_seconds=0.2,
    )
    url = proxy.url
    raw = b""
    arrivals: list[tuple[float, bytes]] = []
    started = time.monotonic()
    async with (
        httpx.AsyncClient(timeout=10) as client,
        client.stream(
            "POST", f"{url}/v1/chat/completions",
            json={"model": "batch", "messages": PROMPT, "stream": True},
        ) as response,
    ):  # fmt: skip
        assert response.status_code == 200
        async for data in response.aiter_raw():
            arrivals.append((time.monotonic() - started, data))
            raw += data
    comments = raw.count(b": rolegate: working\n\n")
    assert comments >= 3  # about one every 0.2 s of the 1 s wait
    answer = raw.replace(b": rolegate: working\n\n", b"")
    # The answer came in one piece, after the comments.
    first_data = next(at for at, data in arrivals if b"data: " in data)
    assert first_data >= 1.0 - 0.05
    assert raw.index(b"data: ") > raw.rindex(b": rolegate: working")
    assert answer.endswith(b"data: [DONE]\n\n")
    assert REPLY.split()[-1].encode() in answer


async def test_when_every_attempt_fails_after_keep_alives_the_error_is_an_event(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    sim = await sim_server({"seed": 4, "models": [{"name": MODEL, "reply": REPLY, "machines": [
        _bad({"kind": "stall", "always": True, "afterTokens": 0, "seconds": 30})]}]})  # fmt: skip
    proxy = await proxy_server(
        [
            provider_policy("agg", f"{sim.url}/v1", {MODEL: ["bad"]}),
            role_table(role("batch", [MODEL], patience=1.5, visibility="Unwatched")),
        ],
        keepalive_seconds=0.2,
    )
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0) as c:
        stream = await c.chat.completions.create(model="batch", messages=PROMPT, stream=True)
        with pytest.raises(openai.APIError, match="No upstream could serve") as caught:
            async for _ in stream:
                pass
    assert "upstream_unavailable" in str(caught.value.body)
    async with httpx.AsyncClient() as client:
        (decision,) = (await client.get(f"{proxy.url}/v1/rolegate/decisions")).json()["decisions"]
    assert (decision["outcome"], decision["error_code"]) == ("failed", "upstream_unavailable")


async def test_a_quick_failure_of_a_buffered_role_keeps_its_http_status(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    """Nothing was committed yet (no keep-alive was due): the client gets the status."""
    sim = await sim_server({"seed": 4, "models": [{"name": MODEL, "reply": REPLY, "machines": [
        _bad({"kind": "serverError", "always": True, "status": 503})]}]})  # fmt: skip
    proxy = await proxy_server(
        [
            provider_policy("agg", f"{sim.url}/v1", {MODEL: ["bad"]}),
            role_table(role("batch", [MODEL], patience=10, visibility="Unwatched")),
        ]
    )
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0) as c:
        with pytest.raises(openai.InternalServerError) as caught:
            await c.chat.completions.create(model="batch", messages=PROMPT, stream=True)
    assert caught.value.status_code == 502
