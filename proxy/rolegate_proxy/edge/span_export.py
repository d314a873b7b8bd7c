"""OpenTelemetry spans from the outcome channel: one consumer more of the records every
other consumer reads (docs/tracing.md).

Each finished request's `Outcome` becomes a SERVER span, and each of its arms (failovers,
moves, rescues, a race's loser) a CLIENT span under it, with the GenAI semantic
conventions' attributes and rolegate's own under `rolegate.`. The ids were drawn while the
request ran (flow/tracing.py), so the span an upstream was told of in its `traceparent` is
the one exported; the times come from the records.

Nothing here runs on the request path. The consumer, on the event loop, only appends a
finished record to a bounded queue (counted in spans); a background thread builds the spans
and hands them to the exporter in batches. When the queue is full the request's spans are
dropped and counted (`rolegate_trace_spans_dropped_total`): an exporter that is slow or
down never slows a request.

A span carries routing metadata only, as the records do: names, numbers, our own words.
Never a prompt, a completion, a credential, or an upstream's error text (not even the
arms' `detail`, which words an upstream's status in our terms).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Final
from urllib.parse import urlsplit

from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState
from opentelemetry.util.types import AttributeValue

from rolegate_policy.config import ProxyConfig

from ..core.arm_end import UPSTREAM_FAULTS, Cause
from ..core.outcomes import Arm, Outcome, OutcomeKind
from ..flow.tracing import span_id
from ..wire.names import upstream_name
from .tracing import TraceSettings

log = logging.getLogger("rolegate.proxy")

SCOPE: Final = InstrumentationScope("rolegate")
DEFAULT_SERVICE: Final = "rolegate-proxy"
# A request span's status when it failed: rolegate's words, never the upstream's.
_FAILED: Final = frozenset({OutcomeKind.FAILED, OutcomeKind.INCOMPLETE})
# An arm's span is an error when the upstream failed it (or we could not send it).
_ARM_ERRORS: Final = frozenset({*(c.value for c in UPSTREAM_FAULTS), Cause.NO_CREDENTIALS.value})
_SAMPLED: Final = TraceFlags(TraceFlags.SAMPLED)


class SpanExport:
    """The outcome channel's span consumer, with its export thread."""

    def __init__(self, settings: TraceSettings, config: Callable[[], ProxyConfig]) -> None:
        self.settings = settings
        self._exporter = settings.exporter
        self._config = config
        self.resource = _resource(settings.resource)
        # (record, the configuration it was served under), and how many spans are queued.
        self._queue: deque[tuple[Outcome, ProxyConfig]] = deque()
        self._queued = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.exported = 0
        self.dropped = 0
        self.failed = 0

    # -- on the event loop ---------------------------------------------------------------

    def __call__(self, batch: Sequence[Outcome]) -> None:
        """The consumer: queue the traced records (O(1) each), never export."""
        config = self._config()
        limit = self.settings.max_queue
        queued = False
        with self._lock:
            for outcome in batch:
                trace = outcome.trace
                if trace is None or not trace.sampled:
                    continue
                spans = 1 + len(outcome.arms)
                if self._queued + spans > limit:
                    self.dropped += spans
                    continue
                self._queue.append((outcome, config))
                self._queued += spans
                queued = True
            full = self._queued >= self.settings.max_batch
        if queued and full:
            self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rolegate-span-export", daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Export what is queued (within `timeout`), then shut the exporter down. Blocking:
        called in a worker thread at shutdown."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._exporter.shutdown()

    # -- on the export thread ------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(self.settings.delay_seconds)
            self._wake.clear()
            stopping = self._stopping
            while self._export_batch():
                pass
            if stopping:
                return

    def _export_batch(self) -> bool:
        """One batch of queued spans exported; False when nothing was queued."""
        taken: list[tuple[Outcome, ProxyConfig]] = []
        count = 0
        with self._lock:
            while self._queue and count < self.settings.max_batch:
                outcome, config = self._queue.popleft()
                taken.append((outcome, config))
                count += 1 + len(outcome.arms)
            self._queued -= count
        if not taken:
            return False
        spans: list[ReadableSpan] = []
        for outcome, config in taken:
            spans.extend(request_spans(outcome, config, self.resource))
        try:
            result = self._exporter.export(spans)
        except Exception:
            # An exporter's bug must not end the thread (and with it every later export).
            log.exception("span exporter %r failed", self._exporter)
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self.exported += len(spans)
        else:
            self.failed += len(spans)
        return True


