"""Turning traces on and off with the standard OTEL_* environment, and reading the caller's
W3C trace context (docs/tracing.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import ConsoleSpanExporter

from rolegate_proxy.core.trace_ids import TraceIds, clean_tracestate, parse_traceparent
from rolegate_proxy.edge.tracing import TracingUnavailable, from_environment
from rolegate_proxy.flow.tracing import request_ids

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {"OTEL_SERVICE_NAME": "proxy"},  # naming the service asks for no export
        {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"},
        {"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"},
        {"OTEL_SDK_DISABLED": "TRUE", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318"},
    ],
)
def test_tracing_is_off_unless_the_environment_asks_for_it(environ: dict[str, str]) -> None:
    assert from_environment(environ) is None


def test_an_otlp_endpoint_alone_turns_on_the_otlp_exporter_with_the_sdk_defaults() -> None:
    settings = from_environment({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert settings is not None
    assert isinstance(settings.exporter, OTLPSpanExporter)
    assert (settings.max_queue, settings.max_batch) == (2048, 512)
    assert (settings.delay_seconds, settings.export_timeout_seconds) == (5.0, 30.0)


def test_the_batch_settings_come_from_otel_bsp() -> None:
    settings = from_environment(
        {
            "OTEL_TRACES_EXPORTER": "console",
            "OTEL_BSP_MAX_QUEUE_SIZE": "100",
            "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "10",
            "OTEL_BSP_SCHEDULE_DELAY": "250",
            "OTEL_BSP_EXPORT_TIMEOUT": "2000",
        }
    )
    assert settings is not None
    assert isinstance(settings.exporter, ConsoleSpanExporter)
    assert (settings.max_queue, settings.max_batch) == (100, 10)
    assert (settings.delay_seconds, settings.export_timeout_seconds) == (0.25, 2.0)


def test_two_exporters_each_get_every_batch() -> None:
    settings = from_environment({"OTEL_TRACES_EXPORTER": "otlp,console"})
    assert settings is not None
    assert type(settings.exporter).__name__ == "FanOut"


@pytest.mark.parametrize(
    ("environ", "says"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER names zipkin"),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf",
        ),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_BSP_MAX_QUEUE_SIZE": "-3"},
            "OTEL_BSP_MAX_QUEUE_SIZE must be a positive whole number, not '-3'",
        ),
    ],
)
def test_what_cannot_be_exported_is_refused_saying_why(environ: dict[str, str], says: str) -> None:
    with pytest.raises(TracingUnavailable, match=says.replace("(", r"\(")):
        from_environment(environ)


def test_the_proxy_refuses_to_start_when_tracing_is_asked_for_without_the_sdk(
    tmp_path: Path,
) -> None:
    """The `rolegate[tracing]` extra not installed (its packages unimportable in the child):
    `rolegate proxy` stops at once, saying what to install, rather than export nothing."""
    blocked = "import sys; sys.modules['opentelemetry.sdk'] = None; "
    run = (
        "from rolegate_cli.main import main; "
        f"sys.exit(main(['proxy', '--manifests', {str(tmp_path)!r}, '--port', '0']))"
    )
    result = subprocess.run(
        [sys.executable, "-c", blocked + run],
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "PATH": "/usr/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "pip install 'rolegate[tracing]'" in result.stderr


def test_a_valid_traceparent_is_read_and_an_invalid_one_ignored() -> None:
    trace, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    assert parse_traceparent(f"00-{trace}-{parent}-01") == (int(trace, 16), int(parent, 16), True)
    assert parse_traceparent(f"00-{trace}-{parent}-00") == (int(trace, 16), int(parent, 16), False)
    # A later version may carry more fields; its first four are read.
    assert parse_traceparent(f"01-{trace}-{parent}-01-extra") is not None
    for bad in (
        None,
        "",
        "garbage",
        f"ff-{trace}-{parent}-01",  # the forbidden version
        f"00-{'0' * 32}-{parent}-01",  # all-zero ids are invalid
        f"00-{trace}-{'0' * 16}-01",
        f"00-{trace.upper()}-{parent}-01",  # lower-case hex only
        f"00-{trace}-{parent}-01-extra",  # version 00 is exactly 55 characters
        f"00_{trace}_{parent}_01",
    ):
        assert parse_traceparent(bad) is None, bad


def test_a_request_joins_its_callers_trace_or_starts_its_own() -> None:
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    joined = request_ids(f"00-{trace}-00f067aa0ba902b7-01", "vendor=abc")
    assert (joined.trace_id, joined.parent_id) == (int(trace, 16), 0xF067AA0BA902B7)
    assert joined.sampled
    assert joined.tracestate == "vendor=abc"
    assert joined.span_id not in (0, joined.parent_id)
    fresh = request_ids("not-a-traceparent", "vendor=abc")
    assert fresh.trace_id != int(trace, 16)
    assert (fresh.parent_id, fresh.sampled, fresh.tracestate) == (0, True, "")
    assert TraceIds(1, 2, sampled=False).traceparent(0xAB) == f"00-{1:032x}-{0xAB:016x}-00"
    assert clean_tracestate("a=1\r\nX-Injected: 1") == ""
    assert clean_tracestate("x" * 600) == ""


@pytest.mark.parametrize(
    ("sampler", "argument", "expected"),
    [
        (None, None, (1.0, True)),
        ("always_on", None, (1.0, False)),
        ("always_off", None, (0.0, False)),
        ("traceidratio", "0.25", (0.25, False)),
        ("parentbased_traceidratio", "0.1", (0.1, True)),
        ("parentbased_always_off", None, (0.0, True)),
    ],
)
def test_the_sampler_comes_from_otel_traces_sampler(
    sampler: str | None, argument: str | None, expected: tuple[float, bool]
) -> None:
    environ = {"OTEL_TRACES_EXPORTER": "console"}
    if sampler is not None:
        environ["OTEL_TRACES_SAMPLER"] = sampler
    if argument is not None:
        environ["OTEL_TRACES_SAMPLER_ARG"] = argument
    settings = from_environment(environ)
    assert settings is not None
    assert (settings.ratio, settings.parent_based) == expected


@pytest.mark.parametrize(
    ("sampler", "argument", "says"),
    [
        ("jaeger_remote", None, "OTEL_TRACES_SAMPLER='jaeger_remote' is not one rolegate applies"),
        ("traceidratio", "1.5", "OTEL_TRACES_SAMPLER_ARG must be a ratio from 0 to 1, not '1.5'"),
        ("traceidratio", "half", "OTEL_TRACES_SAMPLER_ARG must be a ratio from 0 to 1, not 'half'"),
    ],
)
def test_a_sampler_rolegate_cannot_apply_is_refused(
    sampler: str, argument: str | None, says: str
) -> None:
    environ = {"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": sampler}
    if argument is not None:
        environ["OTEL_TRACES_SAMPLER_ARG"] = argument
    with pytest.raises(TracingUnavailable, match=says):
        from_environment(environ)


def test_sampling_by_ratio_keeps_that_share_of_new_traces_and_follows_a_parent() -> None:
    kept = sum(request_ids(None, None, 0.25).sampled for _ in range(4000))
    assert 800 < kept < 1200
    assert not any(request_ids(None, None, 0.0).sampled for _ in range(200))
    sampled_parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    unsampled_parent = sampled_parent[:-2] + "00"
    # Parent-based: the caller's flag decides, whatever the ratio.
    assert request_ids(sampled_parent, None, 0.0, parent_based=True).sampled
    assert not request_ids(unsampled_parent, None, 1.0, parent_based=True).sampled
    # Not parent-based: the ratio decides, on the caller's trace id.
    assert not request_ids(sampled_parent, None, 0.0, parent_based=False).sampled
    assert request_ids(unsampled_parent, None, 1.0, parent_based=False).sampled
