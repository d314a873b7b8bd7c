"""OpenTelemetry traces (issue 18, docs/tracing.md): one SERVER span per client request and
a CLIENT span per arm, built from the outcome records, exported through the SDK's
in-memory exporter; the W3C trace context honoured from the caller and passed upstream
only where the ProviderPolicy says so; a full export queue drops and counts, never slows
a request. Real simulator, real proxy, the real `openai` client.

(The canary tests, test_canary.py, search the spans too; test_tracing_otlp.py exports to a
real OTLP HTTP receiver.)"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx
import openai
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from rolegate_proxy.edge.server import RunningProxy
from rolegate_proxy.edge.tracing import TraceSettings
from rolegate_sim.server import RunningSim

from ..support import ProxyFactory, SimFactory, machine_policy, provider_policy, role, role_table
from ..waiting import eventually

MODEL = "vendor/model-a"
PROMPT: Any = [{"role": "user", "content": "write the next step"}]
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"


def _tracing(exporter: SpanExporter, **limits: Any) -> TraceSettings:
    # A short schedule: the test waits for the export, not the SDK's 5 s default.
    return TraceSettings(exporter, delay_seconds=0.01, **limits)


async def _spans(exporter: InMemorySpanExporter, count: int) -> tuple[ReadableSpan, ...]:
    async def enough() -> tuple[ReadableSpan, ...] | None:
        found = exporter.get_finished_spans()
        return found if len(found) >= count else None

    return await eventually(enough, what=f"{count} spans exported")


def _request_span(spans: Sequence[ReadableSpan]) -> ReadableSpan:
    (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
    return server


def _arm_spans(spans: Sequence[ReadableSpan]) -> list[ReadableSpan]:
    """The arms' spans in the order they were sent."""
    arms = [s for s in spans if s.kind is SpanKind.CLIENT]
    return sorted(arms, key=lambda s: s.start_time or 0)


def _attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


async def _one_machine(
    sim_server: SimFactory,
    proxy_server: ProxyFactory,
    tracing: TraceSettings | None,
    *,
    propagate: bool = False,
) -> tuple[RunningSim, RunningProxy]:
    """A simulator with one instant machine, `m` of MODEL, and a proxy serving role
    `agent` from it, traced by `tracing` (None: tracing off)."""
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "reply": "ok", "machines": [{"name": "m"}]}]}
    )
    policy = provider_policy("p", f"{sim.url}/v1", {MODEL: ["m"]}, dialect="OpenAI")
    if propagate:
        policy["spec"]["propagateTraceContext"] = True
    proxy = await proxy_server([policy, role_table(role("agent", [MODEL]))], tracing=tracing)
    return sim, proxy


async def _stream(url: str, headers: dict[str, str] | None = None) -> str:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="agent",
            messages=PROMPT,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers=headers,
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


async def test_a_streamed_request_is_a_server_span_over_its_arm_under_the_callers_trace(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    exporter = InMemorySpanExporter()
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "reply": "one two three four",
                                "machines": [{"name": "m1", "tokensPerSecond": 200}]}]}
    )  # fmt: skip
    proxy = await proxy_server(
        [machine_policy(sim.url, MODEL, [{"name": "m1"}]), role_table(role("agent", [MODEL]))],
        tracing=_tracing(exporter),
    )
    assert await _stream(proxy.url, {"traceparent": TRACEPARENT}) == "one two three four"
    spans = await _spans(exporter, 2)
    assert len(spans) == 2
    server, (arm,) = _request_span(spans), _arm_spans(spans)
    # The caller's trace: the request span is its span's child, the arm the request's.
    assert server.context is not None
    assert arm.context is not None
    assert arm.parent is not None
    assert f"{server.context.trace_id:032x}" == CALLER_TRACE
    assert server.parent is not None
    assert f"{server.parent.span_id:016x}" == CALLER_SPAN
    assert server.parent.is_remote
    assert arm.context.trace_id == server.context.trace_id
    assert arm.parent.span_id == server.context.span_id
    assert server.name == "chat agent"
    assert arm.name == f"chat {MODEL}"
    request = _attrs(server)
    assert request["gen_ai.operation.name"] == "chat"
    assert request["gen_ai.request.model"] == "agent"
    assert request["gen_ai.response.model"] == MODEL
    assert request["gen_ai.provider.name"] == request["gen_ai.system"] == "agg"
    assert request["gen_ai.response.finish_reasons"] == ("stop",)
    assert request["gen_ai.usage.input_tokens"] > 0
    assert request["gen_ai.usage.output_tokens"] == 4
    assert request["gen_ai.request.stream"] is True
    assert request["rolegate.role"] == "agent"
    assert request["rolegate.ruling"] in ("Order", "Only")
    assert request["rolegate.outcome"] == "answered"
    assert request["rolegate.provider"] == "agg"
    assert request["rolegate.machine"] == "m1"
    assert request["rolegate.verdict"] == "ok"
    assert request["rolegate.attempts"] == 1
    assert request["http.response.status_code"] == 200
    assert server.status.status_code is StatusCode.UNSET
    answered = _attrs(arm)
    assert answered["gen_ai.request.model"] == MODEL
    assert answered["gen_ai.response.model"] == MODEL
    assert answered["gen_ai.usage.output_tokens"] == 4
    assert answered["rolegate.arm.cause"] == "answered"
    assert answered["rolegate.arm.result"] == "ok"
    assert answered["rolegate.arm.served"] is True
    assert answered["rolegate.machine"] == "m1"
    assert answered["server.address"] == "127.0.0.1"
    assert answered["server.port"] == sim.port
    assert arm.status.status_code is StatusCode.UNSET
    # The spans' times are the records': the arm within its request.
    assert server.start_time is not None
    assert server.end_time is not None
    assert arm.start_time is not None
    assert arm.end_time is not None
    assert server.start_time <= arm.start_time <= arm.end_time <= server.end_time + 1_000_000
    assert server.resource.attributes["service.name"] == "rolegate-proxy"


