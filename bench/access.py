"""What identifying a caller adds to a request: an API key, a ServiceAccount token after its
first call, a grant with limits, each against a caller with no credential at all.

Real parts throughout: etcd and kube-apiserver (the control plane the tests use), the
operator compiling the grants into the ConfigMap, the proxy serving it and verifying the
token with TokenReviews, the simulated provider (instant machine), and this load
generator. The four kinds of caller run in alternating rounds at concurrency 1, so each
sees the same machine noise; every figure comes from this one run. The token's first call
(its TokenReview) is timed on its own.

Run: `.venv/bin/python bench/access.py` (builds the control plane on first use, as the
tests do).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp
from bench_cluster import Cluster, cluster
from bench_report import publish, where_it_ran
from overhead import REPLY, Samples, free_port, pct, wait_ready

MODEL = "bench/model"
NAMESPACE = "bench"
API_KEY = "sk-bench-caller-0f3a9c"
LIMITED_KEY = "sk-bench-limited-77e1"
BODY = json.dumps(
    {"model": "bench", "messages": [{"role": "user", "content": "benchmark prompt"}]}
).encode()


def manifests(sim_port: int) -> str:
    """Provider, role, and one grant per kind of caller (the limited one's figures are
    never reached: what is measured is the counting, not a refusal)."""
    return f"""apiVersion: rolegate.dev/v1alpha1
kind: ProviderPolicy
metadata: {{name: sim, namespace: {NAMESPACE}}}
spec:
  endpoint: http://127.0.0.1:{sim_port}/v1
  dialect: Aggregator
  models: [{{name: {MODEL}, machines: [{{name: m1}}]}}]
---
apiVersion: rolegate.dev/v1alpha1
kind: RoleTable
metadata: {{name: bench, namespace: {NAMESPACE}}}
spec:
  roles:
    - {{name: bench, models: [{MODEL}], patienceSeconds: 60, visibility: Watched, ruling: Order}}
---
apiVersion: rolegate.dev/v1alpha1
kind: AccessGrant
metadata: {{name: anyone, namespace: {NAMESPACE}}}
spec: {{subjects: [{{anonymous: true}}], roles: [bench]}}
---
apiVersion: rolegate.dev/v1alpha1
kind: AccessGrant
metadata: {{name: keyed, namespace: {NAMESPACE}}}
spec: {{subjects: [{{apiKeySecretRef: {{name: caller, key: key}}}}], roles: [bench]}}
---
apiVersion: rolegate.dev/v1alpha1
kind: AccessGrant
metadata: {{name: limited, namespace: {NAMESPACE}}}
spec:
  subjects: [{{apiKeySecretRef: {{name: limited, key: key}}}}]
  roles: [bench]
  limits: {{requestsPerMinute: 10000000, tokensPerMinute: 10000000000, costPerDayUSD: 1000000}}
