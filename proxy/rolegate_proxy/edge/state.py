"""The proxy's shared state: one `ProxyState` per app, stored under the typed key `STATE`.

Its own module so that the app factory and the endpoints that read the state (explain.py)
both import it, and neither imports the other.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from rolegate_policy.config import (
    CompiledProvider,
    ProxyConfig,
)
from rolegate_policy.model import (
    BreakerSpec,
    DegradedOutputSpec,
)

from ..core.breaker import Breakers
from ..core.decisions import DecisionLog
from ..core.outcomes import Consumer, OutcomeChannel
from ..core.score import Scoreboard, ScoreSettings
from ..core.score_feed import ScoreFeed
from ..core.verdicts import VerdictLog
from ..flow.dispatch import Dispatcher
from ..flow.metrics import ProxyMetrics
from .access_log import log_access
from .callers import AccessGate, NoCluster
from .configmap_source import ConfigMapSource
from .credentials import KeyStore
from .feedback import ServedIndex
from .outcome_export import OutcomeExporter
from .settings import ProxySettings

if TYPE_CHECKING:
    from .span_export import SpanExport

log = logging.getLogger("rolegate.proxy")


@dataclass
class ProxyState:
    settings: ProxySettings
    # Replaced as a whole on reload; a request reads it once and keeps its own reference,
    # so an in-flight request finishes on the configuration it started with (SPEC D3).
    config: ProxyConfig
    keys: KeyStore
    metrics: ProxyMetrics = field(init=False)
    source: ConfigMapSource | None = None
    decisions: DecisionLog = field(default_factory=DecisionLog)
    served: ServedIndex = field(default_factory=ServedIndex)
    dispatcher: Dispatcher = field(init=False)
    outcomes: OutcomeChannel = field(init=False)
    exporter: OutcomeExporter | None = field(init=False, default=None)
    # The span consumer, when tracing is on (its module imports the OpenTelemetry SDK).
    spans: SpanExport | None = field(init=False, default=None)
    # The outcome channel's consumers, in order: the score first (the closed loop).
    consumers: list[Consumer] = field(init=False)
    # Told (on the loop, no I/O) when what the pod reports on the ProviderPolicies changes
    # other than by a breaker: a configuration swapped in, a key found or lost.
    report_listeners: list[Callable[[], None]] = field(default_factory=list)
    # Who may call, from the configuration's AccessGrants and the keys read for them.
    access: AccessGate = field(init=False)
    # The configuration's providers by name, for the configuration they index (`_provider`).
    _providers: tuple[ProxyConfig | None, dict[str, CompiledProvider]] = field(
        init=False, default=(None, {}), repr=False
    )

    def __post_init__(self) -> None:
        settings = self.settings
        rng = random.Random(settings.random_seed)
        self.metrics = ProxyMetrics(settings.metrics_max_machines)
        self.metrics.machine_label.configure(self.config)
        self.dispatcher = Dispatcher(
            breakers=Breakers(self._breaker_settings, rng, degraded_for=self._degraded_settings),
            verdicts=VerdictLog(),
            rng=rng,
            metrics=self.metrics,
            scores=Scoreboard(
                ScoreSettings(settings.score_full_confidence, settings.score_half_life)
            ),
            explore=settings.explore_share,
            keepalive_seconds=settings.keepalive_seconds,
        )
        # The published figures are the ledger's prior (the sheet), reloaded with config.
        self.dispatcher.ledger.load_sheet(self.config)
        self.access = AccessGate(
            NoCluster(), monotonic=self.dispatcher.now, ttl=settings.token_cache_seconds
        )
        self.access.reload(self.config.grants, self.keys.key_for)
        self.outcomes = OutcomeChannel(settings.outcome_buffer)
        self.consumers = [
            ScoreFeed(self.dispatcher.scores, self.dispatcher.now),
            self.metrics.observe_outcomes,
            self.decisions,
            self.served,
            log_access,
        ]
        if settings.outcome_export is not None:
            self.exporter = OutcomeExporter(settings.outcome_export)
            self.consumers.append(self.exporter)
        exporter = self.exporter
        if settings.tracing is not None:
            from .span_export import SpanExport

            self.spans = SpanExport(settings.tracing, lambda: self.config)
            self.consumers.append(self.spans)
        spans = self.spans
        self.metrics.watch_scores(self.dispatcher.scores.views)
        self.metrics.watch_allowances(self._allowances_left)
        self.metrics.watch_counters(
            {
                "rolegate_outcomes_emitted": (
                    "Outcome records emitted: one per finished client request.",
                    lambda: self.outcomes.emitted,
                ),
                "rolegate_outcomes_dropped": (
                    "Outcome records evicted from the full outcome buffer before a consumer "
                    "saw them (the channel drops under overload rather than slow a request).",
                    lambda: self.outcomes.dropped,
                ),
                "rolegate_outcome_export_dropped": (
                    "Outcome records the JSON-lines exporter dropped because its writer fell "
                    "behind (0 when the export is off).",
                    lambda: exporter.dropped if exporter is not None else 0,
                ),
                "rolegate_trace_spans_dropped": (
                    "Spans dropped because the span export queue was full (the exporter fell "
                    "behind; a request never waits for it). 0 when tracing is off.",
                    lambda: spans.dropped if spans is not None else 0,
                ),
                "rolegate_trace_spans_exported": (
                    "Spans the exporter accepted. 0 when tracing is off.",
                    lambda: spans.exported if spans is not None else 0,
                ),
                "rolegate_trace_spans_failed": (
                    "Spans whose export failed (the collector refused them or could not be "
                    "reached). 0 when tracing is off.",
                    lambda: spans.failed if spans is not None else 0,
                ),
            }
        )

    def consume(self) -> int:
        """Hand every buffered outcome to the consumers; how many there were."""
        batch = self.outcomes.drain()
        if batch:
            for consumer in self.consumers:
                try:
                    consumer(batch)
                except Exception:
                    # One consumer's bug must not starve the others (or the score).
                    log.exception("outcome consumer %r failed on a batch", consumer)
        return len(batch)

    def _breaker_settings(self, provider: str) -> BreakerSpec:
        found = self._provider(provider)
        return found.breaker if found is not None else BreakerSpec()

    def _degraded_settings(self, provider: str) -> DegradedOutputSpec:
        found = self._provider(provider)
        return found.degraded_output if found is not None else DegradedOutputSpec()

    def _provider(self, name: str) -> CompiledProvider | None:
        """`config.provider(name)` from an index of the configuration served: the breakers
        ask for every attempt recorded, and a configuration may have many providers."""
        config, index = self._providers
        if config is not self.config:
            config = self.config
            index = {}
            for provider in config.providers:
                index.setdefault(provider.name, provider)  # the first of a name, as a scan
            self._providers = (config, index)
        return index.get(name)

    def _allowances_left(self) -> dict[str, dict[str, float]]:
        left = self.access.allowances.remaining(self.dispatcher.now())
        return {
            grant: {str(kind): share for kind, share in shares.items()}
            for grant, shares in left.items()
        }

    def report_changed(self) -> None:
        for listener in self.report_listeners:
            listener()

    async def refresh_keys(self) -> None:
        """Re-read the API keys of the configuration served (in a worker thread)."""
        if await asyncio.to_thread(self.keys.refresh, self.config):
            self.report_changed()
        self.access.reload(self.config.grants, self.keys.key_for)

    async def swap_config(self, config: ProxyConfig) -> None:
        """Serve `config` from the next request on; requests in flight keep theirs."""
        if config.hash == self.config.hash:
            return
        # Keys for new providers are read before the swap, off the event loop.
        await asyncio.to_thread(self.keys.refresh, config)
        previous = self.config
        self.dispatcher.ledger.load_sheet(config)
        self.access.reload(config.grants, self.keys.key_for)
        self.config = config
        self.metrics.machine_label.configure(config)
        self.metrics.config_hash.labels(config.hash).set(1)
        if previous.hash:
            self.metrics.config_hash.remove(previous.hash)
            self.metrics.config_reloads.inc()
        log.info(
            "config swapped hash=%s roles=%d providers=%d",
            config.hash,
            len(config.roles),
            len(config.providers),
        )
        self.report_changed()


STATE = web.AppKey("rolegate_state", ProxyState)
