"""`--state-file`: a restarted proxy routes from what it had learned (its speed beliefs and
its operational scores) on its first request,
through the real proxy, the simulator and the `openai` client; a file that is not a memory
starts it cold, and it says so."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from rolegate_proxy.edge.server import RunningProxy

from ..support import ProxyFactory, SimFactory, machine_policy, role_table
from .test_pod_memory import IMPLAUSIBLE_CASES, memory_with

MODEL = "vendor/model-a"
PROMPT: Any = [{"role": "user", "content": "write the next step"}]
# On paper m1 answers first in 0.05 s, m2 in 0.1 s; in fact m1 takes a second.
SHEETS = [
    {"name": "m1", "ttftSeconds": 0.05, "tokensPerSecond": 200},
    {"name": "m2", "ttftSeconds": 0.1, "tokensPerSecond": 200},
]
AGENT = {
    "name": "agent",
    "models": [MODEL],
    "patienceSeconds": 30,
    "visibility": "Watched",
    "ruling": "Order",
    "expectedOutputTokens": 10,
    # Wide: one slow answer never puts m1 a quality tier behind; only time decides.
    "qualityTolerance": 1.0,
}


async def _sim(sim_server: SimFactory) -> str:
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "machines": [
            {"name": "m1", "ttftSeconds": 1.0, "tokensPerSecond": 0},
            {"name": "m2", "ttftSeconds": 0, "tokensPerSecond": 0}]}]}
    )  # fmt: skip
    return sim.url


async def _first_asked(url: str) -> str:
    """The machine a streamed request was sent to first (a slow first token is raced by
    the next machine: the first arm says what the proxy believed before it asked)."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as ai:
        stream = await ai.chat.completions.create(model="agent", messages=PROMPT, stream=True)
        async for _ in stream:
            pass
    async with httpx.AsyncClient() as client:
        decisions = (await client.get(f"{url}/v1/rolegate/decisions")).json()["decisions"]
    return str(decisions[-1]["arms"][0]["machine"])


async def _operational(url: str, machine: str) -> dict[str, Any]:
    async with httpx.AsyncClient() as client:
        state = (await client.get(f"{url}/v1/rolegate/state")).json()
    (row,) = [row for row in state["scores"] if row["machine"] == machine]
    return dict(row["operational"])


async def _expected_ttft(url: str, machine: str) -> float:
    async with httpx.AsyncClient() as client:
        state = (await client.get(f"{url}/v1/rolegate/state")).json()
    (belief,) = [b for b in state["beliefs"] if b["machine"] == machine]
    return float(belief["expected_ttft_seconds"])


async def test_a_restarted_proxy_routes_from_its_restored_memory_on_its_first_request(
    sim_server: SimFactory, proxy_server: ProxyFactory, tmp_path: Path
) -> None:
    sim_url = await _sim(sim_server)
    objects = [machine_policy(sim_url, MODEL, SHEETS), role_table(AGENT)]
    memory = tmp_path / "memory.json"
    first = await proxy_server(objects, state_file=memory)
    # m1 leads on paper; its slow first tokens (raced by m2 each time) teach the first
    # proxy that it is slower than m2, until m2 is asked first.
    asked = [await _first_asked(first.url) for _ in range(3)]
    while asked[-1] == "m1":
        asked.append(await _first_asked(first.url))
        assert len(asked) < 12, asked
    assert asked[0] == "m1"
    learned = await _expected_ttft(first.url, "m1")
    scored = await _operational(first.url, "m2")
    assert scored["n"] >= 3
    await first.stop()  # writes the memory once more
    assert memory.stat().st_size > 0

    restarted = await proxy_server(objects, state_file=memory)
    assert await _expected_ttft(restarted.url, "m1") == pytest.approx(learned, rel=0.05)
    kept = await _operational(restarted.url, "m2")
    assert (kept["n"], kept["observed"]) == (scored["n"], pytest.approx(scored["observed"]))
    assert await _first_asked(restarted.url) == "m2"
    # Without the memory, the same configuration goes by the published figures.
    forgetful = await proxy_server(objects)
    assert await _expected_ttft(forgetful.url, "m1") < 0.1
    assert await _first_asked(forgetful.url) == "m1"


async def test_a_state_file_that_is_not_a_memory_starts_the_proxy_cold_and_says_so(
    sim_server: SimFactory,
    proxy_server: ProxyFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    sim_url = await _sim(sim_server)
    memory = tmp_path / "memory.json"
    memory.write_text('{"format": 1, "pod": "p", "writtenAt": 1, "machines": "sk-not-a-list"}')
    with caplog.at_level(logging.WARNING, logger="rolegate.proxy.memory"):
        proxy = await proxy_server(
            [machine_policy(sim_url, MODEL, SHEETS), role_table(AGENT)], state_file=memory
        )
    assert await _first_asked(proxy.url) == "m1"
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "rolegate.proxy.memory"]
    assert "state file ignored" in warning
    assert "machines is not a list" in warning
    assert "sk-not-a-list" not in warning
    # The next write replaces it with a real memory.
    await proxy.stop()
    assert b'"format":1' in memory.read_bytes()


