"""Prometheus metrics of one proxy, on a registry of its own (several apps may share a process)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Final, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from rolegate_policy.config import ProxyConfig
from rolegate_policy.status import BreakerPhase, ProtocolQuirk

from ..core.beliefs import MachineKey
from ..core.exclusions import (
    BreakerView,
    Transition,
)
from ..core.outcomes import Arm, Outcome
from ..core.score import ScoreView
from ..core.verdicts import Verdict, VerdictKind

LATENCY_BUCKETS: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Label children remembered by `_child` at most (series are bounded by the configuration).
MAX_CACHED_SERIES: Final = 10_000
TTFT_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
# Machines named by upstreams that keep their own label, per provider (ProxySettings).
MAX_MACHINE_LABELS: Final = 100
# The label shared by the machines past that limit.
OTHER_MACHINES: Final = "other"


class _OutcomeSeries(NamedTuple):
    """The series one kind of outcome feeds (but its arms'): None where it feeds none."""

    requests: Any
    grant_requests: Any
    grant_tokens: Any
    grant_cost: Any
    latency: Any
    served: Any = None
    ttft: Any = None
    tokens_in: Any = None
    tokens_out: Any = None
    cost: Any = None


class MachineLabels:
    """The machine label of a series: its own name for every configured machine and for the
    first `limit` others a provider names, `other` for the rest.

    Machine names come from upstream answers (an aggregator names its sub-provider in each
    one), so unbounded, one aggregator's long tail makes every machine-labelled series
    unbounded (1,500 names made /metrics 7 MB). Counted per provider, so one aggregator's
    tail never folds another provider's machines. Configured machines are exempt: the
    configuration bounds them, and they are the ones an operator's dashboards name. A name
    that got its own label keeps it for the life of the process (a label that changed
    meaning would break every rate over it)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._configured: dict[str, frozenset[str]] = {}
        self._named: dict[str, set[str]] = {}
        # Changes with every configuration: until then, a name's label stays what it was
        # (a name is labelled once and keeps it; only the configured set can change that).
        self.generation = 0

    def configure(self, config: ProxyConfig) -> None:
        self.generation += 1
        self._configured = {
            provider.name: frozenset(
                machine.name for model in provider.models for machine in model.machines
            )
            for provider in config.providers
        }

    def __call__(self, provider: str, machine: str) -> str:
        if not machine or machine in self._configured.get(provider, ()):
            return machine
        named = self._named.setdefault(provider, set())
        if machine in named:
            return machine
        if len(named) < self._limit:
            named.add(machine)
            return machine
        return OTHER_MACHINES


class ProxyMetrics:
    """Every series is fed on the event loop; `scrape` renders them off it."""

    def __init__(self, max_machines: int = MAX_MACHINE_LABELS) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        # The series outcomes and arms feed, by what selects them (see `observe_outcomes`),
        # labelled in the machine labels' generation `_labelled`.
        self._outcome_series: dict[tuple[object, ...], _OutcomeSeries] = {}
        self._arm_series: dict[tuple[object, ...], Any] = {}
        self._labelled = 0
        # What the request path adds to counters, per series (a labelled child), until the
        # next scrape adds it to the series (`_count`).
        self._counts: dict[Any, float] = {}
        self.machine_label = MachineLabels(max_machines)
        self._scores = _ScoreGauges()
        # The label sets `rolegate_breaker_open` holds (`observe_breakers`).
        self._excluded: set[tuple[str, str, str, str, str]] = set()
        self._score_views: Callable[[], Iterable[_Views]] = tuple
        # Request-level series are fed by the outcome channel (a consumer, off the
        # request path); `rolegate_outcomes_dropped_total` says how many it lost.
        self.requests = Counter(
            "rolegate_requests",
            "Finished client requests by role, HTTP status answered and outcome (answered, "
            "incomplete, failed, rejected, cancelled).",
            ["role", "status", "outcome"],
            registry=self.registry,
        )
        self.arms = Counter(
            "rolegate_arms",
            "Upstream attempts by role, provider, model, machine and result (ok, late, "
            "server_error, timeout, rate_limited, cancelled, ...).",
            ["role", "provider", "model", "machine", "result"],
            registry=self.registry,
        )
        self.served_latency = Histogram(
            "rolegate_served_seconds",
            "Time from a request's arrival to its last byte, by role and the machine that "
            "served it.",
            ["role", "provider", "model", "machine"],
            registry=self.registry,
            buckets=LATENCY_BUCKETS,
        )
        self.ttft = Histogram(
            "rolegate_time_to_first_token_seconds",
            "Time from a request's arrival to the first content the client received, by role "
            "and serving machine.",
            ["role", "provider", "model", "machine"],
            registry=self.registry,
            buckets=TTFT_BUCKETS,
        )
        self.tokens = Counter(
            "rolegate_tokens",
            "Tokens by role, serving provider and model, and direction (in, out).",
            ["role", "provider", "model", "direction"],
            registry=self.registry,
        )
        self.cost = Counter(
            "rolegate_cost_usd",
            "Cost in USD from the machines' published prices, by role, provider and model.",
            ["role", "provider", "model"],
            registry=self.registry,
        )
        # Per AccessGrant: the label is a configured grant's `namespace/name` (bounded by
        # the configuration, as roles are), never anything a caller sent.
        self.grant_requests = Counter(
            "rolegate_grant_requests",
            "Requests admitted by each AccessGrant, by HTTP status answered (429: over the "
            "grant's limits).",
            ["grant", "status"],
            registry=self.registry,
        )
        self.grant_tokens = Counter(
            "rolegate_grant_tokens",
            "Tokens (input plus output) counted against each AccessGrant.",
            ["grant"],
            registry=self.registry,
        )
        self.grant_cost = Counter(
            "rolegate_grant_cost_usd",
            "Cost in USD counted against each AccessGrant.",
            ["grant"],
            registry=self.registry,
        )
        self._allowances = _AllowanceGauges()
        self._allowance_rows: Callable[[], Mapping[str, Mapping[str, float]]] = dict
        self.registry.register(self._allowances)
        self.feedback = Counter(
            "rolegate_feedback",
            "Judgments accepted on /v1/feedback, by evaluator.",
            ["evaluator"],
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
        self.missing_done = Counter(
            "rolegate_upstream_missing_done",
            "Event streams that ended after their final chunk without data: [DONE] "
            "(supplied to the client; never a fault).",
            ["provider"],
            registry=self.registry,
        )
        self.missing_usage = Counter(
            "rolegate_upstream_missing_usage",
            "Streams that sent no usage although the client asked (rolegate's estimate sent).",
            ["provider"],
            registry=self.registry,
        )
        self.quirks = {
            ProtocolQuirk.MISSING_CHARSET: self.missing_charset,
            ProtocolQuirk.MISSING_DONE: self.missing_done,
            ProtocolQuirk.MISSING_USAGE: self.missing_usage,
        }
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
            buckets=LATENCY_BUCKETS,
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
        # The fleet's memory (edge/fleet_memory.py), in a cluster.
        self.memory_writes = Counter(
            "rolegate_memory_writes",
            "Writes of this pod's ProxyMemory, by result (ok, failed: retried with backoff).",
            ["result"],
            registry=self.registry,
        )
        self.memory_peers = Gauge(
            "rolegate_memory_peers",
            "Other proxy pods whose memory this pod heard last (0 standalone).",
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

    def watch_counters(self, counters: Mapping[str, tuple[str, Callable[[], float]]]) -> None:
        """Counters kept by their owners (the outcome channel, the exporter), read at
        scrape time: exact even when the channel dropped records. name -> (help, read)."""
        self.registry.register(_ReadCounters(counters))

    def watch_scores(self, views: Callable[[], Iterable[_Views]]) -> None:
        """Score gauges read from the scoreboard at scrape time (nothing per request):
        `views` lists (key, operational view, semantic view or None)."""
        self._score_views = views
        self.registry.register(self._scores)

    def watch_allowances(self, remaining: Callable[[], Mapping[str, Mapping[str, float]]]) -> None:
        """What each limited grant has left, read at scrape time: grant -> limit -> share."""
        self._allowance_rows = remaining

    def scrape(self) -> Callable[[], bytes]:
        """Take, on the loop, what a scrape reads of state the loop mutates (the score
        table), and return the rendering, to be run in a worker thread: a page of many
        series held the loop for a second. prometheus_client's own series are safe to read
        from any thread; the score gauges then read only this snapshot."""
        self._scores.rows = _folded_scores(self._score_views(), self.machine_label)
        self._allowances.rows = tuple(
            (grant, limit, share)
            for grant, shares in self._allowance_rows().items()
            for limit, share in shares.items()
        )
        self._flush_counts()
        return partial(_render, self.registry)

    def _count(self, child: Any, amount: float = 1.0) -> None:
        """`child.inc(amount)`, summed per series until the next scrape: a dictionary add
        instead of prometheus_client's locked, checked increment, for the counters every
        request feeds several times. Only the page reads these series (`scrape` adds
        what is pending first), so it shows the same values."""
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        counts = self._counts
        counts[child] = counts.get(child, 0.0) + amount

    def _flush_counts(self) -> None:
        counts, self._counts = self._counts, {}
        for child, amount in counts.items():
            child.inc(amount)

    def observe_outcomes(self, batch: Sequence[Outcome]) -> None:
        """The metrics consumer of the outcome channel.

        An outcome feeds a dozen series, nearly always the same ones as the outcome before
        it: they are looked up together, by what selects them (`_OutcomeSeries`), and made
        with the first outcome that feeds them, as one by one. A machine's label is worked
        out then: labels change only with the configuration, which starts them over."""
        if self._labelled != self.machine_label.generation or (
            len(self._outcome_series) + len(self._arm_series) >= MAX_CACHED_SERIES
        ):
            self._labelled = self.machine_label.generation
            self._outcome_series.clear()
            self._arm_series.clear()
        count = self._count
        for outcome in batch:
            tokens, cost = outcome.tokens, outcome.cost_usd
            key = (
                outcome.role, outcome.status, outcome.outcome, outcome.grant, outcome.provider,
                outcome.model, outcome.machine, outcome.ttft_seconds is None,
                outcome.tokens_in is None, outcome.tokens_out is None, cost is None,
                not tokens, not cost,
            )  # fmt: skip
            series = self._outcome_series.get(key)
            if series is None:
                series = self._outcome_series[key] = self._series_of(outcome)
            count(series.requests)
            if series.grant_requests is not None:
                count(series.grant_requests)
            if series.grant_tokens is not None:
                count(series.grant_tokens, tokens)
            if series.grant_cost is not None and cost:
                count(series.grant_cost, cost)
            series.latency.observe(outcome.latency_seconds)
            for arm in outcome.arms:
                self._count_arm(outcome.role or "-", arm)
            if series.served is not None:
                series.served.observe(outcome.latency_seconds)
            if series.ttft is not None and outcome.ttft_seconds is not None:
                series.ttft.observe(outcome.ttft_seconds)
            if series.tokens_in is not None and outcome.tokens_in is not None:
                count(series.tokens_in, outcome.tokens_in)
            if series.tokens_out is not None and outcome.tokens_out is not None:
                count(series.tokens_out, outcome.tokens_out)
            if series.cost is not None and cost is not None:
                count(series.cost, cost)

    def _series_of(self, outcome: Outcome) -> _OutcomeSeries:
        """The series `outcome` feeds (but its arms'), made as the first outcome of its
        kind feeds them, in the same order."""
        child = self._child
        role, status = outcome.role or "-", str(outcome.status)
        requests = child(self.requests, role, status, outcome.outcome.value)
        grant_requests = grant_tokens = grant_cost = None
        if (grant := outcome.grant) is not None:
            grant_requests = child(self.grant_requests, grant, status)
            if outcome.tokens:
                grant_tokens = child(self.grant_tokens, grant)
            if outcome.cost_usd:
                grant_cost = child(self.grant_cost, grant)
        latency = child(self.latency, role)
        provider, model = outcome.provider, outcome.model
        if provider is None or model is None:
            return _OutcomeSeries(requests, grant_requests, grant_tokens, grant_cost, latency)
        machine = self.machine_label(provider, outcome.machine or "")
        served = child(self.served_latency, role, provider, model, machine)
        ttft = tokens_in = tokens_out = cost = None
        if outcome.ttft_seconds is not None:
            ttft = child(self.ttft, role, provider, model, machine)
        if outcome.tokens_in is not None:
            tokens_in = child(self.tokens, role, provider, model, "in")
        if outcome.tokens_out is not None:
            tokens_out = child(self.tokens, role, provider, model, "out")
        if outcome.cost_usd is not None:
            cost = child(self.cost, role, provider, model)
        return _OutcomeSeries(
            requests, grant_requests, grant_tokens, grant_cost, latency, served, ttft,
            tokens_in, tokens_out, cost,
        )  # fmt: skip

    def _count_arm(self, role: str, arm: Arm) -> None:
        key = (role, arm.provider, arm.model, arm.machine, arm.result)
        series = self._arm_series.get(key)
        if series is None:
            machine = self.machine_label(arm.provider, arm.machine or "")
            series = self._arm_series[key] = self._child(
                self.arms, role, arm.provider, arm.model, machine, arm.result.value
            )
        self._count(series)

    def _child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, remembered: prometheus_client takes a lock and
        validates the labels on every call, and the consumer asks for the same few series
        for every outcome. Only for series that are never removed."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            if len(self._children) >= MAX_CACHED_SERIES:
                self._children.clear()
            found = self._children[key] = metric.labels(*labels)
        return found

    def on_transition(self, transition: Transition) -> None:
        self.trips.labels(
            transition.key.provider,
            transition.key.scope.value,
            transition.kind.value,
            transition.cause.value,
            transition.reason.value,
        ).inc()

    def observe_verdict(self, provider: str, model: str, verdict: Verdict) -> None:
        self._count(self._child(self.answers, provider, model))
        if verdict.kind is VerdictKind.OK:
            return
        signature = verdict.signature.value if verdict.signature else ""
        self.verdicts.labels(
            provider, model, verdict.kind.value, signature, str(verdict.attributable).lower()
        ).inc()

    def observe_breakers(self, states: Iterable[BreakerView]) -> None:
        """Set the excluded keys' series, and remove only those no longer excluded: a
        scrape renders in a worker thread while this runs on the loop, and a series
        cleared and set again could be missed by it, which Prometheus takes for the
        series' end (an alert on how long a key is excluded would start over)."""
        excluded: set[tuple[str, str, str, str, str]] = set()
        for state in states:
            if state.state is BreakerPhase.CLOSED:
                continue
            key = state.key
            # Folded breakers share one series: 1 while any of them is excluded.
            excluded.add(
                (
                    key.provider,
                    key.model or "",
                    self.machine_label(key.provider, key.machine or ""),
                    state.cause.value,
                    state.state.value,
                )
            )
        for labels in excluded:
            self.breaker_open.labels(*labels).set(1)
        for labels in self._excluded - excluded:
            self.breaker_open.remove(*labels)
        self._excluded = excluded


# One page rendered at a time in the process: the cycle collector is paused while one is.
_RENDERING: Final = threading.Lock()


def _render(registry: CollectorRegistry) -> bytes:
    """The page, with the cycle collector paused. A large page is tens of thousands of
    samples alive at once, enough to set off a full collection of the whole heap (50-70 ms
    with the loop stopped, measured with 1,500 machines); they are acyclic and freed as
    they go, so nothing waits for the collector. The collector's switch is process-wide,
    hence one render at a time."""
    with _RENDERING:
        resume = gc.isenabled()
        gc.disable()
        try:
            return generate_latest(registry)
        finally:
            if resume:
                gc.enable()


class _ReadCounters(Collector):
    def __init__(self, counters: Mapping[str, tuple[str, Callable[[], float]]]) -> None:
        self._counters = dict(counters)

    def collect(self) -> Iterator[CounterMetricFamily]:
        for name, (text, read) in self._counters.items():
            yield CounterMetricFamily(name, text, value=read())

    def describe(self) -> Iterator[CounterMetricFamily]:
        for name, (text, _read) in self._counters.items():
            yield CounterMetricFamily(name, text)


_SCORE_LABELS: Final = ["provider", "model", "machine"]


# One machine's scores as the scoreboard lists them: key, operational, semantic (or None).
_Views = tuple[MachineKey, ScoreView, ScoreView | None]


class _Scores(NamedTuple):
    """One score series' values, as the scrape's snapshot holds them (a tuple: the
    snapshot is built on the loop, one per machine)."""

    labels: tuple[str, str, str]
    operational: float
    observations: int
    semantic: float | None


@dataclass(slots=True)
class _Mean:
    """Scores of folded machines as one: weighted by the observations behind each (the
    score of the traffic they served); neutral while none has any."""

    total: float = 0.0
    weight: int = 0
    neutral: float = 0.0

    def add(self, view: ScoreView) -> None:
        self.total += view.score * view.n
        self.weight += view.n
        self.neutral = view.neutral

    @property
    def score(self) -> float:
        return self.total / self.weight if self.weight else self.neutral


@dataclass(slots=True)
class _Pool:
    operational: _Mean
    semantic: _Mean | None = None

    def add(self, operational: ScoreView, semantic: ScoreView | None) -> None:
        self.operational.add(operational)
        if semantic is not None:
            self.semantic = self.semantic or _Mean()
            self.semantic.add(semantic)

    def scores(self, labels: tuple[str, str, str]) -> _Scores:
        semantic = None if self.semantic is None else self.semantic.score
        return _Scores(labels, self.operational.score, self.operational.weight, semantic)


def _folded_scores(
    views: Iterable[_Views], label: Callable[[str, str], str]
) -> tuple[_Scores, ...]:
    """The scores with their machines labelled; machines folded into one label are
    pooled, since two series with the same labels are not a valid page."""
    own: list[_Scores] = []
    pools: dict[tuple[str, str, str], _Pool] = {}
    for (provider, model, machine), operational, semantic in views:
        labels = (provider, model, label(provider, machine))
        if labels[2] == OTHER_MACHINES:
            pools.setdefault(labels, _Pool(_Mean())).add(operational, semantic)
        else:
            score = None if semantic is None else semantic.score
            own.append(_Scores(labels, operational.score, operational.n, score))
    own.extend(pool.scores(labels) for labels, pool in pools.items())
    return tuple(own)


class _AllowanceGauges(Collector):
    """What limited grants have left, from the snapshot `ProxyMetrics.scrape` took."""

    def __init__(self) -> None:
        self.rows: tuple[tuple[str, str, float], ...] = ()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        remaining = GaugeMetricFamily(
            "rolegate_grant_allowance_remaining_ratio",
            "What an AccessGrant's limit has left on this pod, as a share of the limit "
            "(1: untouched, 0: used up, below 0: overdrawn by answers still running when it "
            "ran out), by grant and limit (requests, tokens, cost).",
            labels=["grant", "limit"],
        )
        for grant, limit, share in sorted(self.rows):
            remaining.add_metric([grant, limit], share)
        yield remaining

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())


class _ScoreGauges(Collector):
    """Renders the snapshot `ProxyMetrics.scrape` took: replaced whole, never mutated, so
    a worker thread reads it safely while the loop goes on."""

    def __init__(self) -> None:
        self.rows: tuple[_Scores, ...] = ()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        operational = GaugeMetricFamily(
            "rolegate_operational_score",
            "Shrunk operational score per machine and model, 0..1 (0.5: no evidence).",
            labels=_SCORE_LABELS,
        )
        observations = GaugeMetricFamily(
            "rolegate_operational_score_observations",
            "Observations behind the operational score per machine and model.",
            labels=_SCORE_LABELS,
        )
        semantic = GaugeMetricFamily(
            "rolegate_semantic_score",
            "Shrunk semantic score per machine and model from evaluators' feedback, 0..1; "
            "absent until an evaluator has reported.",
            labels=_SCORE_LABELS,
        )
        # Sorted here, in the rendering thread, for a page in a stable order (the labels
        # are unique, so the sort never compares further).
        for row in sorted(self.rows):
            labels = list(row.labels)
            operational.add_metric(labels, row.operational)
            observations.add_metric(labels, row.observations)
            if row.semantic is not None:
                semantic.add_metric(labels, row.semantic)
        yield operational
        yield observations
        yield semantic

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())
