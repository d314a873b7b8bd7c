"""The real control plane for Kubernetes tests: etcd + kube-apiserver, started once per run.

Never skipped: when the binaries cannot be built, the fixture errors with the build's
output, so a run that claims to test Kubernetes either does or fails loudly.
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Iterator

import pytest

from rolegate_cli.controlplane import REPO_ROOT, ControlPlane, ensure_binaries, scratch_dir
from rolegate_policy.crds import RESOURCES

CRD_DIR = REPO_ROOT / "deploy" / "crds"


@pytest.fixture(scope="session")
def control_plane() -> Iterator[ControlPlane]:
    root = scratch_dir()
    plane = ControlPlane(bin_dir=ensure_binaries(), root=root)
    try:
        yield plane.start()
    finally:
        plane.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def namespace(control_plane: ControlPlane) -> str:
    """A fresh namespace per test (deleted namespaces stay Terminating here: no GC)."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    control_plane.kubectl("create", "namespace", name)
    return name


@pytest.fixture(scope="session")
def crds(control_plane: ControlPlane) -> ControlPlane:
    """The control plane with the rolegate CRDs of `deploy/crds/` applied and established
    (once per run, as a user would: `kubectl apply -f deploy/crds/`)."""
    control_plane.kubectl("apply", "-f", str(CRD_DIR))
    control_plane.kubectl(
        "wait", "--for=condition=established", "--timeout=60s",
        *(f"crd/{resource.crd_name}" for resource in RESOURCES),
    )  # fmt: skip
    # Established is not yet published: the OpenAPI document `kubectl explain` reads
    # follows a moment later.
    deadline = time.monotonic() + 30
    for resource in RESOURCES:
        while True:
            result = control_plane.kubectl("explain", resource.singular, check=False)
            if result.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"{resource.kind} never reached OpenAPI: {result.stderr}")
            time.sleep(0.2)
    return control_plane
