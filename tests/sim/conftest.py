"""Every simulator test talks to a real server on a free loopback port."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from .simclient import StartSim


@pytest.fixture
def start_sim(sim_server: StartSim) -> StartSim:
    """The suite-wide simulator factory (tests/conftest.py) under this package's name."""
    return sim_server


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session
