"""The test control plane itself: a real API server that stores, validates and authorizes."""

from __future__ import annotations

from rolegate_cli.controlplane import ControlPlane


def test_the_api_server_serves_and_enforces_rbac(
    control_plane: ControlPlane, namespace: str
) -> None:
    version = control_plane.kubectl("version", "-o", "json").stdout
    assert '"gitVersion": "v1.34.4"' in version
    control_plane.kubectl("-n", namespace, "create", "configmap", "probe", "--from-literal=k=v")
    got = control_plane.kubectl("-n", namespace, "get", "configmap", "probe", "-o", "name")
    assert got.stdout.strip() == "configmap/probe"
    # RBAC is enforced: a service account with no bindings may not read it.
    denied = control_plane.kubectl(
        "auth", "can-i", "get", "configmaps", "-n", namespace,
        f"--as=system:serviceaccount:{namespace}:nobody", check=False,
    )  # fmt: skip
    assert denied.stdout.strip() == "no"
