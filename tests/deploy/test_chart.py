"""The Helm chart (`deploy/helm/rolegate`) with the real `helm` and the real API server:
it lints, its renders are accepted by the API server, an install creates every object it
renders, its CRDs are deploy/crds/'s, its values schema refuses typos, and the rendered
manifests keep the security, secrets and RBAC invariants docs/helm.md promises.

Which account may do what, proven by the API server's authorizer, is
test_chart_rbac.py's; here the RBAC rules are compared as data.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from itertools import chain
from pathlib import Path
from typing import Any

import pytest
import yaml

from rolegate_cli.controlplane import REPO_ROOT, ControlPlane, installed_binaries, scratch_dir
from rolegate_cli.main import _parser
from rolegate_proxy.edge.tracing import from_environment

from .conftest import (
    CHART,
    CI_VALUES,
    KUBE_VERSION,
    SECRETS_DIR,
    ensure_namespaces,
    find,
    fullname,
    helm,
    install,
    render,
    render_text,
    watched_namespaces,
)

RELEASE = "demo"  # fullname "demo-rolegate"
NS = "apps"
HA = CHART / "ci" / "ha-values.yaml"
MULTI = CHART / "ci" / "multi-namespace-values.yaml"
STANDARD_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/component",
    "app.kubernetes.io/part-of",
    "app.kubernetes.io/managed-by",
    "helm.sh/chart",
)
SELECTOR_LABELS = {
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
}
# The volume types the restricted Pod Security profile allows.
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
    "projected", "secret",
}  # fmt: skip

Docs = list[dict[str, Any]]


def ci_id(path: Path) -> str:
    return path.name.removesuffix("-values.yaml")


@pytest.fixture(scope="module")
def renders() -> dict[str, Docs]:
    """Every ci values file rendered once, as release `demo` in namespace `apps`."""
    return {ci_id(path): render(RELEASE, NS, [path]) for path in CI_VALUES}


def deployment(docs: Docs, component: str) -> dict[str, Any]:
    return find(docs, "Deployment", f"{fullname(RELEASE)}-{component}", NS)


def pod_spec(docs: Docs, component: str) -> dict[str, Any]:
    spec: dict[str, Any] = deployment(docs, component)["spec"]["template"]["spec"]
    return spec


def container(docs: Docs, component: str) -> dict[str, Any]:
    containers: list[dict[str, Any]] = pod_spec(docs, component)["containers"]
    assert len(containers) == 1
    return containers[0]


def rbac_rules(docs: Docs, component: str) -> dict[str, set[str]]:
    """Per namespace, the component's Role rules, each normalized to a sorted string."""
    roles = [
        d
        for d in docs
        if d["kind"] == "Role" and d["metadata"]["name"] == f"{fullname(RELEASE)}-{component}"
    ]
    found: dict[str, set[str]] = {}
    for role in roles:
        rules = {
            json.dumps({key: sorted(value) for key, value in rule.items()}, sort_keys=True)
            for rule in role["rules"]
        }
        assert len(rules) == len(role["rules"]), f"a duplicated rule in {role['metadata']}"
        found[role["metadata"]["namespace"]] = rules
    return found


def rules(*items: dict[str, list[str]]) -> set[str]:
    return {
        json.dumps({key: sorted(value) for key, value in item.items()}, sort_keys=True)
        for item in items
    }


def documented_operator_rules(configmap: str, lease: str) -> list[dict[str, list[str]]]:
    """The Role of docs/operator.md's RBAC section, for a ConfigMap named `configmap` and
    a Lease named `lease` (the documented names are the CLI's defaults)."""
    text = (REPO_ROOT / "docs" / "operator.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, flags=re.DOTALL)
    roles = [doc for doc in map(yaml.safe_load, blocks) if doc.get("kind") == "Role"]
    assert len(roles) == 1, "docs/operator.md should document exactly one Role"
    documented: list[dict[str, list[str]]] = roles[0]["rules"]
    rename = {"rolegate-config": configmap, "rolegate-operator": lease}
    return [
        {key: [rename.get(v, v) for v in value] for key, value in rule.items()}
        for rule in documented
    ]


# 1. Lint ----------------------------------------------------------------------------------


@pytest.mark.parametrize("values", CI_VALUES, ids=ci_id)
def test_lint_strict(values: Path) -> None:
    result = helm(
        "lint", "--strict", "--kube-version", KUBE_VERSION, "--values", str(values), str(CHART)
    )
    assert "0 chart(s) failed" in result.stdout, result.stdout


# 2. The API server accepts every render ---------------------------------------------------


@pytest.mark.parametrize("values", CI_VALUES, ids=ci_id)
def test_renders_are_accepted_by_the_api_server(
    values: Path, chart_cluster: ControlPlane, namespace: str
) -> None:
    """Server-side dry run in a namespace whose Pod Security admission warns at the
    restricted level: the API server's own evaluator judges the pod templates (it warns
    on workloads; enforcement applies to Pods, which never run here)."""
    ensure_namespaces(chart_cluster, watched_namespaces(values))
    restrict(chart_cluster, namespace)
    text = render_text("dry", namespace, [values])
    result = chart_cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=text, check=False)
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stderr, result.stderr
    created = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(created) == len([d for d in yaml.safe_load_all(text) if d]), result.stdout


