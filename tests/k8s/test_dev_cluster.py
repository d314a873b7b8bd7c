"""`rolegate dev-cluster` as a person runs it: it serves, it stops cleanly on SIGTERM as on
Ctrl-C (no etcd or kube-apiserver left behind), and it notices a child that died."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rolegate_cli.controlplane import installed_binaries

from ..support import interruptible


@dataclass
class DevCluster:
    process: subprocess.Popen[str]
    kubeconfig: Path
    children: dict[str, int]  # binary name -> pid

    def kubectl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(installed_binaries() / "kubectl"), *args],
            env={**os.environ, "KUBECONFIG": str(self.kubeconfig)},
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip


def _children(pid: int) -> dict[str, int]:
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            name = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0]
            found[Path(name.decode()).name] = int(child)
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie (a dead child not yet reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _read_until_ready(process: subprocess.Popen[str], within: float = 45) -> str:
    """What it printed up to its ready message (read from the pipe's descriptor: a
    buffered reader would hide what it already holds from select)."""
    assert process.stdout is not None
    deadline = time.monotonic() + within
    printed = b""
    while b"Ctrl-C" not in printed:
        left = deadline - time.monotonic()
        assert left > 0, f"dev-cluster not ready within {within}s; printed: {printed!r}"
        assert process.poll() is None, f"dev-cluster exited {process.returncode}: {printed!r}"
        readable, _, _ = select.select([process.stdout], [], [], left)
        if readable:
            printed += os.read(process.stdout.fileno(), 4096)
    return printed.decode()


@pytest.fixture
def dev_cluster() -> Iterator[DevCluster]:
    process = subprocess.Popen(
        [sys.executable, "-m", "rolegate_cli.main", "dev-cluster"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=interruptible,
    )  # fmt: skip
    children: dict[str, int] = {}
    try:
        printed = _read_until_ready(process)
        match = re.search(r"export KUBECONFIG=(\S+)", printed)
        assert match, printed
        children = _children(process.pid)
        assert set(children) == {"etcd", "kube-apiserver"}, children
        yield DevCluster(process, Path(match[1]), children)
    finally:
        # Only a failed test gets here with anything running; leave nothing behind.
        if process.poll() is None:
            children |= _children(process.pid)
            process.kill()
        process.communicate(timeout=30)
        for pid in children.values():
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def _wait_exit(process: subprocess.Popen[str], within: float = 30) -> tuple[int, str]:
    _, stderr = process.communicate(timeout=within)
    return process.returncode, stderr


@pytest.mark.parametrize("sent", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_dev_cluster_serves_and_stops_cleanly(
    dev_cluster: DevCluster, sent: signal.Signals
) -> None:
    served = dev_cluster.kubectl("get", "--raw", "/readyz")
    assert (served.returncode, served.stdout) == (0, "ok"), served.stderr
    root = dev_cluster.kubeconfig.parent
    dev_cluster.process.send_signal(sent)
    code, stderr = _wait_exit(dev_cluster.process)
    assert code == 0, stderr
    assert not [name for name, pid in dev_cluster.children.items() if _running(pid)]
    assert not root.exists()  # its data is deleted


def test_dev_cluster_notices_a_child_that_died(dev_cluster: DevCluster) -> None:
    os.kill(dev_cluster.children["kube-apiserver"], signal.SIGKILL)
    code, stderr = _wait_exit(dev_cluster.process)
    assert code == 1
    assert "kube-apiserver exited with -9" in stderr
    assert not _running(dev_cluster.children["etcd"])  # the other is stopped, not orphaned
