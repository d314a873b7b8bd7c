"""Deadlines on one timer (flow/deadlines.py) keep asyncio.timeout's contract: a block still
running at its time is cancelled and raises TimeoutError, one that ends first is left
alone, and a cancellation from outside stays a cancellation."""

from __future__ import annotations

import asyncio
import time

import pytest

from rolegate_proxy.flow.deadlines import Deadlines


async def _sleeps(deadlines: Deadlines, seconds: float, sleep: float) -> float:
    """How long the block ran before its deadline ended it (it sleeps far longer)."""
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        async with deadlines.within(seconds):
            await asyncio.sleep(sleep)
    return time.monotonic() - started


async def test_a_block_past_its_deadline_raises_timeout_at_about_its_time() -> None:
    deadlines = Deadlines()
    took = await _sleeps(deadlines, 0.1, 5.0)
    assert 0.09 <= took < 1.0
    assert len(deadlines) == 0


async def test_a_block_that_ends_in_time_is_left_alone_and_leaves_the_table() -> None:
    deadlines = Deadlines()
    async with deadlines.within(0.2) as deadline:
        assert len(deadlines) == 1
        await asyncio.sleep(0.01)
    assert len(deadlines) == 0
    assert not deadline.expired
    # The timer it set fires later, finds nothing due, and cancels nobody.
    await asyncio.sleep(0.3)
    assert asyncio.current_task() is not None
    assert not asyncio.current_task().cancelling()  # type: ignore[union-attr]


async def test_many_deadlines_share_one_timer_and_each_ends_at_its_own_time() -> None:
    deadlines = Deadlines()
    # The longest first: a later, shorter deadline brings the timer forward.
    long = asyncio.create_task(_sleeps(deadlines, 0.6, 5.0))
    await asyncio.sleep(0.01)
    short = asyncio.create_task(_sleeps(deadlines, 0.1, 5.0))
    middle = asyncio.create_task(_sleeps(deadlines, 0.3, 5.0))
    finished = asyncio.create_task(_ends_in_time(deadlines))
    took = await asyncio.gather(short, middle, long)
    assert await finished
    for seconds, ran in zip((0.1, 0.3, 0.6), took, strict=True):
        assert seconds - 0.01 <= ran < seconds + 0.5, (seconds, ran)
    assert took[0] < took[1] < took[2]
    assert len(deadlines) == 0


async def _ends_in_time(deadlines: Deadlines) -> bool:
    async with deadlines.within(0.2):
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # past its deadline, outside the block: not cancelled
    return True


async def test_a_cancellation_from_outside_stays_a_cancellation() -> None:
    deadlines = Deadlines()

    async def inside() -> None:
        async with deadlines.within(5.0):
            await asyncio.sleep(5.0)

    task = asyncio.create_task(inside())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(deadlines) == 0


async def test_a_cancellation_from_outside_after_the_deadline_is_not_swallowed() -> None:
    deadlines = Deadlines()
    reached = asyncio.Event()

    async def inside() -> None:
        async with deadlines.within(0.05):
            try:
                await asyncio.sleep(5.0)
            finally:
                reached.set()
                await asyncio.sleep(0.2)  # cancelled again from outside meanwhile

    task = asyncio.create_task(inside())
    await reached.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_deadline_is_kept_inside_a_task_and_entered_once() -> None:
    deadlines = Deadlines()
    deadline = deadlines.within(1.0)
    async with deadline:
        pass
    with pytest.raises(RuntimeError):
        async with deadline:
            pass
