"""What each proxy pod reports onto each ProviderPolicy's status (SPEC D4, D6), off the
request path.

Each proxy pod owns one entry of `status.reports`, keyed by its pod name, written with
server-side apply under its own field manager (`rolegate-proxy/<pod>`), so replicas never
overwrite each other and the operator's conditions are untouched. The entry carries the
configuration hash the pod serves, whether it could read the provider's API key, its open
breakers and the protocol quirks it met. A report is sent when any of these change (a
breaker transition, a configuration loaded, a key found or lost) and otherwise as a
heartbeat (the operator expires the reports of pods it stops hearing from). Writes are
coalesced: a burst of changes becomes one write per provider after a short pause. The
request path only sets a flag; an unreachable API server only delays the next write.

A pod that shuts down withdraws its entries: it applies an empty `reports` under the same
field manager, which removes the entry that manager owned (and nothing else). The
withdrawal is bounded in time, so shutdown stays fast; what it could not remove expires.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from rolegate_policy import API_VERSION
from rolegate_policy.config import (
    CompiledProvider,
    ProxyConfig,
)
from rolegate_policy.status import (
    MAX_BREAKERS_PER_REPORT,
    MAX_QUIRKS_PER_REPORT,
    BreakerPhase,
    BreakerReport,
    KeyResolution,
    PodReport,
    ProtocolQuirk,
    QuirkReport,
)

from ..core.exclusions import (
    BreakerView,
)
from .kube_api import Backoff, KubeAccess, apply, describe_error, load_access

log = logging.getLogger("rolegate.proxy.status")

FIELD_MANAGER_PREFIX = "rolegate-proxy/"
# How long a pod that shuts down spends, at most, finishing the write in flight and
# withdrawing its reports: shutdown stays fast, and what is left expires.
WITHDRAW_SECONDS = 2.0


def pod_name() -> str:
    """The pod's name (the Helm chart passes it via the downward API), else the host name."""
    return os.environ.get("POD_NAME") or socket.gethostname()


def wall_clock(monotonic_at: float, monotonic_now: float, wall_now: float) -> datetime:
    """A moment on the monotonic clock as a wall-clock time, to the second."""
    moment = wall_now - (monotonic_now - monotonic_at)
    return datetime.fromtimestamp(int(moment), UTC)


def breaker_reports(
    states: list[BreakerView], provider: str, monotonic_now: float, wall_now: float
) -> list[BreakerReport]:
    """The pod's open and half-open breakers of one provider, sorted, at most
    MAX_BREAKERS_PER_REPORT (what the CRD allows)."""
    reports: list[BreakerReport] = []
    for state in states:
        key = state.key
        phase = state.state
        if key.provider != provider or phase is BreakerPhase.CLOSED:
            continue
        if state.reason is None or state.since is None:
            continue  # an open state always has both; a closed one was filtered above
        until = state.until
        reports.append(
            BreakerReport(
                scope=key.scope,
                model=key.model,
                machine=key.machine,
                state=BreakerPhase.OPEN if phase is BreakerPhase.OPEN else BreakerPhase.HALF_OPEN,
                reason=state.reason,
                since=wall_clock(state.since, monotonic_now, wall_now),
                until=None if until is None else wall_clock(until, monotonic_now, wall_now),
            )
        )
    reports.sort(key=lambda r: (r.scope.value, r.model or "", r.machine or ""))
    return reports[:MAX_BREAKERS_PER_REPORT]


def quirk_reports(
    seen: dict[ProtocolQuirk, tuple[int, float]], monotonic_now: float, wall_now: float
) -> list[QuirkReport]:
    """The protocol quirks one provider's answers showed this pod, sorted by kind."""
    reports = [
        QuirkReport(kind=kind, count=count, last_seen=wall_clock(at, monotonic_now, wall_now))
        for kind, (count, at) in sorted(seen.items())
    ]
    return reports[:MAX_QUIRKS_PER_REPORT]


def _no_quirks(_provider: str) -> dict[ProtocolQuirk, tuple[int, float]]:
    return {}


def _unknown_key(_provider: CompiledProvider) -> KeyResolution | None:
    return None


def _wire(model: PodReport | BreakerReport | QuirkReport) -> dict[str, Any]:
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


def report_digest(report: PodReport) -> str:
    """What a report says, without its times and counts (a heartbeat carries those): a
    report whose digest changed is sent at once."""
    return json.dumps(
        [
            report.served_hash,
            report.api_key,
            [_wire(b.model_copy(update={"since": None, "until": None})) for b in report.breakers],
            [quirk.kind.value for quirk in report.quirks],
        ],
        sort_keys=True,
    )


