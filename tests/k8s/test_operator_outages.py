"""The operator through API-server outages longer than kopf's default retries and longer
than the report TTL, as a platform engineer would see them: kube-apiserver killed and
restarted twice, 65 s down each time, with a breaker open on both proxy pods throughout.

Afterwards the operator is still compiling (an edit is accepted), the open breaker shows as
`Tripped=True` within 10 s of the API server being ready, and it never reads False on the
way (a fresh report is never removed for the stale copy's sake)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from rolegate_cli.controlplane import ControlPlane

from ..support import SimFactory, role, role_table
from ..waiting import eventually
from .test_breaker_status import MODEL, Stack, _pods, _tripped, running_stack

OUTAGE_SECONDS = 65.0
# Below the outage, so every report is older than the TTL when the API server returns.
REPORT_TTL = 20.0


async def accepted_generation(stack: Stack) -> int | None:
    text = await asyncio.to_thread(stack.kubectl, "get", "rt", "roles", "-o", "json")
    obj = json.loads(text)
    for condition in (obj.get("status") or {}).get("conditions") or ():
        if condition["type"] == "Accepted" and condition["status"] == "True":
            generation: int = condition["observedGeneration"]
            return generation
    return None


async def edit_role_table(stack: Stack, patience: float) -> None:
    manifest = role_table(role("agent", [MODEL], patience=patience))
    manifest["metadata"]["namespace"] = stack.namespace
    await asyncio.to_thread(stack.plane.kubectl, "apply", "-f", "-", input=json.dumps(manifest))


async def watch_tripped_after_restart(stack: Stack, within: float) -> tuple[float, list[str]]:
    """Poll the Tripped condition from the moment the API server is ready: how long until
    it is True for the current generation, and every status read on the way."""
    started = time.monotonic()
    seen: list[str] = []
    while True:
        condition = _tripped(await stack.pp())
        seen.append(condition.get("status", "absent"))
        if condition.get("status") == "True":
            return time.monotonic() - started, seen
        if time.monotonic() - started > within:
            raise AssertionError(f"Tripped not True within {within}s after the outage: {seen}")
        await asyncio.sleep(0.1)


# Two outages of 65 s, plus the recoveries: well past the suite's default minute.
@pytest.mark.timeout(420)
async def test_two_long_api_server_outages_leave_the_operator_compiling_and_truthful(
    crds: ControlPlane, namespace: str, sim_server: SimFactory
) -> None:
    async with running_stack(crds, namespace, sim_server, report_ttl=REPORT_TTL) as stack:
        await edit_role_table(stack, 35)

        async def both_report() -> bool:
            return _pods(await stack.pp()) == {"proxy-a", "proxy-b"}

        await eventually(both_report, what="both pods' reports", within=30)
        # The machine answers empty from now on: both pods trip it and keep it tripped
        # (each re-probe after the cooldown finds it still empty).
        await stack.faults([{"kind": "empty", "always": True}])
        await stack.send("proxy-a", 3)
        await stack.send("proxy-b", 3)

        async def tripped_on_both() -> bool:
            message: str = _tripped(await stack.pp()).get("message", "")
            return "on 2 of 2 pods" in message

        await eventually(tripped_on_both, what="the trip on both pods", within=30)

        recoveries: list[float] = []
        for outage, patience in enumerate((40.0, 50.0), start=1):
            apiserver = stack.plane.apiserver
            assert apiserver is not None
            await asyncio.to_thread(apiserver.kill)
            await asyncio.to_thread(apiserver.wait)
            down = time.monotonic()
            # Routing goes on meanwhile (D6), and the pods keep probing the machine.
            while time.monotonic() - down < OUTAGE_SECONDS:
                statuses: list[int] = await stack.send("proxy-a", 1)
                assert statuses[0] in (200, 502, 503), statuses
                await asyncio.sleep(5)
            await asyncio.to_thread(stack.plane.start_apiserver)  # returns once ready
            took, seen = await watch_tripped_after_restart(stack, within=10)
            assert "False" not in seen, seen
            recoveries.append(took)

            # Still compiling: an edit made after the outage is accepted.
            await edit_role_table(stack, patience)

            async def edit_accepted(expected: int = outage + 2) -> bool:
                return await accepted_generation(stack) == expected

            await eventually(edit_accepted, what=f"the edit after outage {outage}", within=45)
            operator: Any = stack.processes["operator"]
            assert operator.poll() is None, "the operator exited"

        print(
            "\nTripped=True after the API server was ready: "
            + ", ".join(f"{took:.2f} s" for took in recoveries)
        )
