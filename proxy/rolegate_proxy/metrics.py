"""Prometheus metrics of one proxy, on a registry of its own (several apps may share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


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
