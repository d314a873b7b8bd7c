"""A streamed arm: opening it (held back until its first content) and relaying it.

Streaming is committed lazily: events are held back until the first one that carries
content (or the end of the stream), so an upstream that fails before producing anything is
replaced by the next attempt and the client never sees it. Once committed, each event's
own bytes go to the client as they arrive, one write per network read. The relay stops at
the first of: the answer's `[DONE]` (the client then has the complete answer and nothing
more is read), a break (cut, silence, an error event), a rate act that can move the
stream, or the client leaving (`ClientGone`, raised by the client stream).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypeVar

import aiohttp

from ..core.arm_end import Cause
from ..core.watch import Act, Watch
from ..wire.answers import Chunk
from ..wire.dialects import WireProtocol
from ..wire.sse import Event, EventFramer, MalformedEvent, decode_event_json
from .client_stream import ClientStream
from .upstream import TRANSPORT_ERRORS, ArmFailed, Silence, failed_in_transport

Item = Event | Chunk
# A stream quiet this long is looked at by its watch (SPEC B5: silence is evidence).
SILENCE_TICK_SECONDS = 0.1
Clock = Callable[[], float]
T = TypeVar("T")


class Reads:
    """Per network read, the complete events it finished: comments and [DONE] as they are,
    data events decoded. A malformed event is skipped and counted (SPEC E4).

    Not a generator: a read cancelled while it waits (a timer ran out) consumes nothing,
    and the next one goes on where it was."""

    __slots__ = ("_content", "_framer", "_named", "_on_malformed", "_wire")

    def __init__(
        self,
        response: aiohttp.ClientResponse,
        wire: WireProtocol,
        *,
        named: bool,
        on_malformed: Callable[[], None],
    ) -> None:
        self._content = response.content
        self._framer = EventFramer()
        self._wire = wire
        self._named = named
        self._on_malformed = on_malformed

    async def next(self) -> list[Item] | None:
        """The events the next network reads complete; None at the stream's clean end."""
        while True:
            data = await self._content.readany()
            if not data:
                return None
            items = self._decoded(data)
            if items:
                return items

    def _decoded(self, data: bytes) -> list[Item]:
        items: list[Item] = []
        for event in self._framer.feed(data):
            if event.is_comment or event.is_done:
                items.append(event)
                continue
            try:
                payload = decode_event_json(event)
            except MalformedEvent:
                self._on_malformed()
                continue
            items.append(self._wire.read_chunk(payload, event.raw, named=self._named))
        return items


@dataclass(slots=True)
class OpenedStream:
    """A stream that has produced its first content (or ended empty), not yet committed."""

    response: aiohttp.ClientResponse
    reads: Reads
    held: list[Item]
    first_at: float
    # The machine and model its chunks named, when they did.
    machine: str | None = None
    model: str | None = None
    # It reached its finish (or [DONE]) with no content and no tool call.
    empty: bool = False
    finish_reason: str | None = None

    def close(self) -> None:
        """Read to its end: the connection goes back to the pool. Otherwise (the client
        left, the stream broke or moved) it is closed, so the upstream stops generating."""
        if not self.response.closed and self.response.content.at_eof():
            self.response.release()
        else:
            self.response.close()


async def hold_until_content(
    opened: OpenedStream, clock: Clock, on_named: Callable[[str], None]
) -> None:
    """Read until the first content, the finish or [DONE] (plus whatever came in the same
    read), filling `opened`. Raises ArmFailed if the arm fails before that."""
    while (items := await opened.reads.next()) is not None:
        for index, item in enumerate(items):
            if isinstance(item, Event):
                if item.is_done:
                    opened.held.extend(items[index:])
                    opened.empty = True
                    opened.first_at = clock()
                    return
                continue  # keep-alive comments before content mean nothing to a client
            if item.error is not None:
                raise ArmFailed(
                    Cause.IN_BAND_ERROR, f"{item.error.describe()} before any content",
                    error=item.error,
                )  # fmt: skip
            if opened.machine is None and item.machine is not None:
                opened.machine = item.machine
                # The machine is known before its first token: the rate test judges the
                # wait against the right belief.
                on_named(item.machine)
            opened.model = opened.model or item.model
            if item.has_content:
                opened.held.extend(items[index:])
                opened.first_at = clock()
                opened.finish_reason = item.finish_reason
                opened.empty = item.finish_reason is not None and not item.has_output
                return
            opened.held.append(item)
    raise ArmFailed(Cause.CUT, "the stream ended before any content or [DONE]")


