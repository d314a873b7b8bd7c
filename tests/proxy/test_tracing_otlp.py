"""Traces to a real OTLP HTTP receiver on loopback (issue 18): the `rolegate proxy` command,
configured only through the standard OTEL_* environment, exports protobuf spans over HTTP
for a moved stream, a plain stream and a failed-over request; they carry the GenAI and
rolegate attributes, and no canary (prompt, completion, key, upstream error text)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from ..support import (
    SimFactory,
    machine_policy,
    open_access,
    provider_policy,
    role,
    role_table,
)
from ..waiting import eventually

CLI = [sys.executable, "-m", "rolegate_cli.main"]
MODEL = "vendor/model-a"
OTHER = "vendor/model-b"
PROMPT_CANARY = "canary-prompt-otlp-31c7"
COMPLETION_CANARY = "canary-completion-otlp-8e02"
KEY_CANARY = "sk-canary-otlp-key-5a90"
ERROR_CANARY = "canary-upstream-error-otlp-77d4"
CANARIES = (PROMPT_CANARY, COMPLETION_CANARY, KEY_CANARY, ERROR_CANARY)
MESSAGES: Any = [{"role": "user", "content": f"Repeat {PROMPT_CANARY} please"}]
CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{CALLER_TRACE}-b7ad6b7169203331-01"


class Receiver:
    """An OTLP/HTTP trace receiver: POST /v1/traces with a protobuf body, as a collector."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.spans: list[tuple[dict[str, Any], Span]] = []  # (resource attributes, span)

    async def traces(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        body = await request.read()
        self.bodies.append(body)
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        for resource_spans in export.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend((resource, span) for span in scope_spans.spans)
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(v) for v in value.array_value.values)
    return getattr(value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs if isinstance(pair, KeyValue)}


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[Receiver, str]]:
    found = Receiver()
    app = web.Application()
    app.router.add_post("/v1/traces", found.traces)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield found, f"http://127.0.0.1:{port}"
    await runner.cleanup()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _manifests(tmp_path: Path, moving_url: str, failing_url: str, healthy_url: str) -> Path:
    fast = {"ttftSeconds": 0.1, "tokensPerSecond": 90, "continuesPartialMessage": True}
    objects = [
        # The degrading machine is published a little faster, so it leads the first stream.
        machine_policy(
            moving_url, MODEL, [{"name": "fast1", **fast}, {"name": "degrading", **fast,
                                                             "tokensPerSecond": 100}],
        ),
        provider_policy("first", f"{failing_url}/v1", {OTHER: ["m"]}, dialect="OpenAI"),
        provider_policy(
            "second", f"{healthy_url}/v1", {OTHER: ["m"]}, dialect="OpenAI",
            apiKeySecretRef={"name": "second-key", "key": "apiKey"},
        ),
        role_table(
            role("agent", [MODEL], patience=600),
            role("failover", [OTHER], ruling="Order"),
        ),
        open_access(),
    ]  # fmt: skip
    directory = tmp_path / "manifests"
    directory.mkdir()
    for index, manifest in enumerate(objects):
        (directory / f"{index}.yaml").write_text(yaml.safe_dump(manifest), encoding="utf-8")
    return directory


