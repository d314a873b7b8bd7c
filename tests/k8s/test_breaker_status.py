"""Breaker state on the ProviderPolicy (SPEC D4, D6), end to end on the real control plane:
two proxy processes as two pods, the operator, and `kubectl get pp` as a person reads it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import pytest

from rolegate_cli.controlplane import ControlPlane, free_port

from ..support import (
    SimFactory,
    kubectl_table,
    open_access,
    provider_policy,
    role,
    role_table,
)
from ..waiting import eventually
from .processes import ready, start_cli, stop

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
        (row,) = kubectl_table(await asyncio.to_thread(self.kubectl, "get", "pp", "router"))
        return row

    async def faults(self, faults: list[dict[str, Any]]) -> None:
        async with httpx.AsyncClient() as client:
            url = f"{self.sim_url}/_sim/machines/{MODEL}/m1/faults"
            (await client.put(url, json=faults)).raise_for_status()

    async def send(self, pod: str, count: int = 1, *, stream: bool = False) -> list[int]:
        statuses = []
        async with httpx.AsyncClient(timeout=30) as client:
            for _ in range(count):
                response = await client.post(
                    f"{self.proxies[pod]}/v1/chat/completions",
                    json={"model": "agent", "messages": PROMPT, "stream": stream},
                )
                statuses.append(response.status_code)
        return statuses


@contextlib.asynccontextmanager
async def running_stack(
    crds: ControlPlane, namespace: str, sim_server: SimFactory, *, report_ttl: float = 6
) -> AsyncIterator[Stack]:
    """The simulator, the resources, the operator and two proxy pods."""
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "machines": [{"name": "m1", "ttftSeconds": 0}]}]}
    )
    policy = provider_policy(
        "router", f"{sim.url}/v1", {MODEL: ["m1"]}, breaker={"cooldownSeconds": 2}
    )
    for manifest in (policy, role_table(role("agent", [MODEL])), open_access()):
        manifest["metadata"]["namespace"] = namespace
        await asyncio.to_thread(crds.kubectl, "apply", "-f", "-", input=json.dumps(manifest))
    kube = ["--kubeconfig", str(crds.kubeconfig)]
    processes: dict[str, Any] = {}
    proxies: dict[str, str] = {}
    try:
        processes["operator"] = await start_cli(
            "operator", "--namespace", namespace, "--report-ttl-seconds", str(report_ttl), *kube
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
            await eventually(partial(ready, url), what=f"{url} to be ready", within=30)
        yield Stack(crds, namespace, sim.url, proxies, processes)
    finally:
        for process in processes.values():
            await stop(process)


@pytest.fixture
async def stack(crds: ControlPlane, namespace: str, sim_server: SimFactory) -> AsyncIterator[Stack]:
    async with running_stack(crds, namespace, sim_server) as running:
        yield running


def _pods(status: dict[str, Any]) -> set[str]:
    return {report["pod"] for report in status.get("reports") or ()}


def _tripped(status: dict[str, Any]) -> dict[str, Any]:
    for condition in status.get("conditions") or ():
        if condition["type"] == "Tripped":
            return dict(condition)
    return {}


async def test_a_fault_shows_as_tripped_on_the_resource_and_recovers(stack: Stack) -> None:
    # Both pods report, and their entries coexist.
    async def both_report() -> bool:
        return _pods(await stack.pp()) == {"proxy-a", "proxy-b"}

    await eventually(both_report, what="both pods' reports", within=20)

    async def calm() -> bool:
        return (await stack.columns()).get("TRIPPED") == "False"

    await eventually(calm, what="Tripped=False once pods report", within=20)
    # Nothing tripped: no reason shown (the condition's own reason is `NoOpenBreakers`).
    assert (await stack.columns())["REASON"] == ""

    # The machine starts answering empty on 200 to ASCII prompts.
    await stack.faults([{"kind": "empty", "always": True}])
    started = time.monotonic()
    await stack.send("proxy-a", 3)
    await stack.send("proxy-b", 3)

    async def shows_tripped() -> bool:
        return (await stack.columns()).get("TRIPPED") == "True"

    await eventually(shows_tripped, what="kubectl get pp to show Tripped", within=20)
    shown_after = time.monotonic() - started
    print(
        f"\nkubectl get pp showed the trip {shown_after * 1000:.0f} ms after the first bad answer"
    )
    columns = await stack.columns()
    assert columns["SCOPE"] == MODEL
    assert columns["REASON"] == "EmptyResponses"

    # The first pod's report shows the trip; the second's follows on its own schedule.
    async def on_both_pods() -> bool:
        message: str = _tripped(await stack.pp()).get("message", "")
        return f"model {MODEL} (EmptyResponses) on 2 of 2 pods" in message

    await eventually(on_both_pods, what="both pods' reports of the trip", within=20)

    # The transition's Event is posted beside the status write, not before it.
    async def event_posted() -> bool:
        described = await asyncio.to_thread(stack.kubectl, "describe", "pp", "router")
        return f"Tripped model {MODEL}: EmptyResponses" in described

    await eventually(event_posted, what="the Tripped event", within=20)

    # The fault clears: after the cooldown each pod's probe succeeds and it recovers.
    await stack.faults([])

    async def recovered() -> bool:
        await stack.send("proxy-a")
        await stack.send("proxy-b")
        return (await stack.columns()).get("TRIPPED") == "False"

    await eventually(recovered, what="the recovery to show", within=30)
    # The reason leaves with the trip (written together).
    columns = await stack.columns()
    assert (columns["SCOPE"], columns["REASON"]) == ("", "")
    assert "trippedReason" not in await stack.pp()

    async def recovery_posted() -> bool:
        described = await asyncio.to_thread(stack.kubectl, "describe", "pp", "router")
        return f"Recovered model {MODEL}" in described

    await eventually(recovery_posted, what="the Recovered event", within=20)

    # A pod that dies without a word (SIGKILL: a pod that shuts down withdraws its own
    # report, tests/k8s/test_pod_report.py): its report expires (TTL 6 s); the other's stays.
    stack.processes["proxy-b"].kill()

    async def expired() -> bool:
        return _pods(await stack.pp()) == {"proxy-a"}

    await eventually(expired, what="proxy-b's report to expire", within=20)


async def test_an_api_server_outage_does_not_disturb_routing_and_status_resumes(
    stack: Stack,
) -> None:
    async def both_report() -> bool:
        return _pods(await stack.pp()) == {"proxy-a", "proxy-b"}

    await eventually(both_report, what="both pods' reports", within=20)
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

    took = await eventually(
        shows_tripped, what="the trip to reach the resource after the outage", within=20
    )
    print(f"\nstatus resumed {took * 1000:.0f} ms after the API server came back")


async def test_protocol_quirks_are_noted_on_the_resource_never_as_faults(stack: Stack) -> None:
    """Streams without a charset (the simulator, like OpenRouter, names none) and without
    `data: [DONE]` after their final chunk: tolerated, answered, and noted in the pod's
    report (SPEC A1, E4)."""
    await stack.faults([{"kind": "noDone", "always": True}])
    assert await stack.send("proxy-a", 2, stream=True) == [200, 200]

    async def noted() -> dict[str, int] | None:
        reports = (await stack.pp()).get("reports") or []
        quirks = {
            quirk["kind"]: quirk["count"]
            for report in reports
            if report["pod"] == "proxy-a"
            for quirk in report.get("quirks") or ()
        }
        return quirks if {"MissingCharset", "MissingDone"} <= set(quirks) else None

    quirks = await eventually(noted, what="proxy-a's quirks on the status", within=20)
    assert quirks["MissingDone"] == 2
    # Never a fault: no breaker of the pod's is open.
    reports = (await stack.pp()).get("reports") or []
    assert all(not report.get("breakers") for report in reports)
