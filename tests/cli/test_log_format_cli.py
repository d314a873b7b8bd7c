"""`rolegate --log-format json proxy`: the command's whole stderr is JSON lines, from the
compile report to the access log, and carries no prompt."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from .test_commands import CLI, EXAMPLES, example_manifests, free_port, wait_until_up

PROMPT_CANARY = "canary-prompt-cli-4d17"
KEY_CANARY = "sk-canary-cli-8e03"


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[str]]]:
    processes: list[subprocess.Popen[str]] = []
    yield processes
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


def test_json_log_format_makes_every_stderr_line_a_json_object(
    tmp_path: Path, started: list[subprocess.Popen[str]]
) -> None:
    sim_port, proxy_port = free_port(), free_port()
    manifests = example_manifests(tmp_path, sim_port)
    env = {**os.environ, "ROLEGATE_SECRET_SIM_ROUTER_APIKEY": KEY_CANARY}
    sim = subprocess.Popen(
        [*CLI, "sim", "--scenario", str(EXAMPLES / "scenario.yaml"), "--port", str(sim_port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, env=env,
    )  # fmt: skip
    started.append(sim)
    log = tmp_path / "proxy.log"
    with log.open("w", encoding="utf-8") as stderr:  # a file: a full pipe would block it
        proxy = subprocess.Popen(
            [*CLI, "--log-format", "json", "--log-level", "info",
             "proxy", "--manifests", str(manifests), "--port", str(proxy_port)],
            stdout=subprocess.DEVNULL, stderr=stderr, text=True, env=env,
        )  # fmt: skip
    started.append(proxy)
    wait_until_up(f"http://127.0.0.1:{sim_port}/healthz", sim)
    wait_until_up(f"http://127.0.0.1:{proxy_port}/readyz", proxy)
    with openai.OpenAI(
        base_url=f"http://127.0.0.1:{proxy_port}/v1", api_key=KEY_CANARY, max_retries=2
    ) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="batch", messages=[{"role": "user", "content": PROMPT_CANARY}]
        )
    completion = raw.parse()
    assert completion.choices[0].message.content
    proxy.send_signal(signal.SIGTERM)
    assert proxy.wait(timeout=30) == 0

    text = log.read_text(encoding="utf-8")
    entries = [json.loads(line) for line in text.splitlines()]  # every line, or it fails
    assert entries
    for entry in entries:
        assert {"time", "level", "logger", "message"} <= entry.keys(), entry
    loggers = [entry["logger"] for entry in entries]
    # The compile report and where it listens are log lines now, at every level.
    assert "rolegate.compile" in loggers
    [listening] = [entry for entry in entries if entry["logger"] == "rolegate.proxy.started"]
    assert f"listening on http://127.0.0.1:{proxy_port} " in listening["message"]
    [access] = [entry for entry in entries if entry["logger"] == "rolegate.proxy.access"]
    assert access["request_id"] == raw.headers["X-Request-Id"]
    assert access["role"] == "batch"
    assert access["provider"] == "sim-router"
    assert access["model"] == "deepseek/deepseek-v3"
    assert access["machine"] == raw.headers["X-Rolegate-Machine"]
    assert access["outcome"] == "answered"
    assert access["status"] == 200
    assert access["attempts"] >= 1
    assert access["total_ms"] > 0
    assert PROMPT_CANARY not in text
    assert KEY_CANARY not in text


def test_an_unknown_log_format_is_refused() -> None:
    result = subprocess.run(
        [*CLI, "--log-format", "xml", "compile", str(EXAMPLES / "manifests")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--log-format" in result.stderr
    assert "json" in result.stderr
