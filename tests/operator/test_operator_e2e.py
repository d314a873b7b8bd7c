"""`rolegate operator` against a real kube-apiserver: what a user sees with kubectl.

Each test runs the operator as a subprocess watching a fresh namespace, applies
resources with kubectl and polls (bounded) for the ConfigMap, statuses and Events.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from functools import partial
from typing import Any

import httpx
import yaml
from kubernetes import client, config

from rolegate_cli.controlplane import free_port
from rolegate_policy.compile import compile_manifests
from rolegate_policy.config import (
    ProxyConfig,
)
from rolegate_policy.manifests import manifest_from_object
from tests.policy.builders import provider, role, role_table

from ..waiting import wait_for
from .conftest import Cluster, StartOperator

CONFIGMAP = "rolegate-config"
ROUTER = provider(
    "router",
    namespace=None,
    models={"qwen/qwen3-coder": ["fastco"], "qwen/qwen3-small": ["tinyco"]},
)
TABLE_A = role_table(
    "roles-a",
    role("agent"),
    role(
        "reflex",
        models=["qwen/qwen3-small"],
        visibility="Unwatched",
        patienceSeconds=4,
        ruling="Auto",
    ),
    namespace=None,
)
TABLE_B = role_table("roles-b", role("batch", patienceSeconds=120), namespace=None)


def expected_config(cluster: Cluster, *objects: dict[str, Any]) -> ProxyConfig:
    """What `compile_manifests` makes of exactly these objects (as the user wrote them),
    in the test's namespace."""
    manifests = [
        manifest_from_object(
            {**obj, "metadata": {**obj["metadata"], "namespace": cluster.namespace}}, "test"
        )
        for obj in objects
    ]
    return compile_manifests(manifests).config


