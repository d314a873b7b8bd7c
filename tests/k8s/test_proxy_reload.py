"""Live reload against the real API server (SPEC D3, D6): the proxy as a subprocess,
watching a ConfigMap, while kubectl changes it."""

from __future__ import annotations

import asyncio
import json
import statistics
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from rolegate_cli.controlplane import ControlPlane, free_port

from ..support import SimFactory, compile_objects, provider_policy, role, role_table
from ..waiting import eventually, seconds_until
from .processes import ready, served_roles, start_cli, stop

MODEL = "vendor/model-a"
REPLY = " ".join(f"w{i}" for i in range(60))
CONFIGMAP = "rolegate-config"

Apply = Callable[[list[str]], Awaitable[str]]


def _configmap(namespace: str, sim_url: str, roles: list[str]) -> str:
    config = compile_objects(
        [
            provider_policy("sim", f"{sim_url}/v1", {MODEL: ["m1"]}),
            role_table(*(role(name, [MODEL]) for name in roles)),
        ]
    )
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": CONFIGMAP,
                "namespace": namespace,
                "annotations": {"rolegate.dev/config-hash": config.hash},
            },
            "data": {"config.json": config.to_canonical_json()},
        }
    )


@pytest.fixture
async def sim_url(sim_server: SimFactory) -> str:
    sim = await sim_server(
        {
            "seed": 1,
            "models": [
                {
                    "name": MODEL,
                    "reply": REPLY,
                    "machines": [{"name": "m1", "ttftSeconds": 0, "tokensPerSecond": 25}],
                }
            ],
        }
    )
    return sim.url


@pytest.fixture
async def apply(control_plane: ControlPlane, namespace: str, sim_url: str) -> Apply:
    async def apply_roles(roles: list[str]) -> str:
        manifest = _configmap(namespace, sim_url, roles)
        await asyncio.to_thread(control_plane.kubectl, "apply", "-f", "-", input=manifest)
        return manifest

    return apply_roles


@pytest.fixture
async def proxy(control_plane: ControlPlane, namespace: str, apply: Apply) -> AsyncIterator[str]:
    await apply(["base"])
    port = free_port()
    process = await start_cli(
        "proxy",
        "--configmap", f"{namespace}/{CONFIGMAP}",
        "--kubeconfig", str(control_plane.kubeconfig),
        "--port", str(port),
        "--metrics-on-api-port",
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        await eventually(lambda: ready(url), what="the proxy to load the ConfigMap", within=20)
        yield url
    finally:
        await stop(process)


async def _roles(url: str) -> list[str]:
    return list(await served_roles(url))


async def test_changes_are_served_within_seconds(proxy: str, apply: Apply) -> None:
    delays = []
    for i in range(20):
        wanted = f"r{i}"
        await apply(["base", wanted])

        async def served(wanted: str = wanted) -> bool:
            return wanted in await _roles(proxy)

        delays.append(await seconds_until(served, what=f"role {wanted} to be served", within=10))
    median, worst = statistics.median(delays), max(delays)
    print(f"\nreload after kubectl apply, 20 changes: median {median * 1000:.0f} ms, "
          f"worst {worst * 1000:.0f} ms")  # fmt: skip
    assert worst < 5.0


async def test_a_stream_started_before_a_change_completes_intact(proxy: str, apply: Apply) -> None:
    body = {"model": "base", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream("POST", f"{proxy}/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        raw = b""
        changed = False
        async for chunk in response.aiter_raw():
            raw += chunk
            if not changed and raw.count(b"data: ") > 5:
                # The role this stream uses disappears from the configuration mid-stream.
                await apply(["other"])
                changed = True

                async def swapped() -> bool:
                    return await _roles(proxy) == ["other"]

                await eventually(swapped, what="the new configuration", within=10)
    assert changed
    text = "".join(
        choice["delta"].get("content") or ""
        for block in raw.split(b"\n\n")
        if block.startswith(b"data: {")
        for choice in json.loads(block[6:])["choices"]
    )
    assert text == REPLY
    assert raw.endswith(b"data: [DONE]\n\n")


async def test_an_api_server_outage_does_not_stop_routing(
    proxy: str, apply: Apply, control_plane: ControlPlane
) -> None:
    request: dict[str, Any] = {"model": "base", "messages": [{"role": "user", "content": "x"}]}
    await asyncio.to_thread(control_plane.stop_apiserver)
    try:
        async with httpx.AsyncClient(timeout=30) as client:

            async def answered() -> bool:
                response = await client.post(f"{proxy}/v1/chat/completions", json=request)
                return response.status_code == 200

            async def noticed() -> bool:
                metrics = (await client.get(f"{proxy}/metrics")).text
                return "rolegate_kube_api_up 0.0" in metrics

            # Served while the proxy has not yet noticed, and after it has.
            assert await answered()
            await eventually(noticed, what="the proxy to notice the outage", within=20)
            assert all(await asyncio.gather(answered(), answered()))
    finally:
        await asyncio.to_thread(control_plane.start_apiserver)
    await apply(["base", "after-outage"])

    async def caught_up() -> bool:
        return "after-outage" in await _roles(proxy)

    delay = await seconds_until(caught_up, what="the change made after the outage", within=15)
    print(f"\nchange after the API server returned served in {delay * 1000:.0f} ms")