# Crafted state files (SPEC E8) ------------------------------------------------------------

# Both machines answer at once: what decides the first machine asked is the belief alone.
INSTANT = {"seed": 1, "models": [{"name": MODEL, "machines": [
    {"name": "m1", "ttftSeconds": 0, "tokensPerSecond": 0},
    {"name": "m2", "ttftSeconds": 0, "tokensPerSecond": 0}]}]}  # fmt: skip


async def _started(
    sim_server: SimFactory, proxy_server: ProxyFactory, memory: Path
) -> RunningProxy:
    sim = await sim_server(INSTANT)
    objects = [machine_policy(sim.url, MODEL, SHEETS), role_table(AGENT)]
    return await proxy_server(objects, state_file=memory)


async def _state_answers(url: str) -> None:
    async with httpx.AsyncClient() as client:
        response = await client.get(f"{url}/v1/rolegate/state")
    assert response.status_code == 200, response.text


async def test_the_plausible_memory_the_crafted_files_start_from_is_restored(
    sim_server: SimFactory, proxy_server: ProxyFactory, tmp_path: Path
) -> None:
    """The control for the table below: unchanged, the crafted memory (m1's first token in
    5 s) is taken back, and m2 is asked first."""
    memory = tmp_path / "memory.json"
    memory.write_bytes(memory_with(("agg", MODEL, "m1"), now=time.time()))
    proxy = await _started(sim_server, proxy_server, memory)
    assert await _expected_ttft(proxy.url, "m1") > 2.0
    assert await _first_asked(proxy.url) == "m2"


@pytest.mark.parametrize(("changes", "field", "value"), IMPLAUSIBLE_CASES)
async def test_a_crafted_state_file_is_refused_naming_the_field_and_the_proxy_starts_cold(
    changes: dict[str, Any],
    field: str,
    value: str,
    sim_server: SimFactory,
    proxy_server: ProxyFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    memory = tmp_path / "memory.json"
    memory.write_bytes(memory_with(("agg", MODEL, "m1"), now=time.time(), **changes))
    with caplog.at_level(logging.WARNING, logger="rolegate.proxy.memory"):
        proxy = await _started(sim_server, proxy_server, memory)
    # Cold: it answers the state endpoint and serves the role, by the published figures.
    await _state_answers(proxy.url)
    assert await _first_asked(proxy.url) == "m1"
    assert await _expected_ttft(proxy.url, "m1") < 0.1
    # One warning, naming the file and the field, never the value.
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "rolegate.proxy.memory"]
    assert f"state file ignored path={memory} reason={field}" in warning
    reason = warning.split(" reason=", 1)[1]
    assert value not in reason


async def test_the_temporary_file_a_killed_save_left_is_removed_at_start(
    sim_server: SimFactory,
    proxy_server: ProxyFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A kill between writing the temporary file and renaming it leaves the temporary file
    (named as the writer names it: `.<name>.<8 random>.tmp`, or without the suffix from an
    older version). The next start removes those, and only those."""
    memory = tmp_path / "memory.json"
    # As edge/state_file.write_memory names it: `.<name>.`, eight random characters, `.tmp`.
    handle, left = tempfile.mkstemp(dir=tmp_path, prefix=f".{memory.name}.", suffix=".tmp")
    os.close(handle)
    older = tmp_path / f".{memory.name}.k2j4h6g8"
    older.write_bytes(b'{"format": 1, "po')
    others = [
        tmp_path / f".{memory.name}.notes",
        tmp_path / "other.tmp",
        tmp_path / ".other.json.abcdefgh.tmp",
        tmp_path / f"{memory.name}.abcdefgh.tmp",
    ]
    for other in others:
        other.write_text("not the proxy's")
    assert _names(tmp_path) == {Path(left).name, older.name} | {o.name for o in others}
    with caplog.at_level(logging.INFO, logger="rolegate.proxy.memory"):
        proxy = await _started(sim_server, proxy_server, memory)
    kept = {other.name for other in others}
    # The two leftovers gone (no save has run yet: only the files not the proxy's remain).
    assert _names(tmp_path) == kept
    assert any("state file leftovers removed" in r.getMessage() for r in caplog.records)
    assert await _first_asked(proxy.url) == "m1"
    await proxy.stop()  # and its own save leaves nothing behind but the memory
    assert _names(tmp_path) == {memory.name, *kept}


def _names(directory: Path) -> set[str]:
    return {path.name for path in directory.iterdir()}