async def test_spans_reach_a_real_otlp_receiver_configured_by_otel_environment_alone(
    sim_server: SimFactory, receiver: tuple[Receiver, str], tmp_path: Path
) -> None:
    collector, collector_url = receiver
    reply = f"{COMPLETION_CANARY} " + " ".join(f"t{i}" for i in range(120))
    fast = {"ttftSeconds": 0.05, "tokensPerSecond": 90, "continuesPartialMessage": True}
    collapse = {"kind": "rateCollapse", "always": True, "afterTokens": 40, "tokensPerSecond": 4}
    moving = await sim_server(
        {"seed": 2, "models": [{"name": MODEL, "reply": reply, "machines": [
            {"name": "fast1", **fast}, {"name": "degrading", **fast, "faults": [collapse]}]}]}
    )  # fmt: skip
    error = f"{ERROR_CANARY}: worker crashed on {PROMPT_CANARY}"
    failing = await sim_server(
        {"seed": 1, "models": [{"name": OTHER, "machines": [{"name": "m", "faults": [
            {"kind": "serverError", "always": True, "status": 503, "message": error}]}]}]}
    )  # fmt: skip
    healthy = await sim_server(
        {"seed": 1, "models": [{"name": OTHER, "reply": COMPLETION_CANARY,
                                "machines": [{"name": "m"}]}]}
    )  # fmt: skip
    manifests = _manifests(tmp_path, moving.url, failing.url, healthy.url)
    port = _free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    env.update(
        {
            # Nothing but the standard variables turns tracing on and points it.
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector_url,
            "OTEL_BSP_SCHEDULE_DELAY": "50",
            "OTEL_SERVICE_NAME": "rolegate-under-test",
            "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test",
            "ROLEGATE_SECRET_SECOND_KEY_APIKEY": KEY_CANARY,
        }
    )
    proxy = await asyncio.create_subprocess_exec(
        *CLI, "proxy", "--manifests", str(manifests), "--port", str(port),
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as client:

            async def ready() -> bool:
                assert proxy.returncode is None, "the proxy exited"
                try:
                    return (await client.get(f"{url}/readyz")).status_code == 200
                except httpx.HTTPError:
                    return False

            await eventually(ready, what="the proxy ready", within=30)
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as ai:
            # A stream that moves (the leading machine collapses), then one that does not.
            for headers in ({}, {"traceparent": TRACEPARENT}):
                stream = await ai.chat.completions.create(
                    model="agent", messages=MESSAGES, stream=True, extra_headers=headers
                )
                text = "".join(
                    [c.choices[0].delta.content or "" async for c in stream if c.choices]
                )
                assert text == reply
            # `first` answers 503 with the canaries in its error; `second` serves.
            answer = await ai.chat.completions.create(model="failover", messages=MESSAGES)
            assert answer.choices[0].message.content == COMPLETION_CANARY

        async def three_requests() -> list[Span] | None:
            roots = [span for _, span in collector.spans if span.kind == Span.SPAN_KIND_SERVER]
            return roots if len(roots) == 3 else None

        await eventually(three_requests, what="three request spans at the receiver", within=20)
    finally:
        if proxy.returncode is None:
            proxy.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proxy.wait(), 30)
    assert proxy.returncode == 0
    spans = [span for _, span in collector.spans]
    resource = collector.spans[0][0]
    assert resource["service.name"] == "rolegate-under-test"
    assert resource["deployment.environment"] == "test"
    by_trace: dict[bytes, list[Span]] = {}
    for span in spans:
        by_trace.setdefault(span.trace_id, []).append(span)
    assert len(by_trace) == 3
    requests = {}
    for trace in by_trace.values():
        (root,) = [s for s in trace if s.kind == Span.SPAN_KIND_SERVER]
        arms = sorted((s for s in trace if s.kind == Span.SPAN_KIND_CLIENT),
                      key=lambda s: s.start_time_unix_nano)  # fmt: skip
        assert all(arm.parent_span_id == root.span_id for arm in arms)
        requests[root.start_time_unix_nano] = (root, arms)
    (moved, moved_arms), (streamed, streamed_arms), (failed_over, failover_arms) = (
        requests[key] for key in sorted(requests)
    )

    # The moved stream: its slow arm moved, its continuation served.
    assert [_attributes(a.attributes)["rolegate.arm.cause"] for a in moved_arms] == [
        "moved",
        "answered",
    ]
    assert _attributes(moved_arms[0].attributes)["rolegate.arm.rate_act"] == "continued"
    assert _attributes(moved_arms[0].attributes)["rolegate.machine"] == "degrading"
    assert _attributes(moved.attributes)["rolegate.machine"] == "fast1"

    # The plain stream, under the caller's trace.
    assert streamed.trace_id.hex() == CALLER_TRACE
    assert streamed.parent_span_id.hex() == TRACEPARENT.split("-")[2]
    request = _attributes(streamed.attributes)
    assert streamed.name == "chat agent"
    assert request["gen_ai.operation.name"] == "chat"
    assert request["gen_ai.request.model"] == "agent"
    assert request["gen_ai.response.model"] == MODEL
    assert request["gen_ai.provider.name"] == request["gen_ai.system"] == "agg"
    assert request["gen_ai.response.finish_reasons"] == ("stop",)
    assert request["gen_ai.usage.output_tokens"] == 121
    assert request["rolegate.role"] == "agent"
    assert request["rolegate.outcome"] == "answered"
    assert request["rolegate.verdict"] == "ok"
    assert request["rolegate.ruling"] in ("Order", "Only")
    (arm,) = streamed_arms
    assert arm.name == f"chat {MODEL}"
    assert _attributes(arm.attributes)["rolegate.arm.served"] is True

    # The failed-over request: the failing arms are errors in our words.
    causes = [_attributes(a.attributes)["rolegate.arm.cause"] for a in failover_arms]
    assert causes[-1] == "answered"
    assert set(causes[:-1]) == {"http_error"}
    first = failover_arms[0]
    assert _attributes(first.attributes)["rolegate.provider"] == "first"
    assert _attributes(first.attributes)["http.response.status_code"] == 503
    assert first.status.code == Status.STATUS_CODE_ERROR
    assert first.status.message == "rolegate: the arm ended http_error"
    assert _attributes(failover_arms[-1].attributes)["gen_ai.provider.name"] == "second"
    assert _attributes(failed_over.attributes)["rolegate.provider"] == "second"

    # No canary in any span, decoded or on the wire.
    decoded = "\n".join(str(span) for span in spans)
    wire = b"".join(collector.bodies)
    for canary in CANARIES:
        assert canary not in decoded, f"{canary} in a span"
        assert canary.encode() not in wire, f"{canary} in an export body"
