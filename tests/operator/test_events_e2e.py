"""Events on the real API server: the recorder through `Kube` (aggregated into one Event
whose count is every occurrence), and `rolegate operator` posting `Compiled` on an edit."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from rolegate_operator.conditions import EventNote
from rolegate_operator.kube import Kube, load_configuration
from rolegate_operator.recorder import EventRecorder
from rolegate_operator.store import ResourceKey

from ..waiting import wait_for
from .builders import role
from .conftest import Cluster, StartOperator
from .test_operator_e2e import ROUTER, TABLE_A, expected_config, observed, with_spec

NOTE = EventNote("Warning", "EmptyResponses", "Tripped machine m1 of qwen: EmptyResponses.")


def timestamp(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def test_repeated_notes_become_one_event_whose_count_is_every_occurrence(
    cluster: Cluster,
) -> None:
    cluster.apply(ROUTER)
    uid = cluster.get("pp", "router")["metadata"]["uid"]
    key = ResourceKey("ProviderPolicy", cluster.namespace, "router")
    kube = Kube(load_configuration(str(cluster.plane.kubeconfig)))
    recorder = EventRecorder(kube)
    start = datetime.now(UTC).replace(microsecond=0)
    try:
        # Six occurrences in ten seconds: the first is written, the others held.
        written = [recorder.record(key, uid, NOTE, start + timedelta(seconds=s)) for s in range(6)]
        assert written == [1, 0, 0, 0, 0, 0]
        (event,) = cluster.events("router")
        assert event["count"] == 1
        # The flush after the minute patches the same Event with every occurrence.
        assert recorder.flush(start + timedelta(seconds=30)) == 0
        assert recorder.flush(start + timedelta(seconds=60)) == 1
        (after,) = cluster.events("router")
        assert after["metadata"]["name"] == event["metadata"]["name"]
        assert after["count"] == 6
        assert after["firstTimestamp"] == timestamp(start)
        assert after["lastTimestamp"] == timestamp(start + timedelta(seconds=5))
        assert (after["type"], after["reason"], after["message"]) == (
            NOTE.type,
            NOTE.reason,
            NOTE.message,
        )
        assert after["involvedObject"]["uid"] == uid
        assert after["involvedObject"]["kind"] == "ProviderPolicy"
        assert after["source"]["component"] == "rolegate-operator"

        # Deleted by hand: the next write creates a new Event, carrying the count.
        cluster.delete("event", event["metadata"]["name"])
        wait_for(lambda: not cluster.events("router"), "the Event deleted")
        assert recorder.record(key, uid, NOTE, start + timedelta(seconds=121)) == 1
        (again,) = cluster.events("router")
        assert again["metadata"]["name"] != event["metadata"]["name"]
        assert again["count"] == 7
    finally:
        kube.close()


def compiled(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    return [e for e in cluster.events(name) if (e["type"], e["reason"]) == ("Normal", "Compiled")]


def test_a_successful_edit_posts_a_compiled_event_naming_the_generation_and_hash(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    cluster.apply(ROUTER)
    cluster.apply(TABLE_A)
    operator = start_operator()
    first = expected_config(cluster, ROUTER, TABLE_A)
    wait_for(lambda: observed(cluster, "rt", "roles-a", "True", 1), "roles-a accepted")
    first_message = f"Generation 1 compiled; served in configuration {first.hash}."
    (created,) = wait_for(lambda: compiled(cluster, "roles-a"), "roles-a's first Compiled")
    assert created["message"] == first_message

    edited = with_spec(TABLE_A, roles=[role("agent", patienceSeconds=45)])
    cluster.apply(edited)
    second = expected_config(cluster, ROUTER, edited)
    assert second.hash != first.hash
    message = f"Generation 2 compiled; served in configuration {second.hash}."
    wait_for(
        lambda: [e for e in compiled(cluster, "roles-a") if e["message"] == message],
        "the Compiled event of generation 2",
        alive=[operator],
    )
    table = cluster.get("rt", "roles-a")
    events = cluster.events("roles-a")
    assert sorted((e["type"], e["reason"], e["count"]) for e in events) == [
        ("Normal", "Compiled", 1),
        ("Normal", "Compiled", 1),
    ]
    assert {e["involvedObject"]["uid"] for e in events} == {table["metadata"]["uid"]}
    # The policy was recompiled with it but did not change: its only Event is its own
    # first generation's.
    (policy_event,) = cluster.events("router")
    assert policy_event["message"] == first_message
    assert "event created resource=RoleTable" in operator.log()