def _resource(given: Resource | None) -> Resource:
    resource = Resource.create() if given is None else given
    service = str(resource.attributes.get(SERVICE_NAME, ""))
    if not service or service.startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE}))
    return resource


def request_spans(outcome: Outcome, config: ProxyConfig, resource: Resource) -> list[ReadableSpan]:
    """The request's span and its arms' spans, from its outcome record."""
    trace = outcome.trace
    assert trace is not None
    state = TraceState.from_header([trace.tracestate]) if trace.tracestate else TraceState()
    context = SpanContext(trace.trace_id, trace.span_id, False, _SAMPLED, state)
    parent = (
        SpanContext(trace.trace_id, trace.parent_id, True, _SAMPLED, state)
        if trace.parent_id
        else None
    )
    start = int(outcome.started_at * 1e9)
    end = start + int(outcome.latency_seconds * 1e9)
    served = _served_arm(outcome)
    attributes = _request_attributes(outcome)
    failed = outcome.outcome in _FAILED
    spans = [
        ReadableSpan(
            name=f"chat {outcome.role}" if outcome.role else "chat",
            context=context,
            parent=parent,
            resource=resource,
            attributes=attributes,
            kind=SpanKind.SERVER,
            status=Status(StatusCode.ERROR, f"rolegate: {outcome.outcome.value}")
            if failed
            else Status(StatusCode.UNSET),
            start_time=start,
            end_time=end,
            instrumentation_scope=SCOPE,
        )
    ]
    endpoints = _endpoints(config)
    for arm in outcome.arms:
        arm_start = start + int((arm.started_after or 0.0) * 1e9)
        arm_end = arm_start + int((arm.seconds or 0.0) * 1e9)
        errored = arm.cause in _ARM_ERRORS
        spans.append(
            ReadableSpan(
                name=f"chat {arm.model}",
                context=SpanContext(
                    # An arm that never reached its sending had no id drawn.
                    trace.trace_id,
                    arm.span_id or span_id(),
                    False,
                    _SAMPLED,
                    state,
                ),
                parent=context,
                resource=resource,
                attributes=_arm_attributes(arm, outcome, arm is served, endpoints),
                kind=SpanKind.CLIENT,
                status=Status(StatusCode.ERROR, f"rolegate: the arm ended {arm.cause}")
                if errored
                else Status(StatusCode.UNSET),
                start_time=arm_start,
                end_time=max(arm_end, arm_start),
                instrumentation_scope=SCOPE,
            )
        )
    return spans


def _request_attributes(outcome: Outcome) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.stream": outcome.stream,
        "http.response.status_code": outcome.status,
        "rolegate.request_id": outcome.request_id,
        "rolegate.outcome": outcome.outcome.value,
        "rolegate.attempts": len(outcome.arms),
    }
    _put(attributes, "gen_ai.request.model", outcome.role)
    _put(attributes, "rolegate.role", outcome.role)
    _put(attributes, "rolegate.ruling", outcome.ruling)
    _put(attributes, "rolegate.grant", outcome.grant)
    _put(attributes, "rolegate.config_hash", outcome.config_hash or None)
    _put(attributes, "rolegate.error_code", outcome.error_code)
    _put(attributes, "rolegate.ttft_seconds", outcome.ttft_seconds)
    if outcome.error_code is not None or outcome.outcome in _FAILED:
        attributes["error.type"] = outcome.error_code or outcome.outcome.value
    if outcome.provider is not None:
        _served_attributes(attributes, outcome)
        _put(attributes, "rolegate.cost_usd", outcome.cost_usd)
        attributes["rolegate.tokens_estimated"] = outcome.tokens_estimated
    if outcome.skipped:
        # In our own words (a breaker's exclusion, the caller's narrowing, the patience).
        attributes["rolegate.skip_reasons"] = tuple(
            f"{skip.provider}/{skip.model}"
            + (f"@{_name(skip.machine)}" if skip.machine else "")
            + f": {skip.reason}"
            for skip in outcome.skipped
        )
    return attributes


