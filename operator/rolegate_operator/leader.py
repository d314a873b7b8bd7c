"""One writer among operator replicas: leader election on a `coordination.k8s.io/v1` Lease.

kopf's own peering is not used: it is a kopf-specific custom resource, it pauses every
replica but the one with the highest priority rather than electing one, and it needs a
cluster-wide CRD of its own. A Lease is what kube-controller-manager, controller-runtime
and client-go's `leaderelection` use: `kubectl get lease` shows the holder, and the
timing rules are the well-known ones:

- The leader renews every `retry_seconds`. If it cannot renew for `renew_deadline_seconds`
  it stops writing at once (it may have lost the Lease), and keeps trying to get it back.
- A standby takes the Lease over once it has seen the same holder and renew time for
  `lease_seconds` on its **own** clock (never comparing clocks across machines), so a
  standby takes over within `lease_seconds + retry_seconds` of the leader's last renewal.
- `renew_deadline_seconds < lease_seconds`, so a leader cut off from the API server has
  stopped writing before anyone else may start.
- A leader that stops cleanly releases the Lease (empty holder), and a standby takes over
  at its next attempt, within `retry_seconds`.

Every replica watches and compiles all the time (a warm standby); only the leader writes.
`decide` is pure (the clock comes in as an argument); `Elector` does the I/O.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Final, Protocol

log = logging.getLogger("rolegate.operator.leader")

LEASE_NAME_DEFAULT: Final = "rolegate-operator"


def replica_identity() -> str:
    """Who holds the Lease: the pod's name (the chart passes it via the downward API) or
    the host name, with a random suffix so two processes on one host never share one."""
    name = os.environ.get("POD_NAME") or socket.gethostname()
    return f"{name}_{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class ElectionOptions:
    """How the replicas elect their writer (the `rolegate operator --lease-*` flags)."""

    namespace: str
    name: str = LEASE_NAME_DEFAULT
    identity: str = ""
    lease_seconds: float = 15.0
    renew_deadline_seconds: float = 10.0
    retry_seconds: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_seconds < self.renew_deadline_seconds < self.lease_seconds:
            raise ValueError(
                "leader election needs 0 < retry < renew deadline < lease duration "
                f"(got {self.retry_seconds}, {self.renew_deadline_seconds}, "
                f"{self.lease_seconds} s)"
            )


@dataclass(frozen=True)
class LeaseRecord:
    """What a Lease says, as read from the API server."""

    holder: str
    acquire_time: str
    renew_time: str
    lease_seconds: int
    transitions: int
    resource_version: str

    @property
    def held(self) -> bool:
        return bool(self.holder)


class Step(StrEnum):
    CREATE = "create"  # no Lease yet
    RENEW = "renew"  # ours
    TAKE_OVER = "take-over"  # released, or its holder went silent
    WAIT = "wait"  # someone else holds it and is renewing


def decide(
    record: LeaseRecord | None,
    me: str,
    *,
    unchanged_since: float,
    now: float,
    lease_seconds: float,
) -> Step:
    """What a replica does with the Lease as it reads it now. `unchanged_since` is when
    (on this replica's monotonic clock) it first saw the record's current holder and renew
    time: a holder is presumed gone once nothing changed for a lease duration."""
    if record is None:
        return Step.CREATE
    if record.holder == me:
        return Step.RENEW
    if not record.held or now - unchanged_since >= lease_seconds:
        return Step.TAKE_OVER
    return Step.WAIT


class LeaseApi(Protocol):
    """The Lease calls the elector makes (`kube.Kube` is the real one). `write` creates
    (when `record` is None) or replaces with the read resourceVersion as a precondition;
    it returns False when someone else wrote first (409)."""

    def read_lease(self, namespace: str, name: str) -> LeaseRecord | None: ...

    def write_lease(
        self, namespace: str, name: str, body: Mapping[str, Any], record: LeaseRecord | None
    ) -> bool: ...


def micro_time(moment: datetime) -> str:
    """metav1.MicroTime: RFC 3339 with microseconds, in UTC."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_spec(
    holder: str, now: datetime, lease_seconds: float, record: LeaseRecord | None
) -> dict[str, Any]:
    """The spec to write: renewing (or releasing, with `holder` empty) keeps the acquire
    time and the transition count; taking over counts one more transition."""
    spec: dict[str, Any] = {
        "holderIdentity": holder,
        "leaseDurationSeconds": max(1, round(lease_seconds)),
        "renewTime": micro_time(now),
    }
    if record is None:
        spec |= {"acquireTime": micro_time(now), "leaseTransitions": 0}
    elif holder and record.holder != holder:
        spec |= {"acquireTime": micro_time(now), "leaseTransitions": record.transitions + 1}
    else:
        spec |= {
            "acquireTime": record.acquire_time or micro_time(now),
            "leaseTransitions": record.transitions,
        }
    return spec


