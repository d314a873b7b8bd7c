"""A proxy pod's report on each ProviderPolicy, against the real API server: the
configuration hash it serves, whether it could read the API key, its withdrawal when the
pod shuts down, and what it logs while the API server is away.

The operator runs with a report TTL of ten minutes and the proxies with a heartbeat of
five: nothing a test waits for can be the work of an expiry or of a heartbeat, only of the
change itself."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from rolegate_cli.controlplane import ControlPlane, free_port

from ..support import provider_policy, role, role_table
from ..waiting import eventually, seconds_until
from .processes import ready, start_cli, stop

KEYED, OPEN = "keyed", "open"  # the ProviderPolicies: with an apiKeySecretRef, without
MODEL_KEYED, MODEL_OPEN = "vendor/model-a", "vendor/model-b"
SECRET, SECRET_KEY = "router-key", "apiKey"
KEY_VALUE = "sk-test-0123456789"
PODS = ("proxy-a", "proxy-b")
HEARTBEAT_SECONDS = 300
REPORT_TTL_SECONDS = 600


@dataclass
class Stack:
    plane: ControlPlane
    namespace: str
    secrets_dir: Path
    logs: dict[str, Path]  # process -> its stderr
    proxies: dict[str, str]  # pod name -> url
    processes: dict[str, subprocess.Popen[str]]

    def kubectl(self, *args: str, input: str | None = None) -> str:
        return self.plane.kubectl("-n", self.namespace, *args, input=input).stdout

    async def reports(self, policy: str) -> dict[str, dict[str, Any]]:
        """The policy's `status.reports`, by pod."""
        text = await asyncio.to_thread(self.kubectl, "get", "pp", policy, "-o", "json")
        status = json.loads(text).get("status") or {}
        return {report["pod"]: report for report in status.get("reports") or ()}

    async def served_hash(self, pod: str) -> str:
        async with httpx.AsyncClient() as client:
            found: str = (await client.get(f"{self.proxies[pod]}/readyz")).json()["config_hash"]
        return found

    async def apply_roles(self, *names: str) -> None:
        table = role_table(*(role(name, [MODEL_KEYED, MODEL_OPEN]) for name in names))
        table["metadata"]["namespace"] = self.namespace
        await asyncio.to_thread(self.kubectl, "apply", "-f", "-", input=json.dumps(table))

    def key_file(self) -> Path:
        return self.secrets_dir / SECRET / SECRET_KEY

    def log(self, process: str) -> str:
        return self.logs[process].read_text(encoding="utf-8", errors="replace")


@pytest.fixture
async def stack(crds: ControlPlane, namespace: str, tmp_path: Path) -> AsyncIterator[Stack]:
    # Nothing listens at the endpoints: no request is sent in these tests.
    policies = [
        provider_policy(
            KEYED,
            f"http://127.0.0.1:{free_port()}/v1",
            {MODEL_KEYED: ["m1"]},
            apiKeySecretRef={"name": SECRET, "key": SECRET_KEY},
        ),
        provider_policy(OPEN, f"http://127.0.0.1:{free_port()}/v1", {MODEL_OPEN: ["m1"]}),
    ]
    for manifest in policies:
        manifest["metadata"]["namespace"] = namespace
        await asyncio.to_thread(crds.kubectl, "apply", "-f", "-", input=json.dumps(manifest))
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir()
    kube = ["--kubeconfig", str(crds.kubeconfig)]
    logs = {name: tmp_path / f"{name}.log" for name in ("operator", *PODS)}
    processes: dict[str, subprocess.Popen[str]] = {}
    proxies: dict[str, str] = {}
    stack = Stack(crds, namespace, secrets_dir, logs, proxies, processes)
    try:
        await stack.apply_roles("agent")
        processes["operator"] = await start_cli(
            *("operator", "--namespace", namespace),
            *("--report-ttl-seconds", str(REPORT_TTL_SECONDS), *kube),
            log=logs["operator"],
        )
        for pod in PODS:
            port = free_port()
            processes[pod] = await start_cli(
                *("proxy", "--configmap", f"{namespace}/rolegate-config", "--port", str(port)),
                *("--status-heartbeat-seconds", str(HEARTBEAT_SECONDS)),
                *("--secrets-dir", str(secrets_dir), "--key-refresh-seconds", "0.5", *kube),
                env={"POD_NAME": pod},
                log=logs[pod],
            )
            proxies[pod] = f"http://127.0.0.1:{port}"
        for url in proxies.values():
            await eventually(partial(ready, url), what=f"{url} to be ready", within=30)
        yield stack
    finally:
        for name, process in processes.items():
            await stop(process)
            print(f"--- {name} ---\n{stack.log(name)[-3000:]}")


async def _all_report(stack: Stack, pods: tuple[str, ...] = PODS) -> bool:
    for policy in (KEYED, OPEN):
        if set(await stack.reports(policy)) != set(pods):
            return False
    return True


