"""A machine's answering slots: at most `limit` answers at once, the rest wait their turn.

A single-slot llama.cpp server answers one request at a time; the others wait in its queue
and the wait shows to the client as a late first token. `Slots` is that queue: arrival
order (FIFO), and a waiter whose client goes away (its handler is cancelled) simply leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator


class Slots:
    __slots__ = ("_busy", "_limit", "_waiting")

    def __init__(self, limit: int | None) -> None:
        # None: as many at once as arrive (the default machine never queues).
        self._limit = limit
        self._busy = 0
        self._waiting: deque[asyncio.Future[None]] = deque()

    @property
    def limit(self) -> int | None:
        return self._limit

    @property
    def busy(self) -> int:
        """Answers being produced now."""
        return self._busy

    @property
    def waiting(self) -> int:
        """Requests queued for a slot."""
        return sum(1 for waiter in self._waiting if not waiter.done())

    @property
    def ahead(self) -> int:
        """How many requests a newcomer would wait behind (0: it would be served at once)."""
        if self._free():
            return 0
        return self._busy + self.waiting

    def _free(self) -> bool:
        # A newcomer never overtakes a waiter, even when a slot is momentarily free.
        return self._limit is None or (self._busy < self._limit and not self._waiting)

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        await self._acquire()
        try:
            yield
        finally:
            self._release()

    async def _acquire(self) -> None:
        if self._free():
            self._busy += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                # The slot was handed over just as the client left: pass it on.
                self._release()
            else:
                with contextlib.suppress(ValueError):
                    self._waiting.remove(waiter)
            raise

    def _release(self) -> None:
        # A freed slot goes straight to the longest waiter (the count of busy slots stays).
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._busy -= 1