def restrict(plane: ControlPlane, namespace: str) -> None:
    plane.kubectl(
        "label", "namespace", namespace, "--overwrite",
        "pod-security.kubernetes.io/warn=restricted",
        "pod-security.kubernetes.io/warn-version=v1.34",
    )  # fmt: skip


def test_the_restricted_profile_check_has_teeth(
    renders: dict[str, Docs], chart_cluster: ControlPlane, namespace: str
) -> None:
    """The negative control of the test above: a proxy whose container may escalate is
    warned about, so the absence of warnings there means something."""
    restrict(chart_cluster, namespace)
    proxy = json.loads(json.dumps(deployment(renders["default"], "proxy")))
    proxy["metadata"]["namespace"] = namespace
    proxy["spec"]["template"]["spec"]["containers"][0]["securityContext"].update(
        allowPrivilegeEscalation=True, capabilities={"add": ["NET_ADMIN"]}
    )
    result = chart_cluster.kubectl(
        "apply", "--dry-run=server", "-f", "-", input=json.dumps(proxy), check=False
    )
    assert result.returncode == 0, result.stderr
    assert "would violate PodSecurity" in result.stderr, result.stderr
    assert "allowPrivilegeEscalation" in result.stderr, result.stderr


# 3. An install creates every rendered object ----------------------------------------------


def identity(obj: dict[str, Any]) -> tuple[str, str, str, str]:
    group = obj["apiVersion"].rpartition("/")[0]
    return (group, obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"])


@pytest.mark.parametrize("values", CI_VALUES, ids=ci_id)
def test_install_creates_every_rendered_object(
    values: Path, chart_cluster: ControlPlane, namespace: str
) -> None:
    release = f"it-{uuid.uuid4().hex[:8]}"
    expected = {identity(d) for d in render(release, namespace, [values])}
    result = install(chart_cluster, release, namespace, [values])
    assert "kubectl get rt,pp" in result.stdout, "the NOTES say how to check"

    resources = sorted({f"{kind.lower()}.{group}".rstrip(".") for group, kind, _, _ in expected})
    listed = chart_cluster.kubectl(
        "get", ",".join(resources), "--all-namespaces", "-o", "json",
        "-l", f"app.kubernetes.io/instance={release}",
    )  # fmt: skip
    found = {identity(item) for item in json.loads(listed.stdout)["items"]}
    assert found == expected

    status = json.loads(
        helm("status", release, "-n", namespace, "-o", "json", plane=chart_cluster).stdout
    )
    assert status["info"]["status"] == "deployed"


# 4. The chart's CRDs are deploy/crds/ ------------------------------------------------------


def test_chart_crds_are_byte_identical_to_deploy_crds() -> None:
    source = {p.name: p.read_bytes() for p in (REPO_ROOT / "deploy" / "crds").glob("*.yaml")}
    copy = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert source, "deploy/crds/ has no CRDs"
    stale = sorted(
        name for name in source.keys() | copy.keys() if source.get(name) != copy.get(name)
    )
    assert not stale, (
        f"deploy/helm/rolegate/crds/ differs from deploy/crds/ in {stale}: run `make chart-crds`"
    )


def documented_crd_upgrade() -> tuple[list[str], list[str]]:
    """The two commands of docs/helm.md's "CRDs and upgrades", split into arguments."""
    text = (REPO_ROOT / "docs" / "helm.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, flags=re.DOTALL)
    block = next(b for b in blocks if "kubectl apply --server-side" in b)
    lines = [shlex.split(line, comments=True) for line in block.splitlines()]
    (kubectl,) = [line for line in lines if line[:1] == ["kubectl"]]
    (upgrade,) = [line for line in lines if line[:2] == ["helm", "upgrade"]]
    return kubectl, upgrade


def test_the_documented_crd_upgrade_works(tmp_path: Path) -> None:
    """On an API server of its own (CRDs are cluster-wide, and here Helm must be the one
    that installed them): the first install creates the CRDs; the next release's CRDs,
    with an additive change, go in with the documented `kubectl apply`; `helm upgrade`
    follows."""
    kubectl, upgrade = documented_crd_upgrade()
    assert kubectl[-1] == "deploy/crds/"
    assert upgrade[2:4] == ["rolegate", "deploy/helm/rolegate"]
    newer = tmp_path / "crds"
    newer.mkdir()
    for path in (REPO_ROOT / "deploy" / "crds").glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        spec["properties"]["comment"] = {"type": "string", "maxLength": 64}
        (newer / path.name).write_text(yaml.safe_dump(crd))

    root = scratch_dir()
    plane = ControlPlane(bin_dir=installed_binaries(), root=root).start()
    try:
        plane.kubectl("create", "namespace", "rolegate")
        helm("install", "rolegate", str(CHART), "-n", "rolegate", "--wait=false", plane=plane)
        managers = plane.kubectl(
            "get", "crd", "roletables.rolegate.dev",
            "-o", "jsonpath={.metadata.managedFields[*].manager}",
        ).stdout.split()  # fmt: skip
        assert "helm" in managers, "Helm installed the CRDs from crds/"

        applied = plane.kubectl(*kubectl[1:-1], str(newer), check=False)
        assert applied.returncode == 0, applied.stderr
        stored = json.loads(
            plane.kubectl("get", "crd", "roletables.rolegate.dev", "-o", "json").stdout
        )
        schema = stored["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        assert "comment" in schema["properties"]["spec"]["properties"]

        values = CHART / "ci" / "default-values.yaml"
        swap = {"deploy/helm/rolegate": str(CHART), "my-values.yaml": str(values)}
        helm(*[swap.get(arg, arg) for arg in upgrade[1:]], "--wait=false", plane=plane)
        status = json.loads(
            helm("status", "rolegate", "-n", "rolegate", "-o", "json", plane=plane).stdout
        )
        assert (status["version"], status["info"]["status"]) == (2, "deployed")
    finally:
        plane.stop()
        shutil.rmtree(root, ignore_errors=True)


# 5. The values schema refuses typos and wrong types ----------------------------------------


def template_failing(*args: str) -> subprocess.CompletedProcess[str]:
    """`helm template` expected to fail: its answer, not an exception."""
    return helm("template", "x", str(CHART), "--kube-version", KUBE_VERSION, *args, check=False)


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"proxy": {"replcias": 3}}, "replcias"),
        ({"proxy": {"replica": 3}}, "replica"),
        ({"watchNamespace": ["a"]}, "watchNamespace"),
        ({"proxy": {"metrics": {"serviceMonitor": {"enable": True}}}}, "enable"),
        ({"proxy": {"resources": {"requests": {"cpus": "1"}}}}, "cpus"),
        ({"operator": {"replica": 2}}, "replica"),
        ({"operator": {"leaderElection": {"leaseSecond": 20}}}, "leaseSecond"),
        ({"operator": {"metrics": {"serviceMonitor": {"label": {}}}}}, "label"),
        ({"operator": {"podDisruptionBudget": {"minAvailble": 1}}}, "minAvailble"),
    ],
)
def test_schema_refuses_a_misspelled_key(
    values: dict[str, Any], named: str, tmp_path: Path
) -> None:
    bad = tmp_path / "bad-values.yaml"
    bad.write_text(yaml.safe_dump(values))
    result = template_failing("--values", str(bad))
    assert result.returncode != 0
    assert f"'{named}'" in result.stderr, result.stderr
    assert "additional properties" in result.stderr.lower(), result.stderr


