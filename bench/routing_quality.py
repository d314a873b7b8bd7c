"""Whether rolegate picks the fast machine (issue 31, SPEC B3, B7, B8), measured from outside
through the real proxy and the simulator; one table, each goal met or NOT MET.

1. A machine believed 100x faster than it is. An aggregator model with S1 published far
   faster than it really writes (100x: by default published 800 tok/s, really 8, so a
   20-token answer takes about 2.6 s there; `--full`: 400 and 4 with 40 tokens, about
   10 s, the issue's own figures) and S2 published and writing at 300 tok/s; no prices;
   a role with patience 60 s. Sequential streamed requests: the request at which S2 first
   serves (goal <= 3) and S2's share of the 50 that follow (goal >= 95 %). Standalone, with
   the default exploration share; then the same proxy restarted from its `--state-file`;
   then three proxy pods sharing their memory through a real kube-apiserver (`--pods`):
   pod A serves until S2 leads, and the first request of each of the two pods that never
   served S1 must go to S2.
2. Load. Two identical single-slot machines (the simulator's `slots: 1`: a single-slot
   llama.cpp server) of one aggregator model; six concurrent streams. The worst first
   token of the six through rolegate against "the best": the worst first token of the same
   six sent straight to the simulator, three to each machine, in the same run (goal: at
   most 1.5x the best; the median over the rounds).
3. Honest learning. Two machines that really write at 60 tok/s from the first byte,
   published at that rate with a cautious 0.5 s (H1) and 0.6 s (H2) first token, both able
   to continue a partial answer. 1,000 short non-streamed answers (3 tokens: a few
   milliseconds, far faster per token than the sheet's shape), then 1,000 healthy streams
   (60 tok/s, 30 tokens with real gaps, +-20 % jitter), 16 at a time: the rate test's acts
   (`rolegate_acts_total`) and the streams the simulator saw asked twice (goal 0: every
   act is a false one).

Run: `.venv/bin/python bench/routing_quality.py [--quick] [--full] [--pods]`
(`--quick`: 20 requests after the lead instead of 50, 300 answers and streams instead of
1,000, 3 load rounds; `--pods` adds the three-pod variant: it starts etcd and a
kube-apiserver, as `bench/fleet.py` does). Result: `bench/results/routing-quality.txt`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_report import publish, where_it_ran

from rolegate_policy.compile import compile_manifests
from rolegate_policy.config import ProxyConfig
from rolegate_policy.manifests import manifest_from_object
from rolegate_proxy.edge.server import RunningProxy
from rolegate_proxy.edge.server import start as start_proxy
from rolegate_proxy.edge.settings import ProxySettings
from rolegate_sim.scenario import parse_scenario
from rolegate_sim.server import RunningSim
from rolegate_sim.server import start as start_sim

MODEL = "bench/model"
ROLE = "agent"
PROMPT = [{"role": "user", "content": "go"}]


@dataclass(frozen=True)
class Truth:
    """Case 1's machines: what S1 publishes, what it really does, the answer's length."""

    s1_published: float
    s1_real: float
    tokens: int

    @property
    def s1_seconds(self) -> float:
        return TTFT + (self.tokens - 1) / self.s1_real


SCALED = Truth(s1_published=800, s1_real=8, tokens=20)
FULL = Truth(s1_published=400, s1_real=4, tokens=40)
S2_RATE = 300.0
TTFT = 0.2


@dataclass
class Goal:
    what: str
    value: str
    met: bool
    goal: str

    def line(self) -> str:
        return (
            f"{self.what:<64} {self.value:>12}  {self.goal:<14} {'met' if self.met else 'NOT MET'}"
        )


# --- manifests and scenarios --------------------------------------------------------------


def reply(tokens: int) -> str:
    return " ".join(f"w{i}" for i in range(tokens))


def manifests(
    sim_url: str, machines: Sequence[dict[str, Any]], tokens: int, namespace: str = "bench"
) -> list[dict[str, Any]]:
    """An aggregator ProviderPolicy publishing `machines` for one model, a role with 60 s of
    patience expecting `tokens`, and open access."""
    return [
        {
            "apiVersion": "rolegate.dev/v1alpha1",
            "kind": "ProviderPolicy",
            "metadata": {"name": "agg", "namespace": namespace},
            "spec": {
                "endpoint": f"{sim_url}/v1",
                "dialect": "Aggregator",
                "models": [{"name": MODEL, "machines": list(machines)}],
            },
        },
        {
            "apiVersion": "rolegate.dev/v1alpha1",
            "kind": "RoleTable",
            "metadata": {"name": "bench", "namespace": namespace},
            "spec": {"roles": [{"name": ROLE, "models": [MODEL], "patienceSeconds": 60,
                                "visibility": "Watched", "expectedOutputTokens": tokens}]},
        },
        {
            "apiVersion": "rolegate.dev/v1alpha1",
            "kind": "AccessGrant",
            "metadata": {"name": "bench", "namespace": namespace},
            "spec": {"subjects": [{"anonymous": True}], "roles": ["*"], "admin": True},
        },
    ]  # fmt: skip


def compiled(objects: list[dict[str, Any]]) -> ProxyConfig:
    manifests_ = [manifest_from_object(o, f"bench#{i}") for i, o in enumerate(objects)]
    return compile_manifests(manifests_).config


def published(name: str, rate: float, ttft: float = TTFT) -> dict[str, Any]:
    return {"name": name, "ttftSeconds": ttft, "tokensPerSecond": rate}


async def simulator(tokens: int, machines: Sequence[dict[str, Any]]) -> RunningSim:
    return await start_sim(
        parse_scenario(
            {
                "seed": 31,
                "models": [{"name": MODEL, "reply": reply(tokens), "machines": list(machines)}],
            }
        )
    )


async def proxy(config: ProxyConfig, **settings: Any) -> RunningProxy:
    settings.setdefault("metrics_on_api_port", True)
    return await start_proxy(ProxySettings(host="127.0.0.1", port=0, **settings), config)


# --- talking to the proxy and the simulator ---------------------------------------------


async def stream(
    session: aiohttp.ClientSession, url: str, payload: dict[str, Any]
) -> tuple[float, float]:
    """A streamed chat request: (seconds to the first content token, to the last byte)."""
    sent = time.monotonic()
    first: float | None = None
    async with session.post(f"{url}/v1/chat/completions", json=payload) as response:
        if response.status != 200:
            raise SystemExit(f"{url}: HTTP {response.status}: {(await response.read())[:300]!r}")
        async for line in response.content:
            if first is None and b'"content":"' in line and b'"content":""' not in line:
                first = time.monotonic() - sent
    if first is None:
        raise SystemExit(f"{url}: a stream without content")
    return first, time.monotonic() - sent


def chat(model: str = ROLE, *, stream_: bool = True, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": PROMPT, "stream": stream_, **extra}


async def records(session: aiohttp.ClientSession, sim_url: str, since: int = 0) -> list[Any]:
    async with session.get(f"{sim_url}/_sim/requests", params={"since": str(since)}) as response:
        found: list[Any] = await response.json()
        return found


async def served_by(session: aiohttp.ClientSession, sim_url: str, since: int) -> str:
    """The machine that answered the request sent after record `since` (the last whose
    answer completed: a race's loser or a moved stream's first machine comes before)."""
    done = [r for r in await records(session, sim_url, since) if r["outcome"] == "completed"]
    return str(done[-1]["machine"]) if done else "none"


async def last_seq(session: aiohttp.ClientSession, sim_url: str) -> int:
    found = await records(session, sim_url)
    return int(found[-1]["seq"]) if found else 0


# --- 1. the machine believed 100x faster ----------------------------------------------------


def case1_machines(truth: Truth) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the simulator's machines: the truth, the ProviderPolicy's: what is published)."""
    real = [
        {"name": "S1", "ttftSeconds": TTFT, "tokensPerSecond": truth.s1_real},
        {"name": "S2", "ttftSeconds": TTFT, "tokensPerSecond": S2_RATE},
    ]
    return real, [published("S1", truth.s1_published), published("S2", S2_RATE)]


