"""A fleet of proxy pods as one memory, in the pure core: each pod hears the others'
evidence (weighted by its age), never its own twice and never passes on what it heard.
And the ProxyMemory object that carries one pod's memory through the API server
(edge/fleet_memory.py): its name, its size, and what is refused when read."""

from __future__ import annotations

import re

import pytest

from rolegate_policy.model import DNS_SUBDOMAIN_PATTERN, MAX_MEMORY_CHARS
from rolegate_proxy.core.beliefs import Evidence, MachineEvidence, MachineKey
from rolegate_proxy.core.fleet import PodMemory, hear_fleet, remember
from rolegate_proxy.core.score import ObservationKind, Scoreboard
from rolegate_proxy.edge.fleet_memory import (
    NotPublishable,
    memory_name,
    memory_object,
    read_object,
)
from rolegate_proxy.wire.pod_memory import MAX_MACHINES, MemoryFormatError, decode, encode

from .test_beliefs import AGG, HOUR, MODEL, ledger, seen
from .test_pod_memory import learned

SLOW = MachineKey(AGG, MODEL, "slow")
SHEET = (("fast", 2.0, 50.0), ("slow", 2.0, 50.0))


def pod(name: str, failures: int, *, wall: float = 1000.0) -> PodMemory:
    """The memory of a pod that saw `slow` fail `failures` times, slowly."""
    book, scores = ledger(*SHEET), Scoreboard()
    for i in range(failures):
        book.file(seen("slow", 90.0 + i * 0.1, ttft=8.0))
        scores.observe(SLOW, ObservationKind.EMPTY_SUCCESS, 90.0 + i * 0.1)
    return remember(name, book, scores, 100.0, wall)


def test_three_pods_count_as_one_memory_and_none_counts_itself_twice() -> None:
    a, b, c = pod("a", 10), pod("b", 10), pod("c", 10)
    book, scores = ledger(*SHEET), Scoreboard()
    for i in range(10):  # pod a's own ten, as its ledger and scoreboard hold them
        book.file(seen("slow", 90.0 + i * 0.1, ttft=8.0))
        scores.observe(SLOW, ObservationKind.EMPTY_SUCCESS, 90.0 + i * 0.1)
    hear_fleet([a, b, c], "a", book, scores, 100.0, 1000.0)
    view = scores.operational(SLOW)
    assert view.n == 30  # its own ten and its two peers' twenty: a's own not again
    assert view.observed == pytest.approx(0.0)
    assert view.confidence == pytest.approx(30 / 50)
    # What it shares is still its own ten only.
    mine = remember("a", book, scores, 100.0, 1000.0)
    assert [evidence.n for _, evidence in mine.scores] == [10]
    belief = book.belief_of(SLOW, 100.0)
    alone = ledger(*SHEET)
    for i in range(10):
        alone.file(seen("slow", 90.0 + i * 0.1, ttft=8.0))
    lonely = alone.belief_of(SLOW, 100.0)
    assert belief is not None
    assert lonely is not None
    assert belief.ttft is not None
    assert lonely.ttft is not None
    assert belief.ttft.weight > lonely.ttft.weight


def test_an_old_report_counts_for_less_and_silence_forgets_it() -> None:
    book, scores = ledger(*SHEET), Scoreboard()
    fresh, stale = pod("b", 10, wall=1000.0), pod("c", 10, wall=1000.0 - HOUR)
    hear_fleet([fresh, stale], "a", book, scores, 100.0, 1000.0)
    assert scores.operational(SLOW).n == 10 + round(10 * 0.25)  # an hour: two half-lives
    hear_fleet([], "a", book, scores, 100.0, 1000.0)
    assert scores.operational(SLOW).n == 0
    assert book.belief_of(SLOW, 100.0) == ledger(*SHEET).belief_of(SLOW, 100.0)


def test_a_machine_only_a_peer_has_scored_is_scored_here_too() -> None:
    scores = Scoreboard()
    hear_fleet([pod("b", 60)], "a", ledger(*SHEET), scores, 100.0, 1000.0)
    view = scores.operational(SLOW)
    assert (view.n, view.confidence) == (60, 1.0)
    assert view.score == pytest.approx(0.0)
    # Its own observations then add to the fleet's.
    scores.observe(SLOW, ObservationKind.OK, 101.0)
    assert scores.operational(SLOW).n == 61


# The ProxyMemory object ---------------------------------------------------------------


def test_a_pods_memory_object_is_named_after_it_and_holds_the_wire_format() -> None:
    memory = learned(1000)
    obj = memory_object(memory, "rolegate")
    assert obj["metadata"] == {
        "name": "memory-rolegate-proxy-7d9f5c6b8-x2k4q",
        "namespace": "rolegate",
        "labels": {"app.kubernetes.io/component": "proxy-memory"},
    }
    spec = obj["spec"]
    assert (spec["pod"], spec["machines"]) == ("rolegate-proxy-7d9f5c6b8-x2k4q", 1000)
    assert spec["writtenAt"] == "2025-12-03T12:00:00.123000Z"
    # One wire format for the file and the cluster.
    assert spec["memory"] == encode(memory).decode()
    assert read_object(obj) == decode(encode(memory))
    # 1,000 machines: about 128 bytes each, a tenth of what etcd stores in one object.
    print(f"\n1,000 machines: {len(spec['memory'])} bytes in spec.memory")
    assert len(spec["memory"]) < 1000 * 140


def test_a_pod_name_that_makes_no_object_name_is_folded_into_one() -> None:
    assert memory_name("rolegate-proxy-7d9f5c6b8-x2k4q") == "memory-rolegate-proxy-7d9f5c6b8-x2k4q"
    assert memory_name("proxy.zone-a") == "memory-proxy.zone-a"
    names = [memory_name(pod) for pod in ("My_Laptop", "my-laptop", "x" * 253, "x" * 252 + "y")]
    assert len(set(names)) == len(names)
    for name in names:
        assert len(name) <= 253
        assert re.fullmatch(DNS_SUBDOMAIN_PATTERN, name), name
    assert names[0].startswith("memory-my-laptop-")


def test_an_object_that_holds_no_memory_is_refused_without_being_quoted() -> None:
    with pytest.raises(MemoryFormatError, match="not JSON") as refused:
        read_object({"spec": {"pod": "p", "memory": "sk-planted {"}})
    assert "sk-planted" not in str(refused.value)
    with pytest.raises(MemoryFormatError, match=r"spec\.memory"):
        read_object({"spec": {"pod": "p"}})
    # A memory filed under another pod's name is not that pod's.
    other = encode(PodMemory("proxy-b", 1.0)).decode()
    with pytest.raises(MemoryFormatError, match=r"spec\.pod"):
        read_object({"spec": {"pod": "proxy-a", "memory": other}})


def test_a_memory_longer_than_the_kind_holds_is_not_published() -> None:
    name = "n" * 250
    items = tuple(
        MachineEvidence(MachineKey(name, name, f"{i:04d}{name[4:]}"), Evidence(1, 1, 1), None, 1)
        for i in range(MAX_MACHINES)
    )
    with pytest.raises(NotPublishable, match=str(MAX_MEMORY_CHARS)):
        memory_object(PodMemory("p", 1.0, items), "ns")
