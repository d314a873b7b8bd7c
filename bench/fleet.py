"""How fast a trip on one proxy pod protects the others: from pod A's breaker opening to pod
C keeping the key out, and from A's probe closing it to C taking it back.

Real parts: etcd and kube-apiserver (the tests' control plane), the operator, the
simulator, and three proxy processes as three pods (distinct POD_NAME) sharing their
memory through ProxyMemory objects at the default interval (30 s): a breaker transition
is written at once, not at the next interval, which is what this measures. Each trial
takes m1 down (503s), drives pod A until its breaker on m1 is open, then polls pod C's
`/v1/rolegate/state` every 10 ms until `fleet_trips` names m1; then heals m1, drives A
until its probe closes the breaker, and polls C until m1 is back.

Run: `.venv/bin/python bench/fleet.py [--trials 10]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from bench_cluster import Cluster, cluster
from bench_report import publish, where_it_ran
from overhead import free_port, pct, wait_ready

MODEL = "bench/model"
NAMESPACE = "fleet"
PODS = ("proxy-a", "proxy-b", "proxy-c")
BODY = json.dumps({"model": "agent", "messages": [{"role": "user", "content": "hi"}]}).encode()


def manifests(sim_port: int) -> str:
    """An aggregator with m1 (published faster) and m2; a role that names one machine per
    attempt (`Only`), so m1's failures reach the proxy's breaker; a short cooldown so the
    trials can follow one another."""
    return f"""apiVersion: rolegate.dev/v1alpha1
kind: ProviderPolicy
metadata: {{name: agg, namespace: {NAMESPACE}}}
spec:
  endpoint: http://127.0.0.1:{sim_port}/v1
  dialect: Aggregator
  breaker: {{cooldownSeconds: 1, maxCooldownSeconds: 1, jitterFraction: 0}}
  models:
    - name: {MODEL}
      machines:
        - {{name: m1, ttftSeconds: 0.05, tokensPerSecond: 200}}
        - {{name: m2, ttftSeconds: 0.1, tokensPerSecond: 200}}
---
apiVersion: rolegate.dev/v1alpha1
kind: RoleTable
metadata: {{name: bench, namespace: {NAMESPACE}}}
spec:
  roles:
    - {{name: agent, models: [{MODEL}], patienceSeconds: 30, visibility: Watched, ruling: Only}}
---
apiVersion: rolegate.dev/v1alpha1
kind: AccessGrant
metadata: {{name: bench, namespace: {NAMESPACE}}}
spec: {{subjects: [{{anonymous: true}}], roles: ["*"], admin: true}}
"""


async def state(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(f"{url}/v1/rolegate/state") as response:
        found: dict[str, Any] = await response.json()
        return found


def names_m1(rows: list[dict[str, Any]]) -> bool:
    return any(row.get("machine") == "m1" for row in rows)


async def until(check: Any, within: float, every: float) -> float:
    """Poll `check` until it is true: the monotonic time it first was."""
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            raise SystemExit(f"not within {within:.0f} s")
        await asyncio.sleep(every)
    return time.monotonic()


async def trials(count: int, sim: str, a: str, c: str) -> tuple[list[float], list[float]]:
    faults = f"{sim}/_sim/machines/{MODEL}/m1/faults"
    spread, cleared = [], []
    async with aiohttp.ClientSession() as session:

        async def drive_a() -> None:
            async with session.post(f"{a}/v1/chat/completions", data=BODY) as response:
                await response.read()

        async def a_open() -> bool:
            await drive_a()
            return names_m1((await state(session, a))["breakers"])

        async def a_closed() -> bool:
            await drive_a()
            return not names_m1((await state(session, a))["breakers"])

        async def c_out() -> bool:
            return names_m1((await state(session, c))["fleet_trips"])

        async def c_back() -> bool:
            return not names_m1((await state(session, c))["fleet_trips"])

        for _ in range(count):
            down = [{"kind": "serverError", "always": True, "status": 503}]
            async with session.put(faults, json=down) as response:
                response.raise_for_status()
            tripped = await until(a_open, 60, 0.05)
            spread.append(await until(c_out, 30, 0.01) - tripped)
            async with session.put(faults, json=[]) as response:
                response.raise_for_status()
            closed = await until(a_closed, 60, 0.2)
            cleared.append(await until(c_back, 30, 0.01) - closed)
    return spread, cleared


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "fleet.txt")
    args = parser.parse_args()
    with cluster(NAMESPACE) as running:
        spread, cleared = run(args, running)
    rows = [
        f"{'from a trip on pod A':<38} {'p50':>7} {'p95':>7} {'max':>7}",
        "-" * 62,
    ]
    for name, values in (
        ("to the key kept out on pod C", spread),
        ("(closed on A) to the key back on C", cleared),
    ):
        rows.append(
            f"{name:<38} {statistics.median(values):>6.2f}s {pct(values, 0.95):>6.2f}s "
            f"{max(values):>6.2f}s"
        )
    rows.append("")
    rows.append(f"every trial (s): {' '.join(f'{v:.2f}' for v in spread)}")
    rows.append(
        f"trials={args.trials}; memory published every 30 s and at once on a transition; "
        + where_it_ran()
    )
    publish(rows, args.out)
    return 0


def run(args: argparse.Namespace, running: Cluster) -> tuple[list[float], list[float]]:
    sim_port = free_port()
    running.apply(manifests(sim_port))
    scenario = running.root / "scenario.json"
    scenario.write_text(json.dumps({"seed": 1, "models": [{"name": MODEL, "machines": [
        {"name": "m1", "ttftSeconds": 0, "tokensPerSecond": 0},
        {"name": "m2", "ttftSeconds": 0, "tokensPerSecond": 0}]}]}))  # fmt: skip
    running.start("sim", ["sim", "--scenario", str(scenario), "--port", str(sim_port)])
    running.start(
        "operator", ["operator", "--namespace", NAMESPACE, "--no-leader-election", *running.kube]
    )
    ports = {pod: free_port() for pod in PODS}
    for pod, port in ports.items():
        running.start(
            pod,
            ["proxy", "--configmap", f"{NAMESPACE}/rolegate-config", "--port", str(port),
             "--explore-share", "0", *running.kube],
            {"POD_NAME": pod},
        )  # fmt: skip
    sim = f"http://127.0.0.1:{sim_port}"
    urls = {pod: f"http://127.0.0.1:{port}" for pod, port in ports.items()}
    asyncio.run(wait_ready(f"{sim}/healthz"))
    for url in urls.values():
        asyncio.run(wait_ready(f"{url}/readyz", deadline_s=60))
    return asyncio.run(trials(args.trials, sim, urls["proxy-a"], urls["proxy-c"]))


if __name__ == "__main__":
    sys.exit(main())
