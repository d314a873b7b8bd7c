"""A request's W3C trace context (https://www.w3.org/TR/trace-context/): the ids its spans
are exported under, read from the caller's `traceparent` and written to an upstream's.

Pure: parsing and formatting only. The ids are drawn where requests arrive (flow/tracing)
and travel on the request's records (`Decision`, `Outcome`, each arm's row), from which the
span exporter (edge/tracing.py) builds the spans after the request ended. Ids are labels to
correlate by, never secrets, and carry nothing of a prompt or an answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

# The caller's tracestate is passed on unchanged, within the spec's bounds (32 members of
# at most 256 characters, 512 in all as the spec recommends to keep).
MAX_TRACESTATE: Final = 512
_HEX: Final = frozenset("0123456789abcdef")
_SAMPLED: Final = 0x01


@dataclass(frozen=True, slots=True)
class TraceIds:
    """The request span's place in its trace."""

    trace_id: int
    # The request span's own id; its arms' spans are its children.
    span_id: int
    # The caller's span (from its traceparent); 0: the request starts the trace.
    parent_id: int = 0
    sampled: bool = True
    # The caller's tracestate, passed on to an upstream that takes the trace context.
    tracestate: str = ""

    def traceparent(self, span_id: int) -> str:
        """The `traceparent` header naming `span_id` (an arm's span) as the parent."""
        flags = _SAMPLED if self.sampled else 0
        return f"00-{self.trace_id:032x}-{span_id:016x}-{flags:02x}"


def parse_traceparent(value: str | None) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) from a `traceparent` header; None when it is
    missing or not one (the request then starts a trace of its own, as the spec says)."""
    if value is None:
        return None
    value = value.strip()
    if len(value) < 55:
        return None
    version, trace, parent, flags = value[:2], value[3:35], value[36:52], value[53:55]
    if value[2] != "-" or value[35] != "-" or value[52] != "-":
        return None
    if not _hex(version) or version == "ff" or not _hex(trace + parent + flags):
        return None
    # Version 00 is exactly 55 characters; a later version may append fields after a dash.
    if (version == "00" and len(value) != 55) or (len(value) > 55 and value[55] != "-"):
        return None
    trace_id, parent_id = int(trace, 16), int(parent, 16)
    if trace_id == 0 or parent_id == 0:
        return None
    return trace_id, parent_id, bool(int(flags, 16) & _SAMPLED)


def clean_tracestate(value: str | None) -> str:
    """The caller's `tracestate` when it is a sane header value, else nothing."""
    if not value or len(value) > MAX_TRACESTATE:
        return ""
    if not (value.isascii() and value.isprintable()):
        return ""
    return value.strip()


def _hex(text: str) -> bool:
    return bool(text) and set(text) <= _HEX
