"""`--metrics-port` (issue 15): /metrics, /healthz and /readyz on a listener of their own.
/metrics is on the API port only when asked for (`--metrics-on-api-port`, issue 30: it
names every role, grant and provider to whoever reaches the port). Real servers
in-process, then the `rolegate proxy` command as a process (its flags, a port it cannot
bind). The metrics listener's connection limits: test_metrics_listener.py."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from rolegate_proxy.edge.server import RunningProxy

from ..support import ProxyFactory, SimFactory, provider_policy, role, role_table
from ..waiting import eventually, wait_for

MODEL = "vendor/model-a"
ASK: dict[str, Any] = {"model": "agent", "messages": [{"role": "user", "content": "hi"}]}
CLI = [sys.executable, "-m", "rolegate_cli.main"]
OPERATIONAL = ("/healthz", "/readyz")
API_ONLY = ("/v1/models", "/v1/rolegate/state")


async def _proxy(
    sim_server: SimFactory, proxy_server: ProxyFactory, **settings: Any
) -> RunningProxy:
    sim = await sim_server(
        {
            "seed": 1,
            "models": [
                {"name": MODEL, "reply": "ok", "machines": [{"name": "m1", "ttftSeconds": 0}]}
            ],
        }
    )
    return await proxy_server(
        [
            provider_policy("agg", f"{sim.url}/v1", {MODEL: ["m1"]}),
            role_table(role("agent", [MODEL])),
        ],
        **settings,
    )


def _answered(page: str) -> float:
    """rolegate_requests_total for the role `agent`, answered 200, on a /metrics page."""
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == "rolegate_requests_total" and sample.labels == {
                "role": "agent",
                "status": "200",
                "outcome": "answered",
            }:
                return sample.value
    return 0.0


async def test_with_a_metrics_port_metrics_leave_the_api_port(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    proxy = await _proxy(sim_server, proxy_server, metrics_port=0, metrics_on_api_port=False)
    assert proxy.metrics is not None
    assert proxy.metrics.port != proxy.port
    assert proxy.metrics_url == f"http://127.0.0.1:{proxy.metrics.port}"
    async with httpx.AsyncClient(timeout=10) as client:
        answer = await client.post(f"{proxy.url}/v1/chat/completions", json=ASK)
        assert answer.status_code == 200, answer.text

        # The API port: no /metrics (an unknown path, in the OpenAI error shape).
        hidden = await client.get(f"{proxy.url}/metrics")
        assert hidden.status_code == 404
        assert hidden.json()["error"]["code"] == "unknown_url", hidden.text
        # The routes it lists are the API port's: health, not metrics.
        assert "GET /healthz" in hidden.text
        assert "/metrics" not in hidden.text

        # The metrics port: the same process's metrics, the request just served counted.
        async def counted() -> float:
            page = await client.get(f"{proxy.metrics_url}/metrics")
            assert page.status_code == 200
            assert page.headers["Content-Type"].startswith("text/plain")
            return _answered(page.text)

        assert await eventually(counted, what="the request on the metrics port") == 1.0

        # Health on both listeners (the kubelet probes the metrics port; a load balancer
        # checks where it sends traffic), the same answer from the same state.
        for path in OPERATIONAL:
            on_api = await client.get(f"{proxy.url}{path}")
            on_metrics = await client.get(f"{proxy.metrics_url}{path}")
            assert on_api.status_code == on_metrics.status_code == 200, path
            assert on_api.json() == on_metrics.json(), path
        assert (await client.get(f"{proxy.metrics_url}/readyz")).json()["roles"] == 1
        # The metrics port serves nothing else.
        for path in API_ONLY:
            assert (await client.get(f"{proxy.metrics_url}{path}")).status_code == 404, path
        refused = await client.post(f"{proxy.metrics_url}/v1/chat/completions", json=ASK)
        assert refused.status_code == 404


async def test_without_a_metrics_port_the_api_port_serves_no_metrics_unless_asked(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    proxy = await _proxy(sim_server, proxy_server, metrics_on_api_port=False)
    assert proxy.metrics is None
    async with httpx.AsyncClient(timeout=10) as client:
        answer = await client.post(f"{proxy.url}/v1/chat/completions", json=ASK)
        assert answer.status_code == 200, answer.text
        # To a caller without any credential: no page, and no route to one named.
        hidden = await client.get(f"{proxy.url}/metrics")
        assert hidden.status_code == 404
        assert hidden.json()["error"]["code"] == "unknown_url", hidden.text
        assert "/metrics" not in hidden.text
        assert "agent" not in hidden.text
        for path in (*OPERATIONAL, *API_ONLY):
            assert (await client.get(f"{proxy.url}{path}")).status_code == 200, path


async def test_with_metrics_on_the_api_port_everything_is_served_there(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    proxy = await _proxy(sim_server, proxy_server, metrics_on_api_port=True)
    assert proxy.metrics is None
    assert proxy.metrics_url == proxy.url
    async with httpx.AsyncClient(timeout=10) as client:
        answer = await client.post(f"{proxy.url}/v1/chat/completions", json=ASK)
        assert answer.status_code == 200, answer.text

        async def counted() -> float:
            page = await client.get(f"{proxy.url}/metrics")
            assert page.status_code == 200
            return _answered(page.text)

        assert await eventually(counted, what="the request on the API port") == 1.0
        for path in (*OPERATIONAL, *API_ONLY):
            assert (await client.get(f"{proxy.url}{path}")).status_code == 200, path


# The command -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def manifests(tmp_path: Path) -> Path:
    """A directory the proxy starts on (its provider need not answer to start)."""
    directory = tmp_path / "manifests"
    directory.mkdir()
    objects = [
        provider_policy("agg", "http://127.0.0.1:9/v1", {MODEL: ["m1"]}),
        role_table(role("agent", [MODEL])),
    ]
    (directory / "all.yaml").write_text(yaml.safe_dump_all(objects), encoding="utf-8")
    return directory


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


class _Alive:
    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise AssertionError(f"the proxy exited with {self.process.returncode}")


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


def test_the_command_serves_metrics_on_its_metrics_port(
    manifests: Path, tmp_path: Path, processes: list[subprocess.Popen[str]]
) -> None:
    port, metrics_port = _free_port(), _free_port()
    log = tmp_path / "proxy.log"
    with log.open("w", encoding="utf-8") as stderr:
        proxy = subprocess.Popen(
            [*CLI, "proxy", "--manifests", str(manifests), "--port", str(port),
             "--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1"],
            stdout=subprocess.DEVNULL, stderr=stderr, text=True,
        )  # fmt: skip
    processes.append(proxy)
    api, metrics = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}"
    wait_for(lambda: _status(f"{metrics}/readyz") == 200, "the metrics port", alive=[_Alive(proxy)])
    assert _status(f"{metrics}/metrics") == 200
    assert _status(f"{metrics}/healthz") == 200
    assert _status(f"{api}/readyz") == 200
    assert _status(f"{api}/metrics") == 404
    proxy.send_signal(signal.SIGTERM)
    assert proxy.wait(timeout=30) == 0
    assert f"listening on {api} " in log.read_text()
    assert f"metrics on {metrics}" in log.read_text()


@pytest.mark.parametrize(("flags", "status"), [((), 404), (("--metrics-on-api-port",), 200)])
def test_the_command_serves_metrics_on_its_api_port_only_when_asked(
    manifests: Path, processes: list[subprocess.Popen[str]], flags: tuple[str, ...], status: int
) -> None:
    port = _free_port()
    proxy = subprocess.Popen(
        [*CLI, "proxy", "--manifests", str(manifests), "--port", str(port), *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    processes.append(proxy)
    api = f"http://127.0.0.1:{port}"
    wait_for(lambda: _status(f"{api}/readyz") == 200, "the API port", alive=[_Alive(proxy)])
    assert _status(f"{api}/metrics") == status


@pytest.mark.parametrize("taken", ["--port", "--metrics-port"])
def test_a_port_already_taken_is_refused_by_name(manifests: Path, taken: str) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        ports = {"--port": str(_free_port()), "--metrics-port": str(_free_port())}
        ports[taken] = str(busy)
        result = subprocess.run(
            [*CLI, "proxy", "--manifests", str(manifests),
             *(arg for flag, value in ports.items() for arg in (flag, value))],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    assert result.returncode == 2, result.stderr
    refusal = f"cannot listen on 127.0.0.1:{busy} ({taken}): Address already in use"
    assert refusal in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_a_metrics_host_without_a_metrics_port_is_refused(manifests: Path) -> None:
    result = subprocess.run(
        [*CLI, "proxy", "--manifests", str(manifests), "--metrics-host", "0.0.0.0"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--metrics-host needs --metrics-port" in result.stderr