@dataclass
class Leading:
    """Sequential requests to one proxy: who served each."""

    served: list[str]
    after: int

    @property
    def first_s2(self) -> int | None:
        """1-based number of the first request S2 served (None: never in the window)."""
        return next((i + 1 for i, m in enumerate(self.served[: -self.after]) if m == "S2"), None)

    @property
    def share_after(self) -> float:
        tail = self.served[-self.after :]
        return tail.count("S2") / len(tail)


async def sequential(
    session: aiohttp.ClientSession, proxy_url: str, sim_url: str, count: int
) -> list[str]:
    served = []
    for _ in range(count):
        since = await last_seq(session, sim_url)
        await stream(session, proxy_url, chat())
        served.append(await served_by(session, sim_url, since))
    return served


async def until_s2_leads(
    session: aiohttp.ClientSession, proxy_url: str, sim_url: str, window: int, after: int
) -> Leading:
    """Requests until S2 serves (at most `window`), then `after` more."""
    served: list[str] = []
    while len(served) < window and "S2" not in served:
        served += await sequential(session, proxy_url, sim_url, 1)
    served += await sequential(session, proxy_url, sim_url, after)
    return Leading(served, after)


def leading_goals(name: str, run: Leading, window: int) -> list[Goal]:
    first = run.first_s2
    return [
        Goal(f"1. {name}: request at which S2 first serves", f"{first}" if first else f"> {window}",
             first is not None and first <= 3, "goal <= 3"),
        Goal(f"1. {name}: S2's share of the next {run.after}", f"{run.share_after:.0%}",
             run.share_after >= 0.95, "goal >= 95 %"),
    ]  # fmt: skip


