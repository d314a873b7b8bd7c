"""Hostile memories on the real API server (SPEC E8, issue 30): a ProxyMemory holding a
value no pod could have learned is refused whole by every pod that reads it, with one
warning naming the object and the field (never the value), and is never merged, served or
republished; the pods go on serving the role and answering `/v1/rolegate/state`.

Two memories a holder of the proxy's ServiceAccount could write: one whose TTFT log-sum
(1e5) overflows a belief's arithmetic (before the bounds, every request for the role and
the state endpoint answered 500 on every pod that heard it), and a "liar" claiming that a
machine answers its first token in 0.175 ms (before, it was merged as evidence and drew
the traffic). The pods, the operator and the simulator are real processes, as in
test_fleet_memory.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from rolegate_cli.controlplane import ControlPlane
from rolegate_proxy.wire.pod_memory import decode

from ..proxy.test_state_file import MODEL, _expected_ttft, _first_asked
from ..support import SimFactory
from ..waiting import eventually
from .test_fleet_memory import _memory_object, metrics_of, running_fleet

PODS = ("proxy-a", "proxy-b")
OVERFLOW = 100_000  # a log-sum: e^100000 seconds overflows any float
LIAR = math.log(0.000175)


def memory_of(pod: str, machine: str, ttft: Sequence[float]) -> str:
    """A pod-memory document of one machine of the simulator's model, written now."""
    row = ["agg", MODEL, machine, 40, list(ttft), None, None]
    return json.dumps({"format": 1, "pod": pod, "writtenAt": time.time() - 5, "machines": [row]})


async def plant(plane: ControlPlane, namespace: str, pod: str, memory: str) -> None:
    obj = _memory_object(pod, memory, datetime.now(UTC))
    obj["metadata"]["namespace"] = namespace
    await asyncio.to_thread(plane.kubectl, "apply", "-f", "-", input=json.dumps(obj))


async def peers_heard(url: str) -> float | None:
    """The `rolegate_memory_peers` gauge once the pod has heard at least one peer."""
    for line in (await metrics_of(url)).splitlines():
        if line.startswith("rolegate_memory_peers "):
            value = float(line.split()[1])
            return value if value >= 1 else None
    return None


async def serves(url: str, times: int) -> None:
    """The role answers 200 `times` times, and so does the state endpoint."""
    body = {"model": "agent", "messages": [{"role": "user", "content": "go on"}]}
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(times):
            response = await client.post(f"{url}/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
        state = await client.get(f"{url}/v1/rolegate/state")
        assert state.status_code == 200, state.text


def poisoned(document: dict[str, Any]) -> bool:
    """Whether a memory carries the planted TTFT (its mean log, kept by forgetting)."""
    return any(
        row[4] is not None and row[4][1] / row[4][0] >= OVERFLOW / 2
        for row in document.get("machines", [])
    )


async def written_since(fleet: Any, pod: str, since: float) -> dict[str, Any] | None:
    """The memory in `pod`'s ProxyMemory once `pod` itself has written it after `since`."""
    found = (await fleet.memories()).get(f"memory-{pod}")
    if found is None:
        return None
    document: dict[str, Any] = json.loads(found["spec"]["memory"])
    return document if document["writtenAt"] > since else None


@pytest.mark.timeout(180)
async def test_a_memory_that_would_overflow_a_belief_is_refused_on_every_pod(
    crds: ControlPlane, namespace: str, sim_server: SimFactory, tmp_path: Path
) -> None:
    poison = [1, OVERFLOW, OVERFLOW**2]
    # A peer's memory, and proxy-b's own object (taken back when proxy-b starts).
    planted = time.time()
    await plant(crds, namespace, "proxy-x", memory_of("proxy-x", "m1", poison))
    await plant(crds, namespace, "proxy-b", memory_of("proxy-b", "m1", poison))
    async with running_fleet(crds, namespace, sim_server, tmp_path, PODS) as fleet:
        a, b = (fleet.proxies[pod] for pod in PODS)
        # Each pod's own memory replaces what was there, without the poison (never
        # republished), and each hears the other: the namespace's list (the poison in it)
        # came first, so the poison was read too.
        for pod in PODS:
            own = await eventually(
                partial(written_since, fleet, pod, planted), what=f"{pod} writing", within=20
            )
            assert not poisoned(own), f"{pod} republished the poison"
        for url in (a, b):
            await eventually(partial(peers_heard, url), what="hearing the other pod", within=20)
            # Only the other real pod is heard: proxy-x is not merged.
            assert "rolegate_memory_peers 1.0" in await metrics_of(url)
            await serves(url, 5)
            # m1 is believed what the sheet and real answers say, not e^100000 seconds.
            assert await _expected_ttft(url, "m1") < 60
        for pod in PODS:
            log = fleet.log(pod)
            warnings = [line for line in log.splitlines() if "memory-proxy-x" in line]
            assert len(warnings) == 1, warnings
            assert (
                f"memory ignored object={namespace}/memory-proxy-x "
                "reason=machines[0]: ttft is out of range"
            ) in warnings[0]
            assert str(OVERFLOW) not in log
            assert "Traceback" not in log
        assert (
            f"memory not restored object={namespace}/memory-proxy-b "
            "reason=machines[0]: ttft is out of range"
        ) in fleet.log("proxy-b")
        # Never republished: what each pod writes, after serving too, is plausible.
        memories = await fleet.memories()
        for pod in PODS:
            spec = memories[f"memory-{pod}"]["spec"]
            assert decode(spec["memory"].encode()).pod == pod
            assert not poisoned(json.loads(spec["memory"]))
        print("\n" + warnings[0])


@pytest.mark.timeout(180)
async def test_a_liar_memory_claiming_a_first_token_in_0_175_ms_is_refused(
    crds: ControlPlane, namespace: str, sim_server: SimFactory, tmp_path: Path
) -> None:
    """m2 is published slower than m1; a liar says it answers in 0.175 ms. Believed, it
    would draw the first request; refused, the sheet decides."""
    liar = [40, 40 * LIAR, 40 * LIAR * LIAR]
    await plant(crds, namespace, "proxy-liar", memory_of("proxy-liar", "m2", liar))
    async with running_fleet(crds, namespace, sim_server, tmp_path, PODS[:1]) as fleet:
        url = fleet.proxies["proxy-a"]
        expected = (
            f"memory ignored object={namespace}/memory-proxy-liar "
            "reason=machines[0]: ttft is out of range: its mean is not a duration"
        )

        async def warned() -> bool:
            return expected in fleet.log("proxy-a")

        await eventually(warned, what="proxy-a refusing the liar", within=20)
        assert await _expected_ttft(url, "m2") > 0.05  # the sheet's 0.1 s, not 0.000175
        assert await _first_asked(url) == "m1"
        assert "rolegate_memory_peers 0.0" in await metrics_of(url)
        assert "0.000175" not in fleet.log("proxy-a")
