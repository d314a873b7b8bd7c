"""How the operator process lives and dies, against the real API server: it leaves at once
(non-zero) when kopf gives up, stops within a second of SIGTERM whatever it is doing, and
two replicas elect one writer that a standby replaces when it is killed."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rolegate_cli.controlplane import ControlPlane, free_port
from rolegate_operator.lifecycle import STOP_SECONDS
from tests.policy.builders import provider, role, role_table

from ..conftest import CRD_DIR, fresh_control_plane
from ..waiting import wait_for
from .conftest import Cluster, OperatorProcess, StartOperator
from .test_operator_e2e import observed, with_spec

ROUTER = provider("router", namespace=None)
TABLE = role_table("roles", role("agent"), namespace=None)
# Short lease timings, so a failover fits in a test; the documented bound is the same
# formula with the defaults (lease + retry = 17 s).
LEASE = ("--lease-seconds", "4", "--lease-renew-deadline-seconds", "3")
LEASE_RETRY = 0.5
LEASE_SECONDS = 4.0


def stop_seconds(process: OperatorProcess) -> float:
    """SIGTERM, and how long the process took to exit."""
    started = time.monotonic()
    process.process.send_signal(signal.SIGTERM)
    process.process.wait(timeout=30)
    return time.monotonic() - started


@pytest.fixture
def own_plane() -> Iterator[ControlPlane]:
    """A control plane of its own, for a test that removes a CRD under a running operator
    (the shared one keeps its CRDs for every other test)."""
    with fresh_control_plane() as plane:
        yield plane


def test_when_kopf_gives_up_the_process_exits_non_zero_at_once(
    own_plane: ControlPlane, tmp_path: Path
) -> None:
    plane = own_plane
    plane.kubectl("apply", "-f", str(CRD_DIR))
    plane.kubectl(
        "wait", "--for=condition=established", "--timeout=60s",
        "crd/roletables.rolegate.dev", "crd/providerpolicies.rolegate.dev",
    )  # fmt: skip
    plane.kubectl("create", "namespace", "watched")
    for obj in (ROUTER, TABLE):
        manifest = {**obj, "metadata": {**obj["metadata"], "namespace": "watched"}}
        plane.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    operator = OperatorProcess(
        plane,
        ["--namespace", "watched", "--kubeconfig", str(plane.kubeconfig)],
        tmp_path / "operator.log",
    )
    try:
        wait_for(lambda: "pass done" in operator.log(), "the first pass", alive=[operator])
        # The RoleTable CRD removed under it: kopf's watcher of it fails for good (404).
        plane.kubectl("delete", "crd", "roletables.rolegate.dev")
        wait_for(lambda: operator.process.poll() is not None, "the operator to exit")
        assert operator.process.returncode == 1
        assert "kopf stopped on its own" in operator.log()
    finally:
        operator.stop()
        print(operator.log()[-4000:])


def test_sigterm_stops_it_within_a_second_running_or_cut_off(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    cluster.apply(ROUTER)
    cluster.apply(TABLE)
    running = start_operator()
    wait_for(lambda: observed(cluster, "rt", "roles", "True", 1), "accepted", alive=[running])
    took_running = stop_seconds(running)
    assert running.process.returncode == 0

    cut_off = start_operator()
    wait_for(lambda: "pass done" in cut_off.log(), "the first pass", alive=[cut_off])
    cluster.plane.stop_apiserver()
    try:
        # Its watches and its lease renewals are failing and retrying now.
        wait_for(lambda: "lease attempt failed" in cut_off.log(), "a failed lease renewal")
        took_cut_off = stop_seconds(cut_off)
    finally:
        cluster.plane.start_apiserver()
    print(f"\nSIGTERM to exit: {took_running:.2f} s running, {took_cut_off:.2f} s cut off")
    # The process promises STOP_SECONDS; the margin is for a loaded machine's process
    # start-up of the signal handler, far below kopf's own 10 s stop.
    assert took_running < STOP_SECONDS + 2
    assert took_cut_off < STOP_SECONDS + 2


def metrics(port: int) -> dict[str, float]:
    """The operator's /metrics as `series -> value` (comments left out)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            samples[series] = float(value)
    return samples


def leader_of(processes: list[OperatorProcess], cluster: Cluster) -> OperatorProcess:
    lease = cluster.get("lease", "rolegate-operator")
    holder = lease["spec"].get("holderIdentity") or ""
    assert holder, "nobody holds the lease"
    (leader,) = [p for p in processes if f"identity={holder} " in p.log()]
    return leader


