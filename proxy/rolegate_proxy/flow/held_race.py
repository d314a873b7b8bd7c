"""A race for a held answer nobody has seen (SPEC B6, B9): an alternative opens while the
held stream goes on being read (`delivery.py` starts one for a rate act on a held answer
that the alternative would start afresh).

Nothing of the held answer reached the client, so this is a race like the one for a
late first token: whichever is first wins. The held stream wins by being complete (its
judgment is the delivery's); the alternative by its first content. The held stream is
never paused for the alternative, so no wait of ours becomes its silence, and a complete
held answer is never thrown away for an alternative that has not even begun.
"""

from __future__ import annotations

import asyncio

from ..core.arm_end import Cause
from ..core.watch import Act
from .arms import ArmRun
from .stream import OpenedStream, Relay, Stop
from .stream_arms import Host, StreamArms
from .upstream import ArmFailed


class HeldRace:
    """The alternative opening beside a held stream, until one of them wins."""

    def __init__(self, host: Host, arms: StreamArms, run: ArmRun, act: Act) -> None:
        self.host = host
        self.now = host.services.now
        self.run = run
        self.act = act
        self.task = asyncio.create_task(arms.open(run, host.chat))
        # The alternative failed before its first content (its end is recorded).
        self.failed = False

    async def beside(self, relay: Relay) -> Stop | OpenedStream:
        """`relay` run while the alternative opens: its Stop when it ends first (or the
        alternative failed, recorded), else the alternative's opened stream (its first
        content came first: the relay is stopped where it was)."""
        reading = asyncio.create_task(relay.run())
        try:
            done, _ = await asyncio.wait({reading, self.task}, return_when=asyncio.FIRST_COMPLETED)
            if reading in done:
                return reading.result()
            opened = self._settled()
            if opened is None:
                return await reading
            reading.cancel()
            await asyncio.wait({reading})
            if not reading.cancelled():
                # It ended as it was stopped: the held stream's end decides first.
                return reading.result()
            return opened
        finally:
            if not reading.done():
                reading.cancel()

    def _settled(self) -> OpenedStream | None:
        """The alternative's opened stream, or None when it failed (recorded once)."""
        try:
            return self.task.result()
        except ArmFailed as failure:
            if not self.failed:
                self.failed = True
                self.host.fail(self.run.failed(failure, self.now()))
            return None

    async def replacement(self) -> OpenedStream | None:
        """The held stream broke: the alternative, once open, replaces it (None: it
        failed, recorded)."""
        await asyncio.wait({self.task})
        return self._settled()

    async def lost(self) -> None:
        """The held answer was complete first: the alternative is cancelled (or closed,
        had it just opened), and teaches what it waited (B7)."""
        self.task.cancel()
        await asyncio.wait({self.task})
        if not self.task.cancelled():
            opened = self._settled()
            if opened is None:
                return
            opened.close()
        detail = f"lost the race to a held answer; raced ({self.act.reason.value})"
        self.host.record(self.run.end(Cause.RACE_LOST, self.now(), detail))

    def drop(self) -> None:
        """The request ends (the client left, we shut down): the alternative with it."""
        task = self.task
        if task.done() and not task.cancelled():
            opened = self._settled()
            if opened is None:
                return  # it failed: its end is recorded
            opened.close()
        else:
            task.cancel()
        self.host.record(self.host.services.cancelled(self.run, "before the first token"))
