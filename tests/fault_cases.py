"""The sixteen faults a new user meets (issues 13 and 31), as cases to run through the real
proxy, simulator and `openai` client: `tests/proxy/test_every_fault.py` asserts what each
comes to, `bench/faults.py` prints the table.

Each case is a role with a primary model and one fallback model, each served by a plain
OpenAI-compatible upstream (the simulator, one machine per model: `p1` and `f1`; `p2` is the
primary of the case whose primary continues partial messages); the client streams with
`stream_options.include_usage`.

`LongLivedRig` runs the cases as a user meets them (issue 31, finding 6): one simulator and
one proxy for the whole sequence, each case's faults switched on at runtime through the
simulator's control API, non-streamed health checks between cases, machines that write at a
realistic pace (0.2 s to the first token, about 100 tokens a second, ±20 %) so the rate
test sees real gaps, and every case asked through a Watched role and an Unwatched one (the
Unwatched answer is delivered buffered). Each row is judged on what the client got, the
attempts per machine, resends of an identical body, the caller's time and the `model` that
served: `Expect` per case, `judge` for the rules every case shares.

A `Budget` is the role's retry settings and the provider's idle limit: the defaults, or the
baseline a user might set (at most 2 retries, 30 s patience and stream-idle limit).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

from rolegate_proxy.edge.server import RunningProxy
from rolegate_proxy.edge.server import start as start_proxy
from rolegate_proxy.edge.settings import ProxySettings
from rolegate_sim.scenario import parse_scenario
from rolegate_sim.server import RunningSim
from rolegate_sim.server import start as start_sim

from .support import compile_objects, sim_records
from .waiting import eventually

PRIMARY, FALLBACK = "vendor/primary", "vendor/fallback"
# The primary of the case that needs its primary to continue partial messages: a model of
# its own, so one long-lived rig holds both kinds of primary.
PRIMARY_CONTINUING = "vendor/primary-continuing"
# Sixty tokens, multi-byte characters throughout: a splice that duplicated or lost one
# byte would show.
REPLY = " ".join(f"t{i}—é日🎉" for i in range(60))
PROMPT: Any = [{"role": "user", "content": "count to sixty"}]
FIGURES = {"ttftSeconds": 0.05, "tokensPerSecond": 100}
# The long-lived rig's machines: as published, and as they really write (±20 % per token).
PACED = {"ttftSeconds": 0.2, "tokensPerSecond": 100}
PACED_JITTER = 0.2
HEALTH_CHECK_TOKENS = 10
# Request-caused refusals: resending the identical request to the machine that refused it
# can only be refused again (429 and 408 are the machine's state, not the request's).
REQUEST_CAUSED = frozenset(range(400, 500)) - {408, 429}


@dataclass(frozen=True)
class Budget:
    name: str
    # The role's `retry` (empty: the defaults) and patience; the providers' idleSeconds.
    retry: dict[str, Any] = field(default_factory=dict)
    patience: float = 30.0
    idle_seconds: float | None = None


DEFAULTS = Budget("default settings")
BASELINE = Budget(
    "baseline budget (at most 2 retries, 30 s patience and idle limit)",
    retry={"maxAttempts": 3},
    idle_seconds=30.0,
)


@dataclass(frozen=True)
class Expect:
    """What a case must come to, on top of the rules every case shares (`judge`)."""

    # At most this many attempts at the primary machine and at the fallback machine.
    primary: int
    fallback: int
    # The caller's time, from the request to the last byte, at most (seconds).
    seconds: float
    # The models that may finish the answer (the `model` of its last content chunk); empty
    # for a case whose right outcome is an error.
    served: frozenset[str]


@dataclass(frozen=True)
class Case:
    name: str
    primary: Sequence[dict[str, Any]] = ()
    fallback: Sequence[dict[str, Any]] = ()
    # Whether each machine declares that it continues a partial assistant message.
    continues: tuple[bool, bool] = (False, True)
    # What the client should get: the complete answer, or an error with this status.
    error_status: int | None = None
    expect: Expect | None = None

    @property
    def primary_model(self) -> str:
        return PRIMARY_CONTINUING if self.continues[0] else PRIMARY

    @property
    def primary_machine(self) -> str:
        return "p2" if self.continues[0] else "p1"


def once(kind: str, **params: Any) -> dict[str, Any]:
    return {"kind": kind, "schedule": [1], **params}


def always(kind: str, **params: Any) -> dict[str, Any]:
    return {"kind": kind, "always": True, **params}


def _expect(primary: int, fallback: int, seconds: float, *served: str) -> Expect:
    return Expect(primary, fallback, seconds, frozenset(served))


EITHER = (PRIMARY, FALLBACK)
# An answer on these machines takes about 0.2 + 59 / 100 = 0.8 s.
CASES: tuple[Case, ...] = (
    # Retry-After honoured on the primary, or the idle fallback at once: either is fine.
    Case("429 with Retry-After: 2, once", [once("rateLimit", retryAfterSeconds=2)],
         expect=_expect(2, 1, 3.5, *EITHER)),
    Case("429 forever, no Retry-After", [always("rateLimit")],
         expect=_expect(2, 1, 2.5, FALLBACK)),
    # A transient failure may be retried on the same model (B9's one exception).
    Case("500 once", [once("serverError", status=500)], expect=_expect(2, 1, 2.5, *EITHER)),
    Case("503 forever", [always("serverError", status=503)],
         expect=_expect(2, 1, 2.5, FALLBACK)),
    Case("TCP reset before headers, once", [once("reset")], expect=_expect(2, 1, 2.5, *EITHER)),
    # Published figures call the silent primary late: the fallback races it and wins; the
    # race's loser is never asked again (B9).
    Case("accepted, then silent for 120 s", [always("noResponse", seconds=120)],
         expect=_expect(1, 1, 3.0, FALLBACK)),
    # Run after the silent primary's rows, on a primary three times late in a row: its
    # first-token belief has moved toward lateness (B7), so its late point, and the race,
    # come later than on a machine believed punctual.
    Case("first token after 20 s", [always("lateFirstToken", seconds=20)],
         expect=_expect(1, 1, 3.5, FALLBACK)),
    # Content reached the client (Watched): the fallback continues it. Buffered
    # (Unwatched), the primary may be asked afresh once: a cut is transient.
    Case("stream cut after 40 of 60 tokens", [always("cut", afterTokens=40)],
         expect=_expect(2, 1, 2.5, *EITHER)),
    # Moved away from a silent primary: never back to it (B9).
    Case("20 tokens, 30 s of silence, then close",
         [always("stall", afterTokens=20, seconds=30, thenClose=True)],
         expect=_expect(1, 1, 3.0, FALLBACK)),
    # The answer's own events all arrive: nothing for a fallback to do.
    Case("the 10th event is invalid JSON", [always("malformedEvent", atEvent=10)],
         expect=_expect(1, 0, 2.0, PRIMARY)),
    Case("complete stream without data: [DONE]", [always("noDone")],
         expect=_expect(1, 0, 2.0, PRIMARY)),
    # The request itself was refused: at most one attempt at p1, never resent unchanged.
    Case(
        "400 context_length_exceeded",
        [always("serverError", status=400, errorCode="context_length_exceeded",
                message="This model's maximum context length is 8192 tokens")],
        expect=_expect(1, 1, 2.0, FALLBACK),
    ),
    # A policy refusal is the caller's answer: exactly one attempt, no fallback.
    Case(
        "400 content policy",
        [always("serverError", status=400, errorCode="content_filter",
                message="Input flagged by the content filter")],
        error_status=400,
        expect=_expect(1, 0, 1.0),
    ),
    # The fallback refuses the prefill: the primary, which continues, finishes the answer
    # (Watched); buffered, the fallback may answer afresh: asked twice, the continuation it
    # refused and then the plain request (two bodies, neither resent).
    Case("stream cut, fallback refuses the prefill", [once("cut", afterTokens=40)],
         [always("refusePrefill")], continues=(True, True),
         expect=_expect(2, 2, 3.0, PRIMARY_CONTINUING, FALLBACK)),
    Case("503 forever, usage accounting", [always("serverError", status=503)],
         expect=_expect(2, 1, 2.5, FALLBACK)),
)  # fmt: skip
OUTAGE = "primary 503 for 60 s then healthy, a request every 4 s"
VISIBILITIES = ("Watched", "Unwatched")
# The roles the long-lived rig's health checks go through, in turn (a breaker opened on the
# continuing primary is probed through its own roles).
HEALTH_CHECK_ROLES = ("watched", "unwatched", "watched-continuing", "unwatched-continuing")


@dataclass
class Outcome:
    """What the client got and what the upstream saw."""

    text: str | None = None
    error_status: int | None = None
    error_code: str | None = None
    models: set[str] = field(default_factory=set)
    # The `model` of the last chunk that carried content: the model that finished it.
    last_model: str | None = None
    usage: Any = None
    seconds: float = 0.0
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def attempts(self) -> list[str]:
        """`p1 429`, `f1 200 continued`: each request the upstream saw, in order."""
        shown = []
        for record in self.records:
            status = record["status"] if record["status"] is not None else record["outcome"]
            extra = " continued" if record["continued_partial"] else ""
            shown.append(f"{record['machine']} {status}{extra}")
        return shown

    def attempts_at(self, machine: str) -> int:
        return sum(1 for record in self.records if record["machine"] == machine)

    @property
    def resends(self) -> int:
        """Requests the upstream saw that repeat an earlier one to the same machine, byte
        for byte (a retry of the same model; a bad sign after a request-caused refusal)."""
        seen = Counter((r["machine"], r["body_sha256"]) for r in self.records)
        return sum(count - 1 for count in seen.values())

    def verdict(self, case: Case) -> str:
        if case.error_status is not None:
            good = self.error_status == case.error_status
            return f"{'ok' if good else 'WRONG'}: error {self.error_status} {self.error_code}"
        if self.text == REPLY:
            return "ok: the complete answer"
        if self.text is None:
            return f"WRONG: error {self.error_status} {self.error_code}"
        return "WRONG: a different answer"


def judge(case: Case, outcome: Outcome, *, time_slack: float = 1.0) -> list[str]:
    """Every judgement the row fails (empty: the row is right). `time_slack` multiplies the
    caller's time allowed: the bench judges the case's own limit (1), the test suite, which
    may run on a loaded machine, a multiple of it (speed targets live in bench/)."""
    expect = case.expect
    assert expect is not None, case.name
    failed = []
    if not outcome.verdict(case).startswith("ok"):
        failed.append(outcome.verdict(case).removeprefix("WRONG: "))
    failed += _attempts_judged(case, expect, outcome)
    failed += _resends_judged(outcome)
    if outcome.seconds > expect.seconds * time_slack:
        failed.append(f"{outcome.seconds:.1f} s > {expect.seconds * time_slack:g} s")
    failed += _served_judged(case, expect, outcome)
    return failed


def _attempts_judged(case: Case, expect: Expect, outcome: Outcome) -> list[str]:
    failed = []
    primary = outcome.attempts_at(case.primary_machine)
    if primary == 0:
        failed.append(f"fault never met ({case.primary_machine} not tried)")
    if primary > expect.primary:
        failed.append(f"{case.primary_machine} tried {primary}x > {expect.primary}")
    fallback = outcome.attempts_at("f1")
    if fallback > expect.fallback:
        failed.append(f"f1 tried {fallback}x > {expect.fallback}")
    return failed


def _resends_judged(outcome: Outcome) -> list[str]:
    """No identical body resent to a machine that refused it for what the request is."""
    refused = set()
    failed = []
    for record in outcome.records:
        sent = (record["machine"], record["body_sha256"])
        if sent in refused:
            failed.append(f"identical body resent to {record['machine']} after its refusal")
        if record["status"] in REQUEST_CAUSED:
            refused.add(sent)
    return failed


def _served_judged(case: Case, expect: Expect, outcome: Outcome) -> list[str]:
    if case.error_status is not None:
        return []
    failed = []
    if outcome.last_model not in expect.served:
        failed.append(f"served by {outcome.last_model}")
    # A chunk never names a model whose machine sent nothing.
    producing = {r["model"] for r in outcome.records if r["tokens_sent"]}
    if not outcome.models <= producing:
        failed.append(f"chunks name {sorted(outcome.models - producing)}, which sent nothing")
    if outcome.usage is None or outcome.usage.completion_tokens != 60:
        got = None if outcome.usage is None else outcome.usage.completion_tokens
        failed.append(f"usage says {got} completion tokens, not 60")
    return failed


# --- the manifests and the simulator's scenario ----------------------------------------


def _machine(
    name: str, faults: Sequence[dict[str, Any]], continues: bool, *, paced: bool = False
) -> dict[str, Any]:
    instant = {"ttftSeconds": 0.0, "tokensPerSecond": 0}
    pace = {**PACED, "jitter": PACED_JITTER} if paced else instant
    return {"name": name, **pace, "continuesPartialMessage": continues, "faults": list(faults)}


def _provider(
    name: str,
    url: str,
    model: str,
    machine: str,
    continues: bool,
    budget: Budget,
    figures: dict[str, Any] = FIGURES,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "endpoint": f"{url}/v1",
        "dialect": "OpenAI",
        "models": [{"name": model, "machines": [
            {"name": machine, **figures, "continuesPartialMessage": continues}]}],
    }  # fmt: skip
    if budget.idle_seconds is not None:
        spec["timeouts"] = {"idleSeconds": budget.idle_seconds}
    return {"apiVersion": "rolegate.dev/v1alpha1", "kind": "ProviderPolicy",
            "metadata": {"name": name, "namespace": "faults"}, "spec": spec}  # fmt: skip


def _role(budget: Budget, name: str, models: list[str], visibility: str) -> dict[str, Any]:
    spec = {"name": name, "models": models, "patienceSeconds": budget.patience,
            "visibility": visibility, "expectedOutputTokens": 60}  # fmt: skip
    if budget.retry:
        spec["retry"] = budget.retry
    return spec


def _role_table(budget: Budget, *roles: dict[str, Any]) -> dict[str, Any]:
    if not roles:
        roles = (_role(budget, "agent", [PRIMARY, FALLBACK], "Watched"),)
    return {
        "apiVersion": "rolegate.dev/v1alpha1",
        "kind": "RoleTable",
        "metadata": {"name": "roles", "namespace": "faults"},
        "spec": {"roles": list(roles)},
    }


def role_name(case: Case, visibility: str) -> str:
    """The role a case is asked through: its primary, its visibility."""
    return _role_name(case.primary_model, visibility)


def _role_name(primary: str, visibility: str) -> str:
    return visibility.lower() + ("-continuing" if primary == PRIMARY_CONTINUING else "")


# --- one case, one fresh rig (instant machines) -----------------------------------------


@dataclass
class Rig:
    """One case's simulator and proxy."""

    sim: RunningSim
    proxy: RunningProxy

    async def stop(self) -> None:
        await self.proxy.stop()
        await self.sim.stop()


