"""The ProxyMemory object that carries one pod's memory through the API server
(edge/fleet_memory.py): its name, its size, and what is refused when read. (What a pod
does with its peers' memories: test_fleet_memory.py.)"""

from __future__ import annotations

import re

import pytest

from rolegate_policy.model import DNS_SUBDOMAIN_PATTERN, MAX_MEMORY_CHARS
from rolegate_proxy.core.beliefs import Evidence, MachineEvidence, MachineKey
from rolegate_proxy.core.fleet import PodMemory
from rolegate_proxy.edge.fleet_memory import (
    NotPublishable,
    memory_name,
    memory_object,
    read_object,
)
from rolegate_proxy.wire.pod_memory import MAX_MACHINES, MemoryFormatError, decode, encode

from .test_pod_memory import learned

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


def test_an_object_holding_a_value_no_pod_could_learn_is_refused_naming_the_field() -> None:
    """A log-sum of 1e5 is a finite number but no time to first token (SPEC E8): the memory
    is refused whole, the reason names the field and never the value."""
    poisoned = (
        '{"format":1,"pod":"p","writtenAt":1,"machines":'
        '[["agg","m","m1",1,[1,100000,10000000000],null,null]]}'
    )
    with pytest.raises(MemoryFormatError, match=r"^machines\[0\]: ttft is out of range") as refused:
        read_object({"spec": {"pod": "p", "memory": poisoned}})
    assert "100000" not in str(refused.value)
    # Read at a given moment: from further ahead than the clocks' skew is the future.
    ahead = encode(PodMemory("p", 2000.0)).decode()
    with pytest.raises(MemoryFormatError, match="writtenAt is in the future"):
        read_object({"spec": {"pod": "p", "memory": ahead}}, now=1000.0)
    assert read_object({"spec": {"pod": "p", "memory": ahead}}, now=1950.0).written_at == 2000.0