def warnings_for(cluster: Cluster, name: str, reason: str) -> list[dict[str, object]]:
    return [e for e in cluster.events(name) if e["reason"] == reason]


def test_two_replicas_have_one_writer_and_a_standby_takes_over(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    cluster.apply(ROUTER)
    cluster.apply(TABLE)
    args = ("--namespace", cluster.namespace, *LEASE, "--lease-retry-seconds", str(LEASE_RETRY))
    ports = [free_port(), free_port()]
    replicas = [start_operator(*args, "--metrics-port", str(port)) for port in ports]
    wait_for(lambda: observed(cluster, "rt", "roles", "True", 1), "accepted", alive=replicas)
    leader = wait_for(lambda: leader_of(replicas, cluster), "a leader")
    (standby,) = [p for p in replicas if p is not leader]
    wait_for(lambda: "standby pass done" in standby.log(), "the standby's first compile")
    # Each says which it is on /metrics, and only the leader counts passes it wrote.
    scraped = {p: metrics(port) for p, port in zip(replicas, ports, strict=True)}
    assert scraped[leader]["rolegate_operator_leader"] == 1
    assert scraped[standby]["rolegate_operator_leader"] == 0
    assert scraped[leader]['rolegate_operator_reconciles_total{result="ok"}'] >= 1
    assert 'rolegate_operator_reconciles_total{result="ok"}' not in scraped[standby]
    namespace_series = f'rolegate_operator_watched_namespace{{namespace="{cluster.namespace}"}}'
    assert scraped[standby][namespace_series] == 1

    # A rejection: one status write and one Warning Event, from the leader alone.
    cluster.apply(with_spec(TABLE, roles=[role("agent", models=["nope"])]))
    wait_for(lambda: observed(cluster, "rt", "roles", "False", 2), "rejected", alive=replicas)
    wait_for(lambda: warnings_for(cluster, "roles", "NoServedModel"), "the Warning Event")
    wait_for(lambda: standby.log().count("standby pass done") >= 2, "the standby's compile of it")
    assert len(warnings_for(cluster, "roles", "NoServedModel")) == 1
    assert "status written" not in standby.log()
    assert "status written resource=RoleTable" in leader.log()

    # The leader dies without a word (SIGKILL: no release); the standby takes over within
    # a lease duration and a retry of the leader's last renewal, and writes the next change.
    leader.process.kill()
    leader.process.wait()
    killed = time.monotonic()
    wait_for(lambda: "became the leader" in standby.log(), "the takeover", within=30)
    took_over = time.monotonic() - killed
    cluster.apply(with_spec(TABLE, roles=[role("agent", patienceSeconds=40)]))
    wait_for(lambda: observed(cluster, "rt", "roles", "True", 3), "fixed", alive=[standby])
    served = time.monotonic() - killed
    print(
        f"\nfailover: the standby led {took_over:.2f} s after the leader was killed "
        f"(bound {LEASE_SECONDS + LEASE_RETRY:.1f} s), and had written the next change "
        f"{served:.2f} s after"
    )
    assert took_over <= LEASE_SECONDS + LEASE_RETRY + 1.5  # + one Lease round trip, loaded


def test_a_resource_outside_the_watched_namespaces_gets_no_status_and_metrics_say_why(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    elsewhere = f"{cluster.namespace}-x"
    cluster.plane.kubectl("create", "namespace", elsewhere)
    stray = {**TABLE, "metadata": {**TABLE["metadata"], "namespace": elsewhere}}
    cluster.plane.kubectl("apply", "-f", "-", input=json.dumps(stray))
    cluster.apply(ROUTER)
    cluster.apply(TABLE)
    port = free_port()
    operator = start_operator("--namespace", cluster.namespace, "--metrics-port", str(port))
    wait_for(lambda: observed(cluster, "rt", "roles", "True", 1), "accepted", alive=[operator])
    # The watched one has its status; the stray one has none, and never will.
    found = json.loads(
        cluster.plane.kubectl("-n", elsewhere, "get", "rt", "roles", "-o", "json").stdout
    )
    assert "status" not in found
    watched = {series for series in metrics(port) if series.startswith("rolegate_operator_watched")}
    assert watched == {f'rolegate_operator_watched_namespace{{namespace="{cluster.namespace}"}}'}
