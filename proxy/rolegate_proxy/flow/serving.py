"""Serving one streamed arm up to its first content (SPEC B5, B6, E4): raced against a
better machine when it is late, then handed to its delivery (`delivery.py`).

Before any content reached the client a late first token is a race: a rival starts on the
better machine, whichever produces content first is kept, the other is cancelled, and both
teach the ledger. A stream that finished empty is refused here, while the client has seen
nothing, when the empty answer counts.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from ..core.arm_end import ArmEnd, Cause
from ..core.routing import Attempt
from ..core.watch import Act
from .arms import ArmRun, verdict_on
from .delivery import Delivery
from .stream import OpenedStream
from .stream_arms import Host, Leg, StreamArms
from .upstream import ArmFailed


class StreamServer:
    def __init__(self, host: Host, attempt: Attempt, budget: float) -> None:
        self.host = host
        self.services = host.services
        self.now = host.services.now
        self.arms = StreamArms(host)
        self.budget = budget
        self.leg = Leg(self.arms.run(attempt, budget))
        # The arms waiting for their first content: the client leaving ends each of them.
        self.waiting: list[ArmRun] = [self.leg.run]

    async def serve(self) -> web.StreamResponse | None:
        """The client's response once this arm's content reached it; None when it failed
        before that (recorded; the exchange moves on)."""
        if not await self._first_content():
            return None
        opened = self.leg.opened
        assert opened is not None
        if opened.empty and self._refused_empty(opened):
            return None
        delivery = Delivery(self.host, self.arms, self.leg)
        return await delivery.deliver(self.host.client_stream())

    # -- the first content, raced when it is late ---------------------------------------

    async def _first_content(self) -> bool:
        run = self.leg.run
        first = asyncio.create_task(self.arms.open(run, self.host.chat))
        try:
            act = await self._late(first, run)
            if act is None:
                return self._settled(first, run)
            rival = self._rival(act)
            if rival is None:
                await asyncio.wait({first})
                return self._settled(first, run)
            return await self._race(first, rival, act)
        except asyncio.CancelledError:
            first.cancel()
            # The client left (or we shut down) before the first token: each wait still
            # teaches (B7).
            for waiting in self.waiting:
                self.host.record(self.services.cancelled(waiting, "before the first token"))
            raise
        finally:
            self.waiting.clear()

    async def _late(self, first: asyncio.Task[OpenedStream], run: ArmRun) -> Act | None:
        """Wait for the arm's first content; the rate test's act if it calls the first
        token late while a better machine could race it, else None once the arm settled."""
        watch = run.watch
        assert watch is not None
        while True:
            check_at = watch.next_check(self.now())
            timeout = None if check_at is None else max(0.0, check_at - self.now())
            done, _ = await asyncio.wait({first}, timeout=timeout)
            if done:
                return None
            act = watch.observe(self.now())
            if act is not None and act.movable and act.alternative is not None:
                return act

    def _rival(self, act: Act) -> ArmRun | None:
        rival = self.arms.rival(act, self.leg.run, self.budget)
        if rival is not None:
            self.waiting.append(rival)
        return rival

    def _settled(self, task: asyncio.Task[OpenedStream], run: ArmRun) -> bool:
        try:
            self.leg = Leg(run, task.result())
        except ArmFailed as failure:
            self.host.fail(run.failed(failure, self.now()))
            return False
        return True

    async def _race(self, first: asyncio.Task[OpenedStream], rival: ArmRun, act: Act) -> bool:
        """Both arms run; the one that produces content first serves, the other is
        cancelled (and teaches what it waited)."""
        second = asyncio.create_task(self.arms.open(rival, self.host.chat))
        arms = {first: self.leg.run, second: rival}
        pending: set[asyncio.Task[OpenedStream]] = set(arms)
        lost: list[ArmEnd] = []
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if self._settled_quietly(task, arms[task], lost):
                        await self._cancel_losers(pending, arms, act)
                        for end in lost:
                            self.host.fail(end)
                        return True
        finally:
            for task in pending:
                task.cancel()
        for end in lost:
            self.host.fail(end)
        return False

    def _settled_quietly(
        self, task: asyncio.Task[OpenedStream], run: ArmRun, lost: list[ArmEnd]
    ) -> bool:
        self.waiting.remove(run)
        try:
            self.leg = Leg(run, task.result())
        except ArmFailed as failure:
            lost.append(run.failed(failure, self.now()))
            return False
        return True

    async def _cancel_losers(
        self,
        pending: set[asyncio.Task[OpenedStream]],
        arms: dict[asyncio.Task[OpenedStream], ArmRun],
        act: Act,
    ) -> None:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        for task in pending:
            loser = arms[task]
            self.waiting.remove(loser)
            detail = f"lost the race; raced ({act.reason.value}): {act.detail}"
            self.host.record(loser.end(Cause.RACE_LOST, self.now(), detail))
        pending.clear()

    def _refused_empty(self, opened: OpenedStream) -> bool:
        """A stream that finished with nothing in it, before anything reached the client:
        another machine or model may still answer, if the empty answer counts (SPEC A2)."""
        run = self.leg.run
        verdict = verdict_on(self.host.chat, "", opened.finish_reason)
        if not verdict.counts(run.attempt.provider.degraded_output):
            return False
        opened.close()
        self.host.fail(run.end(Cause.DEGRADED, self.now(), "answered 200 with an empty completion",
                               verdict=verdict))  # fmt: skip
        return True
