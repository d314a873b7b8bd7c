"""Keeping each ProviderPolicy's `Tripped` condition in step with its proxy pods' reports.

Proxy pods write their breaker reports onto `status.reports` (one entry per pod). This
loop wakes on any ProviderPolicy event and on a tick (reports expire by time alone),
aggregates the live reports (tripped.py), and writes what changed: the `Tripped`
condition and the `status.tripped` summary, with server-side apply under a field manager
of its own (`rolegate-operator/tripped`, so the compile loop's `Accepted` and this never
remove each other's fields); an Event per trip and per recovery; and the removal of
reports whose pods were not heard from within the TTL. Events go through the recorder the
compile loop shares (`recorder.EventRecorder`), and each pass first flushes the Event
counts it held back (a key is written at most once a minute; see `events`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, Final, Protocol

from rolegate_operator.conditions import find_condition
from rolegate_operator.kube import describe_error
from rolegate_operator.leader import Leadership, always_leading
from rolegate_operator.metrics import OperatorMetrics
from rolegate_operator.recorder import BufferedEventSink
from rolegate_operator.store import ResourceKey, Store, StoredResource
from rolegate_operator.tripped import TrippedView, aggregate, condition_body, events
from rolegate_policy.status import TRIPPED

log = logging.getLogger("rolegate.operator.tripped")

FIELD_MANAGER: Final = "rolegate-operator/tripped"
PROVIDER_POLICY: Final = "ProviderPolicy"


class TrippedWriter(Protocol):
    def apply_status(
        self, key: ResourceKey, status: Mapping[str, Any], field_manager: str = ...
    ) -> Mapping[str, Any] | None: ...

    def remove_reports(
        self, key: ResourceKey, reports: Any, pods: Any
    ) -> Mapping[str, Any] | None: ...

    def check_reachable(self) -> None: ...


class TrippedLoop:
    def __init__(
        self,
        store: Store,
        kube: TrippedWriter,
        *,
        events: BufferedEventSink,
        now: Callable[[], datetime],
        ttl_seconds: float,
        leadership: Leadership | None = None,
        metrics: OperatorMetrics | None = None,
        tick_seconds: float = 5.0,
        coalesce_seconds: float = 0.2,
    ) -> None:
        self._store = store
        self._kube = kube
        self._events = events
        self._now = now
        self._ttl = ttl_seconds
        self._leadership = leadership or always_leading()
        self._metrics = metrics or OperatorMetrics()
        self._tick = tick_seconds
        self._coalesce = coalesce_seconds
        self._changed = asyncio.Event()
        self._views: dict[ResourceKey, TrippedView] = {}
        # When the API server was last regained after a failed pass (None: never lost).
        self._listening_since: datetime | None = None
        self._lost = False

    def observe(self) -> None:
        self._changed.set()

    def resync(self) -> None:
        """This replica just became the leader. It cannot know whether the pods' reports
        reached the server while another replica (or nobody) was in charge, so they all
        get a full TTL from the first call that reaches the API server."""
        self._lost = True
        self._changed.set()

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=self._tick)
            await asyncio.sleep(self._coalesce)
            self._changed.clear()
            try:
                await asyncio.to_thread(self.run_pass)
            except Exception as error:  # the API server may be away: the next tick retries
                self.lost(error)

    def lost(self, error: BaseException) -> None:
        """A pass failed: until one succeeds, the pods' reports may not have reached the
        server, so their silence must not count against them."""
        self._lost = True
        log.warning("tripped pass failed error=%s", describe_error(error))

    def run_pass(self) -> int:
        """Evaluate every ProviderPolicy; returns how many writes were made. Only the
        leader writes; a standby keeps its views current, so after taking over it posts
        Events only for what changes from then on."""
        now = self._now()
        if self._lost:
            # Only a call that succeeds proves the API server is back (a pass with nothing
            # to write proves nothing). Reports could not be refreshed meanwhile, so their
            # silence restarts counting now.
            self._kube.check_reachable()
            self._listening_since = now
            self._lost = False
        # Events first (only the leader writes them), so a failing status write below never
        # holds back the pending Event counts (of this loop's Events and the compile loop's).
        writes = self._events.flush(now) if self._leadership.leading else 0
        present: set[ResourceKey] = set()
        for key, resource in self._store.snapshot().items():
            if key.kind != PROVIDER_POLICY:
                continue
            present.add(key)
            writes += self._evaluate(key, resource, now)
        for gone in set(self._views) - present:
            del self._views[gone]
        self._metrics.reports.set(sum(len(view.live_pods) for view in self._views.values()))
        self._metrics.status_writes.labels("reports").inc(writes)
        return writes

    def _evaluate(self, key: ResourceKey, resource: StoredResource, now: datetime) -> int:
        writes = 0
        leading = self._leadership.leading
        status = resource.status
        view = self._view(status, resource.generation, now)
        if view.expired_pods and leading:
            written = self._kube.remove_reports(key, _reports(status), view.expired_pods)
            if written is None:
                # A report changed since this copy (the pod is back) or the object is gone:
                # judge again from what the watch delivers next, never from this copy.
                return 0
            writes += 1
            self._metrics.expired_reports.inc(len(view.expired_pods))
            log.info("reports expired resource=%s pods=%s", key, ",".join(view.expired_pods))
            self._store.record_write(written)
            status = written.get("status") or {}
            view = self._view(status, resource.generation, now)
        previous = self._views.get(key)
        self._views[key] = view
        existing = find_condition(status, TRIPPED)
        if existing is None and not view.live_pods:
            return writes  # no proxy pod has reported on this provider: nothing to say yet
        if not leading:
            return writes
        desired = condition_body(view, existing, now)
        if not _same(existing, desired) or (status.get("tripped") or "") != view.summary:
            self._kube.apply_status(
                key,
                {"conditions": [desired], "tripped": view.summary},
                field_manager=FIELD_MANAGER,
            )
            writes += 1
        if previous is not None or view.entries:
            # After a restart the first view has no predecessor: Events only for what
            # is tripped now and was not known to be (recoveries need a predecessor).
            for note in events(previous, view):
                writes += self._events.record(key, resource.uid, note, now)
        return writes

    def _view(self, status: Mapping[str, Any], generation: int, now: datetime) -> TrippedView:
        return aggregate(
            _reports(status), generation, now, self._ttl, listening_since=self._listening_since
        )


def _reports(status: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [r for r in status.get("reports") or () if isinstance(r, Mapping)]


def _same(existing: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> bool:
    if existing is None:
        return False
    keys = ("status", "reason", "message", "observedGeneration")
    return all(existing.get(k) == desired.get(k) for k in keys) and bool(
        existing.get("lastTransitionTime")
    )
