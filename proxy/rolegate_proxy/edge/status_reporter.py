"""Breaker state onto each ProviderPolicy's status (SPEC D4, D6), off the request path.

Each proxy pod owns one entry of `status.reports`, keyed by its pod name, written with
server-side apply under its own field manager (`rolegate-proxy/<pod>`), so replicas never
overwrite each other and the operator's conditions are untouched. A report is sent when
the pod's breakers for that provider change and otherwise as a heartbeat (the operator
expires the reports of pods it stops hearing from). Writes are coalesced: a burst of
transitions becomes one write per provider after a short pause. The request path only
sets a flag; an unreachable API server only delays the next write.
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
    ProxyConfig,
)
from rolegate_policy.status import (
    MAX_BREAKERS_PER_REPORT,
    MAX_QUIRKS_PER_REPORT,
    BreakerPhase,
    BreakerReport,
    PodReport,
    ProtocolQuirk,
    QuirkReport,
)

from ..core.exclusions import (
    BreakerView,
)
from .configmap_source import Backoff
from .kube_api import KubeAccess, load_access

log = logging.getLogger("rolegate.proxy.status")

FIELD_MANAGER_PREFIX = "rolegate-proxy/"


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


def _wire(model: PodReport | BreakerReport | QuirkReport) -> dict[str, Any]:
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


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
    _dirty: asyncio.Event = field(default_factory=asyncio.Event)
    # provider -> (what was last written, when): only changes and heartbeats are sent.
    _sent: dict[str, tuple[str, float]] = field(default_factory=dict)

    def mark_dirty(self, *_: object) -> None:
        """Called from the request path's breaker transitions: O(1), no I/O."""
        self._dirty.set()

    async def run(self, session: aiohttp.ClientSession) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._dirty.wait(), timeout=self.heartbeat_seconds / 3)
            await asyncio.sleep(self.coalesce_seconds)
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
                log.warning("status report failed error=%s retry_in=%.2fs", error, delay)
                await asyncio.sleep(delay)

    async def _report_all(self, session: aiohttp.ClientSession, access: KubeAccess) -> None:
        states = self.snapshot()
        monotonic_now, wall_now = self.monotonic(), time.time()
        for provider in self.config().providers:
            namespace, _, name = provider.source.rpartition("/")
            if not namespace:
                continue  # a provider from a manifest without a namespace: not in a cluster
            breakers = breaker_reports(states, provider.name, monotonic_now, wall_now)
            quirks = quirk_reports(self.quirks(provider.name), monotonic_now, wall_now)
            # What changed, without the times and counts (a heartbeat carries those).
            digest = json.dumps(
                [
                    [_wire(b.model_copy(update={"since": None, "until": None})) for b in breakers],
                    [quirk.kind.value for quirk in quirks],
                ],
                sort_keys=True,
            )
            last = self._sent.get(provider.name)
            if (
                last is not None
                and last[0] == digest
                and wall_now - last[1] < self.heartbeat_seconds
            ):
                continue
            report = PodReport(
                pod=self.pod,
                observed_at=datetime.fromtimestamp(int(wall_now), UTC),
                breakers=breakers,
                quirks=quirks,
            )
            await self._apply(session, access, namespace, name, report)
            self._sent[provider.name] = (digest, wall_now)

    async def _apply(
        self,
        session: aiohttp.ClientSession,
        access: KubeAccess,
        namespace: str,
        name: str,
        report: PodReport,
    ) -> None:
        body = {
            "apiVersion": API_VERSION,
            "kind": "ProviderPolicy",
            "metadata": {"name": name, "namespace": namespace},
            "status": {"reports": [_wire(report)]},
        }
        url = (
            f"{access.base_url}/apis/{API_VERSION}/namespaces/{namespace}"
            f"/providerpolicies/{name}/status"
        )
        async with session.patch(
            url,
            params={"fieldManager": FIELD_MANAGER_PREFIX + self.pod, "force": "true"},
            data=json.dumps(body),
            headers={**access.headers, "Content-Type": "application/apply-patch+yaml"},
            ssl=access.ssl_context,
            timeout=aiohttp.ClientTimeout(total=10),
        ) as response:
            if response.status == 404:
                return  # the ProviderPolicy is gone; nothing to report on
            if response.status >= 400:
                text = await response.text()
                raise RuntimeError(
                    f"HTTP {response.status} patching {namespace}/{name}: {text[:300]}"
                )
        log.info(
            "status reported provider=%s/%s breakers=%d quirks=%d",
            namespace, name, len(report.breakers), len(report.quirks),
        )  # fmt: skip
