"""Mutable runtime state of a running simulator: per-machine counters and faults, and the
request records served by `/_sim/requests`.

Everything that can be computed once per scenario (tokenised replies, their JSON
encodings) is computed here at start-up, keeping the request path to lookups and
concatenation.
"""

from __future__ import annotations

import bisect
import itertools
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from rolegate_sim.faults import needs_rng
from rolegate_sim.scenario import Fault, MachineSpec, ModelSpec, Scenario
from rolegate_sim.slots import Slots
from rolegate_sim.text import encode_json_string, tokenize


class Outcome(StrEnum):
    COMPLETED = "completed"
    CLIENT_DISCONNECTED = "client_disconnected"
    ERROR_STATUS = "error_status"
    RESET = "reset"
    CUT = "cut"
    STREAM_ERROR = "stream_error"
    NO_RESPONSE = "no_response"
    SERVER_STOPPED = "server_stopped"
    # Sent on a keep-alive connection the server had closed for idleness (idleCloseSeconds).
    IDLE_CLOSED = "idle_closed"


@dataclass(slots=True)
class RequestRecord:
    """What happened to one chat request. Never holds prompt or completion text."""

    seq: int
    started_at: float
    # The simulator's monotonic clock (seconds, arbitrary origin) at the same moment: for
    # the interval between two requests, which wall-clock time (`started_at`) can get
    # wrong when the clock is stepped.
    arrived_monotonic: float
    model: str | None = None
    machine: str | None = None
    # The request's 1-based number on its machine: what `schedule` and the RNG key on.
    machine_request: int | None = None
    stream: bool = False
    fault: str | None = None
    split_writes: bool = False
    # Machines the aggregator skipped because a `down` fault fired on them.
    skipped_down: list[str] = field(default_factory=list)
    continued_partial: bool = False
    # The continuation began by re-sending the prefill (echoesPrefill).
    echoed_prefill: bool = False
    provider: dict[str, Any] | None = None
    # The top-level routing fields beyond `model` (`routing.ROUTE_FIELDS`) the body carried.
    route_fields: dict[str, Any] | None = None
    status: int | None = None
    outcome: Outcome | None = None
    # Pieces written to the client: tokens, and reasoning pieces and tool call events.
    tokens_sent: int = 0
    # The piece index of each tool call's first event, for `tool_calls_sent`.
    tool_call_starts: tuple[int, ...] = ()
    ended_at: float | None = None
    # A fingerprint of the bearer token the client sent (first 12 hex digits of its
    # SHA-256), so a test can check which key arrived without the key being stored.
    bearer_sha256: str | None = None
    # The W3C trace context the client sent, if any: a test checks whether it was passed on.
    traceparent: str | None = None
    # A fingerprint of the request body (first 16 hex digits of its SHA-256): two records
    # with the same one were sent the identical request, without the prompt being stored.
    body_sha256: str | None = None
    # How long it waited for one of its machine's slots before its answer began.
    queued_seconds: float = 0.0
    # How many requests were ahead of it on its machine (answering or queued) when it
    # asked for a slot; 0 when it was served at once.
    queued_behind: int = 0

    def finish(self, outcome: Outcome) -> None:
        # The first outcome wins: after a deliberate cut or reset the handler is cancelled
        # by the lost connection, and that must not relabel it as a client disconnect.
        if self.outcome is None:
            self.outcome = outcome
            self.ended_at = time.time()

    @property
    def tool_calls_sent(self) -> int:
        """Tool calls whose first event was written."""
        return bisect.bisect_left(self.tool_call_starts, self.tokens_sent)

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "model": self.model,
            "machine": self.machine,
            "machine_request": self.machine_request,
            "stream": self.stream,
            "fault": self.fault,
            "split_writes": self.split_writes,
            "skipped_down": list(self.skipped_down),
            "continued_partial": self.continued_partial,
            "echoed_prefill": self.echoed_prefill,
            "provider": self.provider,
            "route_fields": self.route_fields,
            "status": self.status,
            "outcome": "in_progress" if self.outcome is None else str(self.outcome),
            "tokens_sent": self.tokens_sent,
            "tool_calls_sent": self.tool_calls_sent,
            "bearer_sha256": self.bearer_sha256,
            "traceparent": self.traceparent,
            "body_sha256": self.body_sha256,
            "queued_seconds": self.queued_seconds,
            "queued_behind": self.queued_behind,
            "started_at": self.started_at,
            "arrived_monotonic": self.arrived_monotonic,
            "ended_at": self.ended_at,
        }


