"""How the operator is run: least-privilege RBAC (the Role documented in
docs/operator.md), every namespace at once, and the command's refusals."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from rolegate_cli.controlplane import REPO_ROOT, free_port
from tests.policy.builders import provider, role, role_table

from ..waiting import wait_for
from .conftest import Cluster, StartOperator
from .test_operator_e2e import accepted_condition, observed

DOCS = REPO_ROOT / "docs" / "operator.md"


def documented_role() -> dict[str, Any]:
    """The Role in the RBAC section of docs/operator.md."""
    blocks = re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), flags=re.DOTALL)
    roles = [doc for doc in map(yaml.safe_load, blocks) if doc.get("kind") == "Role"]
    assert len(roles) == 1, "docs/operator.md should document exactly one Role"
    found: dict[str, Any] = roles[0]
    return found


def service_account_kubeconfig(cluster: Cluster, account: str, path: Path) -> Path:
    """A kubeconfig that authenticates as `account` with a token from the TokenRequest API."""
    return cluster.plane.service_account_kubeconfig(cluster.namespace, account, path)


def test_the_documented_role_is_all_it_needs(
    cluster: Cluster, start_operator: StartOperator, tmp_path: Path
) -> None:
    ns = cluster.namespace
    kubectl = partial(cluster.plane.kubectl, "-n", ns)
    kubectl("create", "serviceaccount", "rolegate-operator")
    kubectl("apply", "-f", "-", input=json.dumps(documented_role()))
    kubectl(
        "create", "rolebinding", "rolegate-operator", "--role=rolegate-operator",
        f"--serviceaccount={ns}:rolegate-operator",
    )  # fmt: skip
    subject = f"--as=system:serviceaccount:{ns}:rolegate-operator"
    for denied in (("get", "secrets"), ("list", "configmaps"), ("patch", "roletables")):
        answer = kubectl("auth", "can-i", *denied, subject, check=False).stdout.strip()
        assert answer == "no", denied

    cluster.apply(provider("router", namespace=None))
    cluster.apply(role_table("roles", role("agent"), namespace=None))
    operator = start_operator(
        kubeconfig=service_account_kubeconfig(cluster, "rolegate-operator", tmp_path / "sa")
    )
    wait_for(
        lambda: observed(cluster, "rt", "roles", "True", 1), "accepted as the SA", alive=[operator]
    )
    wait_for(lambda: cluster.find("configmap", "rolegate-config"), "the ConfigMap")
    # A rejection exercises the Event write too.
    cluster.apply(role_table("roles", role("agent", models=["nope"]), namespace=None))
    wait_for(lambda: observed(cluster, "rt", "roles", "False", 2), "rejected", alive=[operator])
    wait_for(
        lambda: [e for e in cluster.events("roles") if e["reason"] == "NoServedModel"],
        "the Warning Event",
    )
    log = operator.log()
    assert "Forbidden" not in log
    assert "status=403" not in log


def test_all_namespaces_compiles_resources_from_every_namespace(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    """Other tests' namespaces linger (no namespace controller here), so this test's
    resources have names of their own and only they are checked."""
    other = f"t-{uuid.uuid4().hex[:10]}"
    cluster.plane.kubectl("create", "namespace", other)
    suffix = cluster.namespace[2:]
    policy = provider(
        f"router-{suffix}", namespace=other, models={f"model-{suffix}": [f"machine-{suffix}"]}
    )
    cluster.plane.kubectl("apply", "-f", "-", input=json.dumps(policy))
    cluster.apply(
        role_table(f"roles-{suffix}", role(f"role-{suffix}", [f"model-{suffix}"]), namespace=None)
    )
    operator = start_operator("--all-namespaces", "--configmap-namespace", cluster.namespace)
    table = wait_for(
        lambda: observed(cluster, "rt", f"roles-{suffix}", "True", 1),
        "the RoleTable accepted against the other namespace's policy",
        alive=[operator],
    )
    assert accepted_condition(table) is not None

    def served() -> bool:
        configmap = cluster.find("configmap", "rolegate-config")
        if configmap is None:
            return False
        compiled = json.loads(configmap["data"]["config.json"])
        return f"role-{suffix}" in {r["name"] for r in compiled["roles"]} and (
            f"router-{suffix}" in {p["name"] for p in compiled["providers"]}
        )

    wait_for(served, "the role and provider in the ConfigMap", alive=[operator])


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rolegate_cli.main", "operator", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        check=False,
    )


def test_all_namespaces_needs_a_home_for_the_configmap() -> None:
    result = run_cli("--all-namespaces")
    assert result.returncode == 2
    assert "--configmap-namespace" in result.stderr


def test_namespace_and_all_namespaces_exclude_each_other() -> None:
    result = run_cli("--namespace", "a", "--all-namespaces")
    assert result.returncode == 2
    assert "not allowed with" in result.stderr


def test_unusable_credentials_are_refused(tmp_path: Path) -> None:
    result = run_cli("--namespace", "a", "--kubeconfig", str(tmp_path / "missing"))
    assert result.returncode == 2
    assert "no usable Kubernetes credentials" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_unreachable_api_server_is_reported_not_a_traceback(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "c", "cluster": {"server": f"http://127.0.0.1:{free_port()}"}}
                ],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    result = run_cli("--namespace", "a", "--kubeconfig", str(kubeconfig))
    assert result.returncode == 2
    assert "rolegate operator: cannot list rolegate.dev resources at http://127.0.0.1:" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr


def test_a_metrics_port_already_taken_is_refused_by_name(cluster: Cluster) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli(
            "--namespace", cluster.namespace, "--metrics-port", str(port),
            "--kubeconfig", str(cluster.plane.kubeconfig),
        )  # fmt: skip
    assert result.returncode == 2
    assert f"rolegate operator: cannot serve metrics on port {port}" in result.stderr
    assert "Traceback" not in result.stderr
