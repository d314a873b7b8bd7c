"""rolegate beside its peers: LiteLLM's proxy and Portkey's gateway, with the same upstream
and the same load generator, every figure from one run.

Targets, each a real process on loopback in front of the same simulator (instant machines,
one a 1,000-tokens-per-second machine):
- direct: the simulator itself (its own CPU is the upstream's cost);
- rolegate: `rolegate proxy --manifests` (standalone), from this checkout's .venv;
- LiteLLM: `litellm --config` (proxy extra, pinned), an `openai/` model per workload with
  `api_base` at the simulator; installed once into its own venv under the cache;
- Portkey: `@portkey-ai/gateway` (pinned, with `@hono/node-server` pinned to the version it
  streams with), `x-portkey-provider: openai` and `x-portkey-custom-host` at the
  simulator; installed once with npm under the cache.
The cache is `${ROLEGATE_CACHE:-~/.cache/rolegate}/bench-peers/`. Nobody authenticates:
rolegate has an anonymous AccessGrant, LiteLLM no master key, Portkey none of its own.

Cells (workloads), each against each target: a non-streamed request; a 20-chunk stream; a
500-chunk and a 5,000-chunk stream in bursts (the instant machine coalesces due events into
writes of up to 32 KiB); a 500-chunk stream paced at 1 ms a chunk; and non-streamed at
concurrency 64. Rounds alternate the targets within each cell (direct, rolegate, LiteLLM,
Portkey, direct, ...), after a warm-up round that also checks every answer is whole.

Measures: CPU time per request of the target's process tree (utime+stime from /proc, read
before and after each block); added latency to the last byte, p50 and p99 at concurrency 1
(target minus direct, same run); requests/s at concurrency 64; peak RSS (VmHWM summed over
the tree); and, from the CPU, what one chunk costs, bursty and paced.

Run: `make bench-peers` (or `.venv/bin/python bench/peers.py [--rounds 5] [--requests 200]
[--targets rolegate]`); a full run takes about 14 minutes, the first one a minute more to
install the peers. The result is written to bench/results/peers.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench_harness import (
    Cell,
    Measured,
    Processes,
    Results,
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

LITELLM = "1.108.7"
PORTKEY = "1.15.2"
# Portkey's gateway depends on `@hono/node-server@^1.3.3`, which resolves to 1.19 today; with
# that, a stream's body arrives empty (headers, then nothing). The override pins the one it
# streams with for the whole tree.
HONO_NODE_SERVER = "1.13.5"

TARGETS = ("direct", "rolegate", "litellm", "portkey")
SHOWN = {"direct": "direct", "rolegate": "rolegate", "litellm": "LiteLLM", "portkey": "Portkey"}
PROXIES = ("rolegate", "litellm", "portkey")
# The aggregator routing field rolegate adds for an Order ruling over one machine; the
# others get it in the request, so the simulator does the same work for everyone.
PROVIDER = {"order": ["m1"], "allow_fallbacks": True}
PACED_TOKENS_PER_SECOND = 1000


def cells(requests: int) -> list[Cell]:
    """The workloads; the long ones get fewer requests per round, so a round stays short
    while each block still costs its target far more CPU than the 10 ms a reading is
    good to."""
    return [
        Cell("complete", "bench/complete", 20, False, 1, requests),
        Cell("stream-20", "bench/stream-20", 20, True, 1, requests),
        Cell("burst-500", "bench/burst-500", 500, True, 1, max(requests // 4, 5)),
        Cell("burst-5000", "bench/burst-5000", 5000, True, 1, max(requests // 20, 3)),
        Cell("paced-500", "bench/paced-500", 500, True, 1, max(requests // 20, 3)),
        Cell("complete-c64", "bench/complete", 20, False, 64, max(requests * 4, 128)),
    ]


def cache_root() -> Path:
    base = os.environ.get("ROLEGATE_CACHE") or str(Path.home() / ".cache" / "rolegate")
    return Path(base) / "bench-peers"


def _installed(folder: Path, install: Callable[[Path], None], what: str) -> Path:
    """`folder` as `install` leaves it, installed once: a stamp marks a finished install,
    and a folder without one (an interrupted install) is started over."""
    stamp = folder / ".installed"
    if stamp.exists():
        return folder
    print(f"installing {what} into {folder} (once)", file=sys.stderr, flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    log = folder / "install.log"
    try:
        install(folder)
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"installing {what} failed ({exc}); see {log}") from exc
    stamp.touch()
    return folder


def _logged(argv: Sequence[str], folder: Path) -> None:
    with (folder / "install.log").open("ab") as log:
        subprocess.run(argv, cwd=folder, stdout=log, stderr=subprocess.STDOUT, check=True)


def litellm_venv() -> Path:
    def install(folder: Path) -> None:
        _logged([sys.executable, "-m", "venv", str(folder / "venv")], folder)
        pip = str(folder / "venv" / "bin" / "pip")
        _logged([pip, "install", "--quiet", "--upgrade", "pip"], folder)
        _logged([pip, "install", "--quiet", f"litellm[proxy]=={LITELLM}"], folder)

    return _installed(cache_root() / f"litellm-{LITELLM}", install, f"litellm[proxy]=={LITELLM}")


def portkey_folder() -> Path:
    def install(folder: Path) -> None:
        package = {
            "name": "rolegate-bench-portkey",
            "private": True,
            "dependencies": {
                "@portkey-ai/gateway": PORTKEY,
                "@hono/node-server": HONO_NODE_SERVER,
            },
            "overrides": {"@hono/node-server": HONO_NODE_SERVER},
        }
        (folder / "package.json").write_text(json.dumps(package, indent=2) + "\n")
        _logged(["npm", "install", "--no-audit", "--no-fund"], folder)

    what = f"@portkey-ai/gateway@{PORTKEY} with @hono/node-server@{HONO_NODE_SERVER}"
    return _installed(cache_root() / f"portkey-{PORTKEY}", install, what)


def scenario(path: Path, workloads: Sequence[Cell]) -> None:
    models = {
        cell.model: sim_model(
            cell.model,
            cell.tokens,
            ["m1"],
            PACED_TOKENS_PER_SECOND if cell.name.startswith("paced") else 0,
        )
        for cell in workloads
    }
    write_scenario(path, list(models.values()))


def role_name(model: str) -> str:
    return model.removeprefix("bench/")


def rolegate_manifests(folder: Path, sim: str, workloads: Sequence[Cell]) -> None:
    models = sorted({cell.model for cell in workloads})
    provider = {
        "apiVersion": "rolegate.dev/v1alpha1",
        "kind": "ProviderPolicy",
        "metadata": {"name": "sim"},
        "spec": {
            "endpoint": f"{sim}/v1",
            "dialect": "Aggregator",
            "models": [{"name": model, "machines": [{"name": "m1"}]} for model in models],
        },
    }
    roles = roles_and_grant({role_name(model): [model] for model in models})
    write_manifests(folder, [provider, *roles])


def litellm_config(path: Path, sim: str, workloads: Sequence[Cell]) -> None:
    config = {
        "model_list": [
            {
                "model_name": model,
                "litellm_params": {
                    "model": f"openai/{model}",
                    "api_base": f"{sim}/v1",
                    "api_key": "sk-bench",
                },
            }
            for model in sorted({cell.model for cell in workloads})
        ],
        # No credential for any target (rolegate's grant is anonymous); LiteLLM refuses
        # to start without a master key unless told this is on purpose.
        "general_settings": {"dangerously_permit_weak_or_unset_master_key": True},
    }
    path.write_text(json.dumps(config))


def start_targets(
    procs: Processes, root: Path, chosen: Sequence[str], workloads: Sequence[Cell]
) -> tuple[list[Target], list[str]]:
    """Start the simulator and the chosen gateways; return the targets and what ran."""
    rolegate = rolegate_command()
    sim_port = free_port()
    sim_url = f"http://127.0.0.1:{sim_port}"
    scenario(root / "scenario.json", workloads)
    sim = procs.start(
        "sim", [rolegate, "sim", "--scenario", str(root / "scenario.json"), "--port", str(sim_port)]
    )
    ran = [f"upstream: rolegate sim (instant machines; paced: {PACED_TOKENS_PER_SECOND} tok/s)"]
    waits = [(sim, f"{sim_url}/healthz", 30.0)]

    def direct_body(cell: Cell) -> bytes:
        return openai_body(cell.model, cell.stream, PROVIDER)

    targets = [Target("direct", f"{sim_url}/v1/chat/completions", sim, direct_body)]
    if "rolegate" in chosen:
        port = free_port()
        rolegate_manifests(root / "manifests", sim_url, workloads)
        proc = procs.start(
            "rolegate",
            [rolegate, "proxy", "--manifests", str(root / "manifests"), "--port", str(port)],
        )

        def rolegate_body(cell: Cell) -> bytes:
            return openai_body(role_name(cell.model), cell.stream, None)

        url = f"http://127.0.0.1:{port}"
        targets.append(Target("rolegate", f"{url}/v1/chat/completions", proc, rolegate_body))
        waits.append((proc, f"{url}/readyz", 60.0))
        ran.append("rolegate: `rolegate proxy --manifests` (this checkout)")
    if "litellm" in chosen:
        venv = litellm_venv() / "venv"
        port = free_port()
        litellm_config(root / "litellm.yaml", sim_url, workloads)
        proc = procs.start(
            "litellm",
            [
                str(venv / "bin" / "litellm"),
                *("--config", str(root / "litellm.yaml")),
                *("--host", "127.0.0.1", "--port", str(port)),
            ],
            # Its model price list from the package, not fetched at start.
            env={"LITELLM_LOCAL_MODEL_COST_MAP": "True"},
        )
        url = f"http://127.0.0.1:{port}"
        targets.append(Target("litellm", f"{url}/v1/chat/completions", proc, direct_body))
        waits.append((proc, f"{url}/health/liveliness", 180.0))
        ran.append(f"LiteLLM: litellm[proxy]=={LITELLM} (`litellm --config`, 1 uvicorn worker)")
    if "portkey" in chosen:
        folder = portkey_folder()
        port = free_port()
        script = folder / "node_modules" / "@portkey-ai" / "gateway" / "build" / "start-server.js"
        proc = procs.start(
            "portkey", ["node", str(script), f"--port={port}", "--headless"], cwd=folder
        )
        headers = {
            "x-portkey-provider": "openai",
            "x-portkey-custom-host": f"{sim_url}/v1",
            "Authorization": "Bearer sk-bench",
        }
        url = f"http://127.0.0.1:{port}"
        targets.append(Target("portkey", f"{url}/v1/chat/completions", proc, direct_body, headers))
        waits.append((proc, f"{url}/", 60.0))
        node = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout
        ran.append(
            f"Portkey: @portkey-ai/gateway@{PORTKEY}, @hono/node-server@{HONO_NODE_SERVER}, "
            f"node {node.strip()} (`start-server.js --headless`)"
        )

    async def ready() -> None:
        for proc, url, within in waits:
            await proc.ready(url, within)

    run(ready())
    return targets, ran


def report(results: Results, targets: Sequence[str], workloads: Sequence[Cell]) -> list[str]:
    proxies = [name for name in PROXIES if name in targets]
    shown = [SHOWN[name] for name in targets]
    by_name = {cell.name: cell for cell in workloads}
    at_one = [cell for cell in workloads if cell.concurrency == 1]

    def get(target: str, cell: str) -> Measured:
        return results[target, cell]

    def ratios(values: dict[str, float]) -> list[str]:
        rg = values.get("rolegate", float("nan"))
        return [
            ratio(rg, values.get("portkey", float("nan"))),
            ratio(rg, values.get("litellm", float("nan"))),
        ]

    ratio_header = ["rg÷Portkey", "rg÷LiteLLM"]
    rows: list[str] = []

    cpu_rows = []
    for cell in workloads:
        values = {t: get(t, cell.name).cpu_ms_per_request() for t in targets}
        cpu_rows.append([cell.name, *(number(values[t]) for t in targets), *ratios(values)])
    rows += table(
        "CPU per request, ms (the target's process tree; direct: the simulator's own)",
        ["cell", *shown, *ratio_header],
        cpu_rows,
    )

    minus_rows = []
    for cell in workloads:
        upstream = get("direct", cell.name).cpu_ms_per_request()
        minus_rows.append(
            [
                cell.name,
                *(number(get(t, cell.name).cpu_ms_per_request() - upstream) for t in proxies),
                *(number(get(t, cell.name).upstream_cpu_ms_per_request()) for t in proxies),
            ]
        )
    rows += table(
        "Each proxy's CPU minus the upstream's, ms per request; and the upstream's own CPU "
        "while it served that proxy",
        ["cell", *(f"{SHOWN[t]} - up" for t in proxies), *(f"up for {SHOWN[t]}" for t in proxies)],
        minus_rows,
    )

    chunk_rows = []
    for label, name in (("bursty (burst-5000)", "burst-5000"), ("paced (paced-500)", "paced-500")):
        chunks = by_name[name].tokens
        values = {
            t: (get(t, name).cpu_ms_per_request() - get(t, "complete").cpu_ms_per_request())
            * 1000
            / chunks
            for t in targets
        }
        chunk_rows.append([label, *(number(values[t], 2) for t in targets), *ratios(values)])
    rows += table(
        "CPU per chunk, µs: (CPU of the stream - CPU of the non-streamed request) ÷ chunks",
        ["stream", *shown, *ratio_header],
        chunk_rows,
    )

    for label, pick in (("p50", Measured.p50), ("p99", Measured.p99)):
        latency_rows = []
        for cell in at_one:
            direct = pick(get("direct", cell.name))
            added = {t: pick(get(t, cell.name)) - direct for t in proxies}
            latency_rows.append(
                [
                    cell.name,
                    number(direct),
                    *(number(added[t], signed=True) for t in proxies),
                    *ratios(added),
                ]
            )
        rows += table(
            f"Added latency at concurrency 1, {label} to the last byte, ms (target - direct)",
            ["cell", f"direct {label}", *(SHOWN[t] for t in proxies), *ratio_header],
            latency_rows,
        )

    rps = {t: get(t, "complete-c64").per_second() for t in targets}
    rows += table(
        "Requests/s at concurrency 64, non-streamed (the load generator shares the 2 CPUs)",
        ["", *shown, *ratio_header],
        [["requests/s", *(number(rps[t], 0) for t in targets), *ratios(rps)]],
    )

    first_rows = []
    for cell in at_one:
        if cell.stream:
            first_rows.append(
                [cell.name, *(number(get(t, cell.name).first_p50()) for t in targets)]
            )
    rows += table(
        "Streams: first content token p50, ms (a target that buffers shows it here)",
        ["cell", *shown],
        first_rows,
    )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--requests",
        type=int,
        default=200,
        help="per round for the short cells at concurrency 1 (the 500-chunk bursts get a "
        "quarter, the 5,000-chunk and paced streams a twentieth, concurrency 64 four times)",
    )
    parser.add_argument(
        "--targets",
        default=",".join(TARGETS),
        help="comma-separated, of: " + ", ".join(TARGETS) + " (direct is always measured)",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "peers.txt")
    args = parser.parse_args()
    chosen = [name.strip().lower() for name in args.targets.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(TARGETS))
    if unknown:
        parser.error(f"unknown target(s): {', '.join(unknown)}; choose from {', '.join(TARGETS)}")
    workloads = cells(args.requests)

    started = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="rolegate-peers-"))
    with Processes(root) as procs:
        targets, ran = start_targets(procs, root, chosen, workloads)
        names = [target.name for target in targets]
        print(f"logs and inputs: {root}; targets: {', '.join(names)}", file=sys.stderr)
        sim = targets[0].proc
        results = run(
            measure(
                targets,
                workloads,
                args.rounds,
                sim,
                lambda line: print(line, file=sys.stderr, flush=True),
            )
        )
        rss = {target.name: target.proc.peak_rss_mib() for target in targets}

    rows = report(results, names, workloads)
    rows += table(
        "Peak RSS, MiB (VmHWM summed over the process tree, at the end of the run)",
        ["", *(SHOWN[n] for n in names), "rg÷Portkey", "rg÷LiteLLM"],
        [
            [
                "peak RSS",
                *(number(rss[n], 1) for n in names),
                ratio(rss.get("rolegate", float("nan")), rss.get("portkey", float("nan"))),
                ratio(rss.get("rolegate", float("nan")), rss.get("litellm", float("nan"))),
            ]
        ],
    )
    notes = [
        f"{SHOWN[t]}, {cell}: {m.note}" for (t, cell), m in results.items() if m.note is not None
    ]
    rows += [f"note: {note}" for note in notes]
    rows += ran
    per_round = ", ".join(f"{cell.name} {cell.requests}" for cell in workloads)
    rows.append(
        f"rounds={args.rounds}; requests per target and round: {per_round}; "
        f"{time.monotonic() - started:.0f}s; " + where_it_ran()
    )
    publish(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
