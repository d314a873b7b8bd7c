"""Waiting for something that happens elsewhere (another process, a background task, the API
server): poll for the condition until a deadline, and fail naming what never happened and
what was last seen. Never a fixed sleep standing in for the condition, never the first
observation taken as the last word.

The deadlines are generous (a loaded 2-core machine is slow); a condition that holds returns
at its first poll that sees it, so a quick machine never waits for them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol, TypeVar

T = TypeVar("T")


class Watched(Protocol):
    """A process a wait should give up on at once if it died (its output says why)."""

    def check_alive(self) -> None: ...


async def eventually(
    check: Callable[[], Awaitable[T | None]],
    *,
    what: str,
    within: float = 10.0,
    every: float = 0.02,
) -> T:
    """The first truthy result of `check`, polled every `every` seconds."""
    deadline = time.monotonic() + within
    while True:
        last = await check()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within}s: {what} (last: {last!r})")
        await asyncio.sleep(every)


def wait_for(
    probe: Callable[[], T | None],
    what: str,
    *,
    within: float = 20.0,
    every: float = 0.1,
    alive: Iterable[Watched] = (),
) -> T:
    """The first truthy result of `probe`, polled every `every` seconds, for code that runs
    outside an event loop; fails at once if one of `alive` has died."""
    deadline = time.monotonic() + within
    while True:
        for process in alive:
            process.check_alive()
        last = probe()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within}s: {what} (last: {last!r})")
        time.sleep(every)


async def seconds_until(
    check: Callable[[], Awaitable[T | None]], *, what: str, within: float = 10.0
) -> float:
    """How long `check` took to hold: for the latencies a test reports (a reload, a trip
    reaching the resource), polled finely so the figure is not the poll interval."""
    started = time.monotonic()
    await eventually(check, what=what, within=within, every=0.01)
    return time.monotonic() - started
