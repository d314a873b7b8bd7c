"""Fixtures that start real servers on free loopback ports: the simulated provider and the proxy."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from rolegate_proxy.server import RunningProxy
from rolegate_proxy.server import start as start_proxy
from rolegate_proxy.settings import ProxySettings
from rolegate_sim.scenario import parse_scenario
from rolegate_sim.server import RunningSim
from rolegate_sim.server import start as start_sim

from .support import ProxyFactory, SimFactory, compile_objects


@pytest.fixture(autouse=True)
def no_server_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """A handler that raises becomes a logged 500 a client might not notice: fail on it."""
    caplog.set_level(logging.WARNING, logger="aiohttp")
    yield
    errors = [r for r in caplog.get_records("call") if r.name.startswith("aiohttp")]
    assert not errors, [r.getMessage() for r in errors]


@pytest.fixture
async def sim_server() -> AsyncIterator[SimFactory]:
    running: list[RunningSim] = []

    async def make(scenario: dict[str, Any]) -> RunningSim:
        sim = await start_sim(parse_scenario(scenario), "127.0.0.1", 0)
        running.append(sim)
        return sim

    yield make
    for sim in running:
        await sim.stop()


@pytest.fixture
async def proxy_server() -> AsyncIterator[ProxyFactory]:
    running: list[RunningProxy] = []

    async def make(objects: list[dict[str, Any]], **settings: Any) -> RunningProxy:
        config = compile_objects(objects)
        proxy = await start_proxy(ProxySettings(host="127.0.0.1", port=0, **settings), config)
        running.append(proxy)
        return proxy

    yield make
    for proxy in running:
        await proxy.stop()