@pytest.mark.parametrize(
    ("assignment", "named", "expected"),
    [
        ("proxy.replicas=two", "replicas", "integer"),
        ("proxy.outcomeExport=yes", "outcomeExport", "boolean"),
        ("operator.logLevel=loud", "logLevel", "debug"),
        ("proxy.shutdownGraceSeconds=-1", "shutdownGraceSeconds", "0"),
    ],
)
def test_schema_refuses_a_wrong_type_or_value(assignment: str, named: str, expected: str) -> None:
    result = template_failing("--set", assignment)
    assert result.returncode != 0
    assert named in result.stderr, result.stderr
    assert expected in result.stderr, result.stderr


def test_schema_closes_every_object_and_describes_every_value() -> None:
    """Every object of values.schema.json refuses unknown keys (free-form string maps such
    as labels excepted), and every key of values.yaml is in the schema and has a comment
    that starts with its dotted name."""
    schema = json.loads((CHART / "values.schema.json").read_text())

    def resolve(node: dict[str, Any]) -> dict[str, Any]:
        if "$ref" in node:
            resolved: dict[str, Any] = schema["definitions"][node["$ref"].rpartition("/")[2]]
            return resolved
        return node

    def walk(node: dict[str, Any], where: str) -> Iterator[str]:
        node = resolve(node)
        if "object" in node.get("type", ()) and where != "global":
            closed = node.get("additionalProperties")
            if closed is not False and closed != {"type": "string"}:
                yield f"{where}: open to unknown keys"
        for key, child in node.get("properties", {}).items():
            path = f"{where}.{key}".lstrip(".")
            if "description" not in child:
                yield f"{path}: no description"
            yield from walk(child, path)
        if isinstance(node.get("items"), dict):
            yield from walk(node["items"], f"{where}[]")
        for child in node.get("anyOf", []):
            yield from walk(child, where)

    assert list(walk(schema, "")) == []

    text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)

    def leaves(node: dict[str, Any], where: str, node_schema: dict[str, Any]) -> Iterator[str]:
        node_schema = resolve(node_schema)
        for key, value in node.items():
            path = f"{where}.{key}".lstrip(".")
            assert key in node_schema.get("properties", {}), f"{path} is not in the schema"
            raw = node_schema["properties"][key]
            child_schema = resolve(raw)
            # A shared definition (resources, maps) is documented where it is used.
            if isinstance(value, dict) and "properties" in child_schema and "$ref" not in raw:
                yield from leaves(value, path, child_schema)
            else:
                yield path

    undocumented = [
        path
        for path in leaves(values, "", schema)
        if not re.search(rf"# {re.escape(path)} --", text)
    ]
    assert undocumented == []


