"""How much latency the proxy adds over calling the simulated provider directly.

Three real processes on loopback: the simulated provider (instant machine: no TTFT, no
token pacing, so the provider's own time is as small as it gets and the proxy's share is
as visible as it gets), the proxy in standalone mode, and this load generator. Direct and
proxied requests run in alternating rounds so both see the same machine noise, and every
figure below comes from one run: added milliseconds at the median and p95, and the ratio.

Run: `make bench` (or `.venv/bin/python bench/overhead.py --rounds 5`). With `--trace` the
proxy exports OpenTelemetry spans (configured by OTEL_* alone, as an operator would) to a
real OTLP/HTTP receiver on loopback (`otlp_receiver.py`, a fourth process); run with and
without it in alternation to see what tracing adds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from bench_report import publish, where_it_ran

MODEL = "bench/model"
REPLY = " ".join(f"token{i}" for i in range(48)) + " — café 日本語 🚀"


@dataclass
class Samples:
    total: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def write_inputs(root: Path, sim_port: int) -> tuple[Path, Path]:
    scenario = root / "scenario.json"
    scenario.write_text(
        json.dumps(
            {
                "seed": 1,
                "models": [
                    {
                        "name": MODEL,
                        "reply": REPLY,
                        "machines": [{"name": "m1", "ttftSeconds": 0, "tokensPerSecond": 0}],
                    }
                ],
            },
            ensure_ascii=False,
        ),
        encoding="utf-8",
    )
    manifests = root / "manifests"
    manifests.mkdir()
    (manifests / "bench.yaml").write_text(
        f"""apiVersion: rolegate.dev/v1alpha1
kind: ProviderPolicy
metadata: {{name: sim}}
spec:
  endpoint: http://127.0.0.1:{sim_port}/v1
  dialect: Aggregator
  models:
    - name: {MODEL}
      machines: [{{name: m1}}]
---
apiVersion: rolegate.dev/v1alpha1
kind: RoleTable
metadata: {{name: bench}}
spec:
  roles:
    - {{name: bench, models: [{MODEL}], patienceSeconds: 60, visibility: Watched, ruling: Order}}
---
# The load generator calls without a credential: an explicit open grant.
apiVersion: rolegate.dev/v1alpha1
kind: AccessGrant
metadata: {{name: bench}}
spec:
  subjects: [{{anonymous: true}}]
  roles: [bench]
