"""One request, one memory (SPEC B9, B6, B7; issue 31 findings 4 and 5), through one
long-lived proxy and simulator and the real openai client: a request never goes back to a
machine it left (a race's loser, one that refused its body); a complete held answer is
delivered, never thrown away for a slower alternative; a pause of ours is never a
machine's silence.

Each case has models of its own, so what one case teaches the ledger touches no other.
What each machine really does is the simulator's; what the proxy believes of it is what
its ProviderPolicy publishes, so the rate test acts where a case needs it to."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from rolegate_proxy.edge.server import RunningProxy
from rolegate_proxy.edge.server import start as start_proxy
from rolegate_proxy.edge.settings import ProxySettings
from rolegate_sim.scenario import parse_scenario
from rolegate_sim.server import RunningSim
from rolegate_sim.server import start as start_sim

from ..support import compile_objects, models_policy, sim_records
from ..waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT: Any = [{"role": "user", "content": "count"}]
WORDS = 40
REPLY = " ".join(f"w{i}—é" for i in range(WORDS))

# Finding 4: a race's loser is never moved back to.
RACED = "memory/raced"
# Finding 4: a model that refused the body (context length) is never sent it again.
REFUSING, SERVING = "memory/refusing", "memory/serving"
# Finding 4: a retry after a failure skips the race's loser as well.
RETRIED = "memory/retried"
# Finding 5: a complete held answer beats a late alternative.
HELD, LATE = "memory/held", "memory/late"
# Finding 5: the slow stream kept while a continuation is tried is not charged the pause.
PAUSED = "memory/paused"

# Published figures: what the proxy believes before it has seen anything.
QUICK = {"ttftSeconds": 0.05, "tokensPerSecond": 300}


def _machine(name: str, *faults: dict[str, Any], rate: float = 0, **more: Any) -> dict[str, Any]:
    return {"name": name, "ttftSeconds": 0, "tokensPerSecond": rate, "faults": list(faults),
            **more}  # fmt: skip


def _always(kind: str, **params: Any) -> dict[str, Any]:
    return {"kind": kind, "always": True, **params}


SCENARIO = {
    "seed": 31,
    "models": [
        {"name": RACED, "reply": REPLY, "machines": [
            # Late to its first token every time: it loses the race to `rival`.
            _machine("first", _always("lateFirstToken", seconds=1.0),
                     continuesPartialMessage=True),
            # Wins the race, then writes at 5 tok/s: the rate test moves it.
            _machine("rival", _always("rateCollapse", afterTokens=4, tokensPerSecond=5),
                     continuesPartialMessage=True),
            _machine("third", continuesPartialMessage=True),
        ]},
        {"name": RETRIED, "reply": REPLY, "machines": [
            _machine("lead", _always("lateFirstToken", seconds=1.0)),
            # Wins the race with an empty answer, which counts as a failure.
            _machine("racer", _always("empty")),
            _machine("spare"),
        ]},
        {"name": REFUSING, "reply": REPLY, "machines": [
            _machine(name, _always("serverError", status=400,
                                   errorCode="context_length_exceeded",
                                   message="This model's maximum context length is 8 tokens"))
            # Two machines: the one that refused is left, and so is the model's other one.
            for name in ("small", "small2")
        ]},
        {"name": SERVING, "reply": REPLY, "machines": [
            _machine("steady", _always("rateCollapse", afterTokens=4, tokensPerSecond=25)),
        ]},
        {"name": HELD, "reply": REPLY, "machines": [_machine("held", rate=25)]},
        {"name": LATE, "reply": REPLY, "machines": [
            _machine("late", _always("lateFirstToken", seconds=4.0)),
        ]},
        {"name": PAUSED, "reply": REPLY, "machines": [
            _machine("slow", rate=25),
            # Accepts, then says nothing for 2 s and hangs up: a continuation that fails
            # after the slow stream's idle limit has passed.
            _machine("hangs", _always("stall", afterTokens=0, seconds=2.0, thenClose=True),
                     continuesPartialMessage=True),
        ]},
    ],
}  # fmt: skip


def _role(name: str, models: list[str], visibility: str) -> dict[str, Any]:
    return {"name": name, "models": models, "patienceSeconds": 30, "visibility": visibility,
            "ruling": "Order", "expectedOutputTokens": WORDS}  # fmt: skip


def _objects(url: str) -> list[Any]:
    continues = {"continuesPartialMessage": True}
    return [
        models_policy("agg", url, {
            # `first` leads; `rival` is its race's rival; `third` is believed slower.
            RACED: [{"name": "first", **QUICK, **continues},
                    {"name": "rival", "ttftSeconds": 0.05, "tokensPerSecond": 250, **continues},
                    {"name": "third", "ttftSeconds": 0.3, "tokensPerSecond": 60, **continues}],
            RETRIED: [{"name": "lead", **QUICK},
                      {"name": "racer", "ttftSeconds": 0.05, "tokensPerSecond": 250},
                      {"name": "spare", "ttftSeconds": 0.3, "tokensPerSecond": 60}],
            REFUSING: [{"name": "small", **QUICK}, {"name": "small2", **QUICK}],
            SERVING: [{"name": "steady", **QUICK}],
            HELD: [{"name": "held", **QUICK}],
            LATE: [{"name": "late", **QUICK}],
        }),
        # A short idle limit: a pause of ours longer than it would read as a stall.
        models_policy("idle", url, {PAUSED: [{"name": "slow", **QUICK}]},
                timeouts={"idleSeconds": 1.0}),
        models_policy("spare", url, {PAUSED: [{"name": "hangs", **QUICK, **continues}]}),
        {
            "apiVersion": "rolegate.dev/v1alpha1",
            "kind": "RoleTable",
            "metadata": {"name": "roles", "namespace": "test"},
            "spec": {"roles": [
                _role("raced", [RACED], "Watched"),
                _role("retried", [RETRIED], "Watched"),
                _role("refused", [REFUSING, SERVING], "Unwatched"),
                _role("held", [HELD, LATE], "Unwatched"),
                _role("paused", [PAUSED], "Watched"),
            ]},
        },
    ]  # fmt: skip


class Rig:
    def __init__(self, sim: RunningSim, proxy: RunningProxy) -> None:
        self.sim = sim
        self.proxy = proxy

    async def records(self, model: str) -> list[dict[str, Any]]:
        return [r for r in await sim_records(self.sim.url) if r["model"] == model]

    async def decision(self, role: str) -> dict[str, Any]:
        """The role's latest decision, once its outcome reached the log."""

        async def logged() -> dict[str, Any] | None:
            async with httpx.AsyncClient() as client:
                response = await client.get(f"{self.proxy.url}/v1/rolegate/decisions")
            found = [d for d in response.json()["decisions"] if d["role"] == role]
            return found[-1] if found and found[-1].get("outcome") else None

        return await eventually(logged, what=f"a decision for role {role}")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig() -> AsyncIterator[Rig]:
    sim = await start_sim(parse_scenario(SCENARIO), "127.0.0.1", 0)
    settings = ProxySettings(host="127.0.0.1", port=0, explore_share=0.0, random_seed=0,
                             metrics_on_api_port=True)  # fmt: skip
    proxy = await start_proxy(settings, compile_objects(_objects(sim.url)))
    yield Rig(sim, proxy)
    await proxy.stop()
    await sim.stop()