def _served_attributes(attributes: dict[str, AttributeValue], outcome: Outcome) -> None:
    """What the request and its serving arm both say of the answer."""
    _provider(attributes, outcome.provider)
    _put(attributes, "gen_ai.response.model", outcome.model)
    _put(attributes, "gen_ai.usage.input_tokens", outcome.tokens_in)
    _put(attributes, "gen_ai.usage.output_tokens", outcome.tokens_out)
    if outcome.finish_reason is not None:
        attributes["gen_ai.response.finish_reasons"] = (outcome.finish_reason,)
    _put(attributes, "rolegate.provider", outcome.provider)
    _put(attributes, "rolegate.model", outcome.model)
    _put(attributes, "rolegate.machine", _name(outcome.machine))
    _put(attributes, "rolegate.verdict", outcome.verdict)


def _arm_attributes(
    arm: Arm, outcome: Outcome, served: bool, endpoints: dict[str, tuple[str, int | None]]
) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": arm.model,
        "rolegate.arm.result": arm.result.value,
        "rolegate.arm.served": served,
    }
    if served:
        _served_attributes(attributes, outcome)
    _provider(attributes, arm.provider)
    attributes["rolegate.provider"] = arm.provider
    attributes["rolegate.model"] = arm.model
    _put(attributes, "rolegate.machine", _name(arm.machine))
    _put(attributes, "rolegate.arm.cause", arm.cause or None)
    _put(attributes, "rolegate.arm.rate_act", arm.act.value if arm.act else None)
    _put(attributes, "rolegate.arm.ttft_seconds", arm.ttft_seconds)
    _put(attributes, "http.response.status_code", arm.status)
    if arm.cause in _ARM_ERRORS:
        attributes["error.type"] = arm.cause
    endpoint = endpoints.get(arm.provider)
    if endpoint is not None:
        attributes["server.address"] = endpoint[0]
        _put(attributes, "server.port", endpoint[1])
    return attributes


def _served_arm(outcome: Outcome) -> Arm | None:
    """The arm whose answer reached the client: the last one of the serving machine."""
    if outcome.provider is None:
        return None
    for arm in reversed(outcome.arms):
        if (arm.provider, arm.model) == (outcome.provider, outcome.model) and (
            outcome.machine is None or arm.machine == outcome.machine
        ):
            return arm
    return None


def _provider(attributes: dict[str, AttributeValue], provider: str | None) -> None:
    if provider is not None:
        # The current name and its predecessor, which most backends still read.
        attributes["gen_ai.provider.name"] = provider
        attributes["gen_ai.system"] = provider


def _put(attributes: dict[str, AttributeValue], key: str, value: AttributeValue | None) -> None:
    if value is not None:
        attributes[key] = value


def _name(machine: str | None) -> str | None:
    """A machine's name (an upstream may have given it) made safe, as for headers."""
    return None if machine is None else upstream_name(machine)


# Each configuration's provider endpoints (host, port), by the configuration's identity.
_ENDPOINTS: dict[int, tuple[ProxyConfig, dict[str, tuple[str, int | None]]]] = {}


def _endpoints(config: ProxyConfig) -> dict[str, tuple[str, int | None]]:
    found = _ENDPOINTS.get(id(config))
    if found is not None and found[0] is config:
        return found[1]
    endpoints: dict[str, tuple[str, int | None]] = {}
    for provider in config.providers:
        parts = urlsplit(provider.endpoint)
        if parts.hostname:
            endpoints.setdefault(provider.name, (parts.hostname, parts.port))
    if len(_ENDPOINTS) >= 16:
        _ENDPOINTS.clear()  # configurations replaced long ago
    _ENDPOINTS[id(config)] = (config, endpoints)
    return endpoints
