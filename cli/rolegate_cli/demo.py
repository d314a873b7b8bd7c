"""`rolegate demo`: the simulated provider, the proxy and a short mixed workload, end to end.

Everything is real: both servers listen on free loopback ports, the proxy loads the
example manifests through the same standalone loader as `rolegate proxy --manifests`,
and traffic goes through the official `openai` client. It prints a per-role summary.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx
import openai

from rolegate_cli.state_table import render_state
from rolegate_proxy.core.exclusions import (
    Transition,
)
from rolegate_proxy.edge.server import RunningProxy
from rolegate_proxy.edge.server import start as start_proxy
from rolegate_proxy.edge.settings import ProxySettings
from rolegate_proxy.edge.standalone import load_standalone_config
from rolegate_proxy.edge.tracing import TraceSettings
from rolegate_sim.scenario import load_scenario
from rolegate_sim.server import RunningSim
from rolegate_sim.server import start as start_sim

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# The example manifests name this endpoint; the demo points it at the simulator it starts.
PLACEHOLDER_ENDPOINT = "http://127.0.0.1:8089/v1"
PROMPTS = [
    "Rename the variable in utils.py",
    "Résumé this diff — briefly, s'il vous plaît",
    "この関数を説明してください",
    "Write a docstring for parse()",
]
# role -> (share of traffic, stream?)
WORKLOAD = {"agent": (0.5, True), "reflex": (0.3, False), "batch": (0.2, False)}


@dataclass
class Result:
    role: str
    ok: bool
    machine: str
    model: str
    latency_ms: float
    ttft_ms: float | None
    error: str = ""


def run_demo(requests: int = 60, out: TextIO = sys.stdout, trace_file: Path | None = None) -> int:
    """`trace_file`: every span written there as JSON (the tracing extra), and one
    request's spans shown at the end."""
    # The demo narrates breaker transitions itself; the proxy's own log lines would repeat them.
    logging.getLogger("rolegate").setLevel(logging.ERROR)
    if trace_file is None:
        code = asyncio.run(_demo(requests, out, None))
        print("\nto see one request's spans: rolegate demo --trace-file trace.jsonl", file=out)
        return code
    from rolegate_cli.demo_trace import show_one_request
    from rolegate_cli.demo_trace import trace_file as tracing_to

    with tracing_to(trace_file) as tracing:
        code = asyncio.run(_demo(requests, out, tracing))
    show_one_request(trace_file, out)
    return code


async def _demo(requests: int, out: TextIO, tracing: TraceSettings | None) -> int:
    scenario = load_scenario(EXAMPLES / "scenario.yaml")
    sim = await start_sim(scenario, "127.0.0.1", 0)
    proxy: RunningProxy | None = None
    try:
        proxy = await _start_proxy(sim, out, tracing)
        print(f"simulated provider on {sim.url}, proxy on {proxy.url}\n", file=out)
        results = await _workload(proxy.url, requests, out)
        _summary(results, out)
        await _incident(sim.url, proxy, out)
        await _quality(proxy.url, out)
    finally:
        if proxy is not None:
            await proxy.stop()
        await sim.stop()
    failed = [r for r in results if not r.ok]
    # Some faults in the scenario are expected to reach the client as clear errors; the
    # demo fails only if most traffic failed, which means rolegate itself is broken.
    return 0 if len(failed) <= len(results) // 4 else 1


async def _start_proxy(sim: RunningSim, out: TextIO, tracing: TraceSettings | None) -> RunningProxy:
    with tempfile.TemporaryDirectory() as tmp:
        for path in sorted((EXAMPLES / "manifests").glob("*.yaml")):
            text = path.read_text(encoding="utf-8").replace(PLACEHOLDER_ENDPOINT, f"{sim.url}/v1")
            (Path(tmp) / path.name).write_text(text, encoding="utf-8")
        report = io.StringIO()
        config = load_standalone_config(Path(tmp), report)
    print(report.getvalue().replace(tmp + "/", "examples/manifests/"), file=out)
    # The example ProviderPolicy names Secret sim-router/apiKey; outside a cluster the
    # proxy reads it from this variable (docs/proxy.md, "API keys").
    os.environ.setdefault("ROLEGATE_SECRET_SIM_ROUTER_APIKEY", "demo-key-not-secret")
    settings = ProxySettings(
        host="127.0.0.1", port=0, admin_token=ADMIN_TOKEN, random_seed=7, tracing=tracing
    )
    return await start_proxy(settings, config)


