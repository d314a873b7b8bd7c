"""Running `rolegate` subcommands as real processes in async tests, and bounded polling."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import httpx


async def start_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return await asyncio.to_thread(
        subprocess.Popen,
        [sys.executable, "-m", "rolegate_cli.main", "--log-level", "info", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
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