async def test_a_report_names_the_configuration_the_pod_serves_and_follows_a_change(
    stack: Stack,
) -> None:
    first = await stack.served_hash("proxy-a")

    async def reported(wanted: str) -> bool:
        for policy in (KEYED, OPEN):
            reports = await stack.reports(policy)
            if any(reports.get(pod, {}).get("servedHash") != wanted for pod in PODS):
                return False
        return True

    # The first configuration is reported as soon as it is loaded, not a heartbeat later.
    await eventually(partial(reported, first), what=f"servedHash {first}", within=20)
    assert await stack.served_hash("proxy-b") == first

    await stack.apply_roles("agent", "batch")

    async def swapped() -> str | None:
        hashes = {await stack.served_hash(pod) for pod in PODS}
        return hashes.pop() if len(hashes) == 1 and first not in hashes else None

    second = await eventually(swapped, what="both pods to serve the edit", within=20)
    took = await seconds_until(
        partial(reported, second), what=f"servedHash {second} on every report", within=5
    )
    print(f"\nthe new servedHash reached both policies {took * 1000:.0f} ms after /readyz")


async def test_a_key_not_found_is_reported_and_its_fix_follows_promptly(stack: Stack) -> None:
    async def resolutions() -> dict[str, set[str]]:
        found: dict[str, set[str]] = {}
        for policy in (KEYED, OPEN):
            reports = await stack.reports(policy)
            found[policy] = {str(reports.get(pod, {}).get("apiKey")) for pod in PODS}
        return found

    async def showing(keyed: str) -> bool:
        return await resolutions() == {KEYED: {keyed}, OPEN: {"NotRequired"}}

    await eventually(partial(showing, "NotFound"), what="apiKey NotFound", within=20)

    # The Secret appears (as the kubelet would mount it): seen at the next key refresh.
    stack.key_file().parent.mkdir(parents=True)
    stack.key_file().write_text(KEY_VALUE + "\n", encoding="utf-8")
    took = await seconds_until(partial(showing, "Resolved"), what="apiKey Resolved", within=10)
    print(f"\nthe mounted key showed as Resolved {took * 1000:.0f} ms after it was written")

    # And gone again.
    stack.key_file().unlink()
    await eventually(partial(showing, "NotFound"), what="apiKey NotFound again", within=10)

    # The key itself is nowhere: not on the resource, not in a log line.
    policy = await asyncio.to_thread(stack.kubectl, "get", "pp", KEYED, "-o", "json")
    assert KEY_VALUE not in policy
    assert all(KEY_VALUE not in stack.log(pod) for pod in PODS)


async def test_a_pod_that_shuts_down_withdraws_its_reports(stack: Stack) -> None:
    await eventually(partial(_all_report, stack), what="both pods' reports", within=20)
    process = stack.processes["proxy-b"]
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)

    async def withdrawn() -> bool:
        return await _all_report(stack, ("proxy-a",))

    await eventually(withdrawn, what="proxy-b's reports to be withdrawn", within=5)
    took = time.monotonic() - started
    code = await asyncio.to_thread(process.wait, 10)
    print(f"\nproxy-b's reports were gone {took * 1000:.0f} ms after SIGTERM")
    assert code == 0
    # Removed by the pod itself (the TTL is ten minutes): the proxy says so.
    assert stack.log("proxy-b").count("status report withdrawn") == 2
    # Still there: the other pod's reports, as it wrote them.
    assert set(await stack.reports(KEYED)) == {"proxy-a"}


async def test_shutdown_stays_fast_when_the_api_server_does_not_answer(stack: Stack) -> None:
    await eventually(partial(_all_report, stack), what="both pods' reports", within=20)
    apiserver = stack.plane.apiserver
    assert apiserver is not None
    process = stack.processes["proxy-b"]
    # Stopped, not gone: connections are accepted by the kernel and never answered.
    apiserver.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(process.wait, 30)
        took = time.monotonic() - started
    finally:
        apiserver.send_signal(signal.SIGCONT)
    print(f"\nproxy-b stopped {took * 1000:.0f} ms after SIGTERM with the API server hung")
    assert code == 0
    assert took < 5.0  # the withdrawal gives up after 2 s
    assert "status reports not withdrawn within 2.0s" in stack.log("proxy-b")
    # What it could not withdraw is still there (it expires after the operator's TTL).
    assert set(await stack.reports(KEYED)) == set(PODS)