async def case1(truth: Truth, after: int, window: int = 10) -> tuple[list[Goal], list[str]]:
    real, sheet = case1_machines(truth)
    sim = await simulator(truth.tokens, real)
    config = compiled(manifests(sim.url, sheet, truth.tokens))
    notes = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            state_file = Path(tmp) / "state.json"
            async with aiohttp.ClientSession() as session:
                first = await proxy(config, state_file=state_file)
                try:
                    standalone = await until_s2_leads(session, first.url, sim.url, window, after)
                finally:
                    await first.stop()
                again = await proxy(config, state_file=state_file)
                try:
                    restarted = await until_s2_leads(session, again.url, sim.url, window, after)
                finally:
                    await again.stop()
        notes.append(f"standalone served: {compact(standalone.served)}")
        notes.append(f"after the restart: {compact(restarted.served)}")
        goals = leading_goals("standalone", standalone, window)
        goals += leading_goals("restarted from --state-file", restarted, window)
        return goals, notes
    finally:
        await sim.stop()


def compact(served: list[str]) -> str:
    """`S1 x8, S2 x52` in order of runs."""
    runs: list[list[Any]] = []
    for machine in served:
        if runs and runs[-1][0] == machine:
            runs[-1][1] += 1
        else:
            runs.append([machine, 1])
    return ", ".join(f"{m} x{n}" for m, n in runs)


def case1_pods(truth: Truth, window: int = 10) -> tuple[list[Goal], list[str]]:
    """Three proxy pods (processes, distinct POD_NAME) sharing their memory through a real
    kube-apiserver (the operator compiles the manifests), published every second: pod A
    serves until S2 leads; once pod B has heard that S1 is slow, the first request of B and
    of C must go to S2."""
    from bench_cluster import cluster
    from overhead import free_port, wait_ready

    namespace = "quality"
    real, sheet = case1_machines(truth)
    with cluster(namespace) as running:
        sim_port = free_port()
        sim_url = f"http://127.0.0.1:{sim_port}"
        objects = manifests(sim_url, sheet, truth.tokens, namespace)
        running.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
        scenario = running.root / "scenario.json"
        scenario.write_text(json.dumps({"seed": 31, "models": [
            {"name": MODEL, "reply": reply(truth.tokens), "machines": real}]}))  # fmt: skip
        running.start("sim", ["sim", "--scenario", str(scenario), "--port", str(sim_port)])
        running.start(
            "operator", ["operator", "--namespace", namespace, "--no-leader-election",
                         *running.kube],
        )  # fmt: skip
        urls = {}
        for pod in ("proxy-a", "proxy-b", "proxy-c"):
            port = free_port()
            running.start(
                pod,
                ["proxy", "--configmap", f"{namespace}/rolegate-config", "--port", str(port),
                 "--memory-publish-seconds", "1", *running.kube],
                {"POD_NAME": pod},
            )  # fmt: skip
            urls[pod] = f"http://127.0.0.1:{port}"
        asyncio.run(wait_ready(f"{sim_url}/healthz"))
        for url in urls.values():
            asyncio.run(wait_ready(f"{url}/readyz", deadline_s=60))
        return asyncio.run(_pods(urls, sim_url, truth, window))


