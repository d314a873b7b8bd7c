"""A finished stream's relay is freed by reference counting (SPEC E8: memory bounded).

The proxy lets the cycle collector wait for 10,000 young objects (edge/server.py), so a
relay caught in a reference cycle keeps its upstream response, its framer's buffer and
its read's bytes alive long after its request ended: a relay whose alarm kept a bound
method of it raised `peers.py`'s peak RSS by 10 MiB (bench/results/peers-bounds.txt).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import openai
import pytest

from rolegate_proxy.flow.stream import Relay

from ..support import (
    ProxyFactory,
    SimFactory,
    one_machine_sim,
    outcomes,
    provider_policy,
    role,
    role_table,
)

MODEL = "vendor/model"


@pytest.fixture
def no_cycle_collection() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.usefixtures("no_cycle_collection")
async def test_a_finished_streams_relay_is_freed_without_the_cycle_collector(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    sim = await one_machine_sim(
        sim_server, MODEL, reply="one two three four", tokens_per_second=500
    )
    proxy = await proxy_server(
        [
            provider_policy("sim", f"{sim.url}/v1", {MODEL: ["m1"]}),
            role_table(role("agent", [MODEL])),
        ]
    )
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0) as c:
        for _ in range(3):
            stream = await c.chat.completions.create(
                model="agent", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
            assert text == "one two three four"
    await outcomes(proxy, 3)
    left = [o for o in gc.get_objects() if type(o) is Relay]
    assert left == [], f"{len(left)} relays wait for the cycle collector"
