"""Every simulator test talks to a real server on a free loopback port."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from rolegate_sim.scenario import parse_scenario
from rolegate_sim.server import RunningSim, start

StartSim = Callable[[dict[str, Any]], Awaitable[RunningSim]]


@pytest.fixture
async def start_sim() -> AsyncIterator[StartSim]:
    running: list[RunningSim] = []

    async def make(data: dict[str, Any]) -> RunningSim:
        sim = await start(parse_scenario(data), "127.0.0.1", 0)
        running.append(sim)
        return sim

    yield make
    for sim in running:
        await sim.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session
