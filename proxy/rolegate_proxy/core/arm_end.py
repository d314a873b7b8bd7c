"""How one arm ended: the one record every consumer of an attempt is fed from.

Every upstream attempt (an arm) of a request ends with exactly one `ArmEnd`. Its `cause`
is one of an enumerated set that keeps three things apart:

* the **upstream's faults**: an error status, a connection refused or reset before any
  header, an answer cut short, a silence past the idle limit, a body or stream that is not
  the protocol, an error inside a 200 answer or a stream, a degraded answer that counts
  (empty, mangled);
* what is **not the upstream's fault**: the client left, we cancelled the arm (it lost a
  race, or its stream moved to a faster machine), the request's patience ran out while the
  arm had not answered yet, the proxy is shutting down, the upstream refused the request
  itself (context length, content filter);
* **ours**: a stale pooled connection (retried once on a fresh one, charged to nobody), a
  provider we hold no API key for.

From it, pure functions here derive what each consumer needs: what the breaker is told
(`breaker_input`: only an upstream fault or an answer), what the arm teaches the ledger
(`sighting`, SPEC B7), the arm's row on the outcome record (`arm_row`). The `Recorder`
(flow/recorder.py) feeds them; nothing else writes to those sinks.

Routing metadata only: names, numbers, our own words. Never any text of a prompt, an
answer, or an upstream's error message.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final, NamedTuple

from rolegate_policy.signatures import Signature

from .beliefs import NO_GAPS, Completed, GapStats, MachineBelief, Sighting
from .breaker import Attempted, TransportFault
from .outcomes import Arm, ArmAct, ArmResult
from .verdicts import Verdict, VerdictKind


class RequestFault(StrEnum):
    """A 4xx about the request itself: never resent unchanged to the same model (SPEC E4)."""

    # Too long for this model: a later model of the role may have a larger context.
    CONTEXT_LENGTH = "context_length"
    # Refused by a content filter: about the request, goes back to the client as such.
    CONTENT_FILTER = "content_filter"
    # Anything else the upstream says is wrong with the request.
    INVALID = "invalid"


class Cause(StrEnum):
    # A complete answer (it may still carry a verdict that does not count).
    ANSWERED = "answered"
    # -- the upstream's faults --
    HTTP_ERROR = "http_error"
    REFUSED = "refused"
    CUT = "cut"
    STALL = "stall"
    MALFORMED = "malformed"
    IN_BAND_ERROR = "in_band_error"
    DEGRADED = "degraded"
    # -- not the upstream's fault --
    CLIENT_LEFT = "client_left"
    RACE_LOST = "race_lost"
    MOVED = "moved"
    DEADLINE = "deadline"
    SHUTDOWN = "shutdown"
    REJECTED = "rejected"
    # -- ours --
    STALE_CONNECTION = "stale_connection"
    NO_CREDENTIALS = "no_credentials"


UPSTREAM_FAULTS: Final = frozenset(
    {
        Cause.HTTP_ERROR,
        Cause.REFUSED,
        Cause.CUT,
        Cause.STALL,
        Cause.MALFORMED,
        Cause.IN_BAND_ERROR,
        Cause.DEGRADED,
    }
)
# Ended by us or by the client before it could answer: the wait is a lower bound on its
# time to first token (a censored sighting).
_CENSORING: Final = frozenset(
    {Cause.CLIENT_LEFT, Cause.SHUTDOWN, Cause.RACE_LOST, Cause.MOVED, Cause.DEADLINE, Cause.STALL}
)
_TRANSPORT_OF: Final = {
    Cause.REFUSED: TransportFault.CONNECTION_FAILED,
    Cause.CUT: TransportFault.BROKEN_STREAM,
    Cause.MALFORMED: TransportFault.BROKEN_STREAM,
    Cause.STALL: TransportFault.TIMEOUT,
    Cause.IN_BAND_ERROR: TransportFault.STREAM_ERROR,
}
_TOOL_CALL_FAULTS: Final = frozenset({Signature.TOOL_ARGUMENTS_NOT_JSON, Signature.UNDECLARED_TOOL})
# A client may hold an arm's stream this long in all (a few slow writes) before its gaps
# are taken for the client's pace rather than the machine's, and not taught.
CLIENT_HOLD_TOLERANCE: Final = 0.05


class Answered(NamedTuple):
    """What a complete (or partly delivered) answer showed, without its text."""

    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # Its pieces of output of every kind (`core.tokens`): the likely token count when a
    # stream carries no usage.
    estimated_tokens: int = 0
    # The finish was the upstream's length cap, not the caller's own max_tokens.
    capped_by_upstream: bool = False


@dataclass(slots=True)
class ArmEnd:
    """One arm, ended. Times are on the proxy's monotonic clock."""

    provider: str
    model: str
    # The machine that served or failed: named by the answer (an aggregator's
    # sub-provider), a direct provider's own, or the one the routing led with.
    machine: str | None
    cause: Cause
    started_at: float
    ended_at: float
    streamed: bool
    # A direct provider is its own machine; the breaker keys such a failure by provider.
    direct: bool = False
    # The machine was named by the answer itself (not presumed from the routing).
    named: bool = False
    # When the first content arrived.
    first_at: float | None = None
    gaps: GapStats = NO_GAPS
    status: int | None = None
    # The error's code when it is one of a known set (never its message).
    error_code: str | None = None
    # For `REJECTED`: what about the request the upstream refused.
    request_fault: RequestFault | None = None
    retry_after: float | None = None
    verdict: Verdict | None = None
    answer: Answered | None = None
    act: ArmAct | None = None
    # Content reached the client before this arm ended (its failure then shows as an
    # error event in the stream).
    delivered: bool = False
    # For people, in our own words.
    detail: str = ""
    # Its span's id, drawn when it was sent in a traced request (0: none).
    span_id: int = 0
    # Seconds its client kept it waiting: writes held back by a client that read slowly
    # (`ClientStream.client_held`). The machine's time excludes them (SPEC E8).
    client_held: float = 0.0

    @property
    def seconds(self) -> float:
        """The arm's time as the machine spent it: the client's holding left out."""
        return max(self.ended_at - self.started_at - self.client_held, 0.0)

    @property
    def gaps_taught(self) -> GapStats:
        """Its gaps, unless its client held it long enough to have shaped them: a client
        that reads slowly stops the upstream by back-pressure, and what the gaps then
        show is the client's pace, not the machine's (SPEC E8)."""
        return self.gaps if self.client_held <= CLIENT_HOLD_TOLERANCE else NO_GAPS

    @property
    def ttft(self) -> float | None:
        return None if self.first_at is None else max(self.first_at - self.started_at, 0.0)

    @property
    def upstream_fault(self) -> bool:
        return self.cause in UPSTREAM_FAULTS


