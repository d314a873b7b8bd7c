"""Helpers for the Helm chart's tests: the real `helm` (built with the control plane,
`installed_binaries()`), renders as parsed documents, installs into the suite's API server.

Shared by test_chart.py and test_chart_rbac.py; the control plane, namespaces and the
rolegate CRDs come from the suite's fixtures (`tests/conftest.py`).
"""

from __future__ import annotations

import functools
import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from rolegate_cli.controlplane import REPO_ROOT, ControlPlane, installed_binaries

CHART = REPO_ROOT / "deploy" / "helm" / "rolegate"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
# helm built from Go modules cannot ask a cluster for `template` and `lint`: say which
# Kubernetes to render for (the chart requires 1.30 or later).
KUBE_VERSION = "1.34.0"
SECRETS_DIR = "/var/run/secrets/rolegate"


@functools.cache
def helm_path() -> Path:
    return installed_binaries() / "helm"


def helm(
    *args: str, plane: ControlPlane | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run helm; with `plane`, against that API server (its kubeconfig)."""
    result = subprocess.run(
        [str(helm_path()), *args],
        capture_output=True,
        text=True,
        env=plane.env() if plane is not None else None,
        timeout=60,
        check=False,
    )
    if check and result.returncode != 0:
        command = " ".join(args)
        raise AssertionError(f"helm {command} failed ({result.returncode}):\n{result.stderr}")
    return result


def fullname(release: str) -> str:
    """The chart's object-name prefix for a release (no fullnameOverride)."""
    return release if "rolegate" in release else f"{release}-rolegate"[:63].rstrip("-")


def values_args(values: Sequence[Path] = (), sets: Sequence[str] = ()) -> list[str]:
    args: list[str] = []
    for path in values:
        args += ["--values", str(path)]
    for assignment in sets:
        args += ["--set", assignment]
    return args


def render_text(
    release: str, namespace: str, values: Sequence[Path] = (), sets: Sequence[str] = ()
) -> str:
    """`helm template` of the chart (templates only; `crds/` is Helm's to install)."""
    return helm(
        "template", release, str(CHART), "--namespace", namespace,
        "--kube-version", KUBE_VERSION, *values_args(values, sets),
    ).stdout  # fmt: skip


def render(
    release: str, namespace: str, values: Sequence[Path] = (), sets: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """The rendered objects, parsed."""
    text = render_text(release, namespace, values, sets)
    return [doc for doc in yaml.safe_load_all(text) if doc]


def find(docs: Sequence[dict[str, Any]], kind: str, name: str, namespace: str) -> dict[str, Any]:
    found = [
        doc
        for doc in docs
        if doc["kind"] == kind
        and doc["metadata"]["name"] == name
        and doc["metadata"].get("namespace") == namespace
    ]
    assert len(found) == 1, f"expected one {kind} {namespace}/{name}, found {len(found)}"
    return found[0]


def watched_namespaces(values: Path) -> list[str]:
    """The extra namespaces a ci values file watches (they must exist before an install)."""
    loaded = yaml.safe_load(values.read_text()) or {}
    names: list[str] = loaded.get("watchNamespaces", [])
    return names


def ensure_namespaces(plane: ControlPlane, names: Sequence[str]) -> None:
    """Create namespaces unless they exist (shared names across tests: apply, not create)."""
    for name in names:
        plane.kubectl(
            "apply", "-f", "-",
            input=json.dumps({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}),
        )  # fmt: skip


def install(
    plane: ControlPlane,
    release: str,
    namespace: str,
    values: Sequence[Path] = (),
    sets: Sequence[str] = (),
) -> subprocess.CompletedProcess[str]:
    """`helm install` into the test control plane. Nothing runs here (no kubelet), so
    never wait for readiness: the objects are stored and validated, which is the test."""
    ensure_namespaces(plane, [n for v in values for n in watched_namespaces(v)])
    return helm(
        "install", release, str(CHART), "--namespace", namespace, "--wait=false",
        *values_args(values, sets), plane=plane,
    )  # fmt: skip


def stand_in_crd(kind: str, plural: str) -> dict[str, Any]:
    """A stand-in for one of the Prometheus Operator's CRDs (monitoring.coreos.com/v1): the
    chart's optional ServiceMonitors and PrometheusRule can only be applied where the kind
    exists, and the real CRDs are large and not ours to vendor. Accepting any spec is
    enough to prove the object is stored under the right group, version and kind; its
    fields are checked on the rendered manifest (and the rules by promtool)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com",
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "x-kubernetes-preserve-unknown-fields": True,
                        }
                    },
                }
            ],
        },
    }


STAND_IN_CRDS = (
    stand_in_crd("ServiceMonitor", "servicemonitors"),
    stand_in_crd("PrometheusRule", "prometheusrules"),
)


@pytest.fixture(scope="session")
def chart_cluster(crds: ControlPlane) -> ControlPlane:
    """The control plane with the rolegate CRDs and the Prometheus Operator stand-ins."""
    for crd in STAND_IN_CRDS:
        crds.kubectl("apply", "-f", "-", input=json.dumps(crd))
    crds.kubectl(
        "wait", "--for=condition=established", "--timeout=60s",
        *(f"crd/{crd['metadata']['name']}" for crd in STAND_IN_CRDS),
    )  # fmt: skip
    return crds