async def _ask(rig: Rig, role: str) -> tuple[str, set[str], float]:
    """One streamed request: its text, the models its content came from, its seconds."""
    started = time.monotonic()
    base = f"{rig.proxy.url}/v1"
    async with openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0) as client:
        stream = await client.chat.completions.create(model=role, messages=PROMPT, stream=True)
        chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    models = {c.model for c in chunks if c.choices and c.choices[0].delta.content}
    return text, models, time.monotonic() - started


def _machines(records: list[dict[str, Any]]) -> list[str]:
    return [r["machine"] for r in records]


async def test_a_race_loser_is_never_moved_back_to(rig: Rig) -> None:
    text, _, _ = await _ask(rig, "raced")
    assert text == REPLY
    sent = _machines(await rig.records(RACED))
    # `first` lost the race to `rival`; when `rival` fell behind, the move went to a
    # machine this request had not left, never back to `first`.
    assert sent[:2] == ["first", "rival"], sent
    assert sent.count("first") == 1, sent
    assert sent[2:] == ["third"], sent


async def test_a_retry_never_goes_back_to_a_race_loser(rig: Rig) -> None:
    text, _, _ = await _ask(rig, "retried")
    assert text == REPLY
    records = await rig.records(RETRIED)
    # `lead` lost the race to `racer`, whose answer was empty: the retry that followed
    # asked the aggregator for neither of them, not even as a fallback.
    assert _machines(records) == ["lead", "racer", "spare"], _machines(records)
    retry = records[-1]["provider"]
    assert retry["order"] == ["spare"], retry
    assert sorted(retry["ignore"]) == ["lead", "racer"], retry


async def test_a_model_that_refused_the_body_is_never_sent_it_again(rig: Rig) -> None:
    text, models, _ = await _ask(rig, "refused")
    assert text == REPLY
    assert models == {SERVING}
    # One 400 for context length; the slow held answer that followed was moved by the
    # rate test, never to the model that had refused the very same body (not even to its
    # other machine, which this request had not tried).
    refusals = await rig.records(REFUSING)
    assert [r["status"] for r in refusals] == [400]
    assert _machines(await rig.records(SERVING)) == ["steady"]


async def test_a_complete_held_answer_is_delivered_not_thrown_away_for_a_late_one(
    rig: Rig,
) -> None:
    text, models, seconds = await _ask(rig, "held")
    assert text == REPLY
    # The held answer (1.6 s at 25 tok/s) was complete long before the alternative's first
    # token (4 s): it is what the caller got, when it was complete.
    assert models == {HELD}
    assert seconds < 3.5
    decision = await rig.decision("held")
    results = {a["machine"]: a["result"] for a in decision["arms"]}
    assert results["held"] == "ok", decision["arms"]


async def test_our_pause_of_a_stream_is_never_its_silence(rig: Rig) -> None:
    text, models, _ = await _ask(rig, "paused")
    # The slow stream waited unread while `hangs` was tried (longer than its idle limit):
    # kept, it goes on to its end, never charged a stall.
    assert text == REPLY
    assert models == {PAUSED}
    decision = await rig.decision("paused")
    arms = [(a["machine"], a["result"]) for a in decision["arms"]]
    assert ("slow", "ok") in arms, arms
    assert _machines(await rig.records(PAUSED)).count("slow") == 1
