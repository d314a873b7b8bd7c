"""A real Kubernetes control plane on loopback: etcd plus kube-apiserver, no mocks.

Used by the test suite (a session fixture) and by `rolegate dev-cluster` for a person to
`kubectl` against. The binaries are built from Go modules once per machine by
`hack/build-control-plane.sh` (`make control-plane`) and cached under
`$HOME/.cache/rolegate`; nothing here builds them. There is no
controller-manager, scheduler or kubelet: objects are stored and validated, Pods never
run, namespaces deleted stay Terminating, and nothing creates default ServiceAccounts.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "hack" / "build-control-plane.sh"


class ControlPlaneError(RuntimeError):
    pass


TOOLS = ("kube-apiserver", "kubectl", "etcd", "helm")
# Checks the chart's alert rules and dashboard queries. Built by the same script, into a
# directory of its own keyed by Prometheus's version (`installed_promtool`).
PROMTOOL = "promtool"
# The one command that builds them (a step of `make test`, before pytest).
BUILD_COMMAND = "make control-plane"


def _build_dir(flag: str) -> Path:
    """Where the build script puts (or put) its output, as `flag` asks; builds nothing."""
    result = subprocess.run(
        ["bash", str(BUILD_SCRIPT), flag], capture_output=True, text=True, timeout=30, check=True
    )
    return Path(result.stdout.strip())


def installed_binaries() -> Path:
    """The directory holding kube-apiserver, kubectl, etcd and helm. Never builds them: a
    cold build takes minutes and is a step of its own (`make control-plane`, which
    `make test` runs before pytest), never work inside a test under its timeout."""
    bin_dir = _build_dir("--bin-dir")
    missing = [tool for tool in TOOLS if not os.access(bin_dir / tool, os.X_OK)]
    if missing:
        raise ControlPlaneError(
            f"the Kubernetes control plane is not built ({', '.join(missing)} missing from "
            f"{bin_dir}); build it once for this machine (about 10 minutes): {BUILD_COMMAND}"
        )
    return bin_dir


def installed_promtool() -> Path:
    """The promtool built with the control plane. Never builds it (`installed_binaries`)."""
    path = _build_dir("--promtool-dir") / PROMTOOL
    if not os.access(path, os.X_OK):
        raise ControlPlaneError(
            f"promtool is not built ({path} missing); build it once for this machine with "
            f"the control plane: {BUILD_COMMAND}"
        )
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _write_service_account_key(path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )


@dataclass
class ControlPlane:
    bin_dir: Path
    root: Path
    etcd_port: int = field(default_factory=free_port)
    etcd_peer_port: int = field(default_factory=free_port)
    api_port: int = field(default_factory=free_port)
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    etcd: subprocess.Popen[bytes] | None = None
    apiserver: subprocess.Popen[bytes] | None = None

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def ca_file(self) -> Path:
        # With no --tls-cert-file the apiserver writes its self-signed serving cert here,
        # followed by the CA that signed it: usable as the kubeconfig's authority.
        return self.pki / "apiserver.crt"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        }

    def start(self) -> ControlPlane:
        self.pki.mkdir(parents=True, exist_ok=True)
        (self.pki / "tokens.csv").write_text(f"{self.token},admin,admin-uid,system:masters\n")
        _write_service_account_key(self.pki / "sa.key")
        self._start_etcd()
        self.start_apiserver()
        self._write_kubeconfig()
        return self

    def _start_etcd(self) -> None:
        log = (self.root / "etcd.log").open("wb")
        self.etcd = subprocess.Popen(
            [
                str(self.bin_dir / "etcd"),
                "--data-dir", str(self.root / "etcd"),
                "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
                "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
                "--listen-peer-urls", f"http://127.0.0.1:{self.etcd_peer_port}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.etcd_peer_port}",
                "--initial-cluster", f"default=http://127.0.0.1:{self.etcd_peer_port}",
                "--unsafe-no-fsync",
                "--log-level", "warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()

    def start_apiserver(self) -> None:
        log = (self.root / "apiserver.log").open("ab")
        self.apiserver = subprocess.Popen(
            [
                str(self.bin_dir / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.api_port}",
                f"--cert-dir={self.pki}",
                f"--token-auth-file={self.pki / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                f"--service-account-issuer=https://127.0.0.1:{self.api_port}",
                f"--service-account-key-file={self.pki / 'sa.key'}",
                f"--service-account-signing-key-file={self.pki / 'sa.key'}",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--disable-admission-plugins=ServiceAccount",
                "--allow-privileged=true",
                # A stop waits this long for open watches (every operator and proxy holds
                # one) to drain, where by default it waits for them without end.
                "--shutdown-watch-termination-grace-period=2s",
                "-v=0",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self._wait_ready()

    def stop_apiserver(self) -> None:
        _terminate(self.apiserver)
        self.apiserver = None

    def _wait_ready(self, within: float = 60.0) -> None:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # the CA file appears only once it serves
        request = urllib.request.Request(
            f"{self.server}/readyz", headers={"Authorization": f"Bearer {self.token}"}
        )
        deadline = time.monotonic() + within
        last = "no answer"
        while time.monotonic() < deadline:
            if self.apiserver is not None and self.apiserver.poll() is not None:
                raise ControlPlaneError(
                    f"kube-apiserver exited with {self.apiserver.returncode}; see "
                    f"{self.root / 'apiserver.log'}:\n{self._tail('apiserver.log')}"
                )
            try:
                with urllib.request.urlopen(request, timeout=2, context=context) as response:
                    if response.status == 200:
                        return
            except urllib.error.HTTPError as error:  # early polls answer 403 or 500
                last = f"HTTP {error.code}"
            except OSError as error:
                last = str(error)
            time.sleep(0.2)
        raise ControlPlaneError(
            f"kube-apiserver not ready within {within}s ({last}):\n{self._tail('apiserver.log')}"
        )

    def _tail(self, name: str) -> str:
        with contextlib.suppress(OSError):
            return (self.root / name).read_text(errors="replace")[-3000:]
        return ""

    def _write_kubeconfig(self) -> None:
        self._write_token_kubeconfig(self.kubeconfig, "admin", self.token)

    def service_account_kubeconfig(self, namespace: str, account: str, path: Path) -> Path:
        """A kubeconfig holding only a TokenRequest token of the ServiceAccount (what the
        kubelet projects into a pod), with no admin credentials to fall back on: to run a
        component as its account and prove its RBAC is all it needs."""
        token = self.kubectl(
            "-n", namespace, "create", "token", account, "--duration=1h"
        ).stdout.strip()
        self._write_token_kubeconfig(path, account, token)
        return path

    def _write_token_kubeconfig(self, path: Path, user: str, token: str) -> None:
        path.write_text(
            f"""apiVersion: v1