async def _workload(url: str, requests: int, out: TextIO) -> list[Result]:
    rng = random.Random(11)
    roles = list(WORKLOAD)
    weights = [WORKLOAD[r][0] for r in roles]
    plan = [rng.choices(roles, weights)[0] for _ in range(requests)]
    results: list[Result] = []
    progress = _Progress(requests, out)
    semaphore = asyncio.Semaphore(8)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="demo", max_retries=0) as client:

        async def send(index: int, role: str) -> None:
            async with semaphore:
                result = await _one(client, role, PROMPTS[index % len(PROMPTS)])
            results.append(result)
            progress.advance(result.ok)

        await asyncio.gather(*(send(i, role) for i, role in enumerate(plan)))
    progress.close()
    return results


async def _one(client: openai.AsyncOpenAI, role: str, prompt: str) -> Result:
    stream = WORKLOAD[role][1]
    messages: Any = [{"role": "user", "content": prompt}]
    started = time.perf_counter()
    machine = model = "-"
    try:
        if stream:
            raw = await client.chat.completions.with_raw_response.create(
                model=role, messages=messages, stream=True
            )
            machine = raw.headers.get("x-rolegate-machine", "-")
            model = raw.headers.get("x-rolegate-model", "-")
            ttft: float | None = None
            async for chunk in raw.parse():
                if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                    ttft = (time.perf_counter() - started) * 1000
        else:
            raw_complete = await client.chat.completions.with_raw_response.create(
                model=role, messages=messages
            )
            machine = raw_complete.headers.get("x-rolegate-machine", "-")
            model = raw_complete.headers.get("x-rolegate-model", "-")
            raw_complete.parse()
            ttft = None
    except openai.APIError as error:
        return Result(
            role, False, machine, model, (time.perf_counter() - started) * 1000, None, _short(error)
        )
    return Result(role, True, machine, model, (time.perf_counter() - started) * 1000, ttft)


INCIDENT_MODEL = "deepseek/deepseek-v3"
# The demo's own admin token: /v1/feedback is enabled only with one.
ADMIN_TOKEN = "demo-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


async def _quality(url: str, out: TextIO) -> None:
    """An evaluator judges the agent role's answers (the semantic score appears only for
    the machines that served them), then the state snapshot as a table."""
    async with httpx.AsyncClient(timeout=10) as client:
        found = (
            await client.get(
                f"{url}/v1/rolegate/decisions", headers=ADMIN, params={"role": "agent"}
            )
        ).json()["decisions"]
        judged = 0
        for decision in found:
            if decision["outcome"] != "answered":
                continue
            response = await client.post(
                f"{url}/v1/feedback",
                headers=ADMIN,
                json={
                    "request_id": decision["request_id"],
                    # A stand-in judge: it prefers shorter answers (the demo has no model).
                    "score": 4 if (decision["tokens_out"] or 0) < 40 else 3,
                    "scale": [1, 5],
                    "evaluator": "demo-judge",
                },
            )
            judged += response.status_code == 202
        state = (await client.get(f"{url}/v1/rolegate/state", headers=ADMIN)).json()
    print(
        "\nstate: operational scores from every outcome (0.5 is neutral: no evidence), "
        f"semantic from {judged} judgments on /v1/feedback",
        file=out,
    )
    print(render_state(state), file=out)