async def rig(
    case: Case,
    budget: Budget,
    *,
    breaker: dict[str, Any] | None = None,
    seed: int = 0,
    reply: str = REPLY,
) -> Rig:
    """A fresh simulator (instant machines) and proxy for `case`, role `agent`."""
    primary, fallback = case.continues
    sim = await start_sim(parse_scenario({"seed": 13, "models": [
        {"name": PRIMARY, "reply": reply, "machines": [_machine("p1", case.primary, primary)]},
        {"name": FALLBACK, "reply": reply,
         "machines": [_machine("f1", case.fallback, fallback)]},
    ]}), host="127.0.0.1", port=0)  # fmt: skip
    first = _provider("primary", sim.url, PRIMARY, "p1", primary, budget)
    if breaker is not None:
        first["spec"]["breaker"] = breaker
    config = compile_objects(
        [first, _provider("fallback", sim.url, FALLBACK, "f1", fallback, budget),
         _role_table(budget)]
    )  # fmt: skip
    settings = ProxySettings(host="127.0.0.1", port=0, explore_share=0.0, random_seed=seed)
    return Rig(sim, await start_proxy(settings, config))


async def ask(url: str, role: str = "agent") -> Outcome:
    """One streamed request, as a user's code makes it."""
    outcome = Outcome()
    started = time.monotonic()
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        try:
            stream = await client.chat.completions.create(
                model=role, messages=PROMPT, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            parts = []
            async for chunk in stream:
                if chunk.choices:
                    parts.append(chunk.choices[0].delta.content or "")
                    if chunk.choices[0].delta.content:
                        outcome.models.add(chunk.model)
                        outcome.last_model = chunk.model
                if chunk.usage is not None:
                    outcome.usage = chunk.usage
            outcome.text = "".join(parts)
        except openai.APIStatusError as error:
            outcome.error_status = error.status_code
            outcome.error_code = error.code
        except openai.APIError as error:
            outcome.error_code = error.code
    outcome.seconds = time.monotonic() - started
    return outcome


async def run(case: Case, budget: Budget) -> Outcome:
    """The case through a fresh simulator and proxy."""
    fresh = await rig(case, budget)
    try:
        outcome = await ask(fresh.proxy.url)
        outcome.records = await sim_records(fresh.sim.url)
        return outcome
    finally:
        await fresh.stop()


# --- every case through one long-lived rig -----------------------------------------------

# The primary's breaker cools down within a second or two, so a case's trip has ended
# before the next case (the breaker's own schedule is the outage row's).
QUICK_BREAKER = {"cooldownSeconds": 1, "maxCooldownSeconds": 2}
MACHINES = {"p1": PRIMARY, "p2": PRIMARY_CONTINUING, "f1": FALLBACK}


@dataclass
class Row:
    case: Case
    visibility: str
    outcome: Outcome
    failed: list[str]
    # Health checks sent after the row, and how many of them were not answered whole.
    checks: int = 0
    checks_failed: int = 0

    @property
    def verdict(self) -> str:
        return "ok" if not self.failed else "WRONG: " + "; ".join(self.failed)


@dataclass
class LongLivedRig:
    """One simulator and one proxy for a whole sequence of cases."""

    sim: RunningSim
    proxy: RunningProxy
    http: httpx.AsyncClient
    # The caller's time allowed, as a multiple of each case's limit (`judge`).
    time_slack: float = 1.0

    @classmethod
    async def start(cls, budget: Budget, *, seed: int = 0) -> LongLivedRig:
        sim = await start_sim(parse_scenario({"seed": 31, "models": [
            {"name": model, "reply": REPLY,
             "machines": [_machine(machine, (), machine != "p1", paced=True)]}
            for machine, model in MACHINES.items()
        ]}), host="127.0.0.1", port=0)  # fmt: skip
        providers = [
            _provider(f"provider-{m}", sim.url, model, m, m != "p1", budget, PACED)
            for m, model in MACHINES.items()
        ]
        for provider in providers:
            provider["spec"]["breaker"] = QUICK_BREAKER
        roles = [
            _role(budget, _role_name(primary, visibility), [primary, FALLBACK], visibility)
            for primary in (PRIMARY, PRIMARY_CONTINUING)
            for visibility in VISIBILITIES
        ]
        config = compile_objects([*providers, _role_table(budget, *roles)])
        settings = ProxySettings(host="127.0.0.1", port=0, explore_share=0.0, random_seed=seed)
        proxy = await start_proxy(settings, config)
        return cls(sim, proxy, httpx.AsyncClient(timeout=30))

    async def stop(self) -> None:
        await self.http.aclose()
        await self.proxy.stop()
        await self.sim.stop()

    async def _put_faults(self, machine: str, faults: Sequence[dict[str, Any]]) -> None:
        url = f"{self.sim.url}/_sim/machines/{MACHINES[machine]}/{machine}/faults"
        (await self.http.put(url, content=json.dumps(list(faults)))).raise_for_status()

    async def _switch(self, case: Case | None) -> None:
        """The case's faults on its machines, none elsewhere; counters and records zeroed,
        so `schedule: [1]` is the case's first request."""
        for machine in MACHINES:
            faults: Sequence[dict[str, Any]] = ()
            if case is not None and machine == case.primary_machine:
                faults = case.primary
            elif case is not None and machine == "f1":
                faults = case.fallback
            await self._put_faults(machine, faults)
        (await self.http.post(f"{self.sim.url}/_sim/reset")).raise_for_status()

    async def _settled_records(self) -> list[dict[str, Any]]:
        """The records once none is in progress (a race's loser ends a moment later)."""

        async def settled() -> list[dict[str, Any]] | None:
            found = await sim_records(self.sim.url)
            return found if all(r["outcome"] != "in_progress" for r in found) else None

        return await eventually(settled, what="every simulator record finished", within=15)

    async def run(self, case: Case, visibility: str) -> Row:
        await self._switch(case)
        outcome = await ask(self.proxy.url, role_name(case, visibility))
        outcome.records = await self._settled_records()
        row = Row(case, visibility, outcome, judge(case, outcome, time_slack=self.time_slack))
        row.checks, row.checks_failed = await self.health_checks()
        return row

    async def health_checks(self, least: int = 2, within: float = 15.0) -> tuple[int, int]:
        """Faults off; non-streamed requests through every role in turn until the proxy
        holds no breaker open (at least `least`, the Watched and the Unwatched role of the
        usual primary): (sent, not answered whole)."""
        await self._switch(None)
        sent = failed = 0
        deadline = time.monotonic() + within
        while sent < least or (await self._open_breakers() and time.monotonic() < deadline):
            failed += not await self._health_check(HEALTH_CHECK_ROLES[sent % 4])
            sent += 1
        return sent, failed

    async def _health_check(self, role: str) -> bool:
        response = await self.http.post(
            f"{self.proxy.url}/v1/chat/completions",
            json={"model": role, "messages": PROMPT, "max_tokens": HEALTH_CHECK_TOKENS},
        )
        if response.status_code != 200:
            return False
        content = response.json()["choices"][0]["message"]["content"]
        return bool(REPLY.startswith(content) and content)

    async def _open_breakers(self) -> list[Any]:
        state = (await self.http.get(f"{self.proxy.url}/v1/rolegate/state")).json()
        return list(state["breakers"])


async def run_sequence(
    budget: Budget,
    visibilities: Sequence[str] = VISIBILITIES,
    *,
    seed: int = 0,
    time_slack: float = 1.0,
) -> list[Row]:
    """Every case, in order, through one long-lived rig: each case through each visibility,
    health checks after each row."""
    rig = await LongLivedRig.start(budget, seed=seed)
    rig.time_slack = time_slack
    try:
        await rig.health_checks()
        return [await rig.run(case, v) for case in CASES for v in visibilities]
    finally:
        await rig.stop()


# --- the outage (a fresh rig: its window runs from the simulator's start) ---------------


@dataclass
class OutageRun:
    """The outage case: who served each request, when (seconds from the first)."""

    served: list[tuple[float, str | None]]
    recovered_at: float

    @property
    def answered(self) -> bool:
        return all(machine is not None for _, machine in self.served)

    @property
    def back_after(self) -> float | None:
        """Seconds from the primary's recovery to its first answer after it."""
        back = [at for at, machine in self.served if machine == "p1" and at >= self.recovered_at]
        return None if not back else back[0] - self.recovered_at


async def run_outage(budget: Budget, *, scale: float = 1.0, seed: int = 0) -> OutageRun:
    """The primary answers 503 for 60 s then recovers; a request every 4 s for 100 s.
    `scale` shrinks every duration (the breaker's schedule too) for a quick run."""
    outage = [{"kind": "serverError", "status": 503, "duringSeconds": [0, 60 * scale]}]
    breaker = None
    if scale != 1.0:
        breaker = {"cooldownSeconds": 10 * scale, "maxCooldownSeconds": 30 * scale}
    fresh = await rig(Case(OUTAGE, outage), budget, breaker=breaker, seed=seed)
    served: list[tuple[float, str | None]] = []
    try:
        # The outage window runs from the simulator's start: the first request goes now.
        began = time.monotonic()
        while (now := time.monotonic() - began) < 100 * scale:
            outcome = await ask(fresh.proxy.url)
            last = (await sim_records(fresh.sim.url))[-1]
            served.append((now, last["machine"] if outcome.text == REPLY else None))
            await asyncio.sleep(max(0.0, 4 * scale * (len(served)) - (time.monotonic() - began)))
        return OutageRun(served, 60 * scale)
    finally:
        await fresh.stop()
