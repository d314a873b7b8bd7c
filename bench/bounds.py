"""What rolegate's bounds hold its memory to (issue 30, SPEC E8).

    .venv/bin/python bench/bounds.py answers [--rolegate PATH]   # bench/results/bounds-answers.txt
    .venv/bin/python bench/bounds.py soak [--minutes 10]         # bench/results/bounds-soak.txt
    .venv/bin/python bench/bounds.py census [--at 60000 150000]  # bench/results/bounds-census.txt

`answers`: the proxy's peak RSS when an upstream answers 200 MB (non-streamed, chunked),
a 50 MB event, or a gzip bomb (200 MB inside about 200 KB), each in a fresh proxy process
against `tests/proxy/hostile_upstream.py`, beside the peak after 20 ordinary requests.
`--rolegate` runs the same answers through another build's CLI too (the tree before
issue 30 read a body whole).

`soak`: one proxy serving a steady load (streamed and not, 8 at a time) from the simulator
for `--minutes`; its RSS every 15 s beside the requests it had answered, so the curve
shows where each bounded store is full (the feedback index remembers the last 50,000
answered requests) and the RSS stops growing.

`census`: the same load on a proxy in this process (with the simulator and the clients:
slower, but every object is in reach), counting the objects alive, by type, after each
`--at` number of requests, and every container of more than 3,000 entries: whether
what the RSS does is a store growing or memory the allocator kept.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from bench_harness import (
    Proc,
    Processes,
    rolegate_command,
    roles_and_grant,
    run,
    sim_model,
    write_manifests,
    write_scenario,
)
from bench_report import publish, where_it_ran
from overhead import free_port

from rolegate_proxy.edge.feedback import DEFAULT_CAPACITY as SERVED_INDEX

HOSTILE = Path(__file__).resolve().parent.parent / "tests" / "proxy" / "hostile_upstream.py"
MB = 1024 * 1024
SAMPLE_SECONDS = 15.0


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    stream: bool
    flags: tuple[str, ...] = ()
    # Only a build with issue 30's flags can run it.
    needs_flags: bool = False


CASES = [
    Case("20 ordinary requests", "bench/calm", False),
    Case("200 MB answer, non-streamed", "hostile/big-body", False),
    Case(
        "200 MB answer, --max-answer-bytes 16 MiB",
        "hostile/big-body",
        False,
        ("--max-answer-bytes", str(16 * MB)),
        needs_flags=True,
    ),
    Case("50 MB event, streamed", "hostile/big-event", True),
    Case("gzip bomb (200 MB inside), streamed", "hostile/gzip-bomb", True),
    Case("gzip bomb (200 MB inside), non-streamed", "hostile/gzip-body-bomb", False),
]


def rss_mib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise LookupError(field)


def manifests(hostile: str, sim: str) -> list[dict[str, object]]:
    kinds = ["big-body", "big-event", "gzip-bomb", "gzip-body-bomb"]

    def policy(name: str, url: str, models: list[str]) -> dict[str, object]:
        return {
            "apiVersion": "rolegate.dev/v1alpha1",
            "kind": "ProviderPolicy",
            "metadata": {"name": name},
            "spec": {
                "endpoint": f"{url}/v1",
                "dialect": "Aggregator",
                "models": [{"name": m, "machines": [{"name": "m1"}]} for m in models],
            },
        }

    # Each role is named after the answer it gets (`role_of`).
    roles = {kind: [f"hostile/{kind}"] for kind in kinds}
    roles["calm"] = ["bench/calm"]
    return [
        policy("hostile", hostile, [f"hostile/{kind}" for kind in kinds]),
        policy("sim", sim, ["bench/calm"]),
        *roles_and_grant(roles),
    ]


def start_sim(procs: Processes, root: Path, port: int) -> Proc:
    """The simulator serving `bench/calm` (20-token answers, at once) on `port`."""
    write_scenario(root / "scenario.json", [sim_model("bench/calm", 20, ["m1"])])
    scenario = str(root / "scenario.json")
    return procs.start(
        "sim", [rolegate_command(), "sim", "--scenario", scenario, "--port", str(port)]
    )


async def ask(url: str, case: Case, times: int) -> list[int]:
    body = {
        "model": case.model.rpartition("/")[2],
        "messages": [{"role": "user", "content": "benchmark prompt"}],
        "stream": case.stream,
    }
    statuses = []
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for _ in range(times):
            async with session.post(f"{url}/v1/chat/completions", json=body) as response:
                await response.read()
                statuses.append(response.status)
    return statuses


def answers(args: argparse.Namespace) -> int:
    builds = [("this tree", rolegate_command())]
    if args.rolegate:
        builds.append((args.rolegate_label, args.rolegate))
    root = Path(tempfile.mkdtemp(prefix="rolegate-bounds-"))
    rows = [
        "Peak RSS of one proxy process (VmHWM) for each answer, a fresh process per row; "
        "the hostile upstream is tests/proxy/hostile_upstream.py, in its own process.",
        "Defaults: --max-event-bytes 4 MiB, --max-answer-bytes 64 MiB, "
        "--max-decompression-ratio 200.",
        "",
        f"{'build':<12} {'answer':<44} {'status':>8} {'peak MiB':>9} {'over ordinary':>14}",
        "-" * 91,
    ]
    with Processes(root) as procs:
        hostile_port, sim_port = free_port(), free_port()
        hostile = f"http://127.0.0.1:{hostile_port}"
        sim_url = f"http://127.0.0.1:{sim_port}"
        procs.start("hostile", [sys.executable, str(HOSTILE), "--port", str(hostile_port)])
        sim = start_sim(procs, root, sim_port)
        run(sim.ready(f"{sim_url}/healthz", 30))
        write_manifests(root / "manifests", manifests(hostile, sim_url))
        for label, command in builds:
            ordinary: float | None = None
            for index, case in enumerate(CASES):
                if case.needs_flags and label != "this tree":
                    continue
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                proxy = procs.start(
                    f"proxy-{len(rows)}-{index}",
                    [command, "proxy", "--manifests", str(root / "manifests"), "--port",
                     str(port), *case.flags],
                )  # fmt: skip
                run(proxy.ready(f"{url}/readyz", 120))
                statuses = run(ask(url, case, 20 if ordinary is None else 1))
                peak = rss_mib(proxy.popen.pid, "VmHWM")
                proxy.stop()
                ordinary = peak if ordinary is None else ordinary
                over = "" if peak == ordinary else f"+{peak - ordinary:.0f}"
                status = ",".join(sorted({str(s) for s in statuses}))
                rows.append(f"{label:<12} {case.name:<44} {status:>8} {peak:>9.1f} {over:>14}")
                print(rows[-1], flush=True)
    rows += ["", where_it_ran()]
    publish(rows, args.out or Path(__file__).parent / "results" / "bounds-answers.txt")
    return 0


async def _load(
    url: str, until: float, answered: list[int], *, until_answered: float = math.inf
) -> None:
    bodies = [
        json.dumps(
            {
                "model": "calm",
                "messages": [{"role": "user", "content": "benchmark prompt"}],
                "stream": stream,
            }
        ).encode()
        for stream in (False, True)
    ]
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker(turn: int) -> None:
            while time.monotonic() < until and answered[0] < until_answered:
                body = bodies[turn % 2]
                turn += 1
                async with session.post(
                    f"{url}/v1/chat/completions", data=body, headers=headers
                ) as response:
                    await response.read()
                    if response.status == 200:
                        answered[0] += 1

        await asyncio.gather(*(worker(turn) for turn in range(8)))


async def _sample(proc: Proc, until: float, answered: list[int], rows: list[str]) -> None:
    started = time.monotonic()
    while True:
        now = time.monotonic()
        rss = rss_mib(proc.popen.pid, "VmRSS")
        full = "  <- the feedback index is full" if answered[0] >= SERVED_INDEX else ""
        rows.append(f"{(now - started) / 60:>8.2f} {answered[0]:>10,} {rss:>9.1f}{full}")
        print(rows[-1], flush=True)
        if now >= until:
            return
        await asyncio.sleep(min(SAMPLE_SECONDS, until - now))


def soak(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="rolegate-soak-"))
    rows = [
        f"One proxy under a steady load for {args.minutes:g} minutes: 8 clients at a time, "
        "streamed and non-streamed in turn, 20-token answers from the simulator.",
        f"Its RSS every {SAMPLE_SECONDS:g} s beside the requests answered so far. The "
        f"feedback index remembers the last {SERVED_INDEX:,} answered requests; every "
        "other store is bounded smaller.",
        "",
        f"{'minutes':>8} {'answered':>10} {'RSS MiB':>9}",
        "-" * 29,
    ]
    with Processes(root) as procs:
        cli = rolegate_command()
        sim_port, port = free_port(), free_port()
        sim_url, url = f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{port}"
        sim = start_sim(procs, root, sim_port)
        # No hostile upstream here: its roles are never asked.
        write_manifests(root / "manifests", manifests("http://127.0.0.1:9", sim_url))
        proxy = procs.start(
            "proxy", [cli, "proxy", "--manifests", str(root / "manifests"), "--port", str(port)]
        )

        async def soaked() -> None:
            await sim.ready(f"{sim_url}/healthz", 30)
            await proxy.ready(f"{url}/readyz", 120)
            until = time.monotonic() + args.minutes * 60
            answered = [0]
            await asyncio.gather(_load(url, until, answered), _sample(proxy, until, answered, rows))

        run(soaked())
        rows.append(f"peak (VmHWM): {rss_mib(proxy.popen.pid, 'VmHWM'):.1f} MiB")
    rows += ["", where_it_ran()]
    publish(rows, args.out or Path(__file__).parent / "results" / "bounds-soak.txt")
    return 0


def census(args: argparse.Namespace) -> int:
    import collections
    import gc

    from rolegate_proxy.edge.server import start as start_proxy
    from rolegate_proxy.edge.settings import ProxySettings
    from rolegate_sim.scenario import parse_scenario
    from rolegate_sim.server import start as start_sim

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tests
    from tests.support import compile_objects, provider_policy, role, role_table

    def alive() -> tuple[collections.Counter[str], list[tuple[str, int]]]:
        gc.collect()
        objects = gc.get_objects()
        kinds = collections.Counter(type(o).__name__ for o in objects)
        big = sorted(
            ((type(o).__name__, len(o)) for o in objects
             if isinstance(o, dict | list | set | collections.deque) and len(o) > 3000),
            key=lambda found: -found[1],
        )  # fmt: skip
        return kinds, big

    async def counted() -> list[str]:
        model = sim_model("bench/calm", 20, ["m1"])
        sim = await start_sim(parse_scenario({"seed": 1, "recordLimit": 1000,
                                              "models": [model]}), "127.0.0.1", 0)  # fmt: skip
        config = compile_objects(
            [
                provider_policy("sim", f"{sim.url}/v1", {"bench/calm": ["m1"]}),
                role_table(role("calm", ["bench/calm"], patience=60, ruling="Order")),
            ]
        )
        proxy = await start_proxy(ProxySettings(host="127.0.0.1", port=0), config)
        lines: list[str] = []
        answered = [0]
        first: collections.Counter[str] | None = None
        try:
            for count in args.at:
                await _load(proxy.url, math.inf, answered, until_answered=count)
                kinds, big = alive()
                first = first or kinds
                grown = (kinds - first).most_common(5)
                lines.append(
                    f"{answered[0]:>10,} {sum(kinds.values()):>9,}  {big}  grown since the "
                    f"first count: {grown}"
                )
                print(lines[-1], flush=True)
        finally:
            await proxy.stop()
            await sim.stop()
        return lines

    rows = [
        "Objects alive in a proxy under load (in one process with the simulator and 8 "
        "clients), after each number of answered requests; every container of more than "
        "3,000 entries; the types that grew since the first count.",
        "",
        f"{'answered':>10} {'objects':>9}  containers over 3,000  growth",
        *run(counted()),
        "",
        where_it_ran(),
    ]
    publish(rows, args.out or Path(__file__).parent / "results" / "bounds-census.txt")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("answers", help="peak RSS per hostile answer")
    one.add_argument("--rolegate", help="another build's rolegate CLI to run the answers too")
    one.add_argument("--rolegate-label", default="before", help="its name in the table")
    one.add_argument("--out", type=Path)
    one.set_defaults(handler=answers)
    two = commands.add_parser("soak", help="RSS under a steady load")
    two.add_argument("--minutes", type=float, default=10.0)
    two.add_argument("--out", type=Path)
    two.set_defaults(handler=soak)
    three = commands.add_parser("census", help="objects alive in a proxy under load")
    three.add_argument("--at", type=int, nargs="+", default=[60_000, 150_000])
    three.add_argument("--out", type=Path)
    three.set_defaults(handler=census)
    args = parser.parse_args()
    handler = args.handler
    assert callable(handler)
    return int(handler(args))


if __name__ == "__main__":
    sys.exit(main())
