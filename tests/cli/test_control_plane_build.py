"""`hack/build-control-plane.sh`, the one place the control plane is built: concurrent runs
take turns, an interrupted or failed build stops everything it started and leaves nothing
that looks built, and a long step says it is alive.

No test builds the control plane (that is `make control-plane`'s minutes, before pytest).
These run the real script with a stand-in `go` first on the PATH: it records each call,
starts a child that lives on unless its process group is stopped (as the real go command
starts compilers and linkers), takes FAKE_GO_SECONDS (for the calls that mention
FAKE_GO_SLOW, when it is set), then writes the binary it was asked for (`-o`, or the
package's name in $GOBIN for `go install`). What is under test
is the script's process and file handling, not Go.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rolegate_cli.controlplane import (
    BUILD_SCRIPT,
    PROMTOOL,
    TOOLS,
    ControlPlaneError,
    installed_binaries,
    installed_promtool,
)

from ..support import interruptible
from ..waiting import wait_for

EVERY_TOOL = (*TOOLS, PROMTOOL)

FAKE_GO = r"""#!/usr/bin/env bash
set -eu
printf '%s\n' "$*" >> "$FAKE_GO_LOG"
sleep 1000 &  # a compiler it started: it outlives this script unless its group is stopped
printf '%s\n%s\n' "$$" "$!" >> "$FAKE_GO_LOG.pids"
trap 'kill $! 2>/dev/null || true' EXIT  # a normal exit takes its compiler with it
if [ "$1" = mod ]; then
  printf '\tk8s.io/api => ./staging/src/k8s.io/api\n' > "$FAKE_GO_LOG.gomod"
  printf '{"GoMod": "%s"}\n' "$FAKE_GO_LOG.gomod"
  exit 0
fi
case "$*" in *"${FAKE_GO_SLOW:-}"*) sleep "${FAKE_GO_SECONDS:-0}";; esac
out="" previous=""
for arg in "$@"; do [ "$previous" = -o ] && out=$arg; previous=$arg; done
if [ "$1" = install ]; then pkg=${*: -1}; pkg=${pkg%@*}; out="$GOBIN/${pkg##*/}"; fi
[ -n "$out" ] || exit 0
name=$(basename "$out")
case " ${FAKE_GO_FAIL:-} " in
  *" $name "*) echo "fake compile error in $name" >&2; exit 2;;
