"""One arm in flight (`ArmRun`), and the two ways of sending one: a non-streamed answer
read whole (`complete`), and a stream opened up to its first content (`open_stream`).

An arm knows what it was sent with and what it has shown so far; `ArmRun.end` turns that
into its one `ArmEnd`. Neither function records anything: the exchange hands every end to
the recorder.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import aiohttp
from aiohttp import web

from ..core.arm_end import Answered, ArmEnd, Cause
from ..core.beliefs import NO_GAPS, MachineKey
from ..core.exclusions import parse_retry_after
from ..core.load import Load, Ticket
from ..core.outcomes import ArmAct
from ..core.routing import Attempt
from ..core.tool_calls import ToolCall
from ..core.verdicts import Verdict, judge
from ..core.watch import Watch
from ..wire.answers import Completion, NotTheProtocol, UpstreamError
from ..wire.chat_request import ChatRequest
from ..wire.dialects import WIRE, WireProtocol
from . import tracing
from .answer_bounds import AnswerOverBound, read_whole
from .stream import OpenedStream, Reads, hold_until_content
from .upstream import (
    TRANSPORT_ERRORS,
    ArmFailed,
    Silence,
    Upstreams,
    failed_in_transport,
    failed_with_status,
    send,
)

Clock = Callable[[], float]


@dataclass(slots=True)
class ArmRun:
    """One upstream attempt while it runs."""

    attempt: Attempt
    started: float
    streamed: bool
    # How long it may stay silent, and which limit that is.
    silence: Silence
    act: ArmAct | None = None
    # The machine the answer named (an aggregator's sub-provider), once it did.
    named: str | None = None
    # A streamed arm's watch: its first token, its gaps, its rate test.
    watch: Watch | None = None
    # Its span's id in a traced request, drawn at each sending (0: not traced).
    span_id: int = 0
    # Its place in its machine's count of requests in flight, from sending to its end.
    ticket: Ticket | None = None

    @property
    def machine(self) -> str | None:
        return self.named or self.attempt.presumed_machine

    def count_on(self, load: Load) -> ArmRun:
        """The arm counts as in flight on its machine from now (SPEC B8): taken when the
        arm is made, before anything awaits, so requests decided at the same moment see
        each other's choices."""
        machine = self.machine
        if machine is not None:
            self.ticket = load.take(self.key_of(machine), self.started)
        return self

    def name(self, machine: str) -> None:
        """The answer named the machine serving it: the arm counts there from now."""
        self.named = machine
        ticket = self.ticket
        if ticket is not None and ticket.key.machine != machine:
            ticket.owner.move(ticket, self.key_of(machine))

    def key_of(self, machine: str) -> MachineKey:
        attempt = self.attempt
        return MachineKey(attempt.provider.name, attempt.model.name, machine)

    def _give_back(self) -> None:
        """The arm ended: it no longer counts on its machine; its first token, when it
        streamed one, says how the machine's queue treated it (core/load.py)."""
        ticket = self.ticket
        if ticket is None or ticket.returned:
            return
        if self.named is not None and ticket.key.machine != self.named:
            ticket.owner.move(ticket, self.key_of(self.named))
        watch = self.watch
        first = None if watch is None else watch.first_at
        ticket.owner.give_back(ticket, None if first is None else first - self.started)

    @property
    def wire(self) -> WireProtocol:
        """How this arm's provider is spoken to and read."""
        return WIRE[self.attempt.provider.dialect]

    def end(
        self,
        cause: Cause,
        at: float,
        detail: str,
        *,
        verdict: Verdict | None = None,
        answer: Answered | None = None,
    ) -> ArmEnd:
        self._give_back()
        watch = self.watch
        attempt = self.attempt
        # Positional, in the fields' order: passed by keyword, twenty fields cost more to
        # match by name than to make the record.
        return ArmEnd(
            attempt.provider.name,  # provider
            attempt.model.name,  # model
            self.machine,  # machine
            cause,  # cause
            self.started,  # started_at
            at,  # ended_at
            self.streamed,  # streamed
            not attempt.is_aggregator,  # direct
            self.named is not None,  # named
            None if watch is None else watch.first_at,  # first_at
            NO_GAPS if watch is None else watch.gaps,  # gaps
            None,  # status
            None,  # error_code
            None,  # request_fault
            None,  # retry_after
            verdict,  # verdict
            answer,  # answer
            self.act,  # act
            False,  # delivered
            detail,  # detail
            self.span_id,  # span_id
            0.0 if watch is None else watch.client_held,  # client_held
        )

    def failed(self, failure: ArmFailed, at: float) -> ArmEnd:
        error = failure.error
        if error is not None and error.machine is not None:
            self.name(self.named or error.machine)
        end = self.end(failure.cause, at, failure.detail)
        if error is not None:
            # What is kept of the upstream's error: its status and a known code, never text.
            end.status, end.error_code = error.status, error.code
            end.request_fault = error.request_fault
        end.retry_after = parse_retry_after(failure.retry_after, wall_now=time.time())
        return end


