"""What rolegate's request path costs as one model's aggregator grows: 1, 10, 100 and 1,000
machines.

One simulator serves a model per size (`bench/m<N>`, N instant machines, a 20-token reply);
one `rolegate proxy --manifests` process per size serves role `bench` on it through
Aggregator ProviderPolicies whose machines publish TTFT, rate and prices (differing from
machine to machine, as a real aggregator's do). Up to 512 machines (the policy model's
MAX_MACHINES_PER_MODEL) is one ProviderPolicy; 1,000 machines are spread over 16, each
listing its share. Each size has its own direct baseline: the simulator called with the
`provider` field rolegate sends it at that size (read back from the simulator's records),
so the upstream's own work on a longer machine list is not counted as rolegate's.

Measures, at concurrency 1, in alternating rounds (direct-1, rolegate-1, direct-10, ...)
with the harness of peers.py (bench_harness.py): rolegate's CPU per non-streamed request
and per 20-chunk stream (utime+stime of its process from /proc), the added latency at the
median (rolegate minus its direct baseline), and the peak RSS; each as a ratio to the
1-machine figure. The goal being worked toward is at most 1.5x at 1,000 machines.

Run: `make bench-machines` (or `.venv/bin/python bench/machines.py [--rounds 5]
[--requests 300]`), about a minute. The result is written to bench/results/machines.txt.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import aiohttp
from bench_harness import (
    Cell,
    Proc,
    Processes,
    Target,
    measure,
    number,
    openai_body,
    ratio,
    rolegate_command,
    roles_and_grant,
    run,
    sim_model,
    table,
    write_manifests,
    write_scenario,
)
from bench_report import publish, where_it_ran
from overhead import free_port

from rolegate_policy.model import MAX_MACHINES_PER_MODEL

SIZES = (1, 10, 100, 1000)
# How the largest size is spread: 16 ProviderPolicies, each well under the per-model limit.
SPREAD_PROVIDERS = 16
GOAL = 1.5
TOKENS = 20


def machine_names(count: int) -> list[str]:
    return [f"m{i:04d}" for i in range(count)]


def machine_spec(index: int, name: str) -> dict[str, object]:
    """Published figures that differ from machine to machine, so ranking has work to do."""
    return {
        "name": name,
        "ttftSeconds": round(0.2 + (index % 7) * 0.05, 2),
        "tokensPerSecond": 60 + (index % 11) * 10,
        "priceInputPerMTok": round(0.1 + (index % 5) * 0.05, 2),
        "priceOutputPerMTok": round(0.4 + (index % 5) * 0.2, 2),
    }


def providers(size: int, sim: str) -> list[dict[str, object]]:
    names = machine_names(size)
    count = 1 if size <= MAX_MACHINES_PER_MODEL else SPREAD_PROVIDERS
    share = -(-size // count)
    assert share <= MAX_MACHINES_PER_MODEL
    policies: list[dict[str, object]] = []
    for number_ in range(count):
        first = number_ * share
        policies.append(
            {
                "apiVersion": "rolegate.dev/v1alpha1",
                "kind": "ProviderPolicy",
                "metadata": {"name": f"agg-{number_:02d}"},
                "spec": {
                    "endpoint": f"{sim}/v1",
                    "dialect": "Aggregator",
                    "models": [
                        {
                            "name": f"bench/m{size}",
                            "machines": [
                                machine_spec(first + i, name)
                                for i, name in enumerate(names[first : first + share])
                            ],
                        }
                    ],
                },
            }
        )
    return policies


async def sent_provider(sim: str, proxy: str, size: int) -> dict[str, object]:
    """The `provider` field rolegate sends the simulator at this size, as the simulator
    recorded it (a few requests, so the proxy is past its first)."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{sim}/_sim/requests") as response:
            records = await response.json()
        since = max((record["seq"] for record in records), default=0)
        for _ in range(5):
            async with session.post(
                f"{proxy}/v1/chat/completions",
                data=openai_body("bench", False, None),
                headers={"Content-Type": "application/json"},
            ) as response:
                if response.status != 200:
                    raise SystemExit(f"rolegate-{size} answered {response.status}")
                await response.read()
        async with session.get(f"{sim}/_sim/requests", params={"since": str(since)}) as response:
            records = await response.json()
    provider: Mapping[str, object] = records[-1]["provider"]
    return {key: value for key, value in provider.items() if value is not None}


Started = tuple[Proc, list[Target], dict[int, int], dict[int, dict[str, object]]]