def breaker_input(end: ArmEnd) -> Attempted | None:
    """What the breaker is told of this arm: an answer (its verdict decides the rest) or an
    upstream fault; None for everything that is not the upstream's doing (SPEC A5)."""
    machine = None if end.direct else end.machine
    if end.cause is Cause.ANSWERED or end.cause is Cause.DEGRADED:
        if end.verdict is None:
            return None
        return Attempted.answered(
            end.provider, end.model, end.verdict, machine=machine, started_at=end.started_at
        )
    if end.cause is Cause.HTTP_ERROR and end.status is not None:
        return Attempted.http_error(
            end.provider, end.model, end.status, machine=machine,
            retry_after=end.retry_after, started_at=end.started_at,
        )  # fmt: skip
    fault = _TRANSPORT_OF.get(end.cause)
    if fault is None:
        return None
    return Attempted.transport_failure(
        end.provider, end.model, fault, machine=machine, started_at=end.started_at
    )


def sighting(end: ArmEnd, belief: MachineBelief | None) -> Sighting | None:
    """What this arm teaches the ledger (SPEC B7): every arm with a machine, however it
    ended, except a stale pooled connection (a local blip erases nothing) and an arm that
    never reached its upstream. A streamed arm teaches its exact time to first token and
    its gaps; one that never saw a first token teaches its wait as a lower bound when we
    or the client ended it, or it went silent. A non-streamed answer teaches what it shows,
    its total time for its tokens (`_completion_sighting`), never per-token gaps.

    (`belief`, the machine's belief before this arm, is read by no rule today: what a whole
    answer shows is filed against the machine's published shape, which the ledger holds.)"""
    machine = end.machine
    if machine is None or end.cause in (Cause.STALE_CONNECTION, Cause.NO_CREDENTIALS):
        return None
    at = end.ended_at
    if end.first_at is not None:
        taught = Sighting(end.provider, end.model, machine, at, ttft=end.ttft, gaps=end.gaps_taught,
                          cut=end.cause is not Cause.ANSWERED)  # fmt: skip
    elif not end.streamed and end.cause is Cause.ANSWERED and end.answer is not None:
        taught = _completion_sighting(end, machine, end.answer)
    elif end.cause in _CENSORING:
        taught = Sighting(end.provider, end.model, machine, at, waited=end.seconds,
                          gaps=end.gaps_taught, cut=True)  # fmt: skip
    else:
        taught = Sighting(end.provider, end.model, machine, at, gaps=end.gaps_taught)
    return taught if taught.teaches else None