class StopKind(StrEnum):
    DONE = "done"
    BROKE = "broke"
    MOVE = "move"


@dataclass(frozen=True, slots=True)
class Stop:
    kind: StopKind
    cause: Cause = Cause.ANSWERED
    detail: str = ""
    act: Act | None = None
    # A complete answer (DONE) whose `[DONE]` rolegate supplied, and whether the usage chunk
    # the caller asked for was rolegate's estimate: quirks to note, never faults.
    supplied_done: bool = False
    usage_estimated: bool = False


class _Rang(Exception):
    """The alarm interrupted a read: its moment came."""


class _Alarm:
    """One timer for a relay's whole life, interrupting a read when its moment comes.

    `asyncio.timeout` would make and schedule a timer for every read: a tenth of what a
    streamed token costs the proxy. The moment a read is waited to moves later with every
    token (the stall bound, the silence check), so this timer is moved only when it is
    due earlier than it is set for, and when it rings early it is set again. It rings by
    cancelling the waiting task, as `asyncio.timeout` does, and tells that cancellation
    from any other by the task's count of cancellation requests."""

    __slots__ = ("_clock", "_due", "_handle", "_loop", "_rang", "_set_for", "_task")

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._handle: asyncio.TimerHandle | None = None
        self._set_for = math.inf  # on `clock`
        self._due = math.inf
        self._rang = False

    async def during(self, read: Awaitable[T], due: float) -> T:
        """`read`, unless `due` (on `clock`) comes first: then _Rang."""
        self._due = due
        if self._handle is None or due < self._set_for:
            self._set(due)
        try:
            return await read
        except asyncio.CancelledError:
            if not self._rang:
                raise
            self._rang = False
            if self._task.uncancel() > 0:
                raise  # cancelled for another reason too: that one stands
            raise _Rang() from None
        finally:
            self._due = math.inf

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _set(self, due: float) -> None:
        self.stop()
        self._set_for = due
        delay = max(due - self._clock(), 0.0)
        self._handle = self._loop.call_at(self._loop.time() + delay, self._ring)

    def _ring(self) -> None:
        self._handle = None
        if self._due == math.inf:
            return  # no read waits: the next one sets it again
        if self._clock() < self._due:
            self._set(self._due)  # rang early: the moment moved on
            return
        self._rang = True
        self._task.cancel()


