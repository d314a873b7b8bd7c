"""The operator's Prometheus metrics, served on `--metrics-port` at `/metrics`.

Bounded cardinality: labels are the kinds, the outcome of a pass and the watched
namespaces (named on the command line), never resource names. docs/operator.md lists them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

ALL_NAMESPACES: Final = "*"


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.passes = Counter(
            "rolegate_operator_reconciles",
            "Compile passes, by result (ok, failed: some write failed and the pass is retried).",
            ["result"],
            registry=registry,
        )
        self.compile_seconds = Histogram(
            "rolegate_operator_compile_seconds",
            "Time to compile every watched resource into the configuration (no I/O).",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=registry,
        )
        self.resources = Gauge(
            "rolegate_operator_resources",
            "Resources in the last compile, by kind.",
            ["kind"],
            registry=registry,
        )
        self.rejected = Gauge(
            "rolegate_operator_rejected_resources",
            "Resources whose Accepted condition is False in the last compile, by kind.",
            ["kind"],
            registry=registry,
        )
        self.status_writes = Counter(
            "rolegate_operator_status_writes",
            "Status writes made, by the condition family written (accepted, reports).",
            ["writer"],
            registry=registry,
        )
        self.reports = Gauge(
            "rolegate_operator_pod_reports",
            "Live proxy pod reports aggregated over every ProviderPolicy in the last pass.",
            registry=registry,
        )
        self.expired_reports = Counter(
            "rolegate_operator_expired_reports",
            "Proxy pod reports removed because their pod was not heard from within the TTL.",
            registry=registry,
        )
        self.leader = Gauge(
            "rolegate_operator_leader",
            "1 when this replica holds the Lease and writes, 0 on a standby.",
            registry=registry,
        )
        self.watched = Gauge(
            "rolegate_operator_watched_namespace",
            "1 for each namespace watched (`*`: every namespace); resources elsewhere get "
            "no status.",
            ["namespace"],
            registry=registry,
        )

    def set_leader(self, leading: bool) -> None:
        self.leader.set(1 if leading else 0)

    def watch(self, namespaces: Iterable[str]) -> None:
        for namespace in tuple(namespaces) or (ALL_NAMESPACES,):
            self.watched.labels(namespace).set(1)

    async def serve(self, host: str, port: int) -> web.AppRunner:
        app = web.Application()
        app.router.add_get("/metrics", self._handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        return runner

    async def _handle(self, _request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )
