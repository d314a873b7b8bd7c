"""Keeping each ProviderPolicy's `Tripped` condition in step with its proxy pods' reports.

Proxy pods write their breaker reports onto `status.reports` (one entry per pod). This
loop wakes on any ProviderPolicy event and on a tick (reports expire by time alone),
aggregates the live reports (tripped.py), and writes what changed: the `Tripped`
condition and the `tripped`/`trippedReason` summary, with server-side apply under a field manager
of its own (`rolegate-operator/tripped`, so the compile loop's `Accepted` and this never
remove each other's fields); an Event per trip and per recovery; and the removal of
reports whose pods were not heard from within the TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, Final, Protocol

from rolegate_operator.conditions import EventNote, find_condition
from rolegate_operator.store import ResourceKey, Store
from rolegate_operator.tripped import TrippedView, aggregate, condition_body, events
from rolegate_policy.status import TRIPPED

log = logging.getLogger("rolegate.operator.tripped")

FIELD_MANAGER: Final = "rolegate-operator/tripped"
PROVIDER_POLICY: Final = "ProviderPolicy"


class TrippedWriter(Protocol):
    def apply_status(
        self, key: ResourceKey, status: Mapping[str, Any], field_manager: str = ...
    ) -> Mapping[str, Any] | None: ...

    def remove_reports(self, key: ResourceKey, reports: Any, pods: Any) -> None: ...

    def post_event(self, key: ResourceKey, uid: str, note: EventNote, now: datetime) -> None: ...


class TrippedLoop:
    def __init__(
        self,
        store: Store,
        kube: TrippedWriter,
        *,
        now: Callable[[], datetime],
        ttl_seconds: float,
        tick_seconds: float = 5.0,
        coalesce_seconds: float = 0.2,
    ) -> None:
        self._store = store
        self._kube = kube
        self._now = now
        self._ttl = ttl_seconds
        self._tick = tick_seconds
        self._coalesce = coalesce_seconds
        self._changed = asyncio.Event()
        self._views: dict[ResourceKey, TrippedView] = {}

    def observe(self) -> None:
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
                log.warning("tripped pass failed error=%s", error)

    def run_pass(self) -> int:
        """Evaluate every ProviderPolicy; returns how many writes were made."""
        now = self._now()
        writes = 0
        present: set[ResourceKey] = set()
        for key, resource in self._store.snapshot().items():
            if key.kind != PROVIDER_POLICY:
                continue
            present.add(key)
            status = resource.status
            reports = [r for r in status.get("reports") or () if isinstance(r, Mapping)]
            view = aggregate(reports, resource.generation, now, self._ttl)
            previous = self._views.get(key)
            if view.expired_pods:
                self._kube.remove_reports(key, reports, view.expired_pods)
                writes += 1
                log.info("reports expired resource=%s pods=%s", key, ",".join(view.expired_pods))
            existing = find_condition(status, TRIPPED)
            if existing is None and not view.live_pods:
                # No proxy pod has reported on this provider: nothing to say yet.
                self._views[key] = view
                continue
            desired = condition_body(view, existing, now)
            # The Reason column's source: the reason only while tripped. Left out of the
            # apply otherwise, which removes it (this manager owns it; `null` is refused).
            reason = view.condition.reason if view.entries else None
            if (
                not _same(existing, desired)
                or (status.get("tripped") or "") != view.summary
                or status.get("trippedReason") != reason
            ):
                body = {"conditions": [desired], "tripped": view.summary}
                if reason is not None:
                    body["trippedReason"] = reason
                self._kube.apply_status(key, body, field_manager=FIELD_MANAGER)
                writes += 1
            if previous is not None or view.entries:
                # After a restart the first view has no predecessor: Events only for what
                # is tripped now and was not known to be (recoveries need a predecessor).
                for note in events(previous, view):
                    self._kube.post_event(key, resource.uid, note, now)
                    writes += 1
            self._views[key] = view
        for gone in set(self._views) - present:
            del self._views[gone]
        return writes


def _same(existing: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> bool:
    if existing is None:
        return False
    keys = ("status", "reason", "message", "observedGeneration")
    return all(existing.get(k) == desired.get(k) for k in keys) and bool(
        existing.get("lastTransitionTime")
    )
