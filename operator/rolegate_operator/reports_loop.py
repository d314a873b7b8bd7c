"""What the proxy pods report, onto every resource's status: `Tripped`, `ResolvedRefs`
and `Programmed`.

Proxy pods write their reports onto each ProviderPolicy's `status.reports` (one entry per
pod: its open breakers, the configuration hash it serves, whether it could read the key).
This loop wakes on any ProviderPolicy event, after every compile pass this replica wrote,
and on a tick (reports expire by time alone). It expires the reports of pods not heard
from within the TTL, aggregates the live ones (`tripped`, `fleet`), and writes what
changed with server-side apply under a field manager of its own,
`rolegate-operator/tripped` (kept from when it wrote `Tripped` alone: renaming a manager
would orphan the fields the old name owns), so the compile loop's `Accepted` and this never
remove each other's fields:

- on a ProviderPolicy: `Tripped` with the `tripped` summary and `trippedReason`,
  `ResolvedRefs`, and `Programmed`;
- on a RoleTable: `Programmed`.

Events (a Warning per trip, a Normal per recovery) go through the recorder the compile loop
shares (`recorder.EventRecorder`); each pass first flushes the Event counts it held back.
Only the leader writes; a standby keeps its views current.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Protocol

from rolegate_operator.conditions import DesiredCondition, find_condition, render_condition
from rolegate_operator.fleet import Fleet, programmed, resolved_refs
from rolegate_operator.kube import describe_error
from rolegate_operator.leader import Leadership, always_leading
from rolegate_operator.metrics import OperatorMetrics
from rolegate_operator.reconcile import ReconcileResult
from rolegate_operator.recorder import BufferedEventSink
from rolegate_operator.store import ResourceKey, Store, StoredResource
from rolegate_operator.tripped import TrippedView, aggregate, events
from rolegate_policy.status import TRIPPED

log = logging.getLogger("rolegate.operator.reports")

FIELD_MANAGER: Final = "rolegate-operator/tripped"
PROVIDER_POLICY: Final = "ProviderPolicy"


class ReportsWriter(Protocol):
    def apply_status(
        self, key: ResourceKey, status: Mapping[str, Any], field_manager: str = ...
    ) -> Mapping[str, Any] | None: ...

    def remove_reports(
        self, key: ResourceKey, reports: Any, pods: Any
    ) -> Mapping[str, Any] | None: ...

    def check_reachable(self) -> None: ...


class ReportsLoop:
    def __init__(
        self,
        store: Store,
        kube: ReportsWriter,
        *,
        events: BufferedEventSink,
        now: Callable[[], datetime],
        ttl_seconds: float,
        leadership: Leadership | None = None,
        metrics: OperatorMetrics | None = None,
        compiled: Callable[[], ReconcileResult | None] = lambda: None,
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
        self._compiled = compiled
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
        log.warning("reports pass failed error=%s", describe_error(error))

    def run_pass(self) -> int:
        """Evaluate every resource; returns how many writes were made. Only the leader
        writes; a standby keeps its views current, so after taking over it posts Events
        only for what changes from then on."""
        now = self._now()
        if self._lost:
            # Only a call that succeeds proves the API server is back (a pass with nothing
            # to write proves nothing). Reports could not be refreshed meanwhile, so their
            # silence restarts counting now.
            self._kube.check_reachable()
            self._listening_since = now
            self._lost = False
        leading = self._leadership.leading
        # Events first (only the leader writes them), so a failing status write below never
        # holds back the pending Event counts (of this loop's Events and the compile loop's).
        writes = self._events.flush(now) if leading else 0
        snapshot = self._store.snapshot()
        judged: dict[ResourceKey, Judged] = {}
        for key, resource in snapshot.items():
            if key.kind == PROVIDER_POLICY:
                outcome = self._judge(key, resource, now)
                if outcome is not None:
                    judged[key] = outcome
                    writes += outcome.removals
        for gone in set(self._views) - {key for key in snapshot if key.kind == PROVIDER_POLICY}:
            del self._views[gone]
        fleet = Fleet.from_reports(
            report for view in self._views.values() for report in view.live_reports
        )
        if leading:
            result = self._compiled()
            for key, resource in snapshot.items():
                if key.kind != PROVIDER_POLICY:
                    writes += self._write(key, resource, None, fleet, result, now)
                elif key in judged:
                    writes += self._write(key, resource, judged[key], fleet, result, now)
        self._metrics.reports.set(len(fleet.serving))
        self._metrics.status_writes.labels("reports").inc(writes)
        return writes

    def _judge(self, key: ResourceKey, resource: StoredResource, now: datetime) -> Judged | None:
        """Expire what is stale and take the view of one ProviderPolicy's reports; None when
        a removal found a report refreshed since (judge again from the watch's next copy)."""
        status = resource.status
        view = self._view(status, resource.generation, now)
        removals = 0
        if view.expired_pods and self._leadership.leading:
            written = self._kube.remove_reports(key, _reports(status), view.expired_pods)
            if written is None:
                return None
            removals = 1
            self._metrics.expired_reports.inc(len(view.expired_pods))
            log.info("reports expired resource=%s pods=%s", key, ",".join(view.expired_pods))
            self._store.record_write(written)
            status = written.get("status") or {}
            view = self._view(status, resource.generation, now)
        previous = self._views.get(key)
        self._views[key] = view
        return Judged(status, view, previous, removals)

    def _write(
        self,
        key: ResourceKey,
        resource: StoredResource,
        judged: Judged | None,
        fleet: Fleet,
        result: ReconcileResult | None,
        now: datetime,
    ) -> int:
        """Apply this loop's conditions of one resource when they differ; then the Events
        of its trips and recoveries."""
        status = judged.status if judged is not None else resource.status
        desired: list[DesiredCondition] = []
        # The fields besides conditions, as they should read ("" or None: absent).
        fields: dict[str, str | None] = {}
        if judged is not None:
            view = judged.view
            if find_condition(status, TRIPPED) is not None or view.live_pods:
                desired.append(view.condition)
                fields["tripped"] = view.summary
                # The Reason column's source: the reason only while tripped. Left out of
                # the apply otherwise, which removes it (this manager owns it; `null` is
                # refused by the schema).
                fields["trippedReason"] = view.condition.reason if view.entries else None
            refs = resolved_refs(resource.spec, resource.generation, view.live_reports)
            if refs is not None:
                desired.append(refs)
        fate = result.outcomes.get(key) if result is not None else None
        if result is not None and fate is not None and fate.uid == resource.uid:
            desired.append(
                programmed(resource.generation, fate.served_generation, result.config.hash, fleet)
            )
        writes = 0
        rendered = [render_condition(c, find_condition(status, c.type), now) for c in desired]
        changed = any(not _same(find_condition(status, c["type"]), c) for c in rendered) or any(
            (status.get(name) or None) != (value or None) for name, value in fields.items()
        )
        if rendered and changed:
            present = {name: value for name, value in fields.items() if value is not None}
            self._kube.apply_status(
                key, {"conditions": rendered, **present}, field_manager=FIELD_MANAGER
            )
            writes += 1
        if judged is not None and (judged.previous is not None or judged.view.entries):
            # After a restart the first view has no predecessor: Events only for what
            # is tripped now and was not known to be (recoveries need a predecessor).
            for note in events(judged.previous, judged.view):
                writes += self._events.record(key, resource.uid, note, now)
        return writes

    def _view(self, status: Mapping[str, Any], generation: int, now: datetime) -> TrippedView:
        return aggregate(
            _reports(status), generation, now, self._ttl, listening_since=self._listening_since
        )


@dataclass(frozen=True)
class Judged:
    """One ProviderPolicy's reports as judged in this pass."""

    status: Mapping[str, Any]
    view: TrippedView
    previous: TrippedView | None
    removals: int


def _reports(status: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [r for r in status.get("reports") or () if isinstance(r, Mapping)]


def _same(existing: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> bool:
    if existing is None:
        return False
    keys = ("status", "reason", "message", "observedGeneration")
    return all(existing.get(k) == desired.get(k) for k in keys) and bool(
        existing.get("lastTransitionTime")
    )