def with_spec(obj: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {**obj, "spec": {**obj["spec"], **spec}}


def accepted_condition(obj: dict[str, Any]) -> dict[str, Any] | None:
    for condition in obj.get("status", {}).get("conditions", []):
        if condition["type"] == "Accepted":
            found: dict[str, Any] = condition
            return found
    return None


def observed(cluster: Cluster, resource: str, name: str, status: str, generation: int) -> Any:
    """The object once its Accepted condition has `status` for `generation`, else None."""
    obj = cluster.get(resource, name)
    condition = accepted_condition(obj)
    if (
        condition is not None
        and condition["status"] == status
        and condition["observedGeneration"] == generation
        and obj["status"].get("observedGeneration") == generation
        and obj["metadata"]["generation"] == generation
    ):
        return obj
    return None


def find_condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    for condition in obj.get("status", {}).get("conditions", []):
        if condition["type"] == type_:
            found: dict[str, Any] = condition
            return found
    return None


def programmed_too(cluster: Cluster, resource: str, name: str) -> Any:
    """The object once accepted at generation 1 and its `Programmed` condition written (no
    proxy reports here: Unknown)."""
    obj = observed(cluster, resource, name, "True", 1)
    return obj if obj is not None and find_condition(obj, "Programmed") else None


def configmap_with(cluster: Cluster, config_hash: str) -> dict[str, Any] | None:
    found = cluster.find("configmap", CONFIGMAP)
    annotations = found["metadata"].get("annotations", {}) if found else {}
    return found if annotations.get("rolegate.dev/config-hash") == config_hash else None


def resource_version(cluster: Cluster, resource: str, name: str) -> str:
    version: str = cluster.get(resource, name)["metadata"]["resourceVersion"]
    return version


def liveness(port: int) -> dict[str, Any] | None:
    try:
        response = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
    except httpx.TransportError:
        return None
    if response.status_code != 200:
        return None
    found: dict[str, Any] = response.json()
    return found


def operator_managed_fields(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in obj["metadata"]["managedFields"] if e["manager"] == "rolegate-operator"]


def test_resources_compile_into_the_configmap_and_are_accepted(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    for obj in (ROUTER, TABLE_A, TABLE_B):
        cluster.apply(obj)
    operator = start_operator()
    expected = expected_config(cluster, ROUTER, TABLE_A, TABLE_B)

    configmap = wait_for(
        lambda: configmap_with(cluster, expected.hash), "the compiled ConfigMap", alive=[operator]
    )
    assert configmap["data"] == {"config.json": expected.to_canonical_json()}
    assert ProxyConfig.from_json(configmap["data"]["config.json"]) == expected
    assert configmap["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "rolegate-operator"

    for resource, name in (("pp", "router"), ("rt", "roles-a"), ("rt", "roles-b")):
        obj = wait_for(
            partial(observed, cluster, resource, name, "True", 1),
            f"{resource}/{name} Accepted=True",
            alive=[operator],
        )
        condition = accepted_condition(obj)
        assert condition is not None
        assert condition["reason"] == "Accepted"
        assert condition["message"].startswith("Accepted: ")
        # kopf left no trace on the users' objects: no progress annotations, no finalizers.
        assert not obj["metadata"].get("finalizers")
        assert not [a for a in obj["metadata"].get("annotations", {}) if "kopf" in a]

    # `kubectl get rt -o yaml` shows what Auto resolved to.
    shown = yaml.safe_load(
        cluster.plane.kubectl("-n", cluster.namespace, "get", "rt", "roles-a", "-o", "yaml").stdout
    )
    assert shown["status"]["roleCount"] == 2
    assert [
        (r["role"], r["declared"], r["effective"]) for r in shown["status"]["effectiveRulings"]
    ] == [("agent", "Auto", "Order"), ("reflex", "Auto", "Only")]
    assert [
        (r["declaredDelivery"], r["delivery"]) for r in shown["status"]["effectiveRulings"]
    ] == [
        ("Auto", "Live"),
        ("Auto", "Buffered"),
    ]
    assert shown["status"]["rulings"] == "agent Order/Live, reflex Only/Buffered"
    reflex_reason = shown["status"]["effectiveRulings"][1]["reason"]
    assert "Unwatched and patience 4s is under the 10s threshold" in reflex_reason
    # And `kubectl get` prints the columns from it.
    table = cluster.plane.kubectl("-n", cluster.namespace, "get", "rt", "roles-a").stdout
    assert table.split("\n")[1].split()[:5] == ["roles-a", "2", "agent", "Order/Live,", "reflex"]
    assert "True" in table.split("\n")[1].split()


def test_an_invalid_edit_is_reported_and_the_last_good_configuration_stays(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    for obj in (ROUTER, TABLE_A, TABLE_B):
        cluster.apply(obj)
    operator = start_operator()
    good = expected_config(cluster, ROUTER, TABLE_A, TABLE_B)
    configmap = wait_for(lambda: configmap_with(cluster, good.hash), "the first ConfigMap")
    untouched = {
        name: wait_for(
            partial(programmed_too, cluster, resource, name),
            f"{name} accepted and its Programmed condition written",
            alive=[operator],
        )
        for resource, name in (("pp", "router"), ("rt", "roles-b"))
    }
    wait_for(lambda: observed(cluster, "rt", "roles-a", "True", 1), "roles-a accepted")

    # A typo in a model name: the API server accepts it, compile cannot serve it.
    broken = role_table(
        "roles-a", role("agent", models=["qwen/qwen3-codr"]), role("reflex"), namespace=None
    )
    cluster.apply(broken)
    rejected = wait_for(
        lambda: observed(cluster, "rt", "roles-a", "False", 2),
        "roles-a Accepted=False at generation 2",
        alive=[operator],
    )
    condition = accepted_condition(rejected)
    assert condition is not None
    assert condition["reason"] == "NoServedModel"
    assert condition["message"].startswith("spec.roles[0].models: role agent: none of its models")
    assert "Generation 1, the last accepted, is still served" in condition["message"]
    warnings = wait_for(
        lambda: [e for e in cluster.events("roles-a") if e["type"] == "Warning"],
        "a Warning Event about roles-a",
    )
    assert [(e["reason"], e["involvedObject"]["kind"]) for e in warnings] == [
        ("NoServedModel", "RoleTable")
    ]
    assert "spec.roles[0].models" in warnings[0]["message"]
    # The configuration still holds generation 1 of roles-a and everything else: the same
    # hash, so the ConfigMap was not even rewritten.
    configmap_version = configmap["metadata"]["resourceVersion"]
    now = cluster.get("configmap", CONFIGMAP)
    assert now["metadata"]["resourceVersion"] == configmap_version
    assert now["data"]["config.json"] == good.to_canonical_json()

    # A spec change that compiles to the same configuration (no Auto role is Unwatched in
    # roles-b, so the threshold changes nothing): new status, same ConfigMap.
    cluster.apply(with_spec(TABLE_B, autoOnlyBelowSeconds=20))
    wait_for(lambda: observed(cluster, "rt", "roles-b", "True", 2), "roles-b generation 2")
    assert resource_version(cluster, "configmap", CONFIGMAP) == configmap_version

    fixed = with_spec(TABLE_A, roles=[role("agent", patienceSeconds=45)])
    cluster.apply(fixed)
    recovered = expected_config(cluster, ROUTER, fixed, with_spec(TABLE_B, autoOnlyBelowSeconds=20))
    wait_for(
        lambda: observed(cluster, "rt", "roles-a", "True", 3),
        "roles-a Accepted=True at generation 3",
        alive=[operator],
    )
    wait_for(lambda: configmap_with(cluster, recovered.hash), "the recovered ConfigMap")
    # One Warning for the one rejection, one Normal for the recovery, one Normal for the
    # first generation compiled; none repeated.
    wait_for(
        lambda: any(e["reason"] == "Accepted" for e in cluster.events("roles-a")),
        "the recovery Event",
    )
    assert sorted((e["type"], e["reason"], e["count"]) for e in cluster.events("roles-a")) == [
        ("Normal", "Accepted", 1),
        ("Normal", "Compiled", 1),
        ("Warning", "NoServedModel", 1),
    ]

    # Recompiles caused by the others never rewrote the untouched resources: not the
    # ProviderPolicy at all, roles-b only for its own generation 2.
    router = cluster.get("pp", "router")
    before = untouched["router"]["metadata"]
    assert router["metadata"]["resourceVersion"] == before["resourceVersion"]
    assert router["metadata"]["managedFields"] == before["managedFields"]
    log = operator.log()
    assert log.count(f"status written resource=ProviderPolicy {cluster.namespace}/router") == 1
    assert log.count(f"status written resource=RoleTable {cluster.namespace}/roles-b") == 2
    assert log.count(f"status written resource=RoleTable {cluster.namespace}/roles-a") == 3


def test_proxy_owned_status_survives_the_operators_writes(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    cluster.apply(ROUTER)
    operator = start_operator()
    wait_for(lambda: observed(cluster, "pp", "router", "True", 1), "router accepted")

    # A proxy pod writes its own part of the status (its report), as its own field manager.
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    breaker = {"scope": "Model", "model": "qwen/qwen3-coder", "state": "Open"}
    breaker |= {"reason": "EmptyResponses", "since": now}
    configuration = client.Configuration()
    config.load_kube_config(  # type: ignore[no-untyped-call]
        config_file=str(cluster.plane.kubeconfig), client_configuration=configuration
    )
    with client.ApiClient(configuration) as api:
        client.CustomObjectsApi(api).patch_namespaced_custom_object_status(
            "rolegate.dev", "v1alpha1", cluster.namespace, "providerpolicies", "router",
            {
                "apiVersion": "rolegate.dev/v1alpha1",
                "kind": "ProviderPolicy",
                "metadata": {"name": "router", "namespace": cluster.namespace},
                "status": {
                    "reports": [{"pod": "proxy-0", "observedAt": now, "breakers": [breaker]}]
                },
            },
            field_manager="rolegate-proxy/proxy-0", force=True,
            _content_type="application/apply-patch+yaml",
        )  # fmt: skip

    # A spec edit makes the operator write Accepted again; the report makes it write Tripped.
    cluster.apply(with_spec(ROUTER, timeouts={"connectSeconds": 2}))

    def settled() -> dict[str, Any] | None:
        obj: dict[str, Any] | None = observed(cluster, "pp", "router", "True", 2)
        if obj is None or obj["status"].get("tripped") != "qwen/qwen3-coder":
            return None
        return obj

    after = wait_for(settled, "router generation 2, tripped", alive=[operator])
    status = after["status"]
    types = [c["type"] for c in status["conditions"]]
    assert types == ["Accepted", "Tripped", "ResolvedRefs", "Programmed"]
    assert status["conditions"][1]["reason"] == "EmptyResponses"
    assert "on 1 of 1 pods" in status["conditions"][1]["message"]
    assert [r["pod"] for r in status["reports"]] == ["proxy-0"]
    # The compile loop owns exactly its fields; the proxy still owns its report.
    (mine,) = operator_managed_fields(after)
    owned = mine["fieldsV1"]["f:status"]
    assert set(owned) == {"f:conditions", "f:observedGeneration"}
    assert list(owned["f:conditions"]) == ['k:{"type":"Accepted"}']
    managers = {e["manager"] for e in after["metadata"]["managedFields"]}
    assert {"rolegate-proxy/proxy-0", "rolegate-operator/tripped"} <= managers


def test_deleting_a_resource_drops_it_and_a_restart_rewrites_nothing(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    for obj in (ROUTER, TABLE_A, TABLE_B):
        cluster.apply(obj)
    operator = start_operator()
    wait_for(
        lambda: configmap_with(cluster, expected_config(cluster, ROUTER, TABLE_A, TABLE_B).hash),
        "the first ConfigMap",
        alive=[operator],
    )
    cluster.delete("rt", "roles-b")
    smaller = expected_config(cluster, ROUTER, TABLE_A)
    configmap = wait_for(lambda: configmap_with(cluster, smaller.hash), "roles-b gone")
    assert json.loads(configmap["data"]["config.json"])["roles"][0]["name"] == "agent"
    objects = {
        name: wait_for(partial(observed, cluster, resource, name, "True", 1), f"{name} accepted")
        for resource, name in (("pp", "router"), ("rt", "roles-a"))
    }
    assert operator.stop() == 0
    assert "Traceback" not in operator.log()

    # A restart lists everything again before compiling: no partial configuration, no
    # status flapping, nothing rewritten.
    port = free_port()
    restarted = start_operator("--namespace", cluster.namespace, "--liveness-port", str(port))
    wait_for(lambda: "pass done" in restarted.log(), "the first pass after the restart")
    health = wait_for(partial(liveness, port), "the liveness endpoint", alive=[restarted])
    assert health["rolegate-config-hash"] == smaller.hash
    assert "initial sync done resources=2" in restarted.log()
    assert "configmap=unchanged statuses_written=0" in restarted.log()
    for name, before in objects.items():
        resource = "pp" if name == "router" else "rt"
        version = before["metadata"]["resourceVersion"]
        assert resource_version(cluster, resource, name) == version, name
    version = configmap["metadata"]["resourceVersion"]
    assert resource_version(cluster, "configmap", CONFIGMAP) == version
    assert "status written" not in restarted.log()


def test_status_writes_resume_after_an_api_server_outage(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    """SPEC D6: the operator outlives an API server outage and catches up after it."""
    cluster.apply(ROUTER)
    cluster.apply(TABLE_A)
    operator = start_operator()
    wait_for(lambda: observed(cluster, "rt", "roles-a", "True", 1), "accepted", alive=[operator])
    # Killed, not stopped: a crash is the harsher outage (the other outage tests stop it).
    apiserver = cluster.plane.apiserver
    assert apiserver is not None
    apiserver.kill()
    apiserver.wait()
    try:
        # While it is down the operator stays up (its watch fails and retries).
        wait_for(
            lambda: "Watcher for" in operator.log() or "failed" in operator.log(),
            "the operator noticing the outage",
            alive=[operator],
        )
    finally:
        cluster.plane.start_apiserver()
    cluster.apply(with_spec(TABLE_A, roles=[role("agent", patienceSeconds=50)]))
    wait_for(
        lambda: observed(cluster, "rt", "roles-a", "True", 2),
        "generation 2 accepted after the outage",
        within=45,
        alive=[operator],
    )
