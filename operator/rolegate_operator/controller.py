"""The compile loop: debounced, level-based, writing only what changed.

Watch events only update the store and raise a change signal. One task waits for the
signal, lets a burst of changes settle (`debounce_quiet` without a new change, at most
`debounce_max` after the first), compiles everything from the store and then writes:

1. the ConfigMap, when the compiled hash differs from the last one written (and on every
   periodic resync, which also repairs a ConfigMap edited or deleted by hand);
2. the status of each resource whose owned status fields differ from what it carries;
3. an Event for each resource whose `Accepted` verdict or accepted generation changed
   (see `conditions`), through the shared `recorder.EventRecorder`.

The ConfigMap goes first, so a status never says a generation is served before it is.
A failed pass is retried with backoff; while the API server is unreachable nothing is
lost, since the next pass compares against the server again (SPEC D6).

Before the first compile the loop waits until kopf's watch has delivered every object
an initial listing found (bounded by `sync_timeout`), so a restart never compiles a
partial set (RoleTables before the ProviderPolicies they rely on) and flaps statuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from rolegate_operator.conditions import (
    find_condition,
    status_patch,
    transition_event,
)
from rolegate_operator.kube import ConfigMapWrite, describe_error
from rolegate_operator.leader import Leadership, always_leading
from rolegate_operator.metrics import OperatorMetrics
from rolegate_operator.reconcile import AcceptedVersion, ReconcileResult, reconcile
from rolegate_operator.recorder import EventSink
from rolegate_operator.store import KINDS, ResourceKey, Store
from rolegate_policy.config import (
    ProxyConfig,
)
from rolegate_policy.status import ACCEPTED

log = logging.getLogger("rolegate.operator")


@dataclass(frozen=True)
class Options:
    """How the operator runs (the `rolegate operator` flags)."""

    # Namespaces to watch; empty means every namespace.
    namespaces: tuple[str, ...]
    configmap_namespace: str
    configmap_name: str = "rolegate-config"
    debounce_quiet: float = 0.3
    debounce_max: float = 2.0
    resync_seconds: float = 300.0
    sync_timeout: float = 30.0
    retry_first: float = 0.5
    retry_cap: float = 30.0
    # A proxy pod's breaker report expires when not refreshed for this long (the pods
    # send one at least every 30 s by default: three missed heartbeats).
    report_ttl_seconds: float = 90.0


class KubeWriter(Protocol):
    """The API calls the loop makes; `kube.Kube` is the real one."""

    def list_uids(self, kind: str, namespace: str | None) -> set[str] | None: ...

    def apply_status(
        self, key: ResourceKey, status: Mapping[str, Any]
    ) -> Mapping[str, Any] | None: ...

    def sync_configmap(
        self, namespace: str, name: str, proxy_config: ProxyConfig
    ) -> ConfigMapWrite: ...


def debounce_deadline(first: float, last: float, quiet: float, longest: float) -> float:
    """When a burst of changes that began at `first`, latest at `last`, is compiled."""
    return min(last + quiet, first + longest)


def utc_now() -> datetime:
    return datetime.now(UTC)


class PassFailed(RuntimeError):
    """Some writes of a pass failed; the pass is retried."""


class Controller:
    def __init__(
        self,
        options: Options,
        store: Store,
        kube: KubeWriter,
        *,
        events: EventSink,
        now: Callable[[], datetime] = utc_now,
        monotonic: Callable[[], float] = time.monotonic,
        leadership: Leadership | None = None,
        metrics: OperatorMetrics | None = None,
    ) -> None:
        self.options = options
        self._leadership = leadership or always_leading()
        self._metrics = metrics or OperatorMetrics()
        self.store = store
        self._kube = kube
        self._events = events
        self._now = now
        self._monotonic = monotonic
        self._changed = asyncio.Event()
        self._observed = asyncio.Event()
        self._memory: dict[ResourceKey, AcceptedVersion] = {}
        self._written_hash: str | None = None
        self.passes = 0
        self.last_result: ReconcileResult | None = None
        # Called after every pass this replica wrote (what the proxies should serve moved).
        self.after_pass: list[Callable[[], None]] = []

    # Fed by the kopf handlers ------------------------------------------------------

    def observe(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        self._observed.set()
        if self.store.observe(event_type, body):
            self._changed.set()

    def resync(self) -> None:
        """Compare everything with the server again (this replica just became the leader:
        what the last one wrote is not known to be what this one would write)."""
        self._written_hash = None
        self._changed.set()

    # The loop ----------------------------------------------------------------------

    async def run(self) -> None:
        await self._initial_sync()
        verify_configmap = True
        delay = self.options.retry_first
        while True:
            try:
                await self.run_pass(verify_configmap=verify_configmap)
            except Exception as error:  # the API server is down, a write refused: retry
                log.warning(
                    "compile pass failed, retrying retry_in=%.1fs error=%s",
                    delay,
                    describe_error(error),
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.options.retry_cap)
                verify_configmap = True
                continue
            delay = self.options.retry_first
            changed = await self._wait_for_change(self.options.resync_seconds)
            # A quiet resync re-reads the ConfigMap; a change compiles after debouncing.
            verify_configmap = not changed
            if changed:
                await self._debounce()

    async def run_pass(self, *, verify_configmap: bool = False) -> ReconcileResult:
        """Compile from the store and write what differs. Raises `PassFailed` (after
        trying every write) when some status writes failed."""
        self._changed.clear()  # a change from here on means another pass
        snapshot = self.store.snapshot()
        started = self._monotonic()
        result = reconcile(snapshot, self._memory)
        self._record(result, self._monotonic() - started)
        self._memory = dict(result.accepted)
        self.last_result = result
        self.passes += 1
        if not self._leadership.leading:
            # A standby compiles (its last-known-good memory stays warm) but never writes.
            self._written_hash = None
            log.info(
                "standby pass done config_hash=%s resources=%d rejected=%d",
                result.config.hash,
                len(snapshot),
                len(result.rejected),
            )
            return result

        configmap = "skipped"  # the hash last written: no need to look
        if verify_configmap or result.config.hash != self._written_hash:
            outcome = await asyncio.to_thread(
                self._kube.sync_configmap,
                self.options.configmap_namespace,
                self.options.configmap_name,
                result.config,
            )
            self._written_hash = result.config.hash
            configmap = outcome.value
            if outcome is not ConfigMapWrite.UNCHANGED:
                log.info(
                    "configmap %s namespace=%s name=%s config_hash=%s roles=%d providers=%d "
                    "rejected=%d",
                    outcome.value,
                    self.options.configmap_namespace,
                    self.options.configmap_name,
                    result.config.hash,
                    len(result.config.roles),
                    len(result.config.providers),
                    len(result.rejected),
                )

        failures = written = 0
        for key in sorted(result.outcomes):
            try:
                written += await self._write_status(key, result)
            except Exception as error:
                failures += 1
                log.warning("status write failed resource=%s error=%s", key, describe_error(error))
        log.info(
            "pass done config_hash=%s resources=%d rejected=%d configmap=%s statuses_written=%d "
            "status_failures=%d",
            result.config.hash,
            len(snapshot),
            len(result.rejected),
            configmap,
            written,
            failures,
        )
        self._metrics.passes.labels("failed" if failures else "ok").inc()
        self._metrics.status_writes.labels("accepted").inc(written)
        for notify in self.after_pass:
            notify()
        if failures:
            raise PassFailed(f"{failures} status write(s) failed")
        return result

    def _record(self, result: ReconcileResult, seconds: float) -> None:
        metrics = self._metrics
        metrics.compile_seconds.observe(seconds)
        for kind in KINDS:
            fates = [fate for key, fate in result.outcomes.items() if key.kind == kind]
            metrics.resources.labels(kind).set(len(fates))
            metrics.rejected.labels(kind).set(sum(not fate.accepted for fate in fates))

    async def _write_status(self, key: ResourceKey, result: ReconcileResult) -> bool:
        """Write one resource's status if it differs; True when written."""
        outcome = result.outcomes[key]
        current = self.store.get(key)
        if current is None or current.uid != outcome.uid:
            return False  # deleted or re-created since the snapshot: the next pass sees it
        now = self._now()
        patch = status_patch(current.status, outcome.status, now)
        if patch is None:
            return False
        written = await asyncio.to_thread(self._kube.apply_status, key, patch)
        if written is None:
            return False
        self.store.record_write(written)
        accepted = outcome.status.accepted
        log.info(
            "status written resource=%s generation=%d accepted=%s reason=%s served_generation=%s",
            key,
            outcome.status.observed_generation,
            accepted.status.value,
            accepted.reason,
            outcome.served_generation,
        )
        note = transition_event(
            find_condition(current.status, ACCEPTED), accepted, result.config.hash
        )
        if note is not None:
            try:
                await asyncio.to_thread(self._events.record, key, outcome.uid, note, now)
            except Exception as error:  # Events are best effort; the status says it all
                log.warning("event not posted resource=%s error=%s", key, describe_error(error))
        return True

    async def _initial_sync(self) -> None:
        """Wait until the watch has delivered what a listing finds (bounded)."""
        expected: set[str] = set()
        namespaces: tuple[str | None, ...] = self.options.namespaces or (None,)
        delay = self.options.retry_first
        for kind in KINDS:
            for namespace in namespaces:
                while True:
                    try:
                        uids = await asyncio.to_thread(self._kube.list_uids, kind, namespace)
                        break
                    except Exception as error:
                        log.warning(
                            "initial listing failed kind=%s retry_in=%.1fs error=%s",
                            kind,
                            delay,
                            describe_error(error),
                        )
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, self.options.retry_cap)
                expected |= uids or set()
        deadline = self._monotonic() + self.options.sync_timeout
        while True:
            missing = [uid for uid in expected if not self.store.has_seen(uid)]
            if not missing:
                break
            remaining = deadline - self._monotonic()
            if remaining <= 0:
                log.warning(
                    "initial sync incomplete, compiling anyway missing=%d timeout=%.0fs",
                    len(missing),
                    self.options.sync_timeout,
                )
                break
            self._observed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._observed.wait(), min(remaining, 1.0))
        self.store.stop_tracking_uids()
        log.info("initial sync done resources=%d", len(self.store))

    async def _wait_for_change(self, within: float) -> bool:
        try:
            await asyncio.wait_for(self._changed.wait(), within)
        except TimeoutError:
            return False
        return True

    async def _debounce(self) -> None:
        first = last = self._monotonic()
        while True:
            self._changed.clear()
            deadline = debounce_deadline(
                first, last, self.options.debounce_quiet, self.options.debounce_max
            )
            remaining = deadline - self._monotonic()
            if remaining <= 0:
                return
            if not await self._wait_for_change(remaining):
                return
            last = self._monotonic()