def _completion_sighting(end: ArmEnd, machine: str, answer: Answered) -> Sighting:
    """A whole non-streamed answer (SPEC B7). Its one number, the total time, is taught as
    the answer's pace (core/beliefs.py), never split into a first token and gaps: the
    split is a guess (a 2 ms cached answer of 90 tokens would be 22 us gaps), and mixed
    with real streams' gaps it widens their belief until a healthy stream tests as behind.

    It is a time to first token only when the answer had at most one token: the total is
    then the time to its first and only one. With more, it bounds the first token from
    above only, and the TTFT belief takes in bounds from below only (an arm given up on):
    a fast answer's total taken as a TTFT would make the next stream's first token late."""
    tokens = answer.completion_tokens or answer.estimated_tokens
    at = end.ended_at
    if tokens <= 1:
        return Sighting(end.provider, end.model, machine, at, ttft=end.seconds)
    completed = Completed(end.seconds, tokens)
    return Sighting(end.provider, end.model, machine, at, completed=completed)


def arm_row(end: ArmEnd, patience: float, request_started: float | None = None) -> Arm:
    """The arm's row on the request's outcome record (`request_started`: the request's
    start on the same clock, for when the arm was sent)."""
    return Arm(
        end.provider,
        end.model,
        end.machine,
        arm_result(end, patience),
        end.status,
        end.seconds,
        end.ttft,
        end.act,
        end.detail,
        end.cause.value,
        None if request_started is None else max(end.started_at - request_started, 0.0),
        end.span_id,
    )


_RESULT_OF: Final = {
    Cause.REFUSED: ArmResult.REFUSED,
    Cause.CUT: ArmResult.BROKEN_STREAM,
    Cause.STALL: ArmResult.TIMEOUT,
    Cause.MALFORMED: ArmResult.PARSE_FAILURE,
    Cause.IN_BAND_ERROR: ArmResult.SERVER_ERROR,
    Cause.CLIENT_LEFT: ArmResult.CANCELLED,
    Cause.RACE_LOST: ArmResult.CANCELLED,
    Cause.SHUTDOWN: ArmResult.CANCELLED,
    Cause.MOVED: ArmResult.MOVED,
    Cause.DEADLINE: ArmResult.TIMEOUT,
    Cause.REJECTED: ArmResult.REQUEST_FAULT,
    Cause.STALE_CONNECTION: ArmResult.STALE_CONNECTION,
    Cause.NO_CREDENTIALS: ArmResult.UNAUTHORIZED,
}


def arm_result(end: ArmEnd, patience: float) -> ArmResult:
    """The arm's result, as the record and the operational score read it (SPEC C1)."""
    if end.cause is Cause.ANSWERED:
        verdict = end.verdict
        if verdict is not None and verdict.kind is VerdictKind.MANGLED and verdict.attributable:
            # Served (a stream delivers before it can be judged), but mangled by the model:
            # the breaker's business, never the score's (SPEC A5).
            return ArmResult.DEGRADED
        if end.answer is not None and end.answer.capped_by_upstream:
            return ArmResult.LENGTH_CAPPED
        return ArmResult.LATE if end.seconds > patience else ArmResult.OK
    if end.cause is Cause.DEGRADED:
        verdict = end.verdict
        if verdict is None or verdict.kind is not VerdictKind.MALFORMED:
            return ArmResult.DEGRADED
        if verdict.signature in _TOOL_CALL_FAULTS:
            return ArmResult.MALFORMED_TOOL_CALL
        return ArmResult.EMPTY_SUCCESS
    if end.cause is Cause.HTTP_ERROR:
        if end.status == 429:
            return ArmResult.RATE_LIMITED
        if end.status in (401, 402, 403):
            return ArmResult.UNAUTHORIZED
        return ArmResult.SERVER_ERROR
    return _RESULT_OF[end.cause]
