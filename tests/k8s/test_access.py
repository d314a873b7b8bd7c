"""Callers and access end to end on the real control plane: the operator compiles an
AccessGrant, a proxy pod verifies real ServiceAccount tokens (TokenRequest, audience
`rolegate`) with TokenReviews and serves only the roles granted."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial

import httpx
import pytest

from rolegate_cli.controlplane import ControlPlane, free_port

from ..support import SimFactory, provider_policy, role, role_table
from ..waiting import eventually
from .processes import ready, start_cli, stop

MODEL = "vendor/model-a"
PROMPT = [{"role": "user", "content": "plain ascii prompt"}]
# The proxy's trust in a TokenReview verdict (`--token-cache-seconds`), short for the test.
TOKEN_TTL = 3.0
# How long the API server itself keeps accepting a deleted account's token: its token
# authenticator caches successful verdicts for 10 s.
API_SERVER_LAG = 10.0


@dataclass
class Stack:
    plane: ControlPlane
    namespace: str
    url: str

    def token(self, account: str, audience: str = "rolegate") -> str:
        out = self.plane.kubectl(
            "-n", self.namespace, "create", "token", account, "--audience", audience,
        )  # fmt: skip
        return out.stdout.strip()

    async def call(self, role_name: str, token: str | None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        async with httpx.AsyncClient(timeout=30) as client:
            return await client.post(
                f"{self.url}/v1/chat/completions",
                json={"model": role_name, "messages": PROMPT},
                headers=headers,
            )


def grant(namespace: str) -> dict[str, object]:
    return {
        "apiVersion": "rolegate.dev/v1alpha1",
        "kind": "AccessGrant",
        "metadata": {"name": "coders", "namespace": namespace},
        "spec": {"subjects": [{"serviceAccount": {"name": "coder"}}], "roles": ["agent"]},
    }


@pytest.fixture
async def stack(crds: ControlPlane, namespace: str, sim_server: SimFactory) -> AsyncIterator[Stack]:
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "machines": [{"name": "m1", "ttftSeconds": 0}]}]}
    )
    manifests = [
        provider_policy("router", f"{sim.url}/v1", {MODEL: ["m1"]}),
        role_table(role("agent", [MODEL]), role("batch", [MODEL])),
        grant(namespace),
    ]
    for manifest in manifests:
        manifest["metadata"]["namespace"] = namespace
        await asyncio.to_thread(crds.kubectl, "apply", "-f", "-", input=json.dumps(manifest))
    for account in ("coder", "other"):
        await asyncio.to_thread(crds.kubectl, "-n", namespace, "create", "serviceaccount", account)
    kube = ["--kubeconfig", str(crds.kubeconfig)]
    processes: list[subprocess.Popen[str]] = []
    try:
        processes.append(await start_cli("operator", "--namespace", namespace, *kube))
        port = free_port()
        processes.append(
            await start_cli(
                *("proxy", "--configmap", f"{namespace}/rolegate-config", "--port", str(port)),
                *("--token-cache-seconds", str(TOKEN_TTL)),
                *kube,
                env={"POD_NAME": "proxy-a"},
            )
        )
        url = f"http://127.0.0.1:{port}"
        await eventually(partial(ready, url), what="the proxy ready", within=30)
        yield Stack(crds, namespace, url)
    finally:
        for process in processes:
            await stop(process)


async def test_a_service_account_token_is_served_its_granted_role_only(stack: Stack) -> None:
    coder = await asyncio.to_thread(stack.token, "coder")

    async def served() -> bool:  # the grant reaches the proxy with the configuration
        return (await stack.call("agent", coder)).status_code == 200

    await eventually(served, what="the granted role served", within=30)
    # A role it lacks: the very answer a role that does not exist gets.
    refused = await stack.call("batch", coder)
    missing = await stack.call("no-such-role", coder)
    assert refused.status_code == missing.status_code == 404
    assert refused.json() == missing.json()
    error = refused.json()["error"]
    assert error["code"] == "unknown_role"
    assert error["message"].endswith("Your roles: agent.")
    assert coder not in refused.text

    # Another account of the namespace, and the same account's token for another audience.
    other = await asyncio.to_thread(stack.token, "other")
    assert (await stack.call("agent", other)).status_code == 403
    elsewhere = await asyncio.to_thread(stack.token, "coder", "vault")
    wrong = await stack.call("agent", elsewhere)
    assert wrong.status_code == 401
    assert wrong.json()["error"]["type"] == "authentication_error"

    # No credential: a 401 that names no role.
    anonymous = await stack.call("agent", None)
    assert anonymous.status_code == 401
    assert "agent" not in anonymous.json()["error"]["message"]
    assert "batch" not in anonymous.json()["error"]["message"]


async def test_a_deleted_service_account_is_refused_within_the_cache_ttl(stack: Stack) -> None:
    coder = await asyncio.to_thread(stack.token, "coder")

    async def served() -> bool:
        return (await stack.call("agent", coder)).status_code == 200

    await eventually(served, what="the granted role served", within=30)
    await asyncio.to_thread(
        stack.plane.kubectl, "-n", stack.namespace, "delete", "serviceaccount", "coder"
    )
    deleted = time.monotonic()

    async def refused() -> httpx.Response | None:
        response = await stack.call("agent", coder)
        return response if response.status_code == 401 else None

    # Polled, not slept: the bound is what the proxy promises on top of the API server.
    response = await eventually(
        refused, what="the deleted account refused", within=TOKEN_TTL + API_SERVER_LAG + 10
    )
    assert time.monotonic() - deleted <= TOKEN_TTL + API_SERVER_LAG + 2
    assert "not accepted" in response.json()["error"]["message"]
