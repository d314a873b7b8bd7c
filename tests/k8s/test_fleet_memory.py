"""One fleet of proxies, one memory (issue 16), on the real control plane: the operator, the
simulator and three proxy processes as three pods (distinct `POD_NAME`), each publishing
its ProxyMemory every second (`--memory-publish-seconds 1`).

On paper the simulator's m1 answers first in 0.05 s and m2 in 0.1 s; in fact m1 takes a
second. Pod A alone is sent the traffic that teaches it so (requests only m1 may answer,
until m2 is asked first); pods B and C, which served nothing, must come to
believe it too and send their very first request to m2. A restarted pod takes its own
memory back before its first request; an API-server outage only delays the writes; an
object that is not a memory is ignored with a warning, and one older than a day deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from rolegate_cli.controlplane import ControlPlane, free_port
from rolegate_proxy.edge.kube_api import delete, load_access

from ..conftest import CRD_DIR, fresh_control_plane
from ..proxy.test_state_file import AGENT, MODEL, SHEETS, _expected_ttft, _first_asked, _sim
from ..support import (
    SimFactory,
    machine_policy,
    open_access,
    provider_policy,
    proxy_memory,
    role_table,
)
from ..waiting import eventually
from .processes import ready, start_cli, stop

PODS = ("proxy-a", "proxy-b", "proxy-c")
# What the pods write to the API server, every second here (30 s by default).
PUBLISH_SECONDS = 1
SELECTOR = "app.kubernetes.io/component=proxy-memory"


@dataclass
class Fleet:
    plane: ControlPlane
    namespace: str
    logs: Path
    proxies: dict[str, str] = field(default_factory=dict)  # pod -> url
    sim_url: str = ""
    processes: dict[str, subprocess.Popen[str]] = field(default_factory=dict)

    async def start(self, pod: str) -> str:
        """A proxy process as the pod `pod`, ready (its configuration loaded): its URL."""
        port = free_port()
        self.processes[pod] = await start_cli(
            *("proxy", "--configmap", f"{self.namespace}/rolegate-config", "--port", str(port)),
            "--metrics-on-api-port",  # `metrics_of` reads each pod's where it sends
            *("--memory-publish-seconds", str(PUBLISH_SECONDS)),
            # Every decision by the beliefs: no exploration, a seeded dither.
            *("--explore-share", "0", "--seed", "0"),
            *("--kubeconfig", str(self.plane.kubeconfig)),
            env={"POD_NAME": pod},
            log=self.logs / f"{pod}.log",
        )
        url = self.proxies[pod] = f"http://127.0.0.1:{port}"
        await eventually(partial(ready, url), what=f"{pod} ready", within=30)
        return url

    async def stop(self, pod: str) -> None:
        await stop(self.processes.pop(pod))

    def log(self, pod: str) -> str:
        return (self.logs / f"{pod}.log").read_text(encoding="utf-8", errors="replace")

    async def memories(self) -> dict[str, dict[str, Any]]:
        """Every ProxyMemory of the namespace, by name."""
        out = await asyncio.to_thread(
            self.plane.kubectl, "get", "pmem", "-n", self.namespace, "-l", SELECTOR, "-o", "json"
        )
        return {item["metadata"]["name"]: item for item in json.loads(out.stdout)["items"]}

    async def written(self, pod: str) -> datetime | None:
        """When `pod` last wrote its memory, as its ProxyMemory says."""
        found = (await self.memories()).get(f"memory-{pod}")
        if found is None:
            return None
        return datetime.fromisoformat(found["spec"]["writtenAt"])


@contextlib.asynccontextmanager
async def running_fleet(
    plane: ControlPlane,
    namespace: str,
    sim_server: SimFactory,
    logs: Path,
    pods: Sequence[str] = PODS,
    role: dict[str, Any] = AGENT,
    scenario: dict[str, Any] | None = None,
    policy: Callable[[str], dict[str, Any]] | None = None,
) -> AsyncIterator[Fleet]:
    """The simulator, the policy, the operator and one proxy process per pod, all ready
    (by default the slow-m1 scenario and its aggregator)."""
    sim_url = (await sim_server(scenario)).url if scenario else await _sim(sim_server)
    provider = policy(sim_url) if policy else machine_policy(sim_url, MODEL, SHEETS)
    for manifest in (provider, role_table(role), open_access()):
        manifest["metadata"]["namespace"] = namespace
        await asyncio.to_thread(plane.kubectl, "apply", "-f", "-", input=json.dumps(manifest))
    fleet = Fleet(plane, namespace, logs, sim_url=sim_url)
    operator = await start_cli(
        "operator", "--namespace", namespace, "--kubeconfig", str(plane.kubeconfig)
    )
    try:
        for pod in pods:
            await fleet.start(pod)
        yield fleet
    finally:
        for pod in list(fleet.processes):
            await fleet.stop(pod)
        await stop(operator)


async def metrics_of(url: str) -> str:
    async with httpx.AsyncClient(timeout=10) as client:
        return (await client.get(f"{url}/metrics")).text


async def teach(url: str, lessons: int = 3) -> None:
    """Teach one pod m1's real first token (a second): `lessons` streamed requests only m1
    may answer (the caller's `provider.only`), each waited out whole. (Raced by m2, a
    single late first token already makes m2 lead, and says only that m1 was late, not by
    how much.) Then m2 is asked first."""
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(lessons):
            response = await client.post(
                f"{url}/v1/chat/completions",
                json={"model": "agent", "messages": [{"role": "user", "content": "step"}],
                      "stream": True, "provider": {"only": ["m1"]}},
            )  # fmt: skip
            assert response.status_code == 200, response.text
    assert await _first_asked(url) == "m2"


async def close_to(url: str, learned: float) -> float | None:
    """The pod's belief of m1's time to the first token, once within a quarter of what the
    teacher learned."""
    believed = await _expected_ttft(url, "m1")
    return believed if abs(believed - learned) <= 0.25 * learned else None


async def moved_toward(url: str, published: float, learned: float) -> float | None:
    """The pod's belief of m1's time to the first token, once it is past the midpoint
    from the published figure to what the teacher learned."""
    believed = await _expected_ttft(url, "m1")
    return believed if believed > (published + learned) / 2 else None


@pytest.mark.timeout(180)
async def test_what_one_pod_learns_the_others_believe_and_route_by(
    crds: ControlPlane, namespace: str, sim_server: SimFactory, tmp_path: Path
) -> None:
    async with running_fleet(crds, namespace, sim_server, tmp_path) as fleet:
        a, b, c = (fleet.proxies[pod] for pod in PODS)
        published = await _expected_ttft(b, "m1")
        assert published < 0.1
        await teach(a)
        learned = await _expected_ttft(a, "m1")
        assert learned > 5 * published, learned
        taught = time.monotonic()
        # B and C served nothing: what they believe of m1 now is what they heard.
        for pod, url in (("proxy-b", b), ("proxy-c", c)):
            # A memory written between two lessons is heard first: wait for the last.
            believed = await eventually(
                partial(close_to, url, learned),
                what=f"{pod}'s belief of m1 within a quarter of proxy-a's",
                within=15,
            )
            print(f"\n{pod} believes m1's first token in {believed:.2f} s (proxy-a: "
                  f"{learned:.2f} s, published {published:.2f} s), "
                  f"{time.monotonic() - taught:.1f} s after proxy-a learned it")  # fmt: skip
        # And each sends its first request away from m1.
        assert await _first_asked(b) == "m2"
        assert await _first_asked(c) == "m2"
        # Each pod's memory is its own object; A's holds the machines it learned of.
        memories = await fleet.memories()
        assert set(memories) == {f"memory-{pod}" for pod in PODS}
        for pod in PODS:
            spec = memories[f"memory-{pod}"]["spec"]
            assert spec["pod"] == pod
            assert json.loads(spec["memory"])["pod"] == pod
        spec = memories["memory-proxy-a"]["spec"]
        assert spec["machines"] == 2
        print(f"proxy-a's memory of 2 machines: {len(spec['memory'])} bytes")
        # Never counted twice: B passes on nothing it heard (m1 is not in its memory), so
        # C's belief of m1 comes from A's evidence once, not from A's and again from B's.
        rows = json.loads(memories["memory-proxy-b"]["spec"]["memory"])["machines"]
        assert "m1" not in {row[2] for row in rows}, rows
        # Its metrics: the writes it made and the two peers it heard.
        page = await metrics_of(b)
        assert "rolegate_memory_peers 2.0" in page
        assert 'rolegate_memory_writes_total{result="ok"}' in page


@pytest.mark.timeout(180)
async def test_a_restarted_pod_routes_from_its_own_memory_on_its_first_request(
    crds: ControlPlane, namespace: str, sim_server: SimFactory, tmp_path: Path
) -> None:
    async with running_fleet(crds, namespace, sim_server, tmp_path, PODS[:1]) as fleet:
        await teach(fleet.proxies["proxy-a"])
        learned = await _expected_ttft(fleet.proxies["proxy-a"], "m1")
        await fleet.stop("proxy-a")  # writes its memory once more
        # The same pod name (a container restart): its memory comes back before it serves.
        url = await fleet.start("proxy-a")
        assert await _expected_ttft(url, "m1") == pytest.approx(learned, rel=0.05)
        assert "memory restored object=" in fleet.log("proxy-a")
        assert await _first_asked(url) == "m2"


@pytest.mark.timeout(240)
async def test_an_api_server_outage_only_delays_the_memory(
    sim_server: SimFactory, tmp_path: Path
) -> None:
    """On a control plane of its own: the API server is stopped under three pods."""
    with fresh_control_plane() as plane:
        await asyncio.to_thread(plane.kubectl, "apply", "-f", str(CRD_DIR))
        await asyncio.to_thread(
            plane.kubectl, "wait", "--for=condition=established", "--timeout=60s",
            "crd", "--all",
        )  # fmt: skip
        await asyncio.to_thread(plane.kubectl, "create", "namespace", "fleet")
        async with running_fleet(plane, "fleet", sim_server, tmp_path) as fleet:

            async def all_published() -> bool:
                return set(await fleet.memories()) == {f"memory-{pod}" for pod in PODS}

            await eventually(all_published, what="every pod's memory", within=20)
            await asyncio.to_thread(plane.stop_apiserver)
            try:
                down = time.monotonic()
                # Routing goes on (D6): every pod answers, again and again.
                while time.monotonic() - down < 5:
                    async with httpx.AsyncClient(timeout=30) as client:
                        for url in fleet.proxies.values():
                            response = await client.post(
                                f"{url}/v1/chat/completions",
                                json={"model": "agent", "messages": [
                                    {"role": "user", "content": "go on"}]},
                            )  # fmt: skip
                            assert response.status_code == 200, response.text
                for pod in PODS:
                    assert "memory not published object=" in fleet.log(pod), pod
                    page = await metrics_of(fleet.proxies[pod])
                    assert 'rolegate_memory_writes_total{result="failed"}' in page
            finally:
                await asyncio.to_thread(plane.start_apiserver)
            back = datetime.now(UTC)

            async def all_written_since() -> bool:
                times = [await fleet.written(pod) for pod in PODS]
                return all(t is not None and t > back for t in times)

            await eventually(all_written_since, what="every pod writing again", within=30)
            for pod in PODS:
                assert fleet.processes[pod].poll() is None, f"{pod} exited"


def _memory_object(pod: str, memory: str, written: datetime) -> dict[str, Any]:
    return proxy_memory(pod, memory, written.strftime("%Y-%m-%dT%H:%M:%SZ"))


GARBAGE = "sk-planted-not-a-memory {{{"


@pytest.mark.timeout(180)
async def test_a_memory_that_is_garbage_or_a_day_old_is_ignored_and_nothing_else_breaks(
    crds: ControlPlane, namespace: str, sim_server: SimFactory, tmp_path: Path
) -> None:
    now = datetime.now(UTC)
    old = now.timestamp() - 2 * 86_400
    stale = json.dumps(
        {"format": 1, "pod": "proxy-old", "writtenAt": old, "machines": [
            ["agg", MODEL, "m2", 9, [9.0, 9 * 4.0, 9 * 16.0], None, [9, 0.0, 9.0]]]},
    )  # fmt: skip
    for obj in (
        _memory_object("garbage", GARBAGE, now),
        _memory_object("proxy-old", stale, datetime.fromtimestamp(old, UTC)),
    ):
        obj["metadata"]["namespace"] = namespace
        await asyncio.to_thread(crds.kubectl, "apply", "-f", "-", input=json.dumps(obj))
    pods = PODS[:2]
    async with running_fleet(crds, namespace, sim_server, tmp_path, pods) as fleet:
        a, b = (fleet.proxies[pod] for pod in pods)

        async def stale_deleted() -> bool:
            return "memory-proxy-old" not in await fleet.memories()

        await eventually(stale_deleted, what="the day-old memory deleted", within=20)
        # What the pods share still spreads past the garbage.
        published = await _expected_ttft(b, "m1")
        await teach(a)
        learned = await _expected_ttft(a, "m1")
        await eventually(
            partial(moved_toward, b, published, learned), what="proxy-b hearing", within=15
        )
        assert await _first_asked(b) == "m2"
        assert set(await fleet.memories()) == {"memory-garbage", "memory-proxy-a", "memory-proxy-b"}
        for pod in pods:
            log = fleet.log(pod)
            warnings = [line for line in log.splitlines() if "memory ignored" in line]
            # One warning, naming the object and what is wrong, never quoting it.
            assert len(warnings) == 1, warnings
            assert f"object={namespace}/memory-garbage reason=not JSON" in warnings[0]
            assert "sk-planted" not in log
        print("\n" + warnings[0])


async def test_an_expired_memory_written_again_meanwhile_is_not_deleted(
    crds: ControlPlane, namespace: str
) -> None:
    """The deletion's precondition, on the real API server: only the version seen goes."""
    now = datetime.now(UTC)
    obj = _memory_object("proxy-a", '{"format":1}', now)
    obj["metadata"]["namespace"] = namespace
    name = obj["metadata"]["name"]

    def version() -> str:
        out = crds.kubectl("get", "pmem", name, "-n", namespace, "-o", "json").stdout
        return str(json.loads(out)["metadata"]["resourceVersion"])

    await asyncio.to_thread(crds.kubectl, "apply", "-f", "-", input=json.dumps(obj))
    seen = await asyncio.to_thread(version)
    obj["spec"]["machines"] = 2  # a fresh write after the old one was seen
    await asyncio.to_thread(crds.kubectl, "apply", "-f", "-", input=json.dumps(obj))
    fresh = await asyncio.to_thread(version)
    access = await asyncio.to_thread(load_access, crds.kubeconfig)
    path = f"/apis/rolegate.dev/v1alpha1/namespaces/{namespace}/proxymemories/{name}"
    async with aiohttp.ClientSession() as session:
        assert not await delete(session, access, path, seen)
        assert await asyncio.to_thread(version) == fresh
        assert await delete(session, access, path, fresh)
        assert not await delete(session, access, path, fresh)  # gone


