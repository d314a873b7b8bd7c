"""The `rolegate` command as a user runs it: real processes, real ports, real clients."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from rolegate_cli.demo import PLACEHOLDER_ENDPOINT

from ..waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CLI = [sys.executable, "-m", "rolegate_cli.main"]


def example_manifests(tmp_path: Path, sim_port: int) -> Path:
    """The example manifests in a folder of their own, pointed at a simulator on `sim_port`."""
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    for path in (EXAMPLES / "manifests").glob("*.yaml"):
        text = path.read_text(encoding="utf-8").replace(
            PLACEHOLDER_ENDPOINT, f"http://127.0.0.1:{sim_port}/v1"
        )
        (manifests / path.name).write_text(text, encoding="utf-8")
    return manifests


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Running:
    """A started `rolegate` process, for `wait_for` to give up on at once if it exits."""

    process: subprocess.Popen[str]

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise AssertionError(f"the process exited with {self.process.returncode}")


def wait_until_up(url: str, process: subprocess.Popen[str]) -> None:
    def answers() -> bool:
        try:
            return httpx.get(url, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(answers, f"{url} to answer", alive=[Running(process)], every=0.05)


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()


def test_compile_prints_the_configuration_and_the_rulings() -> None:
    result = run("compile", str(EXAMPLES / "manifests"))
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["config"]["hash"].startswith("sha256:")
    assert "role rolegate/agents reflex: ruling Auto → Only" in result.stderr


def test_compile_with_one_invalid_resource_names_file_resource_and_field(tmp_path: Path) -> None:
    for path in (EXAMPLES / "manifests").glob("*.yaml"):
        (tmp_path / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    (tmp_path / "broken.yaml").write_text(
        "apiVersion: rolegate.dev/v1alpha1\nkind: RoleTable\nmetadata: {name: broken}\n"
        "spec:\n  roles:\n    - {name: oops, models: [qwen/qwen3-coder], patienceSeconds: -1,"
        " visibility: Watched}\n",
        encoding="utf-8",
    )
    result = run("compile", str(tmp_path))
    assert result.returncode == 1
    assert "broken.yaml" in result.stderr
    assert "RoleTable broken" in result.stderr
    assert "spec.roles[0].patienceSeconds" in result.stderr
    # The valid resources still compiled.
    roles = [role["name"] for role in json.loads(result.stdout)["config"]["roles"]]
    assert roles == ["agent", "batch", "reflex"]


def test_operator_says_what_it_needs_to_watch() -> None:
    result = run("operator")
    assert result.returncode == 2
    assert "--namespace" in result.stderr
    assert "--all-namespaces" in result.stderr


def test_proxy_refuses_to_start_with_nothing_to_serve(tmp_path: Path) -> None:
    result = run("proxy", "--manifests", str(tmp_path), "--port", str(free_port()))
    assert result.returncode == 2
    assert "no role was accepted" in result.stderr


def test_sim_rejects_a_bad_scenario_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "seed: 1\nmodels:\n  - name: m\n    machines:\n      - {name: a, tokensPerSecond: fast}\n"
    )
    result = run("sim", "--scenario", str(bad), "--port", str(free_port()))
    assert result.returncode == 2
    assert "tokensPerSecond" in result.stderr


def test_sim_and_proxy_processes_serve_the_openai_client_and_stop_on_sigterm(
    tmp_path: Path, processes: list[subprocess.Popen[str]]
) -> None:
    sim_port, proxy_port = free_port(), free_port()
    manifests = example_manifests(tmp_path, sim_port)
    env = {**os.environ, "ROLEGATE_SECRET_SIM_ROUTER_APIKEY": "test-key"}
    sim = subprocess.Popen(
        [*CLI, "sim", "--scenario", str(EXAMPLES / "scenario.yaml"), "--port", str(sim_port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    processes.append(sim)
    proxy = subprocess.Popen(
        [*CLI, "proxy", "--manifests", str(manifests), "--port", str(proxy_port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    processes.append(proxy)
    wait_until_up(f"http://127.0.0.1:{sim_port}/healthz", sim)
    wait_until_up(f"http://127.0.0.1:{proxy_port}/readyz", proxy)

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{proxy_port}/v1", api_key="x", max_retries=2)
    with client:
        completion = client.chat.completions.create(
            model="batch", messages=[{"role": "user", "content": "hello"}]
        )
    assert completion.model == "deepseek/deepseek-v3"
    assert completion.choices[0].message.content

    proxy.send_signal(signal.SIGTERM)
    assert proxy.wait(timeout=30) == 0
    _, stderr = proxy.communicate(timeout=5)
    assert "listening on" in stderr
    assert "hello" not in stderr  # never a prompt in the log


def test_demo_runs_end_to_end() -> None:
    result = run("demo", "--requests", "16", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "per role" in result.stdout
    for role in ("agent", "reflex", "batch"):
        assert f"\n{role} " in result.stdout
    assert (
        "breaker tripped: model deepseek/deepseek-v3 at sim-router (EmptyResponses" in result.stdout
    )
    assert "breaker recovered: model deepseek/deepseek-v3" in result.stdout
    # A newcomer is told where the request's spans are.
    assert "rolegate demo --trace-file" in result.stdout


def test_demo_writes_its_spans_and_shows_one_request(tmp_path: Path) -> None:
    """`--trace-file`: every request's spans as JSON lines (the console exporter), and one
    request's spans printed as a tree with where to find the rest."""
    spans = tmp_path / "spans.jsonl"
    result = run("demo", "--requests", "16", "--trace-file", str(spans), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    written = [json.loads(line) for line in spans.read_text(encoding="utf-8").splitlines()]
    roots = [s for s in written if s["kind"] == "SpanKind.SERVER"]
    assert roots
    assert {s["attributes"]["gen_ai.operation.name"] for s in written} == {"chat"}
    assert f"spans of {len(roots)} requests in {spans}" in result.stdout
    assert "one request's spans (trace 0x" in result.stdout
    assert re.search(r"\n  chat (agent|reflex|batch) \[SERVER \d+ ms", result.stdout)
    assert re.search(r"\n    chat \S+ \[CLIENT \d+ ms", result.stdout)


def test_proxy_connection_limit_flags_reach_the_server(
    tmp_path: Path, processes: list[subprocess.Popen[str]]
) -> None:
    """`--max-connections 1`: a second connection is refused 503 while a silent one holds
    the place; `--header-timeout-seconds 0.5` frees the place, and requests are served."""
    proxy_port = free_port()
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    for path in (EXAMPLES / "manifests").glob("*.yaml"):
        (manifests / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    proxy = subprocess.Popen(
        [*CLI, "proxy", "--manifests", str(manifests), "--port", str(proxy_port),
         "--max-connections", "1", "--header-timeout-seconds", "0.5",
         "--body-timeout-seconds", "0.5", "--idle-timeout-seconds", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    processes.append(proxy)
    wait_until_up(f"http://127.0.0.1:{proxy_port}/readyz", proxy)
    statuses: set[int] = set()

    def refused_then_served() -> bool:
        # Each round holds the one place with a silent connection first.
        with (
            socket.create_connection(("127.0.0.1", proxy_port)),
            contextlib.suppress(httpx.TransportError),
        ):
            statuses.add(httpx.get(f"http://127.0.0.1:{proxy_port}/healthz").status_code)
        return 503 in statuses

    wait_for(refused_then_served, "a connection over --max-connections answered 503")
    wait_for(
        lambda: httpx.get(f"http://127.0.0.1:{proxy_port}/healthz").status_code == 200,
        "a request served once the silent connection is gone",
    )
    assert run("proxy", "--manifests", str(manifests), "--max-connections", "0").returncode == 2
