"""The sixteen faults a new user meets (issue 13), as cases to run through the real proxy,
simulator and `openai` client: `tests/proxy/test_every_fault.py` asserts what each comes
to, `bench/faults.py` prints the table.

Each case is one role with a primary model and one fallback model, each served by a plain
OpenAI-compatible upstream (the simulator, one machine per model: `p1` and `f1`); the
client streams with `stream_options.include_usage`. A `Budget` is the role's retry
settings and the provider's idle limit: the defaults, or the baseline a user might set
(at most 2 retries, 30 s patience and stream-idle limit).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import openai

from rolegate_proxy.edge.server import RunningProxy
from rolegate_proxy.edge.server import start as start_proxy
from rolegate_proxy.edge.settings import ProxySettings
from rolegate_sim.scenario import parse_scenario
from rolegate_sim.server import RunningSim
from rolegate_sim.server import start as start_sim

from .support import compile_objects, sim_records

PRIMARY, FALLBACK = "vendor/primary", "vendor/fallback"
# Sixty tokens, multi-byte characters throughout: a splice that duplicated or lost one
# byte would show.
REPLY = " ".join(f"t{i}—é日🎉" for i in range(60))
PROMPT: Any = [{"role": "user", "content": "count to sixty"}]
FIGURES = {"ttftSeconds": 0.05, "tokensPerSecond": 100}


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
class Case:
    name: str
    primary: Sequence[dict[str, Any]] = ()
    fallback: Sequence[dict[str, Any]] = ()
    # Whether each machine declares that it continues a partial assistant message.
    continues: tuple[bool, bool] = (False, True)
    # What the client should get: the complete answer, or an error with this status.
    error_status: int | None = None


def once(kind: str, **params: Any) -> dict[str, Any]:
    return {"kind": kind, "schedule": [1], **params}


def always(kind: str, **params: Any) -> dict[str, Any]:
    return {"kind": kind, "always": True, **params}


CASES: tuple[Case, ...] = (
    Case("429 with Retry-After: 2, once", [once("rateLimit", retryAfterSeconds=2)]),
    Case("429 forever, no Retry-After", [always("rateLimit")]),
    Case("500 once", [once("serverError", status=500)]),
    Case("503 forever", [always("serverError", status=503)]),
    Case("TCP reset before headers, once", [once("reset")]),
    Case("accepted, then silent for 120 s", [always("noResponse", seconds=120)]),
    Case("first token after 20 s", [always("lateFirstToken", seconds=20)]),
    Case("stream cut after 40 of 60 tokens", [always("cut", afterTokens=40)]),
    Case(
        "20 tokens, 30 s of silence, then close",
        [always("stall", afterTokens=20, seconds=30, thenClose=True)],
    ),
    Case("the 10th event is invalid JSON", [always("malformedEvent", atEvent=10)]),
    Case("complete stream without data: [DONE]", [always("noDone")]),
    Case(
        "400 context_length_exceeded",
        [
            always(
                "serverError",
                status=400,
                errorCode="context_length_exceeded",
                message="This model's maximum context length is 8192 tokens",
            )
        ],
    ),
    Case(
        "400 content policy",
        [
            always(
                "serverError",
                status=400,
                errorCode="content_filter",
                message="Input flagged by the content filter",
            )
        ],
        error_status=400,
    ),
    Case(
        "stream cut, fallback refuses the prefill",
        [once("cut", afterTokens=40)],
        [always("refusePrefill")],
        continues=(True, True),
    ),
    Case("503 forever, usage accounting", [always("serverError", status=503)]),
)
OUTAGE = "primary 503 for 60 s then healthy, a request every 4 s"


@dataclass
class Outcome:
    """What the client got and what the upstream saw."""

    text: str | None = None
    error_status: int | None = None
    error_code: str | None = None
    models: set[str] = field(default_factory=set)
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

    def verdict(self, case: Case) -> str:
        if case.error_status is not None:
            good = self.error_status == case.error_status
            return f"{'ok' if good else 'WRONG'}: error {self.error_status} {self.error_code}"
        if self.text == REPLY:
            return "ok: the complete answer"
        if self.text is None:
            return f"WRONG: error {self.error_status} {self.error_code}"
        return "WRONG: a different answer"


def _machine(name: str, faults: Sequence[dict[str, Any]], continues: bool) -> dict[str, Any]:
    return {"name": name, "ttftSeconds": 0.0, "tokensPerSecond": 0,
            "continuesPartialMessage": continues, "faults": list(faults)}  # fmt: skip


def _provider(
    name: str, url: str, model: str, machine: str, continues: bool, budget: Budget
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "endpoint": f"{url}/v1",
        "dialect": "OpenAI",
        "models": [{"name": model, "machines": [
            {"name": machine, **FIGURES, "continuesPartialMessage": continues}]}],
    }  # fmt: skip
    if budget.idle_seconds is not None:
        spec["timeouts"] = {"idleSeconds": budget.idle_seconds}
    return {"apiVersion": "rolegate.dev/v1alpha1", "kind": "ProviderPolicy",
            "metadata": {"name": name, "namespace": "faults"}, "spec": spec}  # fmt: skip


def _role_table(budget: Budget, **role: Any) -> dict[str, Any]:
    spec = {"name": "agent", "models": [PRIMARY, FALLBACK], "patienceSeconds": budget.patience,
            "visibility": "Watched", "expectedOutputTokens": 60, **role}  # fmt: skip
    if budget.retry:
        spec["retry"] = budget.retry
    return {
        "apiVersion": "rolegate.dev/v1alpha1",
        "kind": "RoleTable",
        "metadata": {"name": "roles", "namespace": "faults"},
        "spec": {"roles": [spec]},
    }


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


async def ask(url: str) -> Outcome:
    """One streamed request, as a user's code makes it."""
    outcome = Outcome()
    started = time.monotonic()
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        try:
            stream = await client.chat.completions.create(
                model="agent", messages=PROMPT, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            parts = []
            async for chunk in stream:
                if chunk.choices:
                    parts.append(chunk.choices[0].delta.content or "")
                    if chunk.choices[0].delta.content:
                        outcome.models.add(chunk.model)
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
