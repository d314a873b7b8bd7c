"""Running `rolegate` subcommands as real processes in async tests, and bounded polling."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

# Each process's stderr file, by pid. Always a file, never a pipe: a pipe nobody reads
# fills after 64 KiB (an API-server outage logs that much) and then blocks every thread of
# the process that logs, freezing it.
_LOGS: dict[int, Path] = {}


async def start_cli(
    *args: str, env: dict[str, str] | None = None, log: Path | None = None
) -> subprocess.Popen[str]:
    """The command as a process, its stderr to `log` (a test may read it while the
    process runs), else to a temporary file `stop` prints the tail of."""
    command = [sys.executable, "-m", "rolegate_cli.main", "--log-level", "info", *args]
    process, path = await asyncio.to_thread(_spawn, command, {**os.environ, **(env or {})}, log)
    _LOGS[process.pid] = path
    return process


def _spawn(
    command: list[str], environment: dict[str, str], log: Path | None
) -> tuple[subprocess.Popen[str], Path]:
    if log is None:
        handle, name = tempfile.mkstemp(prefix="rolegate-", suffix=".log")
        os.close(handle)
        log = Path(name)
    with log.open("w", encoding="utf-8") as stderr:
        process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=stderr, text=True, env=environment
        )
    return process, log


async def stop(process: subprocess.Popen[str]) -> str:
    """SIGTERM, wait, and return the tail of its stderr (printed for failing tests)."""
    if process.poll() is None:
        process.terminate()
    try:
        await asyncio.to_thread(process.wait, timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        await asyncio.to_thread(process.wait, timeout=10)
    log = _LOGS.get(process.pid)
    text = log.read_text(encoding="utf-8", errors="replace") if log is not None else ""
    tail = text[-4000:]
    print(tail)
    return tail


async def ready(url: str) -> bool:
    async with httpx.AsyncClient() as client:
        try:
            return (await client.get(f"{url}/readyz")).status_code == 200
        except httpx.HTTPError:
            return False


async def served_roles(url: str) -> dict[str, dict[str, object]]:
    async with httpx.AsyncClient() as client:
        models = (await client.get(f"{url}/v1/models")).json()
    return {entry["id"]: entry["rolegate"] for entry in models["data"]}