async def test_a_moved_stream_has_a_span_for_the_slow_arm_and_its_continuation(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    exporter = InMemorySpanExporter()
    reply = " ".join(f"t{i}" for i in range(150))
    fast = {"ttftSeconds": 0.05, "tokensPerSecond": 90, "continuesPartialMessage": True}
    collapse = {"kind": "rateCollapse", "always": True, "afterTokens": 40, "tokensPerSecond": 4}
    sim = await sim_server(
        {"seed": 2, "models": [{"name": MODEL, "reply": reply, "machines": [
            {"name": "fast1", **fast}, {"name": "degrading", **fast, "faults": [collapse]}]}]}
    )  # fmt: skip
    published = {"ttftSeconds": 0.1, "tokensPerSecond": 90, "continuesPartialMessage": True}
    first = {**published, "tokensPerSecond": 100}  # the degrading machine leads
    proxy = await proxy_server(
        [
            machine_policy(sim.url, MODEL, [{"name": "fast1", **published},
                                            {"name": "degrading", **first}]),
            role_table(role("agent", [MODEL], patience=600)),
        ],
        tracing=_tracing(exporter),
    )  # fmt: skip
    assert await _stream(proxy.url) == reply
    spans = await _spans(exporter, 3)
    server, arms = _request_span(spans), _arm_spans(spans)
    assert [(_attrs(a)["rolegate.machine"], _attrs(a)["rolegate.arm.cause"]) for a in arms] == [
        ("degrading", "moved"),
        ("fast1", "answered"),
    ]
    moved, continued = (_attrs(a) for a in arms)
    assert moved["rolegate.arm.result"] == "moved"
    assert moved["rolegate.arm.rate_act"] == "continued"
    assert moved["rolegate.arm.served"] is False
    assert "gen_ai.response.model" not in moved
    # A move is rolegate's doing, not the upstream's fault: no error on its span.
    assert arms[0].status.status_code is StatusCode.UNSET
    assert continued["rolegate.arm.served"] is True
    assert continued["gen_ai.response.finish_reasons"] == ("stop",)
    request = _attrs(server)
    assert request["rolegate.machine"] == "fast1"
    assert request["rolegate.attempts"] == 2
    assert request["rolegate.outcome"] == "answered"


async def test_a_failed_over_request_marks_the_failed_arm_in_our_words(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    exporter = InMemorySpanExporter()
    broken = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "machines": [{"name": "m", "faults": [
            {"kind": "serverError", "always": True, "status": 503, "message": "upstream-words"}
        ]}]}]}
    )  # fmt: skip
    healthy = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "reply": "fine", "machines": [{"name": "m"}]}]}
    )
    proxy = await proxy_server(
        [
            provider_policy("first", f"{broken.url}/v1", {MODEL: ["m"]}, dialect="OpenAI"),
            provider_policy("second", f"{healthy.url}/v1", {MODEL: ["m"]}, dialect="OpenAI"),
            role_table(role("agent", [MODEL], ruling="Order")),
        ],
        tracing=_tracing(exporter),
    )
    # `first` leads (names break the tie while nothing is known): it fails, `second` serves.
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0) as ai:
        answer = await ai.chat.completions.create(model="agent", messages=PROMPT)
    assert answer.choices[0].message.content == "fine"
    spans = await _spans(exporter, 1 + 2)
    server, arms = _request_span(spans), _arm_spans(spans)
    # (`first` is tried again after its 503, a transient failure, then `second` serves.)
    providers = [_attrs(a)["rolegate.provider"] for a in arms]
    assert providers[-1] == "second"
    assert set(providers[:-1]) == {"first"}
    failed, served = arms[0], arms[-1]
    failure = _attrs(failed)
    assert failure["rolegate.arm.cause"] == "http_error"
    assert failure["rolegate.arm.result"] == "server_error"
    assert failure["http.response.status_code"] == 503
    assert failure["error.type"] == "http_error"
    assert failure["gen_ai.provider.name"] == "first"
    assert failed.status.status_code is StatusCode.ERROR
    # rolegate's own description: never the upstream's error text.
    assert failed.status.description == "rolegate: the arm ended http_error"
    assert "upstream-words" not in "".join(s.to_json() for s in spans)
    assert _attrs(served)["rolegate.arm.served"] is True
    assert _attrs(served)["gen_ai.provider.name"] == "second"
    request = _attrs(server)
    assert request["rolegate.provider"] == "second"
    assert request["gen_ai.request.stream"] is False
    assert request["rolegate.attempts"] == len(arms)
    assert server.status.status_code is StatusCode.UNSET


