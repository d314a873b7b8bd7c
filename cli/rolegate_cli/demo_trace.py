"""`rolegate demo --trace-file PATH`: the demo's spans written as JSON lines by the
OpenTelemetry console exporter, and one request's spans shown as a tree (docs/tracing.md).

Needs the tracing extra (`pip install 'rolegate[tracing]'`); imported only when asked for.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import ConsoleSpanExporter

from rolegate_proxy.edge.tracing import TraceSettings

# What the tree shows of each span, after its name, kind and duration.
SHOWN = (
    "rolegate.role",
    "rolegate.outcome",
    "rolegate.provider",
    "rolegate.machine",
    "rolegate.arm.cause",
    "rolegate.arm.rate_act",
    "http.response.status_code",
    "gen_ai.usage.output_tokens",
)


@contextmanager
def trace_file(path: Path) -> Iterator[TraceSettings]:
    """Trace settings writing every span to `path`, one JSON object a line; the file is
    closed when the block ends (after the proxy stopped, which exports what is queued)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        exporter = ConsoleSpanExporter(out=out, formatter=_line)
        yield TraceSettings(exporter, delay_seconds=0.2)


def _line(span: ReadableSpan) -> str:
    line: str = span.to_json(indent=None)
    return line + "\n"


def show_one_request(path: Path, out: TextIO) -> None:
    """The request with the most arms (a failover, a move), as a tree of its spans."""
    spans = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    traces: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        traces.setdefault(span["context"]["trace_id"], []).append(span)
    print(f"\ntraces: {len(spans)} spans of {len(traces)} requests in {path}", file=out)
    if not traces:
        return
    trace = max(traces.values(), key=len)
    (root,) = [s for s in trace if s["kind"] == "SpanKind.SERVER"]
    arms = sorted((s for s in trace if s is not root), key=lambda s: str(s["start_time"]))
    print(f"one request's spans (trace {root['context']['trace_id']}):", file=out)
    for depth, span in [(0, root)] + [(1, arm) for arm in arms]:
        print("  " * (depth + 1) + _describe(span), file=out)
    print(
        "every attribute of every span is in the file; send them to a collector with "
        "OTEL_EXPORTER_OTLP_ENDPOINT on `rolegate proxy`",
        file=out,
    )


def _describe(span: dict[str, Any]) -> str:
    took = _at(span["end_time"]) - _at(span["start_time"])
    kind = span["kind"].removeprefix("SpanKind.")
    attributes = span.get("attributes") or {}
    shown = " ".join(f"{key}={attributes[key]}" for key in SHOWN if key in attributes)
    error = " ERROR" if span["status"]["status_code"] == "ERROR" else ""
    return f"{span['name']} [{kind} {took * 1000:.0f} ms{error}] {shown}"


def _at(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()