"""
    )
    return scenario, manifests


async def wait_ready(url: str, deadline_s: float = 20.0) -> None:
    deadline = time.monotonic() + deadline_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise SystemExit(f"{url} did not become ready within {deadline_s}s")


async def one(
    session: aiohttp.ClientSession, url: str, body: bytes, stream: bool, out: Samples
) -> None:
    started = time.perf_counter()
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        if r.status != 200:
            raise SystemExit(f"{url} answered {r.status}: {await r.text()}")
        if stream:
            first = None
            async for chunk in r.content.iter_any():
                if first is None and b"token0" in chunk:
                    first = time.perf_counter()
            out.first.append(((first or time.perf_counter()) - started) * 1000)
        else:
            await r.read()
    out.total.append((time.perf_counter() - started) * 1000)


async def run_block(
    url: str, body: bytes, stream: bool, concurrency: int, requests: int, out: Samples
) -> None:
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        queue = iter(range(requests))

        async def worker() -> None:
            for _ in queue:
                await one(session, url, body, stream, out)

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def body_for(stream: bool, via_proxy: bool) -> bytes:
    payload: dict[str, object] = {
        "model": "bench" if via_proxy else MODEL,
        "messages": [{"role": "user", "content": "benchmark prompt — with non-ASCII ✓"}],
        "stream": stream,
    }
    if not via_proxy:
        # What the proxy would add for an Order ruling, so both sides ask the same thing.
        payload["provider"] = {"order": ["m1"], "allow_fallbacks": True}
    return json.dumps(payload, ensure_ascii=False).encode("utf-8")


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(args: argparse.Namespace, sim_url: str, proxy_url: str) -> list[str]:
    rows = []
    header = (
        f"{'mode':<10} {'conc':>4} {'metric':<6} {'direct p50':>10} {'proxy p50':>10} "
        f"{'added p50':>10} {'ratio':>6} {'direct p95':>10} {'proxy p95':>10} {'added p95':>10}"
    )
    rows.append(header)
    rows.append("-" * len(header))
    for stream in (False, True):
        for concurrency in (1, 64):
            direct, proxied = Samples(), Samples()
            per_round = args.requests if concurrency == 1 else args.requests * 4
            # Warm both paths (connection pools, caches) before measuring.
            await run_block(
                f"{sim_url}/v1/chat/completions",
                body_for(stream, False),
                stream,
                concurrency,
                50,
                Samples(),
            )
            await run_block(
                f"{proxy_url}/v1/chat/completions",
                body_for(stream, True),
                stream,
                concurrency,
                50,
                Samples(),
            )
            for _ in range(args.rounds):
                await run_block(
                    f"{sim_url}/v1/chat/completions",
                    body_for(stream, False),
                    stream,
                    concurrency,
                    per_round,
                    direct,
                )
                await run_block(
                    f"{proxy_url}/v1/chat/completions",
                    body_for(stream, True),
                    stream,
                    concurrency,
                    per_round,
                    proxied,
                )
            metrics = [("total", direct.total, proxied.total)]
            if stream:
                metrics = [
                    ("ttft", direct.first, proxied.first),
                    ("last", direct.total, proxied.total),
                ]
            for name, d, p in metrics:
                d50, p50 = statistics.median(d), statistics.median(p)
                d95, p95 = pct(d, 0.95), pct(p, 0.95)
                rows.append(
                    f"{'stream' if stream else 'complete':<10} {concurrency:>4} {name:<6} "
                    f"{d50:>9.3f}ms {p50:>9.3f}ms {p50 - d50:>+9.3f}ms {p50 / d50:>6.2f} "
                    f"{d95:>9.3f}ms {p95:>9.3f}ms {p95 - d95:>+9.3f}ms"
                )
    return rows


async def trace_counts(proxy_url: str, receiver_url: str) -> str:
    """Tracing's own figures once the proxy's queue has been exported (at most one batch
    delay): spans the receiver got, and the proxy's counts of exported and dropped ones."""
    received, counts = 0, {}
    async with aiohttp.ClientSession() as session:
        for _ in range(100):
            async with session.get(f"{proxy_url}/metrics") as response:
                page = await response.text()
            counts = {
                line.split()[0]: float(line.split()[1])
                for line in page.splitlines()
                if line.startswith("rolegate_trace_spans_")
            }
            if counts.get("rolegate_trace_spans_exported_total", 0) > 0:
                queued_out = counts["rolegate_trace_spans_exported_total"]
                async with session.get(f"{receiver_url}/count") as response:
                    received = (await response.json())["spans"]
                if received >= queued_out:
                    break
            await asyncio.sleep(0.1)
    return (
        f"tracing on: OTLP/HTTP to a receiver on loopback; spans received {received}, "
        f"exported {counts.get('rolegate_trace_spans_exported_total', 0):.0f}, "
        f"dropped {counts.get('rolegate_trace_spans_dropped_total', 0):.0f}, "
        f"failed {counts.get('rolegate_trace_spans_failed_total', 0):.0f} (so far)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200, help="per round at concurrency 1")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "overhead.txt"
    )
    parser.add_argument(
        "--trace", action="store_true", help="the proxy exports spans to an OTLP receiver"
    )
    parser.add_argument(
        "--trace-ratio",
        type=float,
        default=1.0,
        help="with --trace, the share of requests traced (parentbased_traceidratio)",
    )
    args = parser.parse_args()

    sim_port, proxy_port = free_port(), free_port()
    with tempfile.TemporaryDirectory() as tmp:
        scenario, manifests = write_inputs(Path(tmp), sim_port)
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env["PYTHONUNBUFFERED"] = "1"
        cli = [sys.executable, "-m", "rolegate_cli.main"]
        receiver: subprocess.Popen[bytes] | None = None
        receiver_url = f"http://127.0.0.1:{free_port()}"
        proxy_env = dict(env)
        if args.trace:
            receiver = subprocess.Popen(
                [sys.executable, str(Path(__file__).parent / "otlp_receiver.py"),
                 "--port", receiver_url.rsplit(":", 1)[1]], env=env,
            )  # fmt: skip
            # The SDK's defaults otherwise (a 2048-span queue, batches of 512, every 5 s).
            proxy_env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver_url
            if args.trace_ratio < 1.0:
                proxy_env["OTEL_TRACES_SAMPLER"] = "parentbased_traceidratio"
                proxy_env["OTEL_TRACES_SAMPLER_ARG"] = str(args.trace_ratio)
        sim = subprocess.Popen(
            [*cli, "sim", "--scenario", str(scenario), "--port", str(sim_port)], env=env
        )
        proxy = subprocess.Popen(
            [*cli, "proxy", "--manifests", str(manifests), "--port", str(proxy_port),
             "--metrics-on-api-port"],
            env=proxy_env,
        )  # fmt: skip
        try:
            sim_url, proxy_url = f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{proxy_port}"
            asyncio.run(wait_ready(f"{sim_url}/healthz"))
            asyncio.run(wait_ready(f"{proxy_url}/readyz"))
            if receiver is not None:
                asyncio.run(wait_ready(f"{receiver_url}/count"))
            rows = asyncio.run(measure(args, sim_url, proxy_url))
            rss = peak_rss_mib(proxy.pid)
            traced = asyncio.run(trace_counts(proxy_url, receiver_url)) if args.trace else ""
        finally:
            for process in (proxy, sim, receiver):
                if process is not None:
                    process.terminate()
                    process.wait(timeout=30)
    rows.append("")
    rows.append(f"proxy peak RSS: {rss:.1f} MiB")
    if traced:
        rows.append(traced)
    rows.append(
        f"rounds={args.rounds} requests/round={args.requests} (x4 at concurrency 64); "
        + where_it_ran()
    )
    publish(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
