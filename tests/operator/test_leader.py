"""Leader election on a Lease: the pure decision, then two electors against the real API
server (their clocks injected, so a lease duration passes without waiting for it)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from rolegate_operator.kube import Kube, load_configuration
from rolegate_operator.leader import (
    ElectionOptions,
    Elector,
    Leadership,
    LeaseRecord,
    Step,
    decide,
)

from .conftest import Cluster

HELD = LeaseRecord("a", "", "t1", 15, 0, "1")
RELEASED = LeaseRecord("", "", "t1", 1, 0, "2")


def test_no_lease_is_created_and_ones_own_is_renewed() -> None:
    assert decide(None, "a", unchanged_since=0, now=0, lease_seconds=15) is Step.CREATE
    assert decide(HELD, "a", unchanged_since=0, now=100, lease_seconds=15) is Step.RENEW


def test_a_holder_is_presumed_gone_only_after_a_lease_duration_unchanged() -> None:
    assert decide(HELD, "b", unchanged_since=10, now=24.9, lease_seconds=15) is Step.WAIT
    assert decide(HELD, "b", unchanged_since=10, now=25, lease_seconds=15) is Step.TAKE_OVER


def test_a_released_lease_is_taken_at_once() -> None:
    assert decide(RELEASED, "b", unchanged_since=10, now=10, lease_seconds=15) is Step.TAKE_OVER


def test_the_timings_must_leave_the_leader_time_to_stop_first() -> None:
    with pytest.raises(ValueError, match="renew deadline < lease duration"):
        ElectionOptions(namespace="ns", lease_seconds=10, renew_deadline_seconds=10)


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Replica:
    elector: Elector
    leadership: Leadership
    clock: Clock


def replica(cluster: Cluster, identity: str) -> Replica:
    options = ElectionOptions(namespace=cluster.namespace, identity=identity)
    leadership = Leadership()
    clock = Clock()
    kube = Kube(load_configuration(str(cluster.plane.kubeconfig)))
    return Replica(Elector(options, kube, leadership, monotonic=clock), leadership, clock)


def holder(cluster: Cluster) -> str:
    lease = cluster.get("lease", "rolegate-operator")
    return str(lease["spec"].get("holderIdentity") or "")


def test_one_leader_a_standby_takes_over_when_it_goes_silent(cluster: Cluster) -> None:
    a, b = replica(cluster, "a"), replica(cluster, "b")
    assert a.elector.attempt() is Step.CREATE
    assert a.leadership.leading
    assert holder(cluster) == "a"
    assert b.elector.attempt() is Step.WAIT
    assert not b.leadership.leading

    # a renews: b keeps waiting however long it has watched, since the record changes.
    for _ in range(3):
        b.clock.now += 10
        assert a.elector.attempt() is Step.RENEW
        assert b.elector.attempt() is Step.WAIT

    # a goes silent for a lease duration on b's clock: b takes over.
    b.clock.now += 15
    assert b.elector.attempt() is Step.TAKE_OVER
    assert b.leadership.leading
    assert holder(cluster) == "b"
    assert cluster.get("lease", "rolegate-operator")["spec"]["leaseTransitions"] == 1
    # a comes back: it sees b's hold and stands by.
    assert a.elector.attempt() is Step.WAIT
    assert not a.leadership.leading


def test_a_clean_stop_hands_the_lease_over_at_the_next_attempt(cluster: Cluster) -> None:
    a, b = replica(cluster, "a"), replica(cluster, "b")
    a.elector.attempt()
    b.elector.attempt()
    a.elector.release()
    assert not a.leadership.leading
    assert holder(cluster) == ""
    assert b.elector.attempt() is Step.TAKE_OVER
    assert b.leadership.leading


def test_two_takeovers_of_one_version_have_one_winner(cluster: Cluster) -> None:
    a = replica(cluster, "a")
    a.elector.attempt()
    a.elector.release()
    kube = Kube(load_configuration(str(cluster.plane.kubeconfig)))
    record = kube.read_lease(cluster.namespace, "rolegate-operator")
    assert record is not None
    # Both write against the version they read: the resourceVersion precondition lets
    # exactly one of them through.
    won = [
        kube.write_lease(cluster.namespace, "rolegate-operator", {"holderIdentity": who}, record)
        for who in ("b", "c")
    ]
    assert won == [True, False]
    assert holder(cluster) == "b"


def test_a_leader_that_cannot_renew_stops_writing_before_the_lease_runs_out(
    cluster: Cluster,
) -> None:
    a = replica(cluster, "a")
    a.elector.attempt()
    assert a.leadership.leading
    # Its renewals fail (the API server away); the renew deadline passes on its clock.
    a.clock.now += 10
    a.elector.check_deadline()
    assert not a.leadership.leading