async def _pods(
    urls: dict[str, str], sim_url: str, truth: Truth, window: int
) -> tuple[list[Goal], list[str]]:
    async with aiohttp.ClientSession() as session:
        learned = await until_s2_leads(session, urls["proxy-a"], sim_url, window, 3)
        heard = await _hears_s1_is_slow(session, urls["proxy-b"], truth)
        firsts = {}
        for pod in ("proxy-b", "proxy-c"):
            firsts[pod] = (await sequential(session, urls[pod], sim_url, 1))[0]
    goals = leading_goals("three pods, pod A", learned, window)[:1]
    for pod, machine in firsts.items():
        goals.append(Goal(f"1. three pods: first request of {pod} (never served S1)", machine,
                          machine == "S2", "goal S2"))  # fmt: skip
    notes = [
        f"three pods: pod A served {compact(learned.served)}; pod B "
        + (f"heard S1 is slow after {heard:.1f} s" if heard is not None else "NEVER heard it")
    ]
    return goals, notes


async def _hears_s1_is_slow(
    session: aiohttp.ClientSession, url: str, truth: Truth, within: float = 30.0
) -> float | None:
    """Seconds until the pod believes S1 writes at less than half what it publishes."""
    started = time.monotonic()
    while time.monotonic() - started < within:
        async with session.get(f"{url}/v1/rolegate/state") as response:
            beliefs = (await response.json())["beliefs"]
        rates = [b["expected_tokens_per_second"] for b in beliefs if b["machine"] == "S1"]
        if rates and rates[0] is not None and rates[0] < truth.s1_published / 2:
            return time.monotonic() - started
        await asyncio.sleep(0.2)
    return None


# --- 2. load on two single-slot machines -------------------------------------------------


LOAD_TOKENS, LOAD_RATE, STREAMS = 30, 50.0, 6


async def case2(rounds: int) -> tuple[list[Goal], list[str]]:
    real = [{"name": n, "ttftSeconds": TTFT, "tokensPerSecond": LOAD_RATE, "slots": 1}
            for n in ("L1", "L2")]  # fmt: skip
    sim = await simulator(LOAD_TOKENS, real)
    config = compiled(manifests(sim.url, [published("L1", LOAD_RATE), published("L2", LOAD_RATE)],
                                LOAD_TOKENS))  # fmt: skip
    front = await proxy(config)
    through, best, spread = [], [], []
    try:
        async with aiohttp.ClientSession() as session:
            await stream(session, front.url, chat())  # a first answer: beliefs exist
            for _ in range(rounds):
                since = await last_seq(session, sim.url)
                firsts = await asyncio.gather(
                    *(stream(session, front.url, chat()) for _ in range(STREAMS))
                )
                through.append(max(f for f, _ in firsts))
                spread.append(Counter(r["machine"] for r in await records(session, sim.url, since)))
                # The best: three straight to each machine, in the same run.
                direct = await asyncio.gather(
                    *(stream(session, sim.url, chat(MODEL, provider={"only": [f"L{1 + i % 2}"]}))
                      for i in range(STREAMS))
                )  # fmt: skip
                best.append(max(f for f, _ in direct))
    finally:
        await front.stop()
        await sim.stop()
    ours, ideal = statistics.median(through), statistics.median(best)
    ratio = ours / ideal
    goals = [
        Goal("2. worst first token of 6 streams, 2 single-slot machines: rolegate",
             f"{ours:.2f} s", True, ""),
        Goal("2.   the best (3 straight to each machine, same run)", f"{ideal:.2f} s", True, ""),
        Goal("2.   rolegate against the best", f"{ratio:.2f}x", ratio <= 1.5, "goal <= 1.5x"),
    ]  # fmt: skip
    notes = [
        f"load rounds (worst first token, s): rolegate {' '.join(f'{v:.2f}' for v in through)}; "
        f"best {' '.join(f'{v:.2f}' for v in best)}",
        "requests the machines saw per round through rolegate: "
        + "; ".join(" ".join(f"{m} {n}" for m, n in sorted(c.items())) for c in spread),
    ]
    return goals, notes


# --- 3. the rate test after non-streamed answers -----------------------------------------


HEALTHY_TOKENS, HEALTHY_RATE, SHORT_ANSWER_TOKENS = 30, 60.0, 3