kind: Config
clusters:
- name: rolegate-dev
  cluster:
    server: {self.server}
    certificate-authority: {self.ca_file}
users:
- name: {user}
  user:
    token: {token}
contexts:
- name: rolegate-dev
  context: {{cluster: rolegate-dev, user: {user}}}
current-context: rolegate-dev
"""
        )

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.bin_dir / "kubectl"), *args],
            input=input,
            capture_output=True,
            text=True,
            env=self.env(),
            timeout=60,
            check=False,
        )
        if check and result.returncode != 0:
            raise ControlPlaneError(
                f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr}"
            )
        return result

    def stop(self) -> None:
        self.stop_apiserver()
        _terminate(self.etcd)

    def exited(self) -> str | None:
        """Which of the two processes died on its own, with its exit status and the end of
        its log; None while both run."""
        for name, process, log in (
            ("kube-apiserver", self.apiserver, "apiserver.log"),
            ("etcd", self.etcd, "etcd.log"),
        ):
            if process is not None and process.poll() is not None:
                return f"{name} exited with {process.returncode}; the end of its log:\n" + (
                    self._tail(log)
                )
        return None


def _terminate(process: subprocess.Popen[bytes] | None) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def scratch_dir() -> Path:
    """A temporary directory on tmpfs when there is one: etcd is much faster there."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="rolegate-cp-", dir=base))


class _Stopped(Exception):
    """SIGTERM or SIGHUP arrived: stop like Ctrl-C does."""


def _stop_on_signal(signum: int, frame: FrameType | None) -> None:
    raise _Stopped(signal.Signals(signum).name)


def run_dev_cluster() -> int:
    """`rolegate dev-cluster`: start a control plane and keep it until Ctrl-C, SIGTERM or
    SIGHUP, or until etcd or kube-apiserver dies (then stop the other and fail)."""
    bin_dir = installed_binaries()
    root = scratch_dir()
    plane = ControlPlane(bin_dir=bin_dir, root=root)
    # Installed before the first child starts, so no signal can leave one running. A
    # hangup ignored on entry (nohup) stays ignored; Ctrl-C is Python's KeyboardInterrupt.
    signal.signal(signal.SIGTERM, _stop_on_signal)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _stop_on_signal)
    try:
        plane.start()
        print(
            f"control plane ready at {plane.server}\n"
            f"  export KUBECONFIG={plane.kubeconfig}\n"
            f"  export PATH={bin_dir}:$PATH   # kubectl and helm of the same version\n"
            "Ctrl-C (or SIGTERM) stops it and deletes its data.",
            flush=True,
        )
        while (died := plane.exited()) is None:
            time.sleep(0.5)
        print(f"rolegate dev-cluster: {died}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, _Stopped):
        return 0
    finally:
        # A second Ctrl-C or SIGTERM must not cut the cleanup short.
        for stop_signal in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(stop_signal, signal.SIG_IGN)
        plane.stop()
        shutil.rmtree(root, ignore_errors=True)
