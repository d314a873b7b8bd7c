"""The outcome channel (SPEC C6, C7): one typed record per finished client request.

Every client request that reached the chat endpoint ends with exactly one `Outcome`:
answered, incomplete (content reached the client, then the stream broke), failed (no
upstream could answer), rejected (bad input, or the upstream refused the request itself)
or cancelled (the client went away). Failures are emitted like successes; a channel that
only saw the requests that went well would teach the score that everything goes well.

`OutcomeChannel.emit` is the only thing the request path does: an append to a bounded
ring buffer and a counter, O(1), no I/O, no await. When the buffer is full the oldest
record is evicted and counted in `dropped` (visible as a metric): under overload the
channel loses records, it never slows a request. A background task (see `app.py`)
drains the buffer and hands each batch to the consumers: the score update (the closed
loop: outcome, then score, then the next decision), the metrics, the decision log and,
when enabled, the JSON-lines exporter.

Records are plain slotted objects, not frozen ones (a frozen dataclass of this size costs
microseconds to build on every request); nothing changes a record once it is emitted.

Routing metadata only: names, numbers, reasons. A record never holds a prompt, a
completion or a credential, and nothing here could put one in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from .trace_ids import TraceIds

DEFAULT_CAPACITY: Final = 10_000


class OutcomeKind(StrEnum):
    # A complete answer reached the client.
    ANSWERED = "answered"
    # Content reached the client, then the upstream broke: the client got an error event.
    INCOMPLETE = "incomplete"
    # No upstream could answer (the client got 429, 502 or 503 from rolegate).
    FAILED = "failed"
    # Refused before any upstream answered: bad input, an unknown role, or an upstream
    # that rejected the request itself (context length, content filter, another 400).
    REJECTED = "rejected"
    # The client went away before the answer was complete.
    CANCELLED = "cancelled"


class ArmResult(StrEnum):
    """How one upstream attempt ended. The first group is what the operational score
    observes (SPEC C1); the rest say nothing about the machine's quality."""

    OK = "ok"
    LATE = "late"
    SERVER_ERROR = "server_error"
    REFUSED = "refused"
    TIMEOUT = "timeout"
    RATE_LIMITED = "rate_limited"
    PARSE_FAILURE = "parse_failure"
    BROKEN_STREAM = "broken_stream"
    LENGTH_CAPPED = "length_capped"
    EMPTY_SUCCESS = "empty_success"
    # Tool calls the model broke: arguments that are not JSON, a tool never declared.
    MALFORMED_TOOL_CALL = "malformed_tool_call"
    # A structural verdict (mangled encoding, ...): the breaker's business, not the score's.
    DEGRADED = "degraded"
    # The upstream refused the request itself (context length, content filter, a 400).
    REQUEST_FAULT = "request_fault"
    # Auth or quota: a hard exclusion's business.
    UNAUTHORIZED = "unauthorized"
    # Cancelled by rolegate (the slower arm of a race) or by the client leaving.
    CANCELLED = "cancelled"
    # The slow arm a rate act moved away from (its continuation is the next arm).
    MOVED = "moved"
    # A pooled keep-alive connection the upstream had already closed: retried at once on a
    # fresh one, and charged to nobody.
    STALE_CONNECTION = "stale_connection"


class ArmAct(StrEnum):
    """What the mid-stream rate test made of this arm (SPEC B5, B6)."""

    RACED = "raced"
    CONTINUED = "continued"
    KEPT = "kept"


@dataclass(slots=True)
class Arm:
    """One upstream attempt of a request."""

    provider: str
    model: str
    # The machine that served or failed (an aggregator's sub-provider, a direct
    # provider's only machine), None when nobody named one.
    machine: str | None
    result: ArmResult
    # The upstream's HTTP status, when it answered with one.
    status: int | None = None
    seconds: float | None = None
    ttft_seconds: float | None = None
    act: ArmAct | None = None
    # A short reason for people (never content).
    detail: str = ""
    # How it ended (`core.arm_end.Cause`'s value): what the result is derived from.
    cause: str = ""
    # Seconds from the request's start to the arm's sending (its span's start).
    started_after: float | None = None
    # The arm's span id when the request is traced (0: not traced, or drawn at export).
    span_id: int = 0


@dataclass(slots=True)
class Skip:
    """A candidate or machine of a request that was not sent to, and why."""

    provider: str
    model: str
    machine: str | None
    reason: str