class MachineState:
    __slots__ = (
        "faults",
        "faults_since",
        "model",
        "name",
        "name_json",
        "requests",
        "slots",
        "spec",
        "uses_rng",
    )

    def __init__(self, model: str, spec: MachineSpec) -> None:
        self.model = model
        self.spec = spec
        self.name = spec.name
        self.name_json = encode_json_string(spec.name)
        self.requests = 0
        self.slots = Slots(spec.slots)
        self.faults: tuple[Fault, ...] = ()
        self.faults_since = time.monotonic()
        self.uses_rng = False
        self.set_faults(spec.faults)

    def set_faults(self, faults: tuple[Fault, ...]) -> None:
        self.faults = faults
        # The origin of `duringSeconds` windows.
        self.faults_since = time.monotonic()
        self.uses_rng = self.spec.jitter > 0 or needs_rng(faults)

    def faults_age(self) -> float:
        """Seconds since this machine's faults were set (start, reset or PUT)."""
        return time.monotonic() - self.faults_since

    def next_request_number(self) -> int:
        self.requests += 1
        return self.requests

    def to_json(self) -> dict[str, Any]:
        """What the control API shows of the machine: its counter and its queue."""
        return {
            "model": self.model,
            "machine": self.name,
            "requests": self.requests,
            "slots": self.slots.limit,
            "busy": self.slots.busy,
            "waiting": self.slots.waiting,
        }


class ModelState:
    __slots__ = (
        "machine_names",
        "machines",
        "name",
        "name_json",
        "reasoning_tokens",
        "spec",
        "token_json",
        "tokens",
    )

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.name_json = encode_json_string(spec.name)
        self.machines = {m.name: MachineState(spec.name, m) for m in spec.machines}
        self.machine_names = tuple(self.machines)
        self.tokens = tokenize(spec.reply)
        self.token_json = tuple(encode_json_string(t) for t in self.tokens)
        self.reasoning_tokens = tokenize(spec.reasoning)


class SimState:
    """The state behind one app."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.stopping = False
        charset = "" if scenario.charset is None else f"; charset={scenario.charset}"
        self.sse_content_type = "text/event-stream" + charset
        self.json_content_type = "application/json" + charset
        self.models: dict[str, ModelState] = {}
        self.records: deque[RequestRecord] = deque(maxlen=scenario.record_limit)
        self._seq = itertools.count(1)
        # When each open connection last finished an answer (monotonic seconds).
        self._idle_since: weakref.WeakKeyDictionary[object, float] = weakref.WeakKeyDictionary()
        self.reset(restore_faults=True)

    def closed_for_idleness(self, connection: object, now: float) -> bool:
        """Whether the server would have closed `connection` by now (idleCloseSeconds)."""
        limit = self.scenario.idle_close_seconds
        since = self._idle_since.get(connection)
        return limit is not None and since is not None and now - since > limit

    def answered_on(self, connection: object, now: float) -> None:
        self._idle_since[connection] = now

    def reset(self, *, restore_faults: bool = False) -> None:
        """Forget the records and zero every machine's request counter, so the same
        requests replay the same fault sequence. Runtime faults stay unless
        `restore_faults`, which returns to exactly the just-started state."""
        # A fresh deque rather than clear(): requests still in flight finish into their
        # old records without showing up in the new run.
        self.records = deque(maxlen=self.scenario.record_limit)
        self._seq = itertools.count(1)
        if restore_faults:
            self.models = {m.name: ModelState(m) for m in self.scenario.models}
            return
        for model in self.models.values():
            for machine in model.machines.values():
                machine.requests = 0
                machine.faults_since = time.monotonic()

    def open_record(self) -> RequestRecord:
        record = RequestRecord(
            seq=next(self._seq), started_at=time.time(), arrived_monotonic=time.monotonic()
        )
        self.records.append(record)
        return record

    def records_since(self, seq: int) -> list[dict[str, Any]]:
        return [r.to_json() for r in self.records if r.seq > seq]
