"""What a user does: kubectl apply the CRDs and resources, run the operator and a proxy,
send traffic, change a ruling in Git, and watch it take effect."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from rolegate_cli.controlplane import ControlPlane, free_port

from ..support import kubectl_table
from ..waiting import eventually, seconds_until
from .processes import ready, served_roles, start_cli, stop

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
async def stack(crds: ControlPlane, namespace: str) -> AsyncIterator[str]:
    from rolegate_sim.scenario import load_scenario
    from rolegate_sim.server import start

    sim = await start(load_scenario(EXAMPLES / "scenario.yaml"), "127.0.0.1", 0)
    processes = []
    try:
        for path in sorted((EXAMPLES / "manifests").glob("*.yaml")):
            text = (
                path.read_text(encoding="utf-8")
                .replace("http://127.0.0.1:8089/v1", f"{sim.url}/v1")
                .replace("  namespace: rolegate\n", "")  # into this test's namespace
            )
            await asyncio.to_thread(crds.kubectl, "-n", namespace, "apply", "-f", "-", input=text)
        kube = ["--kubeconfig", str(crds.kubeconfig)]
        processes.append(await start_cli("operator", "--namespace", namespace, *kube))
        port = free_port()
        processes.append(
            await start_cli(
                "proxy",
                "--configmap",
                f"{namespace}/rolegate-config",
                "--port",
                str(port),
                *kube,
                env={"ROLEGATE_SECRET_SIM_ROUTER_APIKEY": "test-key"},
            )
        )
        url = f"http://127.0.0.1:{port}"
        await eventually(
            lambda: ready(url), what="the operator's ConfigMap to be served", within=30
        )
        yield url
    finally:
        for process in reversed(processes):
            await stop(process)
        await sim.stop()


def _get(plane: ControlPlane, namespace: str, *args: str) -> str:
    return plane.kubectl("-n", namespace, "get", *args).stdout


async def test_apply_serve_and_change_a_ruling(
    stack: str, crds: ControlPlane, namespace: str
) -> None:
    # Both resources are accepted and the printer columns say so.
    (table,) = kubectl_table(await asyncio.to_thread(_get, crds, namespace, "rt"))
    assert (table["NAME"], table["ROLES"], table["ACCEPTED"]) == ("agents", "3", "True")
    (policy,) = kubectl_table(await asyncio.to_thread(_get, crds, namespace, "pp", "-o", "wide"))
    assert (policy["NAME"], policy["ACCEPTED"]) == ("sim-router", "True")
    assert policy["ENDPOINT"].endswith("/v1")

    # Traffic flows through the real openai client.
    async with openai.AsyncOpenAI(base_url=f"{stack}/v1", api_key="x", max_retries=2) as client:
        completion = await client.chat.completions.create(
            model="batch", messages=[{"role": "user", "content": "hello"}]
        )
    assert completion.model == "deepseek/deepseek-v3"

    # A reviewer sees what Auto resolved to, on the resource itself.
    status = json.loads(
        await asyncio.to_thread(_get, crds, namespace, "rt", "agents", "-o", "json")
    )
    rulings = {r["role"]: r["effective"] for r in status["status"]["effectiveRulings"]}
    assert rulings == {"agent": "Order", "batch": "Order", "reflex": "Only"}
    assert (await served_roles(stack))["reflex"]["ruling"] == "Only"

    # The GitOps change: reflex becomes an explicit Order; the proxy serves it in seconds.
    patch = '[{"op": "replace", "path": "/spec/roles/0/ruling", "value": "Order"}]'
    await asyncio.to_thread(
        crds.kubectl, "-n", namespace, "patch", "rt", "agents", "--type=json", "-p", patch
    )

    async def changed() -> bool:
        return (await served_roles(stack))["reflex"]["ruling"] == "Order"

    took = await seconds_until(changed, what="the new ruling to be served", within=15)
    print(f"\nruling change served {took * 1000:.0f} ms after kubectl patch returned")