@dataclass
class BreakerReporter:
    snapshot: Callable[[], list[BreakerView]]
    config: Callable[[], ProxyConfig]
    monotonic: Callable[[], float]
    kubeconfig: Path | None = None
    pod: str = field(default_factory=pod_name)
    heartbeat_seconds: float = 30.0
    coalesce_seconds: float = 0.5
    backoff: Backoff = field(default_factory=Backoff)
    # The protocol quirks each provider's answers showed (kind -> count, last seen).
    quirks: Callable[[str], dict[ProtocolQuirk, tuple[int, float]]] = _no_quirks
    # Whether the pod could read a provider's API key (KeyStore.resolution: no I/O).
    key_resolution: Callable[[CompiledProvider], KeyResolution | None] = _unknown_key
    _dirty: asyncio.Event = field(default_factory=asyncio.Event)
    _stopping: asyncio.Event = field(default_factory=asyncio.Event)
    # ProviderPolicy (namespace/name) -> (digest of what was last written, when): only
    # changes and heartbeats are sent.
    _sent: dict[str, tuple[str, float]] = field(default_factory=dict)
    # Every ProviderPolicy a report was sent to (or may have reached): where the pod's
    # entry is withdrawn at shutdown.
    _reported: set[str] = field(default_factory=set)

    def mark_dirty(self, *_: object) -> None:
        """Called from the request path's breaker transitions and when a configuration or
        a key changes: O(1), no I/O."""
        self._dirty.set()

    def stop(self) -> None:
        """Ask `run` to return after the write in flight (no new write starts)."""
        self._stopping.set()
        self._dirty.set()

    async def run(self, session: aiohttp.ClientSession) -> None:
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._dirty.wait(), timeout=self.heartbeat_seconds / 3)
            if await self._stopped_within(self.coalesce_seconds):
                return
            self._dirty.clear()
            try:
                access = await asyncio.to_thread(load_access, self.kubeconfig)
                await self._report_all(session, access)
                self.backoff.reset()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the API server may be away: retry later
                self._dirty.set()
                delay = self.backoff.next_delay()
                log.warning(
                    "status report failed error=%s retry_in=%.2fs", describe_error(error), delay
                )
                await self._stopped_within(delay)

    async def _stopped_within(self, seconds: float) -> bool:
        """Pause for `seconds`, or less when `stop` is called: whether it was."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)
        return self._stopping.is_set()

    def report(
        self,
        provider: CompiledProvider,
        config: ProxyConfig,
        states: list[BreakerView],
        monotonic_now: float,
        wall_now: float,
    ) -> PodReport:
        """This pod's report on one provider, as it stands."""
        return PodReport(
            pod=self.pod,
            observed_at=datetime.fromtimestamp(int(wall_now), UTC),
            served_hash=config.hash or None,
            api_key=self.key_resolution(provider),
            breakers=breaker_reports(states, provider.name, monotonic_now, wall_now),
            quirks=quirk_reports(self.quirks(provider.name), monotonic_now, wall_now),
        )

    async def _report_all(self, session: aiohttp.ClientSession, access: KubeAccess) -> None:
        config = self.config()
        states = self.snapshot()
        monotonic_now, wall_now = self.monotonic(), time.time()
        for provider in config.providers:
            namespace, _, name = provider.source.rpartition("/")
            if not namespace:
                continue  # a provider from a manifest without a namespace: not in a cluster
            report = self.report(provider, config, states, monotonic_now, wall_now)
            digest = report_digest(report)
            last = self._sent.get(provider.source)
            if (
                last is not None
                and last[0] == digest
                and wall_now - last[1] < self.heartbeat_seconds
            ):
                continue
            # Before the write: one that fails on our side may still have landed.
            self._reported.add(provider.source)
            await self._apply(session, access, namespace, name, [_wire(report)])
            self._sent[provider.source] = (digest, wall_now)
            log.info(
                "status reported provider=%s hash=%s api_key=%s breakers=%d quirks=%d",
                provider.source, report.served_hash, report.api_key,
                len(report.breakers), len(report.quirks),
            )  # fmt: skip

    async def withdraw(self, session: aiohttp.ClientSession, within: float) -> None:
        """Remove this pod's entry from every ProviderPolicy it reported on, taking at
        most `within` seconds; what is not removed by then expires."""
        targets = sorted(self._reported)
        if not targets or within <= 0:
            return
        try:
            async with asyncio.timeout(within):
                access = await asyncio.to_thread(load_access, self.kubeconfig)
                results = await asyncio.gather(
                    *(self._withdraw_one(session, access, target) for target in targets),
                    return_exceptions=True,
                )
        except TimeoutError:
            log.warning(
                "status reports not withdrawn within %.1fs providers=%s (they expire)",
                within, ",".join(targets),
            )  # fmt: skip
            return
        except Exception as error:
            log.warning(
                "status reports not withdrawn providers=%s error=%s (they expire)",
                ",".join(targets), describe_error(error),
            )  # fmt: skip
            return
        for target, result in zip(targets, results, strict=True):
            if isinstance(result, BaseException):
                log.warning(
                    "status report not withdrawn provider=%s error=%s (it expires)",
                    target, describe_error(result),
                )  # fmt: skip

    async def _withdraw_one(
        self, session: aiohttp.ClientSession, access: KubeAccess, target: str
    ) -> None:
        namespace, _, name = target.rpartition("/")
        # An empty list under the same field manager: the entry it owned goes, the other
        # pods' entries (owned by their own managers) stay.
        await self._apply(session, access, namespace, name, [])
        self._reported.discard(target)
        self._sent.pop(target, None)
        log.info("status report withdrawn provider=%s", target)

    async def _apply(
        self,
        session: aiohttp.ClientSession,
        access: KubeAccess,
        namespace: str,
        name: str,
        reports: list[dict[str, Any]],
    ) -> None:
        body = {
            "apiVersion": API_VERSION,
            "kind": "ProviderPolicy",
            "metadata": {"name": name, "namespace": namespace},
            "status": {"reports": reports},
        }
        path = f"/apis/{API_VERSION}/namespaces/{namespace}/providerpolicies/{name}/status"
        # False (404): the ProviderPolicy is gone; nothing to report on.
        await apply(session, access, path, body, FIELD_MANAGER_PREFIX + self.pod)