async def state_of(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=10) as client:
        found: dict[str, Any] = (await client.get(f"{url}/v1/rolegate/state")).json()
        return found


def m1_in(rows: list[dict[str, Any]]) -> bool:
    return any(row["machine"] == "m1" for row in rows)


@pytest.mark.timeout(180)
async def test_a_trip_on_one_pod_keeps_the_key_out_on_every_pod_until_it_closes(
    crds: ControlPlane, namespace: str, sim_server: SimFactory, tmp_path: Path
) -> None:
    """m1 starts answering 503: pod A trips it; pod C, which sent it nothing, keeps it out
    within 5 s and never probes it; when A's probe closes it, C takes it back."""
    # `Only`: each attempt names one machine, so m1's failures reach the proxy's breaker
    # (under `Order` the aggregator would fall back to m2 itself and hide them).
    only = {**AGENT, "ruling": "Only"}
    async with running_fleet(crds, namespace, sim_server, tmp_path, role=only) as fleet:
        a, c = fleet.proxies["proxy-a"], fleet.proxies["proxy-c"]
        faults = f"{fleet.sim_url}/_sim/machines/{MODEL}/m1/faults"
        down = [{"kind": "serverError", "always": True, "status": 503}]
        async with httpx.AsyncClient(timeout=30) as client:
            (await client.put(faults, json=down)).raise_for_status()

            async def a_tripped() -> bool:
                await _first_asked(a)
                return m1_in((await state_of(a))["breakers"])

            await eventually(a_tripped, what="proxy-a's breaker on m1 open", within=30)
            tripped = time.monotonic()

            async def c_excludes() -> list[dict[str, Any]] | None:
                trips = (await state_of(c))["fleet_trips"]
                return trips if m1_in(trips) else None

            trips = await eventually(c_excludes, what="proxy-c keeping m1 out", within=10)
            spread = time.monotonic() - tripped
            print(f"trip on proxy-a kept out on proxy-c after {spread:.2f} s")
            assert spread < 5.0
            assert {(t["machine"], t["pod"]) for t in trips} == {("m1", "proxy-a")}
            # C's own request skips m1, naming the pod that tripped it, and never probes it.
            assert await _first_asked(c) == "m2"
            decisions = (await client.get(f"{c}/v1/rolegate/decisions")).json()["decisions"]
            skipped = decisions[-1]["skipped"]
            assert any(
                s["machine"] == "m1" and "tripped on proxy pod proxy-a" in s["reason"]
                for s in skipped
            ), skipped
            assert not m1_in((await state_of(c))["breakers"])

            # m1 heals; A's probe closes the breaker; C takes m1 back soon after.
            (await client.put(faults, json=[])).raise_for_status()

            async def a_closed() -> bool:
                await _first_asked(a)
                return not m1_in((await state_of(a))["breakers"])

            await eventually(a_closed, what="proxy-a's breaker on m1 closed", within=120, every=0.5)
            closed = time.monotonic()

            async def c_clear() -> bool:
                return not m1_in((await state_of(c))["fleet_trips"])

            await eventually(c_clear, what="proxy-c taking m1 back", within=10)
            assert time.monotonic() - closed < 5.0