async def _incident(sim_url: str, proxy: RunningProxy, out: TextIO) -> None:
    """A machine starts answering empty on HTTP 200: the breaker trips the (provider,
    model) pair, traffic routes around it, and it recovers once the machine is healthy."""
    started = time.monotonic()

    def say(text: str) -> None:
        print(f"  [{time.monotonic() - started:5.1f}s] {text}", file=out, flush=True)

    def on_transition(transition: Transition) -> None:
        say(
            f"breaker {transition.kind.value}: {transition.key.describe()} "
            f"({transition.reason.value}"
            + (f", trigger {transition.trigger.value}" if transition.trigger else "")
            + ")"
        )

    proxy.state.dispatcher.listeners.append(on_transition)
    print("\nincident: a machine starts answering empty on HTTP 200", file=out)
    async with (
        httpx.AsyncClient(timeout=30) as control,
        openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="demo", max_retries=0) as client,
    ):
        for machine in ("fastco", "steadyco"):
            url = f"{sim_url}/_sim/machines/{INCIDENT_MODEL}/{machine}/faults"
            (await control.put(url, json=[{"kind": "empty", "always": True}])).raise_for_status()
        say(f"simulator: every {INCIDENT_MODEL} machine now answers empty")
        outcomes: Counter[str] = Counter()
        for _ in range(6):
            result = await _one(client, "batch", PROMPTS[0])
            outcomes[result.error or f"answered by {result.model} @ {result.machine}"] += 1
        say("batch requests: " + ", ".join(f"{k} x{v}" for k, v in outcomes.items()))
        agent = await _one(client, "agent", PROMPTS[1])
        say(f"agent (falls back past the tripped model): {agent.model} @ {agent.machine}")
        for machine in ("fastco", "steadyco"):
            url = f"{sim_url}/_sim/machines/{INCIDENT_MODEL}/{machine}/faults"
            (await control.put(url, json=[])).raise_for_status()
        say("simulator: the machines are healthy again")
        deadline = time.monotonic() + 20
        recovered = False
        while time.monotonic() < deadline and not recovered:
            await asyncio.sleep(0.5)
            result = await _one(client, "batch", PROMPTS[2])
            recovered = result.ok
        say("batch answered again: recovered" if recovered else "not recovered within 20s")


def _short(error: openai.APIError) -> str:
    status = getattr(error, "status_code", None)
    return f"HTTP {status}" if status else "stream error"


class _Progress:
    def __init__(self, total: int, out: TextIO) -> None:
        self.total, self.done, self.failed, self.out = total, 0, 0, out
        self.tty = out.isatty()

    def advance(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        if self.tty or self.done == self.total or self.done % 10 == 0:
            width = 30
            filled = width * self.done // self.total
            line = (
                f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} requests"
                f", {self.failed} failed"
            )
            print(("\r" if self.tty else "") + line, end="" if self.tty else "\n", file=self.out)
            self.out.flush()

    def close(self) -> None:
        if self.tty:
            print(file=self.out)


def _summary(results: list[Result], out: TextIO) -> None:
    print("\nper role", file=out)
    header = (
        f"{'role':<8} {'reqs':>4} {'ok':>4} {'p50 ms':>8} {'p95 ms':>8} {'ttft p50':>9} "
        f"{'ttft p95':>9}  served by (model @ machine: count)"
    )
    print(header, file=out)
    print("-" * len(header), file=out)
    for role in WORKLOAD:
        mine = [r for r in results if r.role == role]
        if not mine:
            continue
        ok = [r for r in mine if r.ok]
        latencies = [r.latency_ms for r in ok]
        ttfts = [r.ttft_ms for r in ok if r.ttft_ms is not None]
        served = Counter(f"{r.model} @ {r.machine}" for r in ok)
        errors = Counter(r.error for r in mine if not r.ok)
        print(
            f"{role:<8} {len(mine):>4} {len(ok):>4} "
            f"{_p(latencies, 0.5):>8} {_p(latencies, 0.95):>8} "
            f"{_p(ttfts, 0.5):>9} {_p(ttfts, 0.95):>9}  "
            + ", ".join(f"{k}: {v}" for k, v in sorted(served.items())),
            file=out,
        )
        if errors:
            print(
                f"{'':<8} errors: " + ", ".join(f"{k} x{v}" for k, v in sorted(errors.items())),
                file=out,
            )


def _p(values: list[float], q: float) -> str:
    if not values:
        return "-"
    if q == 0.5:
        return f"{statistics.median(values):.0f}"
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))]:.0f}"
