"""Whether the proxy exports OpenTelemetry traces, and where to: read from the standard
`OTEL_*` environment (docs/tracing.md).

Tracing is off unless the environment asks for it: `OTEL_TRACES_EXPORTER` (`otlp`,
`console`, or both, comma-separated) or an OTLP endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT`,
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`); `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`
turns it off whatever else is set. Off, the SDK is never imported. On, it must be installed
(`pip install 'rolegate[tracing]'`): asked for and missing is an error at startup, never a
proxy that silently exports nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

# The SDK's batch processor defaults (OTEL_BSP_*), in spans and seconds.
DEFAULT_QUEUE: Final = 2048
DEFAULT_BATCH: Final = 512
DEFAULT_DELAY: Final = 5.0
DEFAULT_EXPORT_TIMEOUT: Final = 30.0
INSTALL_HINT: Final = "install the tracing extra: pip install 'rolegate[tracing]'"


class TracingUnavailable(Exception):
    """The environment asks for traces the proxy cannot export (stopped at startup)."""


@dataclass(frozen=True)
class TraceSettings:
    """Where spans go and how many may wait: a bounded queue, exported in batches by a
    background thread (edge/span_export.py)."""

    exporter: SpanExporter
    # None: the SDK's `Resource.create()` (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES).
    resource: Resource | None = None
    max_queue: int = DEFAULT_QUEUE
    max_batch: int = DEFAULT_BATCH
    delay_seconds: float = DEFAULT_DELAY
    export_timeout_seconds: float = DEFAULT_EXPORT_TIMEOUT
    # Sampling (OTEL_TRACES_SAMPLER): the share of new traces kept, and whether a caller's
    # sampled flag decides for its requests.
    ratio: float = 1.0
    parent_based: bool = True


def from_environment(environ: Mapping[str, str]) -> TraceSettings | None:
    """The trace settings the environment asks for; None when tracing is off. Raises
    `TracingUnavailable` when it asks for what cannot be done."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",")]
    names = [n for n in names if n]
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if not names:
        if not endpoint:
            return None
        names = ["otlp"]
    if "none" in names:
        return None
    unknown = sorted(set(names) - {"otlp", "console"})
    if unknown:
        raise TracingUnavailable(
            f"OTEL_TRACES_EXPORTER names {', '.join(unknown)}: rolegate exports traces to "
            "otlp (HTTP/protobuf) and console, or none"
        )
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    if "otlp" in names and protocol.strip() != "http/protobuf":
        raise TracingUnavailable(
            f"the OTLP protocol {protocol!r} is not supported: rolegate exports OTLP over "
            "HTTP with protobuf bodies; set OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf"
        )
    try:
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        exporters: list[SpanExporter] = []
        if "otlp" in names:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            # It reads its endpoint, headers, timeout and compression from OTEL_* itself.
            exporters.append(OTLPSpanExporter())
        if "console" in names:
            exporters.append(ConsoleSpanExporter())
    except ImportError as missing:
        raise TracingUnavailable(
            f"OTEL_* asks for traces but the OpenTelemetry SDK is not installed "
            f"({missing.name}); {INSTALL_HINT}, or unset OTEL_TRACES_EXPORTER"
        ) from None
    ratio, parent_based = _sampler(environ)
    return TraceSettings(
        ratio=ratio,
        parent_based=parent_based,
        exporter=exporters[0] if len(exporters) == 1 else _fan_out(exporters),
        max_queue=_positive(environ, "OTEL_BSP_MAX_QUEUE_SIZE", DEFAULT_QUEUE),
        max_batch=_positive(environ, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", DEFAULT_BATCH),
        delay_seconds=_positive(environ, "OTEL_BSP_SCHEDULE_DELAY", DEFAULT_DELAY * 1000) / 1000,
        export_timeout_seconds=_positive(
            environ, "OTEL_BSP_EXPORT_TIMEOUT", DEFAULT_EXPORT_TIMEOUT * 1000
        )
        / 1000,
    )


_SAMPLERS: Final = {
    "always_on": (1.0, False),
    "always_off": (0.0, False),
    "traceidratio": (None, False),
    "parentbased_always_on": (1.0, True),
    "parentbased_always_off": (0.0, True),
    "parentbased_traceidratio": (None, True),
}


def _sampler(environ: Mapping[str, str]) -> tuple[float, bool]:
    """(ratio, parent-based) from OTEL_TRACES_SAMPLER and its argument; the SDK's default
    is parent-based, always on."""
    name = environ.get("OTEL_TRACES_SAMPLER", "").strip().lower() or "parentbased_always_on"
    if name not in _SAMPLERS:
        raise TracingUnavailable(
            f"OTEL_TRACES_SAMPLER={name!r} is not one rolegate applies: " + ", ".join(_SAMPLERS)
        )
    ratio, parent_based = _SAMPLERS[name]
    if ratio is None:
        raw = environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip() or "1.0"
        try:
            ratio = float(raw)
        except ValueError:
            ratio = -1.0
        if not 0.0 <= ratio <= 1.0:
            raise TracingUnavailable(
                f"OTEL_TRACES_SAMPLER_ARG must be a ratio from 0 to 1, not {raw!r}"
            )
    return ratio, parent_based


def _positive(environ: Mapping[str, str], name: str, default: float) -> int:
    raw = environ.get(name, "").strip()
    if not raw:
        return int(default)
    try:
        value = int(raw)
    except ValueError:
        raise TracingUnavailable(f"{name} must be a positive whole number, not {raw!r}") from None
    if value <= 0:
        raise TracingUnavailable(f"{name} must be a positive whole number, not {raw!r}")
    return value


def _fan_out(exporters: Sequence[SpanExporter]) -> SpanExporter:
    """One exporter handing every batch to each of `exporters` (OTEL_TRACES_EXPORTER
    names more than one)."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class FanOut(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            results = [exporter.export(spans) for exporter in exporters]
            ok = all(result is SpanExportResult.SUCCESS for result in results)
            return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

        def shutdown(self) -> None:
            for exporter in exporters:
                exporter.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return all(exporter.force_flush(timeout_millis) for exporter in exporters)

    return FanOut()