---
apiVersion: rolegate.dev/v1alpha1
kind: AccessGrant
metadata: {{name: pods, namespace: {NAMESPACE}}}
spec: {{subjects: [{{serviceAccount: {{name: caller}}}}], roles: [bench]}}
"""


async def call(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> float:
    started = time.perf_counter()
    async with session.post(url, data=BODY, headers=headers) as response:
        await response.read()
        if response.status != 200:
            raise SystemExit(f"{url} answered {response.status} for {sorted(headers)}")
    return (time.perf_counter() - started) * 1000


async def served(url: str, headers: dict[str, str], within: float = 60.0) -> None:
    """Until the configuration with every grant has reached the proxy."""
    deadline = time.monotonic() + within
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.post(url, data=BODY, headers=headers) as response:
                if response.status == 200:
                    return
            if time.monotonic() > deadline:
                raise SystemExit(f"not served within {within:.0f}s ({response.status})")
            await asyncio.sleep(0.2)


async def measure(args: argparse.Namespace, url: str, token: str) -> list[str]:
    callers = {
        "no credential": {},
        "API key": {"Authorization": f"Bearer {API_KEY}"},
        "API key, limits": {"Authorization": f"Bearer {LIMITED_KEY}"},
        "SA token": {"Authorization": f"Bearer {token}"},
    }
    # Every grant arrives in one configuration: the keys' being served says the token's
    # grant is too, and leaves the token's first call (its review) to be timed below.
    for name in ("no credential", "API key", "API key, limits"):
        await served(url, callers[name])
    samples = {name: Samples() for name in callers}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        first_review = await call(session, url, callers["SA token"])
        for headers in callers.values():  # warm every path
            for _ in range(50):
                await call(session, url, headers)
        order = list(callers.items())
        for round_ in range(args.rounds):
            # Each round starts with a different caller: none is always first or last.
            for name, headers in order[round_ % 4 :] + order[: round_ % 4]:
                for _ in range(args.requests):
                    samples[name].total.append(await call(session, url, headers))
    base = samples["no credential"].total
    b50, b95 = statistics.median(base), pct(base, 0.95)
    header = f"{'caller':<16} {'p50':>9} {'vs none':>9} {'p95':>9} {'vs none':>9}"
    rows = [header, "-" * len(header)]
    for name, sample in samples.items():
        p50, p95 = statistics.median(sample.total), pct(sample.total, 0.95)
        rows.append(
            f"{name:<16} {p50:>7.3f}ms {p50 - b50:>+7.3f}ms {p95:>7.3f}ms {p95 - b95:>+7.3f}ms"
        )
    rows.append("")
    rows.append(f"a token's first call (its TokenReview included): {first_review:.2f} ms")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--requests", type=int, default=300, help="per caller per round")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "access.txt"
    )
    args = parser.parse_args()
    with cluster(NAMESPACE) as running:
        rows = run(args, running)
    rows.append(f"rounds={args.rounds} requests/caller/round={args.requests}; " + where_it_ran())
    publish(rows, args.out)
    return 0


def run(args: argparse.Namespace, running: Cluster) -> list[str]:
    plane, root = running.plane, running.root
    plane.kubectl("-n", NAMESPACE, "create", "serviceaccount", "caller")
    token = plane.kubectl(
        "-n", NAMESPACE, "create", "token", "caller", "--audience", "rolegate"
    ).stdout.strip()
    sim_port, proxy_port = free_port(), free_port()
    running.apply(manifests(sim_port))
    secrets = root / "secrets"
    for name, key in (("caller", API_KEY), ("limited", LIMITED_KEY)):
        (secrets / name).mkdir(parents=True)
        (secrets / name / "key").write_text(key)
    scenario = root / "scenario.json"
    scenario.write_text(json.dumps({"seed": 1, "models": [{"name": MODEL, "reply": REPLY,
        "machines": [{"name": "m1", "ttftSeconds": 0, "tokensPerSecond": 0}]}]},
        ensure_ascii=False), encoding="utf-8")  # fmt: skip
    running.start("sim", ["sim", "--scenario", str(scenario), "--port", str(sim_port)])
    running.start(
        "operator", ["operator", "--namespace", NAMESPACE, "--no-leader-election", *running.kube]
    )
    running.start(
        "proxy",
        ["proxy", "--configmap", f"{NAMESPACE}/rolegate-config", "--port", str(proxy_port),
         "--secrets-dir", str(secrets), *running.kube],
        {"POD_NAME": "bench-proxy"},
    )  # fmt: skip
    url = f"http://127.0.0.1:{proxy_port}"
    asyncio.run(wait_ready(f"http://127.0.0.1:{sim_port}/healthz"))
    asyncio.run(wait_ready(f"{url}/readyz", deadline_s=60))
    return asyncio.run(measure(args, f"{url}/v1/chat/completions", token))


if __name__ == "__main__":
    sys.exit(main())