# Only the rate arm: never a count burst, a minimum sample of 30 over the last 40 answers.
RATE_ONLY = {
    "novelSignatureCount": 10_000,
    "familiarSignatureCount": 10_000,
    "rateMinSamples": 30,
    "rateWindow": 40,
    "rateThreshold": 0.25,
}


@pytest.mark.timeout(180)
async def test_a_model_35_percent_empty_through_three_pods_trips_within_the_fleet_s_sample(
    crds: ControlPlane, namespace: str, sim_server: SimFactory, tmp_path: Path
) -> None:
    """Requests spread evenly over three pods, the model answering 35 % empty: counted per
    pod, the first trip would need 30 answers on one pod (about 88 in all); counted across
    the fleet it comes near 30 in all (plus what a second of publishing lag lets through)."""
    scenario = {"seed": 7, "models": [{"name": MODEL, "machines": [
        {"name": "m1", "ttftSeconds": 0, "tokensPerSecond": 0,
         "faults": [{"kind": "empty", "probability": 0.35}]}]}]}  # fmt: skip

    def direct(url: str) -> dict[str, Any]:
        return provider_policy(
            "router", f"{url}/v1", {MODEL: ["m1"]}, dialect="OpenAI", breaker=RATE_ONLY
        )

    role = {**AGENT, "ruling": "Only"}
    async with running_fleet(
        crds, namespace, sim_server, tmp_path, role=role, scenario=scenario, policy=direct
    ) as fleet:
        urls = [fleet.proxies[pod] for pod in PODS]
        body = {"model": "agent", "messages": [{"role": "user", "content": "hi"}]}
        answered = 0
        async with httpx.AsyncClient(timeout=30) as client:

            async def tripped_anywhere() -> bool:
                states = await asyncio.gather(*(state_of(url) for url in urls))
                return any(state["breakers"] for state in states)

            while not await tripped_anywhere():
                # Round robin, paced like steady traffic (about 20 answers a second).
                response = await client.post(f"{urls[answered % 3]}/v1/chat/completions", json=body)
                assert response.status_code in (200, 502), response.text
                answered += 1
                assert answered < 88, "no trip before a single pod could have tripped alone"
                await asyncio.sleep(0.05)
        print(f"fleet-wide trip after {answered} answers across three pods")
        assert answered <= 30 + 20