# 6. Invariants of the rendered manifests ---------------------------------------------------


@pytest.mark.parametrize("case", [ci_id(p) for p in CI_VALUES])
def test_every_pod_meets_the_restricted_profile(renders: dict[str, Docs], case: str) -> None:
    for component in ("operator", "proxy"):
        spec = pod_spec(renders[case], component)
        assert spec["securityContext"] == {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "runAsGroup": 10001,
            "fsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        for forbidden in ("hostNetwork", "hostPID", "hostIPC", "initContainers"):
            assert forbidden not in spec, (component, forbidden)
        assert spec["serviceAccountName"] == f"{fullname(RELEASE)}-{component}"
        assert spec["automountServiceAccountToken"] is True
        for volume in spec["volumes"]:
            kinds = set(volume) - {"name"}
            assert kinds <= RESTRICTED_VOLUMES, (component, volume)
        for each in spec["containers"]:
            assert each["securityContext"] == {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "runAsNonRoot": True,
                "capabilities": {"drop": ["ALL"]},
                "seccompProfile": {"type": "RuntimeDefault"},
            }
            assert all("hostPort" not in port for port in each.get("ports", []))
            tmp = [m for m in each["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert len(tmp) == 1
            assert {"name": tmp[0]["name"], "emptyDir": {"sizeLimit": "64Mi"}} in spec["volumes"]


@pytest.mark.parametrize("case", [ci_id(p) for p in CI_VALUES])
def test_no_secret_reaches_an_environment_variable(renders: dict[str, Docs], case: str) -> None:
    for component in ("operator", "proxy"):
        each = container(renders[case], component)
        for entry in each.get("env", []):
            assert "secretKeyRef" not in entry.get("valueFrom", {}), (component, entry)
        for entry in each.get("envFrom", []):
            assert "secretRef" not in entry, (component, entry)
    # The one variable each pod gets from elsewhere: its own name, from the downward API
    # (the proxy's report key, the operator's Lease identity). The rest are the chart's
    # own values (the tracing settings).
    for component in ("operator", "proxy"):
        env = container(renders[case], component)["env"]
        assert env[0] == {
            "name": "POD_NAME",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
        }, component
        assert all(set(entry) == {"name", "value"} for entry in env[1:]), (component, env)


def test_api_key_secrets_are_read_only_file_mounts(renders: dict[str, Docs]) -> None:
    names = yaml.safe_load(HA.read_text())["proxy"]["apiKeySecrets"]
    assert names
    spec = pod_spec(renders["ha"], "proxy")
    mounts = {m["mountPath"]: m for m in container(renders["ha"], "proxy")["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    for name in names:
        mount = mounts[f"{SECRETS_DIR}/{name}"]
        assert mount["readOnly"] is True
        assert "subPath" not in mount, "a subPath mount never sees a rotated key"
        assert volumes[mount["name"]]["secret"] == {"secretName": name, "defaultMode": 0o440}
    secret_volumes = [v for v in spec["volumes"] if "secret" in v]
    assert len(secret_volumes) == len(names) + 1  # and the admin token's
    args = container(renders["ha"], "proxy")["args"]
    assert args[args.index("--secrets-dir") + 1] == SECRETS_DIR
    # The admin token: its own directory (not an API key), one key, read-only.
    token = args[args.index("--admin-token-file") + 1]
    assert token == "/var/run/secrets/rolegate-admin/token"
    admin = mounts["/var/run/secrets/rolegate-admin"]
    assert admin["readOnly"] is True
    assert volumes[admin["name"]]["secret"]["secretName"] == "rolegate-admin"
    assert volumes[admin["name"]]["secret"]["items"] == [{"key": "token", "path": "token"}]
    # Without any, nothing secret is mounted.
    plain = pod_spec(renders["default"], "proxy")
    assert [v for v in plain["volumes"] if "secret" in v] == []


def test_operator_deployment(renders: dict[str, Docs]) -> None:
    """Two replicas by default, rolled one at a time (the Lease admits one writer), each
    told its Lease, the Lease timings, its pod name and where to serve metrics."""
    name = fullname(RELEASE)
    for case, watched in (("default", [NS]), ("multi-namespace", watched_namespaces(MULTI))):
        operator = deployment(renders[case], "operator")
        assert operator["spec"]["replicas"] == 2
        assert operator["spec"]["strategy"] == {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
        }
        each = container(renders[case], "operator")
        assert each["command"] == ["rolegate"]
        namespaces = [arg for ns in watched for arg in ("--namespace", ns)]
        assert each["args"] == [
            "--log-level", "info", "--log-format", "text", "operator", *namespaces,
            "--configmap", f"{name}-config", "--configmap-namespace", NS,
            "--liveness-port", "8081", "--report-ttl-seconds", "90",
            "--leader-election", "--lease-name", f"{name}-operator",
            "--lease-seconds", "15", "--lease-renew-deadline-seconds", "10",
            "--lease-retry-seconds", "2", "--metrics-port", "8082",
        ]  # fmt: skip
        assert each["env"] == [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
        ]
        assert each["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
        assert each["ports"] == [
            {"name": "healthz", "containerPort": 8081, "protocol": "TCP"},
            {"name": "metrics", "containerPort": 8082, "protocol": "TCP"},
        ]
        assert operator["spec"]["template"]["metadata"]["annotations"] == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": "8082",
            "prometheus.io/path": "/metrics",
        }
        # Preferably one replica per node: a node's loss leaves a standby.
        anti = pod_spec(renders[case], "operator")["affinity"]["podAntiAffinity"]
        assert anti == {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {
                            "matchLabels": operator["spec"]["selector"]["matchLabels"]
                        },
                    },
                }
            ]
        }
    # The HA set: three replicas and its own Lease timings (a fraction passes as written).
    args = container(renders["ha"], "operator")["args"]
    assert deployment(renders["ha"], "operator")["spec"]["replicas"] == 3
    timings = ("--lease-seconds", "--lease-renew-deadline-seconds", "--lease-retry-seconds")
    assert [args[args.index(flag) + 1] for flag in timings] == ["8", "6", "1.5"]
    # Switched off, the spreading and the annotations are gone.
    plain = render(
        RELEASE, NS,
        sets=["operator.spreadAcrossNodes=false", "operator.metrics.podAnnotations=false"],
    )  # fmt: skip
    assert "affinity" not in pod_spec(plain, "operator")
    assert "annotations" not in deployment(plain, "operator")["spec"]["template"]["metadata"]


def test_operator_companions(renders: dict[str, Docs]) -> None:
    """The operator's metrics Service always; its ServiceMonitor only when enabled, aimed
    at that Service's `metrics` port; its PodDisruptionBudget only with more than one
    replica."""
    name = f"{fullname(RELEASE)}-operator"
    selector = deployment(renders["default"], "operator")["spec"]["selector"]["matchLabels"]
    for case in ("default", "ha"):
        service = find(renders[case], "Service", name, NS)
        assert service["spec"]["type"] == "ClusterIP"
        assert service["spec"]["selector"] == selector
        assert service["spec"]["ports"] == [
            {"name": "metrics", "port": 8082, "targetPort": "metrics", "protocol": "TCP"}
        ]
    # The ServiceMonitor: not by default, as configured when enabled.
    monitors = [d["metadata"]["name"] for d in renders["default"] if d["kind"] == "ServiceMonitor"]
    assert monitors == []
    monitor = find(renders["ha"], "ServiceMonitor", name, NS)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NS]}
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s"}
    ]
    # It selects the operator's Service and no other.
    wanted = monitor["spec"]["selector"]["matchLabels"]
    services = [
        d["metadata"]["name"]
        for d in renders["ha"]
        if d["kind"] == "Service" and wanted.items() <= d["metadata"]["labels"].items()
    ]
    assert services == [name]
    # Enabled alone, without the proxy's.
    alone = render(RELEASE, NS, sets=["operator.metrics.serviceMonitor.enabled=true"])
    assert [d["metadata"]["name"] for d in alone if d["kind"] == "ServiceMonitor"] == [name]
    # The PDB: with two replicas (the default) and three, never with one.
    assert find(renders["default"], "PodDisruptionBudget", name, NS)["spec"] == {
        "minAvailable": 1,
        "selector": {"matchLabels": selector},
    }
    assert find(renders["ha"], "PodDisruptionBudget", name, NS)["spec"]["minAvailable"] == 1
    single = render(RELEASE, NS, sets=["operator.replicas=1"])
    assert deployment(single, "operator")["spec"]["replicas"] == 1
    budgets = [d["metadata"]["name"] for d in single if d["kind"] == "PodDisruptionBudget"]
    assert budgets == [f"{fullname(RELEASE)}-proxy"]
    off = render(RELEASE, NS, sets=["operator.podDisruptionBudget.enabled=false"])
    budgets = [d["metadata"]["name"] for d in off if d["kind"] == "PodDisruptionBudget"]
    assert budgets == [f"{fullname(RELEASE)}-proxy"]


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        # The order the operator requires: 0 < retry < renew deadline < lease.
        (["operator.leaderElection.retrySeconds=10"], "(got 10, 10, 15)"),
        (["operator.leaderElection.leaseSeconds=9.5"], "(got 2, 10, 9.5)"),
        (["operator.leaderElection.retrySeconds=0.0"], "(got 0, 10, 15)"),
        # The schema: above zero, a number.
        (["operator.leaderElection.leaseSeconds=0"], "/operator/leaderElection/leaseSeconds"),
        (["operator.leaderElection.retrySeconds=-1"], "/operator/leaderElection/retrySeconds"),
        (["operator.leaderElection.leaseSeconds=soon"], "/operator/leaderElection/leaseSeconds"),
        (["operator.replicas=two"], "/operator/replicas"),
    ],
)
def test_lease_timings_are_validated(sets: list[str], expected: str) -> None:
    result = template_failing(*(arg for each in sets for arg in ("--set", each)))
    assert result.returncode != 0
    assert expected in result.stderr, result.stderr