async def test_warnings_during_an_api_server_outage_name_the_address_not_objects(
    stack: Stack,
) -> None:
    await eventually(partial(_all_report, stack), what="both pods' reports", within=20)
    await asyncio.to_thread(stack.plane.stop_apiserver)
    try:
        # A change while the API server is away: the report of it fails, and says so.
        stack.key_file().parent.mkdir(parents=True)
        stack.key_file().write_text(KEY_VALUE, encoding="utf-8")
        address = f"127.0.0.1:{stack.plane.api_port}"
        refused = f"connecting to {address}: ECONNREFUSED (Connection refused)"

        def warned() -> bool:
            lines = stack.log("proxy-a").splitlines()
            return any("kubernetes api unavailable" in line and refused in line for line in lines)

        async def both_warned() -> bool:
            lines = stack.log("proxy-a").splitlines()
            return warned() and any(
                "status report failed" in line and refused in line for line in lines
            )

        await eventually(both_warned, what="proxy-a's warnings of the outage", within=20)
    finally:
        await asyncio.to_thread(stack.plane.start_apiserver)
    warnings = [line for line in stack.log("proxy-a").splitlines() if " WARNING " in line]
    print("\n" + "\n".join(warnings[-4:]))
    assert not [line for line in warnings if "object at 0x" in line]

    # And the report resumes once it is back.
    async def resolved() -> bool:
        return (await stack.reports(KEYED)).get("proxy-a", {}).get("apiKey") == "Resolved"

    await eventually(resolved, what="the report after the outage", within=20)


async def _condition(stack: Stack, kind: str, name: str, type_: str) -> dict[str, Any]:
    text = await asyncio.to_thread(stack.kubectl, "get", kind, name, "-o", "json")
    for condition in (json.loads(text).get("status") or {}).get("conditions") or ():
        if condition["type"] == type_:
            return dict(condition)
    return {}


async def test_a_missing_secret_is_a_condition_naming_it_and_its_fix_clears_it(
    stack: Stack,
) -> None:
    """What the pods report of the key becomes `ResolvedRefs` on the ProviderPolicy: False
    with `SecretNotFound` naming the Secret and key while no pod can read it."""

    async def refs(policy: str, status: str) -> dict[str, Any] | None:
        condition = await _condition(stack, "pp", policy, "ResolvedRefs")
        return condition if condition.get("status") == status else None

    async def both_missing() -> dict[str, Any] | None:
        # The condition is False from the first pod's report on; both pods' reports are
        # what it says once the second pod's is in too (on a loaded machine, later).
        condition = await refs(KEYED, "False")
        return condition if condition and "2 of 2 proxy pods" in condition["message"] else None

    missing = await eventually(
        both_missing, what="ResolvedRefs=False on the keyed policy from both pods", within=30
    )
    assert missing["reason"] == "SecretNotFound"
    assert f"Secret {SECRET}, key {SECRET_KEY}" in missing["message"]
    assert (await refs(OPEN, "True") or {}).get("message") == "No Secret is referenced."

    stack.key_file().parent.mkdir(parents=True)
    stack.key_file().write_text(KEY_VALUE)
    fixed = await eventually(
        partial(refs, KEYED, "True"), what="ResolvedRefs=True once the key exists", within=30
    )
    assert fixed["reason"] == "Resolved"
    described = await asyncio.to_thread(stack.kubectl, "get", "pp", KEYED, "-o", "yaml")
    assert KEY_VALUE not in described


async def test_programmed_says_when_every_pod_serves_a_generation(stack: Stack) -> None:
    """`Accepted` is the operator's verdict; `Programmed` is True only once every live pod
    reports serving the configuration that holds the resource's current generation."""

    async def programmed(kind: str, name: str, status: str, generation: int) -> bool:
        condition = await _condition(stack, kind, name, "Programmed")
        return (
            condition.get("status") == status and condition.get("observedGeneration") == generation
        )

    await eventually(
        partial(programmed, "rt", "roles", "True", 1), what="the table programmed", within=30
    )
    await eventually(
        partial(programmed, "pp", OPEN, "True", 1), what="the policy programmed", within=30
    )

    # proxy-b freezes: its last report (the old hash) stays live, so a change is served by
    # proxy-a alone and the condition says it waits for proxy-b.
    frozen = stack.processes["proxy-b"]
    frozen.send_signal(signal.SIGSTOP)
    try:
        await stack.apply_roles("agent", "batch")

        async def waiting_for_b() -> dict[str, Any] | None:
            condition = await _condition(stack, "rt", "roles", "Programmed")
            message = condition.get("message", "")
            # proxy-a reports the new hash a moment after the operator compiled it.
            return condition if message.startswith("1 of 2 proxy pods") else None

        waiting = await eventually(waiting_for_b, what="served by proxy-a alone", within=30)
        assert waiting["status"] == "False"
        assert waiting["reason"] == "RollingOut"
        assert waiting["observedGeneration"] == 2
        assert waiting["message"].endswith("waiting for proxy-b.")
    finally:
        frozen.send_signal(signal.SIGCONT)
    took = await seconds_until(
        partial(programmed, "rt", "roles", "True", 2), what="served everywhere", within=30
    )
    served = await _condition(stack, "rt", "roles", "Programmed")
    assert "All 2 proxy pods serve configuration" in served["message"]
    print(f"\nProgrammed=True {took:.2f} s after the frozen pod resumed")
