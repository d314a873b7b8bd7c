"""What the benchmarks that need Kubernetes share: the tests' control plane (etcd and
kube-apiserver) with the CRDs established and one namespace, and `rolegate` subcommands
as processes that log to files and are stopped, last started first, whatever happens."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rolegate_cli.controlplane import ControlPlane, installed_binaries

CRDS = Path(__file__).parents[1] / "deploy" / "crds"


@dataclass
class Cluster:
    plane: ControlPlane
    namespace: str
    root: Path
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def kube(self) -> list[str]:
        """The flag that points a component at this control plane."""
        return ["--kubeconfig", str(self.plane.kubeconfig)]

    def apply(self, manifests: str) -> None:
        self.plane.kubectl("apply", "-f", "-", input=manifests)

    def start(self, name: str, args: Sequence[str], env: Mapping[str, str] = {}) -> None:
        """`rolegate <args>` as a process, its output in `<root>/<name>.log`."""
        with (self.root / f"{name}.log").open("wb") as log:
            self.processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "rolegate_cli.main", *args],
                    env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                    stdout=log,
                    stderr=log,
                )
            )


@contextlib.contextmanager
def cluster(namespace: str) -> Iterator[Cluster]:
    """A control plane of its own with the rolegate CRDs and `namespace`, torn down after."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        plane = ControlPlane(bin_dir=installed_binaries(), root=root / "plane").start()
        running = Cluster(plane, namespace, root)
        try:
            plane.kubectl("apply", "-f", str(CRDS))
            plane.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")
            plane.kubectl("create", "namespace", namespace)
            yield running
        finally:
            for process in reversed(running.processes):
                process.terminate()
                process.wait(timeout=30)
            plane.stop()
