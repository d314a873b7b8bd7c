"""Prometheus metrics of one proxy, on a registry of its own (several apps may share a process)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .exclusions import BreakerState, State, Transition
from .verdicts import Verdict, VerdictKind


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "rolegate_requests",
            "Client requests by role and HTTP status answered.",
            ["role", "status"],
            registry=self.registry,
        )
        self.attempt_failures = Counter(
            "rolegate_attempt_failures",
            "Upstream attempts that produced nothing usable, by provider and kind.",
            ["provider", "kind"],
            registry=self.registry,
        )
        self.missing_charset = Counter(
            "rolegate_upstream_missing_charset",
            "Event streams whose Content-Type named no charset (decoded as UTF-8 anyway).",
            ["provider"],
            registry=self.registry,
        )
        self.malformed_events = Counter(
            "rolegate_malformed_events",
            "Stream events skipped because their data was not UTF-8 JSON.",
            ["provider"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "rolegate_request_seconds",
            "Time from receiving a client request to its last byte, by role.",
            ["role"],
            registry=self.registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )
        self.config_hash = Gauge(
            "rolegate_config_info",
            "The configuration being served: 1 for its content hash.",
            ["hash"],
            registry=self.registry,
        )
        self.config_reloads = Counter(
            "rolegate_config_reloads",
            "Configurations swapped in while serving.",
            registry=self.registry,
        )
        self.config_rejected = Counter(
            "rolegate_config_rejected",
            "Configuration payloads refused (the last good configuration stayed).",
            registry=self.registry,
        )
        self.kube_api_up = Gauge(
            "rolegate_kube_api_up",
            "1 while the Kubernetes API answers the configuration watch, else 0.",
            registry=self.registry,
        )
        self.verdicts = Counter(
            "rolegate_verdicts",
            "Structural verdicts on answers that were not ok, by provider, model, verdict, "
            "signature and whether the model was at fault.",
            ["provider", "model", "verdict", "signature", "attributable"],
            registry=self.registry,
        )
        self.answers = Counter(
            "rolegate_answers",
            "Answers judged, by provider and model (the denominator of the verdict rates).",
            ["provider", "model"],
            registry=self.registry,
        )
        self.trips = Counter(
            "rolegate_breaker_transitions",
            "Breaker and exclusion transitions (tripped, half_opened, recovered) by scope, "
            "provider, cause and reason.",
            ["provider", "scope", "kind", "cause", "reason"],
            registry=self.registry,
        )
        self.acts = Counter(
            "rolegate_acts",
            "Moves decided by the mid-stream rate test, by role, reason (rate, ttft, deadline) "
            "and what was done (continued, raced, kept).",
            ["role", "reason", "done"],
            registry=self.registry,
        )
        self.breaker_open = Gauge(
            "rolegate_breaker_open",
            "1 for each key currently excluded (Open or HalfOpen), by provider, model, machine "
            "and cause.",
            ["provider", "model", "machine", "cause", "state"],
            registry=self.registry,
        )

    def on_transition(self, transition: Transition) -> None:
        self.trips.labels(
            transition.key.provider,
            transition.key.scope.value,
            transition.kind.value,
            transition.cause.value,
            transition.reason.value,
        ).inc()

    def observe_verdict(self, provider: str, model: str, verdict: Verdict) -> None:
        self.answers.labels(provider, model).inc()
        if verdict.kind is VerdictKind.OK:
            return
        signature = verdict.signature.value if verdict.signature else ""
        self.verdicts.labels(
            provider, model, verdict.kind.value, signature, str(verdict.attributable).lower()
        ).inc()

    def observe_breakers(self, states: Iterable[BreakerState]) -> None:
        self.breaker_open.clear()
        for state in states:
            if state.state is State.CLOSED:
                continue
            key = state.key
            self.breaker_open.labels(
                key.provider,
                key.model or "",
                key.machine or "",
                state.cause.value,
                state.state.value,
            ).set(1)