@dataclass(slots=True)
class Relay:
    """Forwards one opened stream to the client, feeding its watch.

    Waiting for the next read is timed: a stream quiet for SILENCE_TICK_SECONDS is asked
    about by the watch (a silence is evidence, SPEC B5), as often as it wants, and one that
    sends nothing the client would see (only keep-alive comments, or nothing at all) for
    its silence bound has stalled, however many bytes it sent. A stream that keeps
    producing costs one timer per read, and the watch only its token observations."""

    opened: OpenedStream
    client: ClientStream
    watch: Watch
    silence: Silence
    clock: Clock
    # Whether a rate act may still move this stream (one move per request).
    may_move: bool = True
    # The rate acts that found nothing to move to: kept, and counted.
    kept: list[Act] = field(default_factory=list)
    # When content last reached the client (the start of the relay until the first).
    _content_at: float | None = None
    # When the watch wants to be asked next, once it has been asked in a silence.
    _check_at: float | None = None
    _alarm: _Alarm | None = None

    async def run(self) -> Stop:
        """Forward until the answer is complete, the stream breaks, or it should move."""
        if self._content_at is None:  # (a kept stream resumes with its own)
            self._content_at = self.clock()
        if self.opened.held:
            held, self.opened.held = self.opened.held, []
            stop = await self._send(held, first=True)
            if stop is not None:
                return stop
        while True:
            got = await self._read()
            if isinstance(got, Stop):
                return got
            if got is None:
                return await self._ended()
            stop = await self._send(got, first=False)
            if stop is not None:
                return stop

    def close(self) -> None:
        """The relay is over: its alarm rings no more."""
        if self._alarm is not None:
            self._alarm.stop()

    async def _read(self) -> list[Item] | Stop | None:
        """The next read, or the Stop a wait ended in: a stall, or a rate act that moves."""
        alarm = self._alarm
        if alarm is None:
            alarm = self._alarm = _Alarm(self.clock)
        while True:
            now = self.clock()
            assert self._content_at is not None
            stalled_at = self._content_at + self.silence.seconds
            wake = min(stalled_at, self._check_at or self._content_at + SILENCE_TICK_SECONDS)
            if now < wake:
                try:
                    return await alarm.during(self.opened.reads.next(), wake)
                except _Rang:
                    now = self.clock()
                except TRANSPORT_ERRORS as error:
                    failure = failed_in_transport(
                        error, self.silence, headers_in=True, content_in=True
                    )
                    return Stop(StopKind.BROKE, failure.cause, failure.detail)
            if now >= stalled_at:
                detail = f"sent nothing to show for {self.silence.seconds:g} s mid-answer"
                return Stop(StopKind.BROKE, Cause.STALL, detail)
            stop = self._acted(self.watch.observe(now))
            if stop is not None:
                return stop
            # Asked again when it wants (never: only the stall bound is left to wait for).
            check = self.watch.next_check(now)
            self._check_at = stalled_at if check is None else max(check, now + 0.001)

    def _acted(self, act: Act | None) -> Stop | None:
        if act is None:
            return None
        if self.may_move and act.movable and act.alternative is not None:
            return Stop(StopKind.MOVE, Cause.MOVED, act=act)
        self.kept.append(act)
        return None

    async def _ended(self) -> Stop:
        """The upstream ended its stream cleanly. After the final chunk (its finish reason)
        the answer is complete: a missing `[DONE]` is supplied. Before it, a cut."""
        if self.client.delivered.finish_reason is not None:
            estimated = await self.client.finish(b"")
            return Stop(StopKind.DONE, supplied_done=True, usage_estimated=estimated)
        return Stop(
            StopKind.BROKE, Cause.CUT, "the upstream stream was cut before the answer finished"
        )

    async def _send(self, items: list[Item], *, first: bool) -> Stop | None:
        """One read's events, in one write. The first content's gap is the TTFT (the watch
        took it when the stream opened), not a token gap."""
        out = bytearray()
        tokens = 0
        delivered = self.client.delivered
        for item in items:
            if isinstance(item, Event):
                if item.is_done:
                    estimated = await self.client.finish(bytes(out))
                    return Stop(StopKind.DONE, usage_estimated=estimated)
                out += item.raw
                continue
            if item.error is not None:
                await self.client.write(bytes(out))
                code = f" ({item.error.code})" if item.error.code else ""
                detail = f"the upstream reported an error mid-stream{code}"
                return Stop(StopKind.BROKE, Cause.IN_BAND_ERROR, detail)
            if delivered.note(item):
                out += item.raw
            tokens += 1 if item.content else 0
        await self.client.write(bytes(out))
        if tokens:
            self._content_at = self.clock()
            self._check_at = None
        if first or not tokens:
            return None
        return self._acted(self.watch.observe(self.clock(), tokens=tokens))