@dataclass
class Leadership:
    """Whether this replica may write now. Read by the loops before every write;
    `on_gain` callbacks run when it becomes the leader (they resync what they write)."""

    leading: bool = False
    on_gain: list[Callable[[], None]] = field(default_factory=list)
    on_change: list[Callable[[bool], None]] = field(default_factory=list)

    def set(self, leading: bool) -> None:
        if leading == self.leading:
            return
        self.leading = leading
        for notify in self.on_change:
            notify(leading)
        if leading:
            for resync in self.on_gain:
                resync()


def always_leading() -> Leadership:
    """A single replica without election (`--leader-election off`): always the writer."""
    return Leadership(leading=True)


class Elector:
    def __init__(
        self,
        options: ElectionOptions,
        api: LeaseApi,
        leadership: Leadership,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._options = options
        self._api = api
        self._leadership = leadership
        self._monotonic = monotonic
        self._wall = wall
        self._seen: tuple[str, str] | None = None
        self._seen_since = 0.0
        self._renewed_at: float | None = None

    async def run(self) -> None:
        options = self._options
        log.info(
            "leader election lease=%s/%s identity=%s lease_seconds=%.0f",
            options.namespace, options.name, options.identity, options.lease_seconds,
        )  # fmt: skip
        while True:
            try:
                _, leading = await asyncio.to_thread(self.contend)
                # Applied here, on the loop: the callbacks wake the loops' asyncio events.
                self._lead(leading)
            except Exception as error:  # the API server may be away: try again
                log.warning("lease attempt failed error=%s", type(error).__name__)
            self.check_deadline()
            await asyncio.sleep(options.retry_seconds)

    def attempt(self) -> Step:
        """One round, applied at once (for callers without an event loop)."""
        step, leading = self.contend()
        self._lead(leading)
        return step

    def contend(self) -> tuple[Step, bool]:
        """One read-decide-write round (blocking: run in a thread): the step taken and
        whether this replica holds the Lease afterwards."""
        options = self._options
        record = self._api.read_lease(options.namespace, options.name)
        now = self._monotonic()
        seen = (record.holder, record.renew_time) if record is not None else None
        if seen != self._seen:
            self._seen, self._seen_since = seen, now
        step = decide(
            record,
            options.identity,
            unchanged_since=self._seen_since,
            now=now,
            lease_seconds=options.lease_seconds,
        )
        if step is Step.WAIT:
            return step, False
        body = lease_spec(options.identity, self._wall(), options.lease_seconds, record)
        if not self._api.write_lease(options.namespace, options.name, body, record):
            return step, False
        self._renewed_at = self._monotonic()
        return step, True

    def _lead(self, leading: bool) -> None:
        if leading and not self._leadership.leading:
            options = self._options
            log.info("became the leader lease=%s/%s", options.namespace, options.name)
        self._leadership.set(leading)

    def check_deadline(self) -> None:
        """A leader that could not renew in time stops writing: another replica may hold
        the Lease by now."""
        if not self._leadership.leading or self._renewed_at is None:
            return
        if self._monotonic() - self._renewed_at >= self._options.renew_deadline_seconds:
            log.warning(
                "lost the lease: not renewed for %.0f s, writes stop",
                self._options.renew_deadline_seconds,
            )
            self._leadership.set(False)

    def release(self) -> None:
        """Give the Lease up on a clean stop, so a standby takes over at its next attempt
        instead of waiting a lease duration. Stops writing at once; the Lease write is
        blocking (bounded by the request timeout): run `release_lease` in a thread."""
        was_leading = self._leadership.leading
        self._leadership.set(False)
        if was_leading:
            self.release_lease()

    def release_lease(self) -> None:
        options = self._options
        record = self._api.read_lease(options.namespace, options.name)
        if record is None or record.holder != options.identity:
            return
        body = lease_spec("", self._wall(), options.lease_seconds, record)
        body["leaseDurationSeconds"] = 1
        if self._api.write_lease(options.namespace, options.name, body, record):
            log.info("released the lease lease=%s/%s", options.namespace, options.name)
