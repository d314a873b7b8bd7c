"""Deadlines for every arm in flight on one timer: `asyncio.timeout`, many at a time.

Each arm's answer (a stream's first content) is due within its silence bound from its
sending. With `asyncio.timeout` every arm made and cancelled a timer of its own, and
uvloop makes that costly: a libuv timer handle opened and closed each time cost more than
building the arm's request. Here a deadline is an entry in a table, and one timer is set
for the earliest entry. When it fires, every entry whose time has come expires (its task
is cancelled, and leaving the `within` block turns that cancellation into TimeoutError by
asyncio.timeout's own rule), and the timer is set for the earliest entry left. An arm that
ends first only leaves the table: the timer, once set, serves every later deadline.
"""

from __future__ import annotations

import asyncio
import math
from types import TracebackType


class Deadlines:
    """The deadlines of one event loop's arms."""

    __slots__ = ("_pending", "_timer", "_timer_at")

    def __init__(self) -> None:
        self._pending: dict[Deadline, None] = {}
        self._timer: asyncio.TimerHandle | None = None
        # When the timer fires (inf: no timer).
        self._timer_at = math.inf

    def within(self, seconds: float) -> Deadline:
        """`async with deadlines.within(seconds):` as `async with asyncio.timeout(seconds):`
        (the time counts from entering the block)."""
        return Deadline(self, seconds)

    def __len__(self) -> int:
        """Deadlines pending (blocks entered and not yet left)."""
        return len(self._pending)

    def _add(self, deadline: Deadline, loop: asyncio.AbstractEventLoop) -> None:
        self._pending[deadline] = None
        if deadline.when < self._timer_at:
            self._set_timer(deadline.when, loop)

    def _set_timer(self, when: float, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = loop.call_at(when, self._fire, loop)

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        # Due: every deadline up to the time this timer was set for, as their own timers
        # would have been (or up to now, should it fire late).
        due = max(self._timer_at, loop.time())
        self._timer, self._timer_at = None, math.inf
        earliest = math.inf
        for deadline in list(self._pending):
            if deadline.when <= due:
                del self._pending[deadline]
                deadline.expire()
            elif deadline.when < earliest:
                earliest = deadline.when
        if earliest < math.inf:
            self._set_timer(earliest, loop)


class Deadline:
    """One `within` block: entered in a task, it cancels that task if still inside at its
    time, and raises TimeoutError on leaving when that cancellation is what ended it."""

    __slots__ = ("_cancelling", "_deadlines", "_expired", "_seconds", "_task", "when")

    def __init__(self, deadlines: Deadlines, seconds: float) -> None:
        self._deadlines = deadlines
        self._seconds = seconds
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self._expired = False
        self.when = math.inf

    async def __aenter__(self) -> Deadline:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a deadline is kept inside a task")
        if self.when != math.inf:
            raise RuntimeError("a deadline is entered once")
        loop = asyncio.get_running_loop()
        self._task = task
        self._cancelling = task.cancelling()
        self.when = loop.time() + self._seconds
        self._deadlines._add(self, loop)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._deadlines._pending.pop(self, None)
        task, self._task = self._task, None  # (a finished task is not kept alive)
        if (
            self._expired
            and task is not None
            and task.uncancel() <= self._cancelling
            and exc_type is asyncio.CancelledError
        ):
            # No other cancellation came meanwhile: this one was ours.
            raise TimeoutError from exc

    @property
    def expired(self) -> bool:
        return self._expired

    def expire(self) -> None:
        """Its time has come: the task inside is cancelled."""
        if self._task is not None and not self._expired:
            self._expired = True
            self._task.cancel()
