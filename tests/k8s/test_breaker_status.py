"""Breaker state on the ProviderPolicy (SPEC D4, D6), end to end on the real control plane:
two proxy processes as two pods, the operator, and `kubectl get pp` as a person reads it."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import pytest

from rolegate_cli.controlplane import ControlPlane, free_port

from ..support import SimFactory, provider_policy, role, role_table
from .processes import ready, start_cli, stop, until

MODEL = "vendor/model-a"
PROMPT = [{"role": "user", "content": "plain ascii prompt"}]


@dataclass
class Stack:
    plane: ControlPlane
    namespace: str
    sim_url: str
    proxies: dict[str, str]  # pod name -> url
    processes: dict[str, Any]

    def kubectl(self, *args: str) -> str:
        return self.plane.kubectl("-n", self.namespace, *args).stdout

    async def pp(self) -> dict[str, Any]:
        text = await asyncio.to_thread(self.kubectl, "get", "pp", "router", "-o", "json")
        status: dict[str, Any] = json.loads(text).get("status") or {}
        return status

    async def columns(self) -> dict[str, str]:
        table = await asyncio.to_thread(self.kubectl, "get", "pp", "router")
        header, row = table.strip().splitlines()[:2]
        names = re.split(r"\s{2,}", header.strip())
        # Empty cells collapse the spacing: read by column offsets instead.
        starts = [header.index(name) for name in names]
        ends = [*starts[1:], None]
        return {n: row[s:e].strip() for n, s, e in zip(names, starts, ends, strict=True)}

    async def faults(self, faults: list[dict[str, Any]]) -> None:
        async with httpx.AsyncClient() as client:
            url = f"{self.sim_url}/_sim/machines/{MODEL}/m1/faults"
            (await client.put(url, json=faults)).raise_for_status()

    async def send(self, pod: str, count: int = 1) -> list[int]:
        statuses = []
        async with httpx.AsyncClient(timeout=30) as client:
            for _ in range(count):
                response = await client.post(
                    f"{self.proxies[pod]}/v1/chat/completions",
                    json={"model": "agent", "messages": PROMPT},
                )
                statuses.append(response.status_code)
        return statuses


@pytest.fixture
async def stack(crds: ControlPlane, namespace: str, sim_server: SimFactory) -> AsyncIterator[Stack]:
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "machines": [{"name": "m1", "ttftSeconds": 0}]}]}
    )
    policy = provider_policy(
        "router", f"{sim.url}/v1", {MODEL: ["m1"]}, breaker={"cooldownSeconds": 2}
    )
    for manifest in (policy, role_table(role("agent", [MODEL]))):
        manifest["metadata"]["namespace"] = namespace
        await asyncio.to_thread(crds.kubectl, "apply", "-f", "-", input=json.dumps(manifest))
    kube = ["--kubeconfig", str(crds.kubeconfig)]
    processes: dict[str, Any] = {}
    proxies: dict[str, str] = {}
    try:
        processes["operator"] = await start_cli(
            "operator", "--namespace", namespace, "--report-ttl-seconds", "6", *kube
        )
        for pod in ("proxy-a", "proxy-b"):
            port = free_port()
            processes[pod] = await start_cli(
                *("proxy", "--configmap", f"{namespace}/rolegate-config", "--port", str(port)),
                *("--status-heartbeat-seconds", "2", *kube),
                env={"POD_NAME": pod},
            )
            proxies[pod] = f"http://127.0.0.1:{port}"
        for url in proxies.values():
            await until(partial(ready, url), within=30, what=f"{url} to be ready")
        yield Stack(crds, namespace, sim.url, proxies, processes)
    finally:
        for process in processes.values():
            await stop(process)


def _pods(status: dict[str, Any]) -> set[str]:
    return {report["pod"] for report in status.get("reports") or ()}


def _tripped(status: dict[str, Any]) -> dict[str, Any]:
    for condition in status.get("conditions") or ():
        if condition["type"] == "Tripped":
            return dict(condition)
    return {}


async def _eventually(check: Callable[[], Awaitable[bool]], what: str, within: float = 20) -> float:
    return await until(check, within=within, what=what)


async def test_a_fault_shows_as_tripped_on_the_resource_and_recovers(stack: Stack) -> None:
    # Both pods report, and their entries coexist.
    async def both_report() -> bool:
        return _pods(await stack.pp()) == {"proxy-a", "proxy-b"}

    await _eventually(both_report, "both pods' reports")

    async def calm() -> bool:
        return (await stack.columns()).get("TRIPPED") == "False"

    await _eventually(calm, "Tripped=False once pods report")

    # The machine starts answering empty on 200 to ASCII prompts.
    await stack.faults([{"kind": "empty", "always": True}])
    started = time.monotonic()
    await stack.send("proxy-a", 3)
    await stack.send("proxy-b", 3)

    async def shows_tripped() -> bool:
        return (await stack.columns()).get("TRIPPED") == "True"

    await _eventually(shows_tripped, "kubectl get pp to show Tripped")
    shown_after = time.monotonic() - started
    print(
        f"\nkubectl get pp showed the trip {shown_after * 1000:.0f} ms after the first bad answer"
    )
    columns = await stack.columns()
    assert columns["SCOPE"] == MODEL
    assert columns["REASON"] == "EmptyResponses"
    condition = _tripped(await stack.pp())
    assert f"model {MODEL} (EmptyResponses) on 2 of 2 pods" in condition["message"]
    described = await asyncio.to_thread(stack.kubectl, "describe", "pp", "router")
    assert "Tripped" in described
    assert f"Tripped model {MODEL}: EmptyResponses" in described

    # The fault clears: after the cooldown each pod's probe succeeds and it recovers.
    await stack.faults([])

    async def recovered() -> bool:
        await stack.send("proxy-a")
        await stack.send("proxy-b")
        return (await stack.columns()).get("TRIPPED") == "False"

    await _eventually(recovered, "the recovery to show", within=30)
    described = await asyncio.to_thread(stack.kubectl, "describe", "pp", "router")
    assert f"Recovered model {MODEL}" in described

    # A pod that stops: its report expires (TTL 6 s); the other's stays.
    await stop(stack.processes["proxy-b"])

    async def expired() -> bool:
        return _pods(await stack.pp()) == {"proxy-a"}

    await _eventually(expired, "proxy-b's report to expire")


async def test_an_api_server_outage_does_not_disturb_routing_and_status_resumes(
    stack: Stack,
) -> None:
    async def both_report() -> bool:
        return _pods(await stack.pp()) == {"proxy-a", "proxy-b"}

    await _eventually(both_report, "both pods' reports")
    await asyncio.to_thread(stack.plane.stop_apiserver)
    try:
        assert await stack.send("proxy-a", 3) == [200, 200, 200]
        # A trip while the API server is away...
        await stack.faults([{"kind": "empty", "always": True}])
        await stack.send("proxy-a", 3)
    finally:
        await asyncio.to_thread(stack.plane.start_apiserver)

    # ... reaches the resource once it is back.
    async def shows_tripped() -> bool:
        return _tripped(await stack.pp()).get("status") == "True"

    took = await _eventually(shows_tripped, "the trip to reach the resource after the outage")
    print(f"\nstatus resumed {took * 1000:.0f} ms after the API server came back")
