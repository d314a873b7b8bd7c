"""Every simulator test talks to a real server on a free loopback port."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest

from rolegate_sim.scenario import parse_scenario
from rolegate_sim.server import RunningSim, start

from .simclient import StartSim


@pytest.fixture(autouse=True)
def no_server_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """A handler that raises becomes a logged 500 a client might not notice: fail on it."""
    caplog.set_level(logging.WARNING, logger="aiohttp")
    yield
    errors = [r for r in caplog.get_records("call") if r.name.startswith("aiohttp")]
    assert not errors, [r.getMessage() for r in errors]


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