# Two equal machines whose answers take seconds: a request in flight on one is a queue.
EVEN = [
    {"name": "m1", "ttftSeconds": 0.05, "tokensPerSecond": 4},
    {"name": "m2", "ttftSeconds": 0.05, "tokensPerSecond": 4},
]


async def fleet_in_flight(url: str, machine: str) -> int | None:
    """What the pod heard its peers have in flight on `machine`, once it heard any."""
    async with httpx.AsyncClient() as client:
        load = (await client.get(f"{url}/v1/rolegate/state")).json()["load"]
    heard = sum(row["fleet_in_flight"] for row in load if row["machine"] == machine)
    return heard or None


@pytest.mark.timeout(120)
async def test_requests_in_flight_on_one_pod_count_on_the_others(
    crds: ControlPlane, namespace: str, sim_server: SimFactory, tmp_path: Path
) -> None:
    """SPEC B8: a machine's queue is the fleet's. A's long answer on m1 is published with
    A's memory; B, which has sent nothing, sends its first request to the idle m2."""
    scenario = {"seed": 2, "models": [{"name": MODEL, "reply": " ".join(["word"] * 40),
                                       "machines": EVEN}]}  # fmt: skip
    async with running_fleet(
        crds, namespace, sim_server, tmp_path, pods=PODS[:2], scenario=scenario,
        policy=lambda url: machine_policy(url, MODEL, EVEN),
    ) as fleet:  # fmt: skip
        a, b = fleet.proxies["proxy-a"], fleet.proxies["proxy-b"]
        long_answer = asyncio.create_task(_first_asked(a))
        try:
            heard = await eventually(
                partial(fleet_in_flight, b, "m1"), what="proxy-b hearing proxy-a's m1 queue"
            )
            assert heard == 1
            # Equal on paper and in belief; m1 busy across the fleet: B goes to m2.
            assert await _first_asked(b) == "m2"
        finally:
            assert await long_answer == "m1"
