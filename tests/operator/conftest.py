"""The operator end to end: `rolegate operator` as a subprocess against the real API server.

The control plane, the per-test namespace and the CRDs come from the suite's fixtures
(`tests/conftest.py`), shared with tests/k8s: one control plane per run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pytest

from rolegate_cli.controlplane import REPO_ROOT, ControlPlane


@dataclass
class Cluster:
    """kubectl against the test control plane, in one namespace, with JSON answers."""

    plane: ControlPlane
    namespace: str

    def apply(self, obj: dict[str, Any]) -> None:
        obj = {**obj, "metadata": {**obj["metadata"], "namespace": self.namespace}}
        self.plane.kubectl("apply", "-f", "-", input=json.dumps(obj))

    def get(self, resource: str, name: str) -> dict[str, Any]:
        out = self.plane.kubectl(
            "-n", self.namespace, "get", resource, name, "-o", "json", "--show-managed-fields",
        )  # fmt: skip
        found: dict[str, Any] = json.loads(out.stdout)
        return found

    def find(self, resource: str, name: str) -> dict[str, Any] | None:
        out = self.plane.kubectl(
            "-n", self.namespace, "get", resource, name, "-o", "json", "--ignore-not-found",
        )  # fmt: skip
        return json.loads(out.stdout) if out.stdout.strip() else None

    def delete(self, resource: str, name: str) -> None:
        self.plane.kubectl("-n", self.namespace, "delete", resource, name, "--wait=false")

    def events(self, name: str) -> list[dict[str, Any]]:
        out = self.plane.kubectl(
            "-n", self.namespace, "get", "events", "-o", "json",
            "--field-selector", f"involvedObject.name={name}",
        )  # fmt: skip
        items: list[dict[str, Any]] = json.loads(out.stdout)["items"]
        return items


class OperatorProcess:
    """`rolegate operator` in a subprocess; its log goes to a file (a full pipe would
    block it) and is printed at teardown, so a failing test shows it."""

    def __init__(
        self,
        plane: ControlPlane,
        args: Sequence[str],
        log_path: Path,
        options: Sequence[str] = ("--log-level", "info"),
    ) -> None:
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rolegate_cli.main", *options, "operator", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            env=plane.env(),
        )  # fmt: skip

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise AssertionError(
                f"the operator exited with {self.process.returncode}:\n{self.log()[-6000:]}"
            )

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode


class StartOperator(Protocol):
    def __call__(
        self, *args: str, kubeconfig: Path | None = None, options: Sequence[str] = ...
    ) -> OperatorProcess: ...


@pytest.fixture
def cluster(crds: ControlPlane, namespace: str) -> Cluster:
    return Cluster(crds, namespace)


@pytest.fixture
def start_operator(cluster: Cluster, tmp_path: Path) -> Iterator[StartOperator]:
    started: list[OperatorProcess] = []

    def start(
        *args: str,
        kubeconfig: Path | None = None,
        options: Sequence[str] = ("--log-level", "info"),
    ) -> OperatorProcess:
        """`rolegate OPTIONS operator ARGS` (default: `--namespace` the test's namespace)."""
        process = OperatorProcess(
            cluster.plane,
            [
                *(args or ("--namespace", cluster.namespace)),
                "--kubeconfig", str(kubeconfig or cluster.plane.kubeconfig),
            ],
            tmp_path / f"operator-{len(started)}.log",
            options,
        )  # fmt: skip
        started.append(process)
        return process

    yield start
    for number, process in enumerate(started):
        code = process.stop()
        # Shown only when the test fails.
        print(f"--- operator {number} (exit {code}) ---\n{process.log()}")