def start(procs: Processes, root: Path) -> Started:
    """The simulator and a rolegate per size: the simulator, the targets (direct-N before
    rolegate-N), how many ProviderPolicies each size has, and the `provider` field rolegate
    sends at each size."""
    cli = rolegate_command()
    sim_port = free_port()
    sim_url = f"http://127.0.0.1:{sim_port}"
    write_scenario(
        root / "scenario.json",
        [sim_model(f"bench/m{size}", TOKENS, machine_names(size)) for size in SIZES],
    )
    sim = procs.start(
        "sim", [cli, "sim", "--scenario", str(root / "scenario.json"), "--port", str(sim_port)]
    )
    proxies: dict[int, tuple[Proc, str]] = {}
    spread: dict[int, int] = {}
    for size in SIZES:
        folder = root / f"manifests-{size}"
        policies = providers(size, sim_url)
        spread[size] = len(policies)
        write_manifests(folder, [*policies, *roles_and_grant({"bench": [f"bench/m{size}"]})])
        port = free_port()
        proc = procs.start(
            f"rolegate-{size}", [cli, "proxy", "--manifests", str(folder), "--port", str(port)]
        )
        proxies[size] = (proc, f"http://127.0.0.1:{port}")

    async def ready() -> dict[int, dict[str, object]]:
        await sim.ready(f"{sim_url}/healthz", 30)
        for proc, url in proxies.values():
            await proc.ready(f"{url}/readyz", 120)
        return {size: await sent_provider(sim_url, url, size) for size, (_, url) in proxies.items()}

    sent = run(ready())
    targets = []
    for size, (proc, url) in proxies.items():

        def direct_body(cell: Cell, size: int = size) -> bytes:
            return openai_body(f"bench/m{size}", cell.stream, sent[size])

        def rolegate_body(cell: Cell) -> bytes:
            return openai_body("bench", cell.stream, None)

        chat = "/v1/chat/completions"
        targets.append(Target(f"direct-{size}", f"{sim_url}{chat}", sim, direct_body))
        targets.append(Target(f"rolegate-{size}", f"{url}{chat}", proc, rolegate_body))
    return sim, targets, spread, sent


def machine_lists(field: Mapping[str, object]) -> str:
    """How many machines each list of a `provider` field names."""
    return " ".join(
        f"{key} {len(value)}" for key, value in field.items() if isinstance(value, list)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=300, help="per cell, target and round")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "machines.txt"
    )
    args = parser.parse_args()
    cells = [
        Cell("complete", "bench/m<N>", TOKENS, False, 1, args.requests),
        Cell("stream-20", "bench/m<N>", TOKENS, True, 1, args.requests),
    ]

    started = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="rolegate-machines-"))
    with Processes(root) as procs:
        sim, targets, spread, sent = start(procs, root)
        print(f"logs and inputs: {root}", file=sys.stderr)
        results = run(
            measure(
                targets,
                cells,
                args.rounds,
                sim,
                lambda line: print(line, file=sys.stderr, flush=True),
            )
        )
        rss = {t.name: t.proc.peak_rss_mib() for t in targets if t.name.startswith("rolegate")}

    def figures(size: int) -> list[float]:
        proxied = [results[f"rolegate-{size}", cell.name] for cell in cells]
        direct = [results[f"direct-{size}", cell.name] for cell in cells]
        return [
            *(m.cpu_ms_per_request() for m in proxied),
            *(p.p50() - d.p50() for p, d in zip(proxied, direct, strict=True)),
            rss[f"rolegate-{size}"],
        ]

    base = figures(SIZES[0])
    labels = ["CPU complete", "CPU stream-20", "added p50 complete", "added p50 stream-20"]
    rows = []
    for size in SIZES:
        values = figures(size)
        row = [f"{size:,}", str(spread[size])]
        for value, first in zip(values[:4], base[:4], strict=True):
            row += [number(value), ratio(value, first)]
        row += [number(values[4], 1), ratio(values[4], base[4])]
        rows.append(row)
    header = ["machines", "policies"]
    for label in [*labels, "peak RSS MiB"]:
        header += [label, "x1"]
    report = table(
        "rolegate, one model on N aggregator machines: per request at concurrency 1, ms; "
        "x1 is the ratio to 1 machine",
        header,
        rows,
    )
    last = figures(SIZES[-1])
    verdicts = [
        f"{label} {last[i] / base[i]:.2f}x {'met' if last[i] / base[i] <= GOAL else 'not met'}"
        for i, label in enumerate(labels)
        if base[i] > 0
    ]
    report.append(f"goal: at most {GOAL}x the 1-machine figure at {SIZES[-1]:,} machines: ")
    report[-1] += "; ".join(verdicts)
    report.append(
        "the provider field rolegate sends: "
        + "; ".join(f"{size:,}: {machine_lists(sent[size])}" for size in SIZES)
    )
    per_size = {size: results[f"direct-{size}", "complete"].p50() for size in SIZES}
    report.append(
        "direct p50 complete, ms: "
        + ", ".join(f"{size:,}: {number(value)}" for size, value in per_size.items())
    )
    report.append(
        f"rounds={args.rounds} requests per cell, target and round={args.requests}; "
        f"{time.monotonic() - started:.0f}s; " + where_it_ran()
    )
    publish(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