esac
printf '#!/bin/sh\n' > "$out"
chmod +x "$out"
"""


@dataclass
class Build:
    cache: Path
    log: Path
    env: dict[str, str]
    processes: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def bin_dir(self) -> Path:
        return self._dir("--bin-dir")

    @property
    def promtool(self) -> Path:
        return self._dir("--promtool-dir") / PROMTOOL

    def _dir(self, flag: str) -> Path:
        out = subprocess.run(
            ["bash", str(BUILD_SCRIPT), flag], env=self.env, capture_output=True,
            text=True, check=True,
        ).stdout  # fmt: skip
        return Path(out.strip())

    def start(self, **env: str) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            ["bash", str(BUILD_SCRIPT)],
            env={**self.env, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=interruptible,
        )
        self.processes.append(process)
        return process

    def run(self, **env: str) -> subprocess.CompletedProcess[str]:
        process = self.start(**env)
        stdout, stderr = process.communicate(timeout=50)
        return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def builds(self) -> list[str]:
        """The binaries the stand-in go was asked to produce, in order."""
        names = []
        for call in self.calls():
            words = call.split()
            if words[0] == "build":
                names.append(Path(words[words.index("-o") + 1]).name)
            elif words[0] == "install":
                names.append(words[-1].partition("@")[0].rpartition("/")[2])
        return names

    def started_pids(self) -> list[int]:
        pids = self.log.with_name(self.log.name + ".pids")
        return [int(line) for line in pids.read_text().split()] if pids.exists() else []


@pytest.fixture
def build(tmp_path: Path) -> Iterator[Build]:
    fake = tmp_path / "fake-go"
    fake.mkdir()
    (fake / "go").write_text(FAKE_GO)
    (fake / "go").chmod(0o755)
    cache = tmp_path / "cache"
    log = tmp_path / "go-calls"
    env = {
        **os.environ,
        "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}",
        "ROLEGATE_CACHE": str(cache),
        "FAKE_GO_LOG": str(log),
    }
    made = Build(cache, log, env)
    yield made
    # Only a failed test leaves anything running: the script stops its children itself.
    for process in made.processes:
        if process.poll() is None:
            process.kill()
        process.communicate()
    for pid in made.started_pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead but not yet reaped by its parent.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def test_a_build_makes_every_tool_once_and_a_second_run_builds_nothing(build: Build) -> None:
    first = build.run()
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == str(build.bin_dir)
    assert sorted(build.builds()) == sorted(EVERY_TOOL)
    assert all(os.access(build.bin_dir / tool, os.X_OK) for tool in TOOLS)
    assert os.access(build.promtool, os.X_OK)
    assert build.promtool.parent != build.bin_dir  # keyed by its own version
    assert not build.bin_dir.with_name(build.bin_dir.name + ".partial").exists()
    # Progress for a newcomer: what it is doing, how long it takes, where go's output went.
    assert "about 10 minutes" in first.stderr
    assert "building kube-apiserver" in first.stderr
    assert "go: " not in first.stderr  # hundreds of download lines stay in the build log

    again = build.run()
    assert again.returncode == 0
    assert "already built" in again.stderr
    assert len(build.builds()) == len(EVERY_TOOL)


def test_the_bin_dir_is_named_without_go_and_without_building(build: Build) -> None:
    no_go = {**build.env, "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--bin-dir"], env=no_go, capture_output=True, text=True
    )
    assert result.returncode == 0
    assert Path(result.stdout.strip()).is_relative_to(build.cache)
    assert build.calls() == []


def test_concurrent_builds_take_turns_and_build_once(build: Build) -> None:
    first = build.start(FAKE_GO_SECONDS="0.5")
    wait_for(lambda: bool(build.calls()), "the first build to start")
    second = build.start(FAKE_GO_SECONDS="0.5")
    out_first, err_first = first.communicate(timeout=50)
    out_second, err_second = second.communicate(timeout=50)
    assert (first.returncode, second.returncode) == (0, 0), err_first + err_second
    assert "waiting for it to finish" in err_second
    assert "built by the other run" in err_second
    assert out_first == out_second
    assert sorted(build.builds()) == sorted(EVERY_TOOL)  # each tool once, not twice


@pytest.mark.parametrize(("sent", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_an_interrupted_build_stops_all_it_started_and_keeps_nothing(
    build: Build, sent: signal.Signals, status: int
) -> None:
    process = build.start(FAKE_GO_SECONDS="60")
    wait_for(lambda: len(build.started_pids()) == 2, "the first step (etcd's download) to start")
    assert all(_alive(pid) for pid in build.started_pids())
    process.send_signal(sent)
    _, stderr = process.communicate(timeout=20)
    assert process.returncode == status
    assert "interrupted" in stderr
    # The go command and the compiler it started are stopped with the script.
    wait_for(lambda: not any(_alive(pid) for pid in build.started_pids()), "every child to stop")
    # The build was cut short: no binary of anything.
    assert not [tool for tool in TOOLS if (build.bin_dir / tool).exists()]
    assert not build.promtool.exists()
    assert not build.bin_dir.with_name(build.bin_dir.name + ".partial").exists()


def test_a_failed_step_says_why_keeps_what_finished_and_resumes(build: Build) -> None:
    failed = build.run(FAKE_GO_FAIL="kubectl")
    assert failed.returncode != 0
    assert "building kubectl failed" in failed.stderr
    assert "fake compile error in kubectl" in failed.stderr  # the end of go's output
    assert not (build.bin_dir / "kubectl").exists()
    assert (build.bin_dir / "kube-apiserver").exists()  # complete, so kept
    assert not any(_alive(pid) for pid in build.started_pids())

    resumed = build.run()
    assert resumed.returncode == 0, resumed.stderr
    assert build.builds().count("kubectl") == 2
    assert build.builds().count("kube-apiserver") == 1


def test_a_long_step_says_it_is_still_going(build: Build) -> None:
    result = build.run(
        FAKE_GO_SECONDS="1.5", FAKE_GO_SLOW="build -o", ROLEGATE_BUILD_PROGRESS_SECONDS="1"
    )
    assert result.returncode == 0
    assert "still building etcd" in result.stderr


def test_a_missing_control_plane_fails_at_once_with_the_command_to_run(
    build: Build, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a test or fixture meets on a machine where the control plane is not built."""
    monkeypatch.setenv("ROLEGATE_CACHE", str(build.cache))
    monkeypatch.setenv("PATH", build.env["PATH"])
    with pytest.raises(ControlPlaneError, match="make control-plane"):
        installed_binaries()
    with pytest.raises(ControlPlaneError, match=r"promtool is not built.*make control-plane"):
        installed_promtool()
    assert build.calls() == []


def test_promtool_alone_is_built_where_the_control_plane_is(build: Build) -> None:
    """A cache built before promtool joined the script (or after a bump of its version)
    gets promtool only: the control plane is not built again."""
    assert build.run().returncode == 0
    build.promtool.unlink()
    again = build.run()
    assert again.returncode == 0, again.stderr
    assert build.builds().count(PROMTOOL) == 2
    assert len(build.builds()) == len(EVERY_TOOL) + 1
    assert os.access(build.promtool, os.X_OK)


def test_rolegate_dev_cluster_without_a_build_says_what_to_run(build: Build) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rolegate_cli.main", "dev-cluster"],
        env=build.env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert "make control-plane" in result.stderr
    assert build.calls() == []
