"""Running `rolegate` subcommands as real processes in async tests, and bounded polling."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx


async def start_cli(
    *args: str, env: dict[str, str] | None = None, log: Path | None = None
) -> subprocess.Popen[str]:
    """The command as a process; its stderr to `log` when given (a test reads it while the
    process runs), else to a pipe `stop` reads."""
    command = [sys.executable, "-m", "rolegate_cli.main", "--log-level", "info", *args]
    environment = {**os.environ, **(env or {})}
    if log is None:
        return await asyncio.to_thread(
            subprocess.Popen,
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=environment,
        )
    with log.open("w", encoding="utf-8") as stderr:
        return await asyncio.to_thread(
            subprocess.Popen,
            command,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            text=True,
            env=environment,
        )


async def stop(process: subprocess.Popen[str]) -> str:
    """SIGTERM, wait, and return the tail of its stderr (printed for failing tests)."""
    if process.poll() is None:
        process.terminate()
    try:
        _, stderr = await asyncio.to_thread(process.communicate, timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        _, stderr = await asyncio.to_thread(process.communicate, timeout=10)
    tail = (stderr or "")[-4000:]
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