@dataclass(slots=True)
class Outcome:
    """One finished client request: what was asked of whom, what happened, what it cost."""

    request_id: str
    # None when the request was refused before a role was chosen.
    role: str | None
    outcome: OutcomeKind
    # The HTTP status rolegate answered with (499: the client went away).
    status: int
    stream: bool
    # Seconds since the epoch when the request arrived (for export), and durations.
    started_at: float
    latency_seconds: float
    # Time to the first content byte the client received; None when none did.
    ttft_seconds: float | None = None
    ruling: str | None = None
    # The role's patience (a late answer is scored by how late it was).
    patience_seconds: float | None = None
    # The AccessGrant the request was counted against (`namespace/name`).
    grant: str | None = None
    provider: str | None = None
    model: str | None = None
    machine: str | None = None
    finish_reason: str | None = None
    # The structural verdict on the served answer (ok, malformed, mangled, ...).
    verdict: str | None = None
    tokens_in: int | None = None
    tokens_out: int | None = None
    # True when tokens_out was counted from stream deltas (the upstream sent no usage).
    tokens_estimated: bool = False
    cost_usd: float | None = None
    arms: tuple[Arm, ...] = ()
    skipped: tuple[Skip, ...] = ()
    config_hash: str = ""
    error_code: str | None = None
    # Where the request's span belongs in its trace, when tracing is on.
    trace: TraceIds | None = None

    @property
    def tokens(self) -> int:
        """Input plus output tokens (0 for what was not counted)."""
        return (self.tokens_in or 0) + (self.tokens_out or 0)

    def as_json(self) -> dict[str, Any]:
        """The record as JSON-ready data (enums as their values)."""
        return {
            "request_id": self.request_id,
            "role": self.role,
            "outcome": self.outcome.value,
            "status": self.status,
            "stream": self.stream,
            "started_at": self.started_at,
            "latency_seconds": self.latency_seconds,
            "ttft_seconds": self.ttft_seconds,
            "ruling": self.ruling,
            "patience_seconds": self.patience_seconds,
            "grant": self.grant,
            "provider": self.provider,
            "model": self.model,
            "machine": self.machine,
            "finish_reason": self.finish_reason,
            "verdict": self.verdict,
            "tokens_in": self.tokens_in,
            "tokens_out": self.tokens_out,
            "tokens_estimated": self.tokens_estimated,
            "cost_usd": self.cost_usd,
            "arms": [
                {
                    "provider": arm.provider,
                    "model": arm.model,
                    "machine": arm.machine,
                    "result": arm.result.value,
                    "status": arm.status,
                    "seconds": arm.seconds,
                    "ttft_seconds": arm.ttft_seconds,
                    "act": arm.act.value if arm.act else None,
                    "detail": arm.detail,
                    "cause": arm.cause,
                    "started_after": arm.started_after,
                    "span_id": f"{arm.span_id:016x}" if arm.span_id else None,
                }
                for arm in self.arms
            ],
            "skipped": [
                {
                    "provider": skip.provider,
                    "model": skip.model,
                    "machine": skip.machine,
                    "reason": skip.reason,
                }
                for skip in self.skipped
            ],
            "config_hash": self.config_hash,
            "error_code": self.error_code,
            # The request's span, to find its trace by (the tracestate stays out).
            "trace": None
            if self.trace is None
            else {
                "trace_id": f"{self.trace.trace_id:032x}",
                "span_id": f"{self.trace.span_id:016x}",
                "sampled": self.trace.sampled,
            },
        }


Consumer = Callable[[Sequence[Outcome]], None]


class OutcomeChannel:
    """A bounded ring buffer of outcomes with emission and drop counters.

    `emit` is O(1) and never blocks: `deque(maxlen=...)` evicts the oldest record itself
    when full, and the eviction is counted. `wake` (set by the background drainer) is
    called after each emission so the drainer runs on the loop's next turn."""

    __slots__ = ("_buffer", "capacity", "dropped", "emitted", "wake")

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(
                f"the outcome buffer needs room for at least one record, not {capacity}"
            )
        self.capacity = capacity
        self._buffer: deque[Outcome] = deque(maxlen=capacity)
        self.emitted = 0
        self.dropped = 0
        self.wake: Callable[[], None] | None = None

    def emit(self, outcome: Outcome) -> None:
        if len(self._buffer) == self.capacity:
            self.dropped += 1
        self._buffer.append(outcome)
        self.emitted += 1
        if self.wake is not None:
            self.wake()

    def drain(self) -> list[Outcome]:
        """Every buffered record, oldest first; the buffer is left empty."""
        batch = list(self._buffer)
        self._buffer.clear()
        return batch

    def __len__(self) -> int:
        return len(self._buffer)