async def post(
    upstreams: Upstreams, run: ArmRun, chat: ChatRequest, *, fresh: bool
) -> aiohttp.ClientResponse:
    """Send the arm; an error status is read, classified and raised as ArmFailed."""
    trace_headers = None
    ids = tracing.current()
    if ids is not None:
        # Each sending is a span of its own (a stale connection's retry is another arm).
        run.span_id = tracing.span_id()
        if run.attempt.provider.propagate_trace_context:
            trace_headers = tracing.upstream_headers(ids, run.span_id)
    if run.ticket is None or run.ticket.returned:
        run.count_on(upstreams.load)  # sent again (a stale connection's retry)
    response = await send(
        upstreams, run.attempt, chat, run.silence, fresh=fresh, extra_headers=trace_headers
    )
    if response.status != 200:
        try:
            raise await failed_with_status(response, run.wire, named=run.attempt.is_aggregator)
        finally:
            response.release()
    return response


class Reply(NamedTuple):
    """A non-streamed answer ready for the client: the provider's own bytes."""

    body: bytes
    completion: Completion


async def complete(upstreams: Upstreams, run: ArmRun, chat: ChatRequest, *, fresh: bool) -> Reply:
    """One non-streamed arm, read whole. Raises ArmFailed when it produced nothing usable
    (its verdict is the caller's to judge). The whole answer is due within the arm's
    silence bound from its sending, whatever keep-alive whitespace comes before it."""
    silence = run.silence
    try:
        async with upstreams.deadlines.within(silence.seconds):
            response = await post(upstreams, run, chat, fresh=fresh)
            try:
                raw = await read_whole(response, upstreams.bounds)
            finally:
                response.release()
    except TRANSPORT_ERRORS as error:
        raise failed_in_transport(error, silence, headers_in=True, content_in=False) from None
    except AnswerOverBound as bound:
        raise ArmFailed(Cause.MALFORMED, str(bound)) from None
    try:
        parsed = run.wire.parse_completion(raw, named=run.attempt.is_aggregator)
    except NotTheProtocol as problem:
        raise ArmFailed(Cause.MALFORMED, f"answered 200 with a body that is {problem}") from None
    if isinstance(parsed, UpstreamError):
        run.named = run.named or parsed.machine
        raise ArmFailed(Cause.IN_BAND_ERROR, f"answered 200 with {parsed.describe()}", error=parsed)
    run.named = run.named or parsed.machine
    return Reply(raw, parsed)


def verdict_on(
    chat: ChatRequest,
    text: str,
    finish: str | None,
    *,
    tool_calls: Sequence[ToolCall] = (),
    refusal: bool = False,
) -> Verdict:
    """The structural verdict on an answer (SPEC A2, A3): its text, and its tool calls
    against the tools the request declared."""
    return judge(
        text,
        finish_reason=finish,
        status=200,
        prompt=chat.prompt,
        client_capped=chat.client_capped(finish),
        tool_calls=tool_calls,
        declared=chat.tools,
        refusal=refusal,
    )


async def open_stream(
    upstreams: Upstreams, run: ArmRun, chat: ChatRequest, hooks: StreamHooks
) -> OpenedStream:
    """Send one streamed arm and wait for its first content (or its end), which is due
    within the arm's silence bound from its sending: keep-alive comments do not extend it
    (SPEC E5: patience bounds every wait). Until then a failure is invisible to the client
    and raises ArmFailed."""
    silence = run.silence
    try:
        async with upstreams.deadlines.within(silence.seconds):
            return await _opened(upstreams, run, chat, hooks)
    except TimeoutError as error:
        raise failed_in_transport(error, silence, headers_in=True, content_in=False) from None


async def _opened(
    upstreams: Upstreams, run: ArmRun, chat: ChatRequest, hooks: StreamHooks
) -> OpenedStream:
    silence = run.silence
    response = await post(upstreams, run, chat, fresh=hooks.fresh)
    if "charset" not in response.headers.get("Content-Type", "").lower():
        # Noted, never failed: this header is why latin-1 fallbacks mangle text (A1).
        hooks.missing_charset()
    opened = OpenedStream(
        response,
        Reads(
            response,
            run.wire,
            named=run.attempt.is_aggregator,
            on_malformed=hooks.malformed,
            bounds=upstreams.bounds,
        ),
        [],
        0.0,
    )
    try:
        await hold_until_content(opened, hooks.clock, hooks.named)
    except TRANSPORT_ERRORS as error:
        opened.close()
        raise failed_in_transport(error, silence, headers_in=True, content_in=False) from None
    except BaseException:
        opened.close()
        raise
    return opened


@dataclass(frozen=True, slots=True)
class StreamHooks:
    """What opening a stream reports back as it happens."""

    clock: Clock
    named: Callable[[str], None]
    malformed: Callable[[], None]
    missing_charset: Callable[[], None]
    fresh: bool = False


def reply_response(reply: Reply, headers: dict[str, str]) -> web.Response:
    return web.Response(
        body=reply.body, content_type="application/json", charset="utf-8", headers=headers
    )
