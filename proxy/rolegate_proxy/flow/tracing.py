"""The trace context of the request being served, for its arms to take their span ids
from and, where a provider takes it, to send upstream as `traceparent`.

Only ids live here, never the OpenTelemetry SDK: the spans are built from the request's
records after it ended (edge/span_export.py). With tracing off nothing is set, and an arm
asks one context variable per sending (tens of nanoseconds).
"""

from __future__ import annotations

import contextvars
import os
import random

from ..core.trace_ids import TraceIds, clean_tracestate, parse_traceparent

# The trace context of the request whose task (or sub-task: a race's rival) is running.
_TRACE: contextvars.ContextVar[TraceIds | None] = contextvars.ContextVar(
    "rolegate_trace", default=None
)
# Ids: random bits from a generator seeded once from the OS (as the SDK's own id generator
# does; the W3C spec asks for randomness, not secrecy).
_ids = random.Random(os.urandom(32))
# A ratio sampler reads the trace id's low 64 bits against the ratio of this bound.
_LOW_64 = (1 << 64) - 1
_BOUND = 1 << 64


def span_id() -> int:
    return _ids.getrandbits(64) or 1


def request_ids(
    traceparent: str | None,
    tracestate: str | None,
    ratio: float = 1.0,
    parent_based: bool = True,
) -> TraceIds:
    """The request span's ids: a child of the caller's span when it sent a valid
    `traceparent`, else the root of a new trace. Sampled as the caller's span was
    (`parent_based`), else when the trace id falls within `ratio` (the SDK's
    TraceIdRatioBased rule, so every service sampling by ratio keeps the same traces)."""
    parent = parse_traceparent(traceparent)
    if parent is None:
        trace_id = _ids.getrandbits(128) or 1
        return TraceIds(trace_id, span_id(), 0, _within(trace_id, ratio))
    trace_id, parent_id, sampled = parent
    if not parent_based:
        sampled = _within(trace_id, ratio)
    return TraceIds(trace_id, span_id(), parent_id, sampled, clean_tracestate(tracestate))


def _within(trace_id: int, ratio: float) -> bool:
    if ratio >= 1.0:
        return True
    return (trace_id & _LOW_64) < round(ratio * _BOUND)


def begin(ids: TraceIds) -> contextvars.Token[TraceIds | None]:
    return _TRACE.set(ids)


def end(token: contextvars.Token[TraceIds | None]) -> None:
    _TRACE.reset(token)


def current() -> TraceIds | None:
    return _TRACE.get()


def upstream_headers(ids: TraceIds, arm_span: int) -> dict[str, str]:
    """What an upstream that takes the trace context is sent: the arm's span as parent."""
    headers = {"traceparent": ids.traceparent(arm_span)}
    if ids.tracestate:
        headers["tracestate"] = ids.tracestate
    return headers