def test_lease_timings_in_order_render() -> None:
    """The negative control of the test above: fractions in the right order pass, as
    `--set` strings too."""
    docs = render(
        RELEASE, NS,
        sets=[
            "operator.leaderElection.leaseSeconds=4.5",
            "operator.leaderElection.renewDeadlineSeconds=3",
            "operator.leaderElection.retrySeconds=0.5",
        ],
    )  # fmt: skip
    args = container(docs, "operator")["args"]
    timings = ("--lease-seconds", "--lease-renew-deadline-seconds", "--lease-retry-seconds")
    assert [args[args.index(flag) + 1] for flag in timings] == ["4.5", "3", "0.5"]


def test_proxy_connection_limits_render_as_flags() -> None:
    """The connection limits (and the memory's interval) reach the proxy's flags, fractions
    as `--set` strings too."""
    docs = render(
        RELEASE, NS,
        sets=[
            "proxy.headerTimeoutSeconds=2.5",
            "proxy.bodyTimeoutSeconds=0.5",
            "proxy.idleTimeoutSeconds=620",
            "proxy.maxConnections=100",
            "proxy.tokenCacheSeconds=12.5",
            "proxy.memoryPublishSeconds=7.5",
        ],
    )  # fmt: skip
    args = container(docs, "proxy")["args"]
    flags = (
        "--header-timeout-seconds", "--body-timeout-seconds", "--idle-timeout-seconds",
        "--max-connections", "--token-cache-seconds", "--memory-publish-seconds",
    )  # fmt: skip
    assert [args[args.index(flag) + 1] for flag in flags] == [
        "2.5", "0.5", "620", "100", "12.5", "7.5",
    ]  # fmt: skip