async def test_a_request_nobody_could_serve_is_an_error_span_with_its_skip_reasons(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    exporter = InMemorySpanExporter()
    sim = await sim_server(
        {"seed": 1, "models": [{"name": MODEL, "machines": [{"name": "m", "faults": [
            {"kind": "serverError", "always": True, "status": 401, "message": "no"}]}]}]}
    )  # fmt: skip
    proxy = await proxy_server(
        [
            provider_policy("only", f"{sim.url}/v1", {MODEL: ["m"]}, dialect="OpenAI"),
            role_table(role("agent", [MODEL])),
        ],
        tracing=_tracing(exporter),
    )
    async with httpx.AsyncClient(timeout=10) as client:
        body = {"model": "agent", "messages": PROMPT}
        first = await client.post(f"{proxy.url}/v1/chat/completions", json=body)
        # The 401 excluded the provider: the second request is skipped, with why.
        second = await client.post(f"{proxy.url}/v1/chat/completions", json=body)
    assert (first.status_code, second.status_code) == (502, 503)
    spans = await _spans(exporter, 3)
    servers = sorted(
        (s for s in spans if s.kind is SpanKind.SERVER), key=lambda s: s.start_time or 0
    )
    assert [s.status.status_code for s in servers] == [StatusCode.ERROR, StatusCode.ERROR]
    assert [s.status.description for s in servers] == ["rolegate: failed", "rolegate: failed"]
    skipped = _attrs(servers[1])
    assert skipped["rolegate.attempts"] == 0
    assert skipped["error.type"] == skipped["rolegate.error_code"]
    assert skipped["rolegate.skip_reasons"]
    assert all(r.startswith(f"only/{MODEL}: ") for r in skipped["rolegate.skip_reasons"])


async def _one_traced_request(proxy: RunningProxy) -> None:
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0) as ai:
        await ai.chat.completions.create(
            model="agent", messages=PROMPT, extra_headers={"traceparent": TRACEPARENT}
        )