async def case3(answers: int, streams: int) -> tuple[list[Goal], list[str]]:
    # The case: both machines really write at 60 tok/s from the first byte; their
    # sheets publish that rate and a cautious 0.5 s first token. A short non-streamed
    # answer (three tokens, all of it in a few milliseconds) is then far faster than the
    # sheet's shape: taught as per-token gaps it made H1 look hundreds of times faster than
    # its streams, and healthy streams were moved to H2, which can take them over.
    real = [
        {"name": name, "ttftSeconds": 0.0, "tokensPerSecond": HEALTHY_RATE, "jitter": 0.2,
         "continuesPartialMessage": True}
        for name in ("H1", "H2")
    ]  # fmt: skip
    sim = await simulator(HEALTHY_TOKENS, real)
    sheet = [
        {**published(name, HEALTHY_RATE, ttft), "continuesPartialMessage": True}
        for name, ttft in (("H1", 0.5), ("H2", 0.6))
    ]
    front = await proxy(compiled(manifests(sim.url, sheet, HEALTHY_TOKENS)))
    gate = asyncio.Semaphore(16)
    try:
        async with aiohttp.ClientSession() as session:

            async def answer() -> None:
                async with (
                    gate,
                    session.post(
                        f"{front.url}/v1/chat/completions",
                        json=chat(stream_=False, max_tokens=SHORT_ANSWER_TOKENS),
                    ) as response,
                ):
                    await response.read()

            async def healthy() -> None:
                async with gate:
                    await stream(session, front.url, chat())

            await asyncio.gather(*(answer() for _ in range(answers)))
            done = await records(session, sim.url)
            on = Counter(r["machine"] for r in done)
            since = int(done[-1]["seq"])
            await asyncio.gather(*(healthy() for _ in range(streams)))
            streamed = await records(session, sim.url, since)
            async with session.get(f"{front.url}/metrics") as response:
                metrics = await response.text()
    finally:
        await front.stop()
        await sim.stop()
    acts = sum(float(v) for v in re.findall(r"^rolegate_acts_total\{[^}]*\} (\S+)$", metrics, re.M))
    twice = len(streamed) - streams
    goals = [
        Goal(f"3. rate-test acts over {streams} healthy streams after {answers} answers",
             f"{acts:.0f}", acts == 0, "goal 0"),
        Goal("3.   streams the simulator saw asked more than once", f"{twice}", twice == 0,
             "goal 0"),
    ]  # fmt: skip
    notes = [
        "non-streamed answers per machine: " + " ".join(f"{m} {n}" for m, n in sorted(on.items())),
        "streams per machine: "
        + " ".join(f"{m} {n}" for m, n in sorted(Counter(r["machine"] for r in streamed).items())),
    ]
    return goals, notes


# --- the table -----------------------------------------------------------------------------


async def measure(args: argparse.Namespace) -> tuple[list[Goal], list[str]]:
    truth = FULL if args.full else SCALED
    after = 20 if args.quick else 50
    goals, notes = await case1(truth, after)
    more_goals, more_notes = await case2(3 if args.quick else 5)
    goals += more_goals
    notes += more_notes
    count = 300 if args.quick else 1000
    more_goals, more_notes = await case3(count, count)
    return goals + more_goals, notes + more_notes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, a few minutes")
    parser.add_argument("--full", action="store_true", help="case 1 at the issue's own figures")
    parser.add_argument("--pods", action="store_true", help="case 1 with three pods as well")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "routing-quality.txt"
    )
    args = parser.parse_args()
    truth = FULL if args.full else SCALED
    started = time.monotonic()
    goals, notes = asyncio.run(measure(args))
    if args.pods:
        pod_goals, pod_notes = case1_pods(truth)
        goals[2:2] = pod_goals
        notes[2:2] = pod_notes
    header = f"{'measure':<64} {'value':>12}  {'goal':<14} verdict"
    rows = [header, "-" * len(header), *(goal.line() for goal in goals), ""]
    if not args.pods:
        rows.append("1. three pods sharing memory: not run (add --pods)")
    rows += notes
    rows += [
        "",
        f"case 1: S1 published at {truth.s1_published:g} tok/s, really {truth.s1_real:g} "
        f"(100x), S2 {S2_RATE:g} as published, TTFT {TTFT} s, {truth.tokens} tokens: "
        f"{truth.s1_seconds:.1f} s an answer on S1; default exploration share",
        f"goals NOT MET: {sum(not g.met for g in goals)} of {sum(bool(g.goal) for g in goals)}; "
        f"{'quick' if args.quick else 'full counts'}; {time.monotonic() - started:.0f} s; "
        + where_it_ran(),
    ]
    publish(rows, args.out)
    return 0 if all(goal.met for goal in goals) else 1


if __name__ == "__main__":
    sys.exit(main())