def test_the_answer_bounds_render_as_flags_the_proxy_takes() -> None:
    """How much of an upstream's answer is read (docs/proxy.md, Bounds) is the chart's to
    set, and what it renders the proxy's own parser accepts."""
    docs = render(
        RELEASE, NS,
        sets=[
            "proxy.maxEventBytes=1048576",
            "proxy.maxAnswerBytes=16777216",
            "proxy.maxDecompressionRatio=50.5",
        ],
    )  # fmt: skip
    args = container(docs, "proxy")["args"]
    flags = ("--max-event-bytes", "--max-answer-bytes", "--max-decompression-ratio")
    rendered = [args[args.index(flag) + 1] for flag in flags]
    assert rendered == ["1048576", "16777216", "50.5"]
    given = chain.from_iterable(zip(flags, rendered, strict=True))
    parsed = _parser().parse_args(["proxy", "--manifests", ".", *given])
    assert (parsed.max_event_bytes, parsed.max_answer_bytes, parsed.max_decompression_ratio) == (
        1048576, 16777216, 50.5,
    )  # fmt: skip


def test_json_logs_and_tracing_render_as_the_proxy_reads_them() -> None:
    """`logFormat` reaches both pods' flags, and `proxy.tracing` renders the OTEL_* variables
    that the proxy's own reader (edge/tracing.py) turns into an OTLP export with the ratio
    asked for; with no endpoint, that reader finds tracing off."""
    docs = render(
        RELEASE, NS,
        sets=[
            "proxy.logFormat=json",
            "operator.logFormat=json",
            "proxy.tracing.endpoint=http://collector.observability:4318",
            "proxy.tracing.sampleRatio=0.25",
        ],
    )  # fmt: skip
    for component in ("proxy", "operator"):
        args = container(docs, component)["args"]
        assert args[args.index("--log-format") + 1] == "json", component
    env = {e["name"]: e["value"] for e in container(docs, "proxy")["env"] if "value" in e}
    assert env == {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector.observability:4318",
        "OTEL_SERVICE_NAME": f"{fullname(RELEASE)}-proxy",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
    }
    settings = from_environment(env)
    assert settings is not None
    assert (settings.ratio, settings.parent_based) == (0.25, True)
    assert type(settings.exporter).__name__ == "OTLPSpanExporter"
    quiet = container(render(RELEASE, NS), "proxy")["env"]
    assert from_environment({e["name"]: e.get("value", "") for e in quiet}) is None