async def test_the_trace_context_goes_upstream_only_where_the_provider_policy_allows(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    for allowed in (False, True):
        exporter = InMemorySpanExporter()
        sim = await sim_server(
            {"seed": 1, "models": [{"name": MODEL, "reply": "ok", "machines": [{"name": "m"}]}]}
        )
        spec = {"propagateTraceContext": True} if allowed else {}
        proxy = await proxy_server(
            [
                provider_policy("p", f"{sim.url}/v1", {MODEL: ["m"]}, dialect="OpenAI", **spec),
                role_table(role("agent", [MODEL])),
            ],
            tracing=_tracing(exporter),
        )
        await _one_traced_request(proxy)
        arm = _arm_spans(await _spans(exporter, 2))[0]
        async with httpx.AsyncClient() as client:
            (record,) = (await client.get(f"{sim.url}/_sim/requests")).json()
        if not allowed:
            assert record["traceparent"] is None
            continue
        # The arm's own span is the upstream's parent: the provider's spans hang under it.
        assert arm.context is not None
        assert record["traceparent"] == f"00-{CALLER_TRACE}-{arm.context.span_id:016x}-01"


async def test_with_tracing_off_nothing_is_traced_or_sent_upstream(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    sim, proxy = await _one_machine(sim_server, proxy_server, None, propagate=True)
    assert proxy.state.spans is None
    await _one_traced_request(proxy)
    async with httpx.AsyncClient() as client:
        (record,) = (await client.get(f"{sim.url}/_sim/requests")).json()
        metrics = (await client.get(f"{proxy.url}/metrics")).text
    # Not even the caller's own traceparent is passed on: only a traced proxy speaks it.
    assert record["traceparent"] is None
    assert "rolegate_trace_spans_dropped_total 0.0" in metrics


async def test_an_unsampled_caller_is_not_exported_but_its_flag_goes_upstream(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    exporter = InMemorySpanExporter()
    sim, proxy = await _one_machine(sim_server, proxy_server, _tracing(exporter), propagate=True)
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0) as ai:
        await ai.chat.completions.create(
            model="agent",
            messages=PROMPT,
            extra_headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-00"},
        )
        # A sampled one after it: once its spans are out, the first one's would have been.
        await ai.chat.completions.create(model="agent", messages=PROMPT)
    spans = await _spans(exporter, 2)
    assert all(s.context is not None and f"{s.context.trace_id:032x}" != CALLER_TRACE
               for s in spans)  # fmt: skip
    async with httpx.AsyncClient() as client:
        records = (await client.get(f"{sim.url}/_sim/requests")).json()
    assert records[0]["traceparent"].startswith(f"00-{CALLER_TRACE}-")
    assert records[0]["traceparent"].endswith("-00")


async def test_a_sampling_ratio_of_zero_exports_only_what_a_sampled_caller_asks_for(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    exporter = InMemorySpanExporter()
    # OTEL_TRACES_SAMPLER=parentbased_traceidratio, OTEL_TRACES_SAMPLER_ARG=0
    _sim, proxy = await _one_machine(sim_server, proxy_server, _tracing(exporter, ratio=0.0))
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0) as ai:
        await ai.chat.completions.create(model="agent", messages=PROMPT)
    await _one_traced_request(proxy)
    spans = await _spans(exporter, 2)
    # The first request's spans, had they been kept, were queued before the second's.
    assert len(spans) == 2
    assert {f"{s.context.trace_id:032x}" for s in spans if s.context} == {CALLER_TRACE}


class _Blocked(SpanExporter):
    """An exporter stuck in its first export until released: a collector that hangs."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        self.release.wait(30)
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.release.set()


async def _dropped(url: str) -> float:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{url}/metrics")).text
    (line,) = [
        ln for ln in text.splitlines() if ln.startswith("rolegate_trace_spans_dropped_total")
    ]
    return float(line.split()[-1])


async def test_a_stuck_exporter_drops_and_counts_spans_and_never_slows_a_request(
    sim_server: SimFactory, proxy_server: ProxyFactory
) -> None:
    exporter = _Blocked()
    # Room for four requests' spans (two each) while the exporter hangs on its batch.
    _sim, proxy = await _one_machine(
        sim_server, proxy_server, _tracing(exporter, max_queue=8, max_batch=2)
    )
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0) as ai:
        await ai.chat.completions.create(model="agent", messages=PROMPT)
        # The first request's spans are in the exporter's hands, and it hangs there.
        await asyncio.to_thread(exporter.entered.wait, 10)
        took = []
        for _ in range(30):
            started = time.monotonic()
            await ai.chat.completions.create(model="agent", messages=PROMPT)
            took.append(time.monotonic() - started)
    # Every request went at the simulator's pace: none waited on the export (a request
    # that waited would take the 30 s the exporter hangs for).
    assert max(took) < 1.0, took
    # 30 requests after the stuck one, 4 of them queued: 26 dropped, 2 spans each.
    dropped = await eventually(
        lambda: _dropped_if(proxy.url, 52), what="52 spans counted as dropped"
    )
    assert dropped == 52
    exporter.release.set()

    async def exported() -> bool:
        return len(exporter.spans) == 2 + 8

    await eventually(exported, what="the stuck batch and the queued spans exported")


async def _dropped_if(url: str, count: float) -> float | None:
    dropped = await _dropped(url)
    return dropped if dropped >= count else None


class _Refusing(SpanExporter):
    """A collector that refuses every batch, then one whose exporter raises."""

    def __init__(self) -> None:
        self.calls = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.calls += 1
        if self.calls == 1:
            return SpanExportResult.FAILURE
        raise RuntimeError("an exporter's own bug")


async def _counter(url: str, name: str) -> float:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{url}/metrics")).text
    (line,) = [ln for ln in text.splitlines() if ln.startswith(f"{name} ")]
    return float(line.split()[-1])


async def test_a_refused_or_failing_export_is_counted_and_the_export_goes_on(
    sim_server: SimFactory, proxy_server: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    exporter = _Refusing()
    _sim, proxy = await _one_machine(sim_server, proxy_server, _tracing(exporter))
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0) as ai:
        for expected in (2, 4):  # each request's two spans
            await ai.chat.completions.create(model="agent", messages=PROMPT)

            async def failed(count: float = expected) -> float | None:
                found = await _counter(proxy.url, "rolegate_trace_spans_failed_total")
                return found if found >= count else None

            assert await eventually(failed, what=f"{expected} spans failed") == expected
    assert await _counter(proxy.url, "rolegate_trace_spans_exported_total") == 0
    # The exporter's bug is logged (and the thread lives on: the second batch was tried).
    assert any("span exporter" in r.getMessage() for r in caplog.records)
