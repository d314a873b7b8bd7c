"""Expiring proxy reports safely: a report is removed only while it is still the stale one
that was judged expired, and silence while the operator could not hear counts for nothing.
Against the real API server, with the operator's own `Kube` and `ReportsLoop`."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from kubernetes import client

from rolegate_operator.kube import Kube, load_configuration
from rolegate_operator.leader import Leadership
from rolegate_operator.recorder import EventRecorder
from rolegate_operator.reports_loop import ReportsLoop
from rolegate_operator.store import ResourceKey, Store
from tests.policy.builders import provider

from .conftest import Cluster

KEY_NAME = "router"


def stamp(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def report(cluster: Cluster, pod: str, at: datetime, *, tripped: bool = True) -> None:
    """What a proxy pod writes: its own entry, as its own field manager."""
    breakers = (
        [{"scope": "Model", "model": "qwen/qwen3-coder", "state": "Open"}
         | {"reason": "EmptyResponses", "since": stamp(at)}]
        if tripped
        else []
    )  # fmt: skip
    body = {
        "apiVersion": "rolegate.dev/v1alpha1",
        "kind": "ProviderPolicy",
        "metadata": {"name": KEY_NAME, "namespace": cluster.namespace},
        "status": {"reports": [{"pod": pod, "observedAt": stamp(at), "breakers": breakers}]},
    }
    configuration = load_configuration(str(cluster.plane.kubeconfig))
    with client.ApiClient(configuration) as api:
        client.CustomObjectsApi(api).patch_namespaced_custom_object_status(
            "rolegate.dev", "v1alpha1", cluster.namespace, "providerpolicies", KEY_NAME, body,
            field_manager=f"rolegate-proxy/{pod}", force=True,
            _content_type="application/apply-patch+yaml",
        )  # fmt: skip


def reports_of(obj: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list((obj.get("status") or {}).get("reports") or [])


def pods(cluster: Cluster) -> list[str]:
    return [r["pod"] for r in reports_of(cluster.get("pp", KEY_NAME))]


def test_a_report_refreshed_since_the_judgement_is_not_removed(cluster: Cluster) -> None:
    cluster.apply(provider(KEY_NAME, namespace=None))
    key = ResourceKey("ProviderPolicy", cluster.namespace, KEY_NAME)
    kube = Kube(load_configuration(str(cluster.plane.kubeconfig)))
    long_ago = datetime.now(UTC) - timedelta(minutes=10)
    report(cluster, "proxy-a", long_ago)
    report(cluster, "proxy-b", long_ago)
    stale = reports_of(cluster.get("pp", KEY_NAME))

    # proxy-a reports again (the API server is back): the stale copy no longer holds.
    report(cluster, "proxy-a", datetime.now(UTC))
    assert kube.remove_reports(key, stale, ["proxy-a", "proxy-b"]) is None
    assert pods(cluster) == ["proxy-a", "proxy-b"]

    # Judged on the current copy, only the really silent pod goes.
    current = reports_of(cluster.get("pp", KEY_NAME))
    written = kube.remove_reports(key, current, ["proxy-b"])
    assert written is not None
    assert [r["pod"] for r in reports_of(written)] == ["proxy-a"]
    assert pods(cluster) == ["proxy-a"]


def tripped_condition(cluster: Cluster) -> dict[str, Any]:
    for condition in (cluster.get("pp", KEY_NAME).get("status") or {}).get("conditions") or []:
        if condition["type"] == "Tripped":
            return dict(condition)
    return {}


def test_after_an_outage_every_pod_has_a_full_ttl_to_report_again(cluster: Cluster) -> None:
    cluster.apply(provider(KEY_NAME, namespace=None))
    kube = Kube(load_configuration(str(cluster.plane.kubeconfig)))
    clock = [datetime.now(UTC)]
    store = Store()
    loop = ReportsLoop(
        store, kube, events=EventRecorder(kube), now=lambda: clock[0], ttl_seconds=90
    )

    def refresh_store() -> None:
        store.observe("MODIFIED", cluster.get("pp", KEY_NAME))

    report(cluster, "proxy-a", clock[0])
    refresh_store()
    loop.run_pass()
    assert tripped_condition(cluster)["status"] == "True"

    # The API server goes away for longer than the TTL: the pass that tries to expire the
    # report fails (no connection), and the operator knows it could not hear anyone.
    cluster.plane.stop_apiserver()
    try:
        clock[0] += timedelta(seconds=300)
        try:
            loop.run_pass()
        except Exception as error:  # what `ReportsLoop.run` does with a failed pass
            loop.lost(error)
    finally:
        cluster.plane.start_apiserver()

    # Back: the pod has not re-reported yet, and the store still holds the old copy. Its
    # report is not expired (its silence during the outage does not count) and Tripped
    # stays True.
    clock[0] += timedelta(seconds=1)
    loop.run_pass()
    assert pods(cluster) == ["proxy-a"]
    assert tripped_condition(cluster)["status"] == "True"

    # A pod that stays silent for a full TTL after the outage does expire.
    clock[0] += timedelta(seconds=91)
    loop.run_pass()
    assert pods(cluster) == []
    assert tripped_condition(cluster)["status"] == "False"


def test_a_new_leader_gives_every_pod_a_full_ttl_before_expiring_it(cluster: Cluster) -> None:
    """A replica that takes over (after a failover, or after losing the Lease during an
    outage) cannot know whether the pods' reports reached the server meanwhile."""
    cluster.apply(provider(KEY_NAME, namespace=None))
    kube = Kube(load_configuration(str(cluster.plane.kubeconfig)))
    clock = [datetime.now(UTC)]
    store = Store()
    leadership = Leadership(leading=False)
    loop = ReportsLoop(
        store,
        kube,
        events=EventRecorder(kube),
        now=lambda: clock[0],
        ttl_seconds=90,
        leadership=leadership,
    )
    leadership.on_gain.append(loop.resync)
    report(cluster, "proxy-a", clock[0])
    store.observe("MODIFIED", cluster.get("pp", KEY_NAME))

    # As a standby it watches the report age past the TTL, writing nothing.
    clock[0] += timedelta(seconds=300)
    assert loop.run_pass() == 0
    leadership.set(True)
    loop.run_pass()
    assert pods(cluster) == ["proxy-a"]

    clock[0] += timedelta(seconds=91)
    loop.run_pass()
    assert pods(cluster) == []
