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
from rolegate_policy.config import ProxyConfig

from ..core.exclusions import BreakerState, State
from .configmap_source import Backoff
from .kube_api import KubeAccess, load_access

log = logging.getLogger("rolegate.proxy.status")

FIELD_MANAGER_PREFIX = "rolegate-proxy/"
# The most breakers one report lists (the CRD bounds the list too).
MAX_BREAKERS_PER_REPORT = 256


def pod_name() -> str:
    """The pod's name (the Helm chart passes it via the downward API), else the host name."""
    return os.environ.get("POD_NAME") or socket.gethostname()


def wall_clock(monotonic_at: float, monotonic_now: float, wall_now: float) -> str:
    moment = wall_now - (monotonic_now - monotonic_at)
    return datetime.fromtimestamp(moment, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def breaker_entries(
    states: list[BreakerState], provider: str, monotonic_now: float, wall_now: float
) -> list[dict[str, Any]]:
    """The pod's open and half-open breakers of one provider, as `BreakerReport` objects."""
    entries: list[dict[str, Any]] = []
    for state in states:
        key = state.key
        if key.provider != provider or state.state is State.CLOSED:
            continue
        if state.reason is None or state.since is None:
            continue  # an open state always has both; a closed one was filtered above
        entry: dict[str, Any] = {
            "scope": key.scope.value,
            "state": state.state.value,
            "reason": state.reason.value,
            "since": wall_clock(state.since, monotonic_now, wall_now),
        }
        if key.model is not None:
            entry["model"] = key.model
        if key.machine is not None:
            entry["machine"] = key.machine
        if state.until is not None:
            entry["until"] = wall_clock(state.until, monotonic_now, wall_now)
        entries.append(entry)
    entries.sort(key=lambda e: (e["scope"], e.get("model", ""), e.get("machine", "")))
    return entries[:MAX_BREAKERS_PER_REPORT]


@dataclass
class BreakerReporter:
    snapshot: Callable[[], list[BreakerState]]
    config: Callable[[], ProxyConfig]
    monotonic: Callable[[], float]
    kubeconfig: Path | None = None
    pod: str = field(default_factory=pod_name)
    heartbeat_seconds: float = 30.0
    coalesce_seconds: float = 0.5
    backoff: Backoff = field(default_factory=Backoff)
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
            breakers = breaker_entries(states, provider.name, monotonic_now, wall_now)
            digest = json.dumps(
                [{k: v for k, v in b.items() if k not in ("since", "until")} for b in breakers],
                sort_keys=True,
            )
            last = self._sent.get(provider.name)
            if (
                last is not None
                and last[0] == digest
                and wall_now - last[1] < self.heartbeat_seconds
            ):
                continue
            await self._apply(session, access, namespace, name, breakers, wall_now)
            self._sent[provider.name] = (digest, wall_now)

    async def _apply(
        self,
        session: aiohttp.ClientSession,
        access: KubeAccess,
        namespace: str,
        name: str,
        breakers: list[dict[str, Any]],
        wall_now: float,
    ) -> None:
        body = {
            "apiVersion": API_VERSION,
            "kind": "ProviderPolicy",
            "metadata": {"name": name, "namespace": namespace},
            "status": {
                "reports": [
                    {
                        "pod": self.pod,
                        "observedAt": datetime.fromtimestamp(wall_now, UTC).strftime(
                            "%Y-%m-%dT%H:%M:%SZ"
                        ),
                        "breakers": breakers,
                    }
                ]
            },
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
        log.info("status reported provider=%s/%s breakers=%d", namespace, name, len(breakers))