def test_proxy_deployment(renders: dict[str, Docs]) -> None:
    name = fullname(RELEASE)
    proxy = deployment(renders["default"], "proxy")
    assert proxy["spec"]["replicas"] == 2
    each = container(renders["default"], "proxy")
    assert each["command"] == ["rolegate"]
    assert each["args"] == [
        "--log-level", "warning", "--log-format", "text", "proxy",
        "--configmap", f"{NS}/{name}-config",
        "--host", "0.0.0.0", "--port", "8080", "--metrics-port", "9090",
        "--secrets-dir", SECRETS_DIR,
        "--shutdown-grace-seconds", "30", "--max-body-bytes", "4194304",
        "--max-event-bytes", "4194304", "--max-answer-bytes", "67108864",
        "--max-decompression-ratio", "200",
        "--header-timeout-seconds", "10", "--body-timeout-seconds", "30",
        "--idle-timeout-seconds", "75", "--max-connections", "4096",
        "--token-cache-seconds", "60", "--status-heartbeat-seconds", "30",
        "--memory-publish-seconds", "30",
    ]  # fmt: skip
    # The probes, like Prometheus, use the metrics port (9090), never the API's.
    assert each["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert each["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert each["ports"] == [
        {"name": "http", "containerPort": 8080, "protocol": "TCP"},
        {"name": "metrics", "containerPort": 9090, "protocol": "TCP"},
    ]
    # Graceful shutdown: endpoints drop the pod first, then streams get their grace.
    assert each["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    assert pod_spec(renders["default"], "proxy")["terminationGracePeriodSeconds"] == 30 + 15
    assert pod_spec(renders["ha"], "proxy")["terminationGracePeriodSeconds"] == 60 + 15
    assert proxy["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    annotations = proxy["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "9090",
        "prometheus.io/path": "/metrics",
    }
    # The HA set: the autoscaler owns the replica count; outcomes go to stdout.
    ha = deployment(renders["ha"], "proxy")
    assert "replicas" not in ha["spec"]
    args = container(renders["ha"], "proxy")["args"]
    assert args[args.index("--outcome-export") + 1] == "-"
    assert "--outcome-export" not in each["args"]
    service = find(renders["default"], "Service", f"{name}-proxy", NS)
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"},
        {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"},
    ]


def test_proxy_companions(renders: dict[str, Docs]) -> None:
    """The HPA, the PodDisruptionBudget and the ServiceMonitor, when and as they render."""
    name = f"{fullname(RELEASE)}-proxy"
    kinds = {case: {d["kind"] for d in docs} for case, docs in renders.items()}
    assert "HorizontalPodAutoscaler" not in kinds["default"]
    assert "ServiceMonitor" not in kinds["default"]
    hpa = find(renders["ha"], "HorizontalPodAutoscaler", name, NS)
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": name,
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    monitor = find(renders["ha"], "ServiceMonitor", name, NS)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    # It scrapes the Service's `metrics` port: the API port no longer serves /metrics.
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s"}
    ]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    # The PDB: with two pods (the default) and with the autoscaler, never with one pod.
    assert find(renders["default"], "PodDisruptionBudget", name, NS)["spec"]["minAvailable"] == 1
    assert find(renders["ha"], "PodDisruptionBudget", name, NS)["spec"]["minAvailable"] == 2
    single = render(RELEASE, NS, sets=["proxy.replicas=1"])
    assert name not in {d["metadata"]["name"] for d in single if d["kind"] == "PodDisruptionBudget"}
    no_annotations = render(RELEASE, NS, sets=["proxy.metrics.podAnnotations=false"])
    assert "annotations" not in deployment(no_annotations, "proxy")["spec"]["template"]["metadata"]


def test_autoscaling_without_a_cpu_request_is_refused() -> None:
    result = template_failing(
        "--set", "proxy.autoscaling.enabled=true", "--set", "proxy.resources.requests.cpu=null"
    )
    assert result.returncode != 0
    assert "proxy.resources.requests.cpu" in result.stderr, result.stderr


def test_rbac_rules_are_exactly_the_documented_ones(renders: dict[str, Docs]) -> None:
    """Any rule added to a Role fails here: each component's rules, per namespace, as data."""
    configmap = f"{fullname(RELEASE)}-config"
    lease = f"{fullname(RELEASE)}-operator"
    proxy_configmap = {
        "apiGroups": [""], "resources": ["configmaps"], "resourceNames": [configmap],
        "verbs": ["get", "list", "watch"],
    }  # fmt: skip
    proxy_status = {
        "apiGroups": ["rolegate.dev"], "resources": ["providerpolicies/status"],
        "verbs": ["patch"],
    }  # fmt: skip
    proxy_memory = {
        "apiGroups": ["rolegate.dev"], "resources": ["proxymemories"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    }  # fmt: skip
    documented = documented_operator_rules(configmap, lease)
    # The ConfigMap's and the Lease's rules belong where they live: the release namespace.
    home_only = (["configmaps"], ["leases"])
    home_rules = [r for r in documented if r["resources"] in home_only]
    watched_rules = [r for r in documented if r["resources"] not in home_only]
    assert len(home_rules) == 4
    assert len(watched_rules) == 3
    # The Lease: create any (`create` cannot be limited by name), read and write only the
    # release's own; Events created and patched (a repeated Event counts up).
    assert {
        "apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
        "resourceNames": [lease], "verbs": ["get", "update"],
    } in home_rules  # fmt: skip
    assert {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]} in (
        watched_rules
    )

    # Default: the release namespace is watched and holds the ConfigMap.
    for case in ("default", "ha"):
        assert rbac_rules(renders[case], "proxy") == {
            NS: rules(proxy_configmap, proxy_memory, proxy_status)
        }
        assert rbac_rules(renders[case], "operator") == {NS: rules(*documented)}

    # Two other namespaces watched: the ConfigMap rules stay at home, the rest go there.
    teams = watched_namespaces(MULTI)
    assert rbac_rules(renders["multi-namespace"], "proxy") == {
        NS: rules(proxy_configmap, proxy_memory),
        **{team: rules(proxy_status) for team in teams},
    }
    assert rbac_rules(renders["multi-namespace"], "operator") == {
        NS: rules(*home_rules),
        **{team: rules(*watched_rules) for team in teams},
    }


@pytest.mark.parametrize("case", [ci_id(p) for p in CI_VALUES])
def test_bindings_service_accounts_and_scope(renders: dict[str, Docs], case: str) -> None:
    docs = renders[case]
    name = fullname(RELEASE)
    # One cluster-scoped pair only: the proxy's right to create TokenReviews.
    cluster = [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    assert sorted(d["kind"] for d in cluster) == ["ClusterRole", "ClusterRoleBinding"]
    (cluster_role,) = (d for d in cluster if d["kind"] == "ClusterRole")
    assert cluster_role["rules"] == [
        {
            "apiGroups": ["authentication.k8s.io"],
            "resources": ["tokenreviews"],
            "verbs": ["create"],
        }
    ]
    (cluster_binding,) = (d for d in cluster if d["kind"] == "ClusterRoleBinding")
    assert cluster_binding["subjects"] == [
        {"kind": "ServiceAccount", "name": f"{name}-proxy", "namespace": NS}
    ]
    namespaced = [d for d in docs if d not in cluster]
    assert all(d["metadata"].get("namespace") for d in namespaced), "all else is namespaced"
    accounts = sorted(d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount")
    assert accounts == [f"{name}-operator", f"{name}-proxy"]
    roles = {
        (d["metadata"]["namespace"], d["metadata"]["name"]) for d in docs if d["kind"] == "Role"
    }
    for binding in (d for d in docs if d["kind"] == "RoleBinding"):
        where, called = binding["metadata"]["namespace"], binding["metadata"]["name"]
        assert (where, called) in roles
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": called,
        }  # fmt: skip
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": called, "namespace": NS}]
    assert len([d for d in docs if d["kind"] == "RoleBinding"]) == len(roles)


@pytest.mark.parametrize("case", [ci_id(p) for p in CI_VALUES])
def test_labels_on_every_object(renders: dict[str, Docs], case: str) -> None:
    for doc in renders[case]:
        labels = doc["metadata"]["labels"]
        missing = [label for label in STANDARD_LABELS if label not in labels]
        assert not missing, (doc["kind"], doc["metadata"]["name"], missing)
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/component"] in ("operator", "proxy", "monitoring")
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        spec = doc.get("spec", {})
        selector = spec.get("selector", {})
        selector = selector.get("matchLabels", selector)
        if selector:
            assert set(selector) == SELECTOR_LABELS, (doc["kind"], selector)
        if doc["kind"] == "Deployment":
            pod_labels = spec["template"]["metadata"]["labels"]
            assert {k: pod_labels[k] for k in SELECTOR_LABELS} == selector


def test_fullname() -> None:
    def names(release: str, *sets: str) -> set[str]:
        return {
            d["metadata"]["name"]
            for d in render(release, NS, sets=sets)
            if d["kind"] == "Deployment"
        }

    assert names("edge") == {"edge-rolegate-operator", "edge-rolegate-proxy"}
    assert names("my-rolegate") == {"my-rolegate-operator", "my-rolegate-proxy"}
    assert names("edge", "fullnameOverride=gw") == {"gw-operator", "gw-proxy"}


def test_an_image_pinned_by_digest() -> None:
    """`image.digest` replaces the tag in the image reference; the version label stays a
    valid label value whatever the tag holds."""
    digest = "sha256:" + "ab" * 32
    docs = render("edge", NS, sets=(f"image.digest={digest}", "image.tag=1.2.3+build.7"))
    images = {
        container["image"]
        for d in docs
        if d["kind"] == "Deployment"
        for container in d["spec"]["template"]["spec"]["containers"]
    }
    assert images == {f"rolegate@{digest}"}
    labels = {d["metadata"]["labels"]["app.kubernetes.io/version"] for d in docs}
    assert labels == {"1.2.3_build.7"}
    refused = template_failing("--set", "image.digest=latest")
    assert refused.returncode != 0
    assert "digest" in refused.stderr
