"""A streamed arm: opening it (held back until its first output) and relaying it.

Streaming is committed lazily: events are held back until the first one that carries
output of any kind (text, reasoning, a tool call, a refusal) or the end of the stream, so
an upstream that fails before producing anything is replaced by the next attempt and the
client never sees it. Once committed, each event's own bytes go to the client as they
arrive, one write per network read; from the answer's first tool call on they are held
(the client stream's), so a tool call reaches the client only whole. The relay stops at
the first of: the answer's `[DONE]` (the client then has the complete answer and nothing
more is read), a break (cut, silence, an error event), a rate act that can move the
stream, or the client leaving (`ClientGone`, raised by the client stream).

The relay keeps the stream's own time: the wall clock less what a slow client held it
and less our own pauses (`paused`: the stream left unread while another machine is tried
to take it over). Neither is the machine's silence, a gap of its own, or a stall; both
are left out of the arm's time (`Watch.client_held`, which becomes `ArmEnd.client_held`).
A rate act on an answer already complete (its final chunk read) moves nothing.

A continuation's events pass its seam with what the client has (`seam.py`): the few that
change there are the provider's events with only that changed (its reader's `rewrite`),
every other one is the upstream's own bytes; what rolegate adds of its own (a finish at
the seam, text the seam held to the end) its writer writes (`ChatWriter`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import chain

import aiohttp

from ..core.arm_end import Cause
from ..core.verdicts import Verdict
from ..core.watch import Act, Watch
from ..wire.answers import Chunk
from ..wire.dialects import WireProtocol
from ..wire.sse import EventFramer, EventTooLarge, Kind
from .answer_bounds import AnswerBounds, AnswerMeter, AnswerOverBound
from .client_stream import ClientStream
from .seam import Seam, as_chunk
from .upstream import TRANSPORT_ERRORS, ArmFailed, Silence, failed_in_transport

# What the relay is handed per event: a decoded data event (a chunk, or the text of one
# that says nothing else), or a comment or `[DONE]` as its kind.
Item = Chunk | str | Kind
# An item and where the upstream's bytes that forward it lie: (item, buffer, start, end).
Sent = tuple[Item, bytes, int, int]
# A stream quiet this long is looked at by its watch (SPEC B5: silence is evidence).
SILENCE_TICK_SECONDS = 0.1
Clock = Callable[[], float]


class Reads:
    """Per network read, the complete events it finished: comments and [DONE] as their
    kind, data events decoded, each beside the span of upstream bytes that forwards it. A
    malformed event is skipped and counted (SPEC E4).

    A read's events are an iterator, each decoded as it is taken: a burst of a thousand
    events never becomes a list of a thousand decoded ones, whose objects, all alive at
    once, were what set the cycle collector off on a stream (an event's now die with it).
    Not a generator across reads: a read cancelled while it waits (a timer ran out)
    consumes nothing, and the next one goes on where it was."""

    __slots__ = ("_framer", "_meter", "_on_malformed", "_reader", "read_any")

    def __init__(
        self,
        response: aiohttp.ClientResponse,
        wire: WireProtocol,
        *,
        named: bool,
        on_malformed: Callable[[], None],
        bounds: AnswerBounds,
    ) -> None:
        # The next network read's bytes (b"" at the stream's clean end).
        self.read_any = response.content.readany
        connection = response.connection
        if connection is not None and connection.protocol is not None:
            # The relay's alarm bounds every silence of the stream (from its last content),
            # and opening it is bounded as a whole: aiohttp's read timeout would only bound
            # it again, at the cost of a timer made and cancelled on every network read.
            connection.protocol.read_timeout = None
        self._framer = EventFramer(bounds.max_event_bytes)
        self._meter = AnswerMeter(response.content, bounds)
        self._reader = wire.stream_reader(named=named)
        self._on_malformed = on_malformed

    def rewrite(self, event: bytes, chunk: Chunk) -> bytes:
        """The provider's event saying `chunk`'s text and reasoning instead (`StreamReader`)."""
        return self._reader.rewrite(event, chunk)

    async def next(self) -> Iterator[Sent] | None:
        """The events the next network reads complete; None at the stream's clean end."""
        while True:
            data = await self.read_any()
            if not data:
                return None
            if (events := self.take(data)) is not None:
                return events

    def take(self, data: bytes) -> Iterator[Sent] | None:
        """The events a network read completes; None when it completes none. Raises
        ArmFailed when the answer has passed a bound (`answer_bounds.py`)."""
        framer = self._framer
        try:
            self._meter.count(len(data))
            ended = framer.feed(data)
        except AnswerOverBound as bound:
            raise ArmFailed(Cause.MALFORMED, str(bound)) from None
        except EventTooLarge as bound:
            raise ArmFailed(Cause.MALFORMED, f"{bound} (--max-event-bytes)") from None
        return framer.events(self._reader.read, self._on_malformed) if ended else None


@dataclass(slots=True)
class OpenedStream:
    """A stream that has produced its first content (or ended empty), not yet committed."""

    response: aiohttp.ClientResponse
    reads: Reads
    # What was read up to the first content (keep-alive comments left out), and the rest
    # of the read that brought it, not yet decoded.
    held: list[Sent]
    first_at: float
    rest: Iterable[Sent] = ()
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
    while (sent := await opened.reads.next()) is not None:
        for each in sent:
            item = each[0]
            if isinstance(item, Kind):
                if item is Kind.DONE:
                    opened.held.append(each)
                    opened.empty = True
                    opened.first_at = clock()
                    return
                continue  # keep-alive comments before content mean nothing to a client
            if isinstance(item, str):
                # Text alone: content (in practice never here: it only follows a content
                # chunk read whole, and the first content ends the wait).
                opened.held.append(each)
                opened.rest = sent
                opened.first_at = clock()
                return
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
            opened.held.append(each)
            if item.has_content:  # output of any kind, or the finish
                opened.rest = sent
                opened.first_at = clock()
                opened.finish_reason = item.finish_reason
                opened.empty = item.finish_reason is not None and not item.has_output
                return
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
    # A held answer judged broken (BROKE with cause DEGRADED): its verdict.
    verdict: Verdict | None = None
    # A complete answer (DONE) whose `[DONE]` rolegate supplied, and whether the usage chunk
    # the caller asked for was rolegate's estimate: quirks to note, never faults.
    supplied_done: bool = False
    usage_estimated: bool = False


class _Alarm:
    """One timer for a relay's whole life, interrupting a read when its moment comes (the
    relay arms it before each read and disarms it after).

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

    def arm(self, due: float) -> None:
        """A read is about to wait, until `due` (on `clock`) at most."""
        self._due = due
        if self._handle is None or due < self._set_for:
            self._set(due)

    def disarm(self) -> None:
        """The read is over, however it ended."""
        self._due = math.inf

    def serves(self, task: asyncio.Task[object] | None) -> bool:
        """Whether it interrupts `task`'s reads (a relay run in another task needs its own)."""
        return self._task is task

    def rang(self) -> bool:
        """Whether the cancellation a read ended in was this alarm ringing (it is withdrawn
        then); False: it came from elsewhere (too), and stands."""
        if not self._rang:
            return False
        self._rang = False
        return self._task.uncancel() == 0

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
    producing costs no timer per read (one alarm, `_Alarm`), and the watch only its token
    observations."""

    opened: OpenedStream
    client: ClientStream
    watch: Watch
    silence: Silence
    clock: Clock
    # Whether a rate act may still move this stream (one move per request).
    may_move: bool = True
    # A continuation's seam with what the client has (`seam.py`).
    seam: Seam | None = None
    # The rate acts that found nothing to move to: kept, and counted.
    kept: list[Act] = field(default_factory=list)
    # When content last reached the client (the start of the relay until the first).
    _content_at: float | None = None
    # When the watch wants to be asked next, once it has been asked in a silence.
    _check_at: float | None = None
    _alarm: _Alarm | None = None
    # The client's holding before this relay began (`ClientStream.client_held`).
    _held_before: float = field(init=False)
    # Our own pauses of this stream (`paused`).
    _paused: _Paused = field(init=False)
    # The stream's own time (`_stream_clock`).
    _now: Clock = field(init=False)

    def __post_init__(self) -> None:
        self._held_before = self.client.client_held
        self._paused = _Paused()
        self._now = _stream_clock(self.clock, self.client, self._paused)

    async def run(self) -> Stop:
        """Forward until the answer is complete, the stream breaks, or it should move."""
        alarm = self._alarm
        if alarm is not None and not alarm.serves(asyncio.current_task()):
            # Run in another task than before (beside a race): an alarm of its own.
            alarm.stop()
            self._alarm = None
        try:
            return await self._relayed()
        finally:
            self._held()

    def _held(self) -> None:
        """The watch is told the seconds this stream was held from outside the machine (a
        slow client, our pauses): the arm's time leaves them out."""
        self.watch.client_held = self.client.client_held - self._held_before + self._paused.seconds

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The stream is left unread meanwhile, on our account (another machine is tried
        to take it over): that time is neither its silence nor a gap of its own."""
        began = self.clock()
        try:
            yield
        finally:
            self._paused.seconds += max(self.clock() - began, 0.0)
            self._held()

    async def _relayed(self) -> Stop:
        if self._content_at is None:  # (a kept stream resumes with its own)
            self._content_at = self._now()
        opened = self.opened
        # What was held back goes first, in one write with the rest of its read.
        first = bool(opened.held)
        events: Iterator[Sent] = chain(opened.held, opened.rest)
        opened.held, opened.rest = [], ()
        while True:
            if not first:
                got = await self._read()
                if isinstance(got, Stop):
                    return got
                if got is None:
                    return await self._ended()
                events = got
            # Sliced and written here, not in a coroutine: this is every network read.
            data, tokens, pending = self._forwarded(events)
            if pending is None:
                await self.client.write(data)
            else:
                attended = await self._attended(data, tokens, pending, events)
                if isinstance(attended, Stop):
                    return attended
                tokens = attended
            if tokens and (stop := self._produced(tokens, first=first)) is not None:
                return stop
            first = False

    def close(self) -> None:
        """The relay is over: its alarm rings no more."""
        if self._alarm is not None:
            self._alarm.stop()

    async def _read(self) -> Iterator[Sent] | Stop | None:
        """The next read, or the Stop a wait ended in: a stall, or a rate act that moves."""
        alarm = self._alarm
        if alarm is None:
            alarm = self._alarm = _Alarm(self._now)
        reads = self.opened.reads
        while True:
            now = self._now()
            assert self._content_at is not None
            stalled_at = self._content_at + self.silence.seconds
            wake = min(stalled_at, self._check_at or self._content_at + SILENCE_TICK_SECONDS)
            if now < wake:
                # Awaited here, not in a helper: a coroutine less for every network read.
                alarm.arm(wake)
                try:
                    data = await reads.read_any()
                except asyncio.CancelledError:
                    if not alarm.rang():
                        raise
                    now = self._now()
                except TRANSPORT_ERRORS as error:
                    failure = failed_in_transport(
                        error, self.silence, headers_in=True, content_in=True
                    )
                    return Stop(StopKind.BROKE, failure.cause, failure.detail)
                else:
                    if not data:
                        return None
                    try:
                        events = reads.take(data)
                    except ArmFailed as failure:
                        return Stop(StopKind.BROKE, failure.cause, failure.detail)
                    if events is not None:
                        return events
                    continue  # a read that completed no event: wait on
                finally:
                    alarm.disarm()
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
        if (
            self.may_move
            and act.movable
            and act.alternative is not None
            # Its final chunk read, the answer is complete: nothing is left to move.
            and self.client.delivered.finish_reason is None
        ):
            return Stop(StopKind.MOVE, Cause.MOVED, act=act)
        self.kept.append(act)
        return None

    async def _ended(self) -> Stop:
        """The upstream ended its stream cleanly. After the final chunk (its finish reason)
        the answer is complete: a missing `[DONE]` is supplied. Before it, a cut."""
        if self.client.delivered.finish_reason is not None:
            estimated = await self.client.finish(self._seam_rest())
            return Stop(StopKind.DONE, supplied_done=True, usage_estimated=estimated)
        return Stop(
            StopKind.BROKE, Cause.CUT, "the upstream stream was cut before the answer finished"
        )

    def _forwarded(self, events: Iterator[Sent]) -> tuple[bytes, int, Sent | None]:
        """One read's events as the bytes to write and how many pieces of output they
        carried, up to the first event that needs more than forwarding, if one does: the
        end ([DONE], an error chunk), the answer's first tool call, reasoning held back,
        or, while a continuation is checked at its seam, any of its output. That event is
        returned, taken from `events` but not forwarded; the rest of them are not read."""
        out = _Forward()
        tokens = 0
        client = self.client
        delivered = client.delivered
        texts = delivered.texts
        seam = self.seam
        at_seam = seam is not None and seam.splice is not None
        for sent in events:
            item, buffer, start, end = sent
            if type(item) is str:
                if at_seam:
                    return out.take(), tokens, sent
                # Text alone: all `Delivered.note` would take of it (the answer so far is
                # the texts; whatever else the chunk named, an earlier chunk named first).
                texts.append(item)
                tokens += 1
            elif type(item) is Chunk:
                if (
                    at_seam
                    or item.error is not None
                    or (item.tool_calls and not client.holds_tools)
                    or (item.reasoning and seam is not None and seam.drop_reasoning)
                ):
                    return out.take(), tokens, sent
                if not delivered.note(item):
                    continue
                tokens += item.outputs
            elif item is Kind.DONE:
                return out.take(), tokens, sent
            out.add(buffer, start, end)
        return out.take(), tokens, None

    async def _attended(
        self, data: bytes, tokens: int, pending: Sent, events: Iterator[Sent]
    ) -> Stop | int:
        """The rest of a read that held an event needing more than forwarding (rare): each
        such event attended to, the others forwarded; the Stop one makes, else the pieces
        of output the read carried."""
        while True:
            attended = await self._attend(data, pending)
            if isinstance(attended, Stop):
                return attended
            if attended < 0:  # the tool calls begin: that event again, now held
                events = chain((pending,), events)
            else:
                tokens += attended
            data, counted, next_pending = self._forwarded(events)
            tokens += counted
            if next_pending is None:
                await self.client.write(data)
                return tokens
            pending = next_pending

    async def _attend(self, data: bytes, sent: Sent) -> Stop | int:
        """An event `_forwarded` stopped at, after the bytes before it: the Stop it makes,
        else the pieces of output it added, or -1 for the answer's first tool call, which
        starts the hold and is then forwarded (into it) like any event."""
        item = sent[0]
        client = self.client
        if item is Kind.DONE:
            estimated = await client.finish(data + self._seam_rest())
            return Stop(StopKind.DONE, usage_estimated=estimated)
        assert not isinstance(item, Kind)
        if isinstance(item, Chunk) and item.error is not None:
            await client.write(data)
            code = f" ({item.error.code})" if item.error.code else ""
            detail = f"the upstream reported an error mid-stream{code}"
            return Stop(StopKind.BROKE, Cause.IN_BAND_ERROR, detail)
        chunk = as_chunk(item, client.delivered.model)
        passed, stopped = (chunk, False) if self.seam is None else self.seam.through(chunk)
        if stopped:
            # A stop sequence ends at the seam: the answer is complete there.
            estimated = await client.finish(data, reason="stop")
            return Stop(StopKind.DONE, usage_estimated=estimated)
        if passed.tool_calls and not client.holds_tools:
            if client.delivered.texts or client.delivered.others:
                await client.write(data)
                data = b""
            # (Else what came before is no answer yet, the role chunk say: held with it,
            # so an answer that is a call alone shows the client nothing until it is.)
            client.hold_tools()
            if passed is chunk:
                await client.write(data)
                return -1
        if passed is not chunk:
            # Not what the upstream sent: its event, changed only where the seam changed it
            # (dropped when nothing is left of it).
            if passed.has_content or passed.has_usage:
                client.delivered.note(passed)
                data += self.opened.reads.rewrite(sent[1][sent[2] : sent[3]], passed)
            await client.write(data)
            return passed.outputs
        if client.delivered.note(passed):
            data += sent[1][sent[2] : sent[3]]
        await client.write(data)
        return passed.outputs

    def _seam_rest(self) -> bytes:
        """At the continuation's end: its text still held at the seam, as an event."""
        seam = self.seam
        rest = None if seam is None else seam.rest(self.client.delivered.model)
        if rest is None:
            return b""
        self.client.delivered.note(rest)
        return self.client.writer.chunk(rest, rest.model)

    def _produced(self, tokens: int, *, first: bool) -> Stop | None:
        """Content reached the client: the stall clock starts again, and the watch is told.
        The first content's gap is the TTFT (the watch took it when the stream opened), not
        a token gap."""
        now = self._content_at = self._now()
        self._check_at = None
        return None if first else self._acted(self.watch.observe(now, tokens=tokens))


class _Paused:
    """Seconds a relay's stream was left unread on our account (`Relay.paused`)."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds = 0.0


def _stream_clock(clock: Clock, client: ClientStream, paused: _Paused) -> Clock:
    """A stream's own time: `clock` less what its client held it from now on (a slow
    reader stops the upstream by back-pressure; that wait is neither a silence nor a gap
    of the machine's, and no patience of the caller's is spent on it), and less our own
    pauses of it. A closure, not a method: the relay's alarm keeps it, and a bound method
    would tie the relay into a cycle that only the cycle collector frees, buffers and all."""
    held_before = client.client_held

    def now() -> float:
        return clock() - (client.client_held - held_before) - paused.seconds

    return now


class _Forward:
    """The bytes one write forwards: spans of the upstream's reads, each run of adjacent
    spans sliced once (a read forwarded whole is written as the very bytes read), never a
    copy per event."""

    __slots__ = ("_buffer", "_end", "_runs", "_start")

    def __init__(self) -> None:
        self._buffer = b""
        self._start = self._end = 0
        # Runs closed by a gap (an event not forwarded, or another read's): rare.
        self._runs: list[bytes] = []

    def add(self, buffer: bytes, start: int, end: int) -> None:
        if buffer is self._buffer and start == self._end:
            self._end = end
            return
        if self._end > self._start:
            self._runs.append(self._buffer[self._start : self._end])
        self._buffer, self._start, self._end = buffer, start, end

    def take(self) -> bytes:
        run = self._buffer[self._start : self._end]
        return b"".join((*self._runs, run)) if self._runs else run
