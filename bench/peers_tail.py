"""The latency tails of two rolegate builds side by side, from pooled samples.

`peers.py` gives a p99 per run, over a few dozen streams (nearly their maximum), and
`peers_compare.py` takes the median of those across runs: a tail cell moves by tens of
percent between runs of one tree. This runs both builds at once, against one simulator,
alternating between them block by block within every round (with the simulator alone as
the baseline), and reports each cell's percentiles over every stream of the run: a p99
over hundreds of streams, the two builds measured under the same conditions.

    .venv/bin/python bench/peers_tail.py --before /work/old/.venv/bin/rolegate \\
        [--after .venv/bin/rolegate] [--rounds 30] [--out bench/results/peers-tail.txt]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bench_harness import (
    Measured,
    Processes,
    Target,
    measure,
    openai_body,
    rolegate_command,
    run,
)
from bench_report import publish, where_it_ran
from overhead import free_port, pct
from peers import PROVIDER, cells, role_name, rolegate_manifests, scenario

CELLS = ("stream-20", "paced-500")
PERCENTILES = (0.5, 0.9, 0.99)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the other build's rolegate CLI")
    parser.add_argument("--after", default=rolegate_command(), help="default: this checkout's")
    parser.add_argument("--label", default="before -> after")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--requests", type=int, default=200, help="as peers.py's")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "peers-tail.txt"
    )
    args = parser.parse_args()
    workloads = [cell for cell in cells(args.requests) if cell.name in CELLS]
    root = Path(tempfile.mkdtemp(prefix="rolegate-tail-"))
    started = time.monotonic()
    with Processes(root) as procs:
        sim_port = free_port()
        sim_url = f"http://127.0.0.1:{sim_port}"
        scenario(root / "scenario.json", workloads)
        sim = procs.start(
            "sim",
            [args.after, "sim", "--scenario", str(root / "scenario.json"), "--port", str(sim_port)],
        )
        rolegate_manifests(root / "manifests", sim_url, workloads)
        targets = [
            Target(
                "direct",
                f"{sim_url}/v1/chat/completions",
                sim,
                lambda cell: openai_body(cell.model, cell.stream, PROVIDER),
            )
        ]
        for name, cli in (("before", args.before), ("after", args.after)):
            port = free_port()
            proc = procs.start(
                name, [cli, "proxy", "--manifests", str(root / "manifests"), "--port", str(port)]
            )
            run(proc.ready(f"http://127.0.0.1:{port}/readyz", 60))
            targets.append(
                Target(
                    name,
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    proc,
                    lambda cell: openai_body(role_name(cell.model), cell.stream, None),
                )
            )
        run(sim.ready(f"{sim_url}/healthz", 30))
        results = run(
            measure(
                targets,
                workloads,
                args.rounds,
                sim,
                lambda line: print(line, file=sys.stderr, flush=True),
            )
        )

    columns = ("direct", "before +", "after +")
    header = f"{'cell':<10} {'streams':>7} {'pct':>5} " + " ".join(f"{c:>9}" for c in columns)
    header += f" {'change':>8}"
    rows = [
        f"Added latency to the last byte, ms, pooled over every stream of the run: {args.label}",
        f"Both builds live at once against one simulator, alternating block by block within "
        f"each of {args.rounds} rounds; the simulator alone is the baseline.",
        "",
        header,
        "-" * len(header),
    ]
    for cell in workloads:
        measured: dict[str, Measured] = {t.name: results[t.name, cell.name] for t in targets}
        streams = len(measured["after"].latencies_ms)
        for share in PERCENTILES:
            direct = pct(measured["direct"].latencies_ms, share)
            before = pct(measured["before"].latencies_ms, share) - direct
            after = pct(measured["after"].latencies_ms, share) - direct
            change = (after - before) / before * 100 if before else float("nan")
            rows.append(
                f"{cell.name:<10} {streams:>7} {'p' + str(round(share * 100)):>5} "
                f"{direct:>9.3f} {before:>9.3f} {after:>9.3f} {change:>+7.1f}%"
            )
    rows += ["", f"{time.monotonic() - started:.0f}s; " + where_it_ran()]
    publish(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
