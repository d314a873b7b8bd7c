"""The fleet's memory through the Kubernetes API server (issue 16), in a cluster: every
proxy pod shares what it learned of each machine, hears what the others learned, and
takes its own back after a restart.

- **One object per pod.** Each pod keeps a `ProxyMemory` in its own namespace (the
  ConfigMap's), named `memory-<pod>` and labelled `app.kubernetes.io/component:
  proxy-memory`, holding its own memory (`core/fleet.remember`) in the pod-memory format
  (`wire/pod_memory`, the `--state-file` format: one wire format for file and cluster).
  Its size is bounded by the machines one pod knows, not by pods times machines, and each pod
  writes only its own object, once per interval.
- **Publishing.** Every `--memory-publish-seconds` the memory is taken on the event loop
  (the ledger is the loop's), encoded in a worker thread and server-side applied under
  the pod's field manager (`rolegate-proxy/<pod>`); at once (`URGENT_COALESCE_SECONDS`
  later) after a breaker transition, so the fleet hears of a trip or a recovery within a
  second; once more at shutdown, after the last request, within a bounded time. An
  unreachable API server only delays it.
- **Hearing.** The pod lists and watches every ProxyMemory of its namespace and, after a
  change (coalesced: at most once a second), takes every peer's memory into its priors
  with `core/fleet.hear_fleet` (weighted by age, its own skipped, nothing heard passed on),
  and keeps out the keys a peer holds open for up to `trip_expiry` after its last word.
  An object that is not a memory, or holds a value no pod could have learned (an
  implausible TTFT, a count past the ledger's cap, a time in the future: core/plausible.py),
  is ignored whole with one warning naming it and the field, never quoting a value.
  A memory older than a day is ignored, and deleted by whichever pod sees it, with a
  resourceVersion precondition, so a fresh write is never deleted.
- **Restoring.** Before the first request a pod reads its own object (a container restart
  keeps the pod name) and restores it; if the API server does not answer within
  `RESTORE_SECONDS`, the pod starts without it (the request path never waits on
  Kubernetes, SPEC D6).

Nothing here runs on the request path.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

import aiohttp
from pydantic import ValidationError

from rolegate_policy import API_VERSION
from rolegate_policy.model import MAX_MEMORY_CHARS, PROXY_MEMORY_KIND, ProxyMemorySpec

from ..core.fleet import MAX_RESTORE_AGE_SECONDS, PodMemory, hear_fleet, remember, restore
from ..flow.dispatch import Dispatcher
from ..wire.pod_memory import MemoryFormatError, decode, encode, machine_count
from .kube_api import (
    Backoff,
    KubeApiError,
    ListWatch,
    Object,
    apply,
    delete,
    describe_error,
    get,
    load_access,
)
from .status_reporter import FIELD_MANAGER_PREFIX, pod_name

log = logging.getLogger("rolegate.proxy.memory")

COMPONENT_LABEL: Final = "app.kubernetes.io/component"
COMPONENT: Final = "proxy-memory"
SELECTOR: Final = f"{COMPONENT_LABEL}={COMPONENT}"
NAME_PREFIX: Final = "memory-"
MAX_NAME: Final = 253
# How long a starting pod waits for its own memory before it serves without it.
RESTORE_SECONDS: Final = 2.0
# After a breaker transition, the next memory is written this much later (so a burst of
# transitions is one write): what a trip takes to leave this pod for the fleet.
URGENT_COALESCE_SECONDS: Final = 0.2
# Peers' memories are heard at most this often: a burst of writes is heard once.
HEAR_EVERY_SECONDS: Final = 1.0

_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def memory_name(pod: str) -> str:
    """The name of `pod`'s ProxyMemory: `memory-<pod>`. A pod name that would not make a
    DNS subdomain of at most 253 characters is folded into one, followed by a hash of it,
    so two pods never share an object."""
    name = NAME_PREFIX + pod
    if len(name) <= MAX_NAME and _DNS_SUBDOMAIN.fullmatch(name):
        return name
    digest = hashlib.sha256(pod.encode()).hexdigest()[:10]
    folded = re.sub(r"[^a-z0-9]+", "-", pod.lower()).strip("-")
    base = (NAME_PREFIX + folded)[: MAX_NAME - len(digest) - 1].rstrip("-")
    return f"{base}-{digest}"


class NotPublishable(ValueError):
    """A memory a ProxyMemory cannot hold: longer than MAX_MEMORY_CHARS, or a pod name the
    kind refuses."""


def memory_object(memory: PodMemory, namespace: str) -> Object:
    """The ProxyMemory holding `memory`, as it is applied. Encoding takes a millisecond or
    so per thousand machines: call it in a worker thread."""
    text = encode(memory).decode()
    if len(text) > MAX_MEMORY_CHARS:
        raise NotPublishable(
            f"the memory takes {len(text)} characters, over the {MAX_MEMORY_CHARS} a "
            "ProxyMemory holds"
        )
    try:
        spec = ProxyMemorySpec(
            pod=memory.pod,
            written_at=datetime.fromtimestamp(memory.written_at, UTC),
            machines=machine_count(memory),
            memory=text,
        )
    except ValidationError as error:  # the fields only: the values may be long
        fields = ", ".join(".".join(map(str, e["loc"])) for e in error.errors())
        raise NotPublishable(f"the ProxyMemory's spec refuses {fields}") from None
    return {
        "apiVersion": API_VERSION,
        "kind": PROXY_MEMORY_KIND,
        "metadata": {
            "name": memory_name(memory.pod),
            "namespace": namespace,
            "labels": {COMPONENT_LABEL: COMPONENT},
        },
        "spec": spec.model_dump(mode="json", by_alias=True),
    }


def read_object(obj: Object, now: float | None = None) -> PodMemory:
    """The memory a ProxyMemory holds, read at `now` (the wall clock when None);
    `MemoryFormatError` (naming what is wrong, never quoting it) when it holds none, or one
    with a value no pod could have learned (wire/pod_memory.py): that memory is never
    heard, restored or republished."""
    spec = obj.get("spec")
    if not isinstance(spec, dict) or not isinstance(spec.get("memory"), str):
        raise MemoryFormatError("spec.memory is not a string")
    memory = decode(spec["memory"].encode(), now)
    if spec.get("pod") != memory.pod:
        raise MemoryFormatError("spec.pod is not the pod the memory names")
    return memory


def _read(obj: Object) -> PodMemory | MemoryFormatError:
    try:
        return read_object(obj)
    except MemoryFormatError as error:
        return error


def _name(obj: Object) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")


@dataclass
class FleetMemory:
    """One pod's side of the fleet's memory: publish its own, hear the others', restore
    its own at start."""

    dispatcher: Dispatcher
    namespace: str
    kubeconfig: Path | None = None
    pod: str = field(default_factory=pod_name)
    publish_seconds: float = 30.0
    backoff: Backoff = field(default_factory=Backoff)
    # Object name -> (resourceVersion, memory): every fresh memory of the namespace.
    _heard: dict[str, tuple[str, PodMemory]] = field(default_factory=dict)
    # Object name -> resourceVersion: memories older than a day, to delete.
    _expired: dict[str, str] = field(default_factory=dict)
    # Object name -> resourceVersion: objects that are not memories, warned about once.
    _refused: dict[str, str] = field(default_factory=dict)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    # Set by a breaker transition: the fleet hears of a trip (or its end) at once.
    _urgent: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def trip_expiry(self) -> float:
        """How long a peer's open breaker keeps its key out here without a newer word from
        that peer: three publish intervals (a pod that stops writing stops excluding)."""
        return 3.0 * self.publish_seconds

    def mark_urgent(self, *_: object) -> None:
        """A breaker transition (on the request path): O(1), no I/O."""
        self._urgent.set()

    @property
    def name(self) -> str:
        return memory_name(self.pod)

    @property
    def _collection(self) -> str:
        return f"/apis/{API_VERSION}/namespaces/{self.namespace}/proxymemories"

    def _where(self, name: str) -> str:
        return f"{self.namespace}/{name}"

    # -- restoring ------------------------------------------------------------------------

    async def restore_own(self, session: aiohttp.ClientSession, within: float) -> bool:
        """Take this pod's own memory back, if the API server has it and answers within
        `within` seconds: whether it was restored."""
        where = self._where(self.name)
        try:
            async with asyncio.timeout(within):
                access = await asyncio.to_thread(load_access, self.kubeconfig)
                obj = await get(session, access, f"{self._collection}/{self.name}")
        except TimeoutError:
            log.warning(
                "memory not restored object=%s reason=no answer within %.1fs (starting without)",
                where, within,
            )  # fmt: skip
            return False
        except Exception as error:
            log.warning(
                "memory not restored object=%s error=%s (starting without)",
                where, describe_error(error),
            )  # fmt: skip
            return False
        if obj is None:
            return False
        try:
            memory = read_object(obj)
        except MemoryFormatError as error:
            log.warning("memory not restored object=%s reason=%s", where, error)
            return False
        if memory.pod != self.pod:
            return False
        dispatcher = self.dispatcher
        now, wall_now = dispatcher.now(), time.time()
        age = max(0.0, wall_now - memory.written_at)
        learners = (dispatcher.ledger, dispatcher.scores)
        if not restore(memory, *learners, now, wall_now, breakers=dispatcher.breakers):
            log.info("memory not restored object=%s reason=older than a day", where)
            return False
        log.info(
            "memory restored object=%s machines=%d scores=%d age_s=%.0f",
            where, len(memory.machines), len(memory.scores), age,
        )  # fmt: skip
        return True

    # -- publishing -----------------------------------------------------------------------

    async def publish(self, session: aiohttp.ClientSession) -> None:
        """Apply this pod's memory as it stands."""
        dispatcher = self.dispatcher
        # Taken on the loop (the ledger and scores are the loop's), encoded off it.
        memory = remember(
            self.pod,
            dispatcher.ledger,
            dispatcher.scores,
            dispatcher.now(),
            time.time(),
            breakers=dispatcher.breakers,
            load=dispatcher.load,
        )
        body = await asyncio.to_thread(memory_object, memory, self.namespace)
        access = await asyncio.to_thread(load_access, self.kubeconfig)
        path = f"{self._collection}/{self.name}"
        if not await apply(session, access, path, body, FIELD_MANAGER_PREFIX + self.pod):
            raise KubeApiError(
                404, "NotFound", f"no ProxyMemory kind or no namespace {self.namespace}"
            )
        log.info(
            "memory published object=%s machines=%d bytes=%d",
            self._where(self.name), body["spec"]["machines"], len(body["spec"]["memory"]),
        )  # fmt: skip

    async def farewell(self, session: aiohttp.ClientSession, within: float) -> None:
        """The memory published once more at shutdown (after the last request), taking at
        most `within` seconds; the previous one stays when it cannot."""
        if within <= 0:
            return
        try:
            async with asyncio.timeout(within):
                await self.publish(session)
        except TimeoutError:
            log.warning("memory not published at shutdown within %.1fs", within)
        except Exception as error:
            log.warning("memory not published at shutdown error=%s", describe_error(error))

    async def _publish_forever(self, session: aiohttp.ClientSession) -> None:
        delay = self.publish_seconds
        while True:
            # Every interval, or at once after a breaker transition (coalesced: a burst of
            # transitions is one write).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._urgent.wait(), timeout=delay)
                await asyncio.sleep(URGENT_COALESCE_SECONDS)
            self._urgent.clear()
            try:
                await self.publish(session)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the API server may be away: retry later
                self.dispatcher.metrics.memory_writes.labels("failed").inc()
                delay = min(self.backoff.next_delay(), self.publish_seconds)
                log.warning(
                    "memory not published object=%s error=%s retry_in=%.2fs",
                    self._where(self.name), describe_error(error), delay,
                )  # fmt: skip
            else:
                self.dispatcher.metrics.memory_writes.labels("ok").inc()
                self.backoff.reset()
                delay = self.publish_seconds

    # -- hearing --------------------------------------------------------------------------

    async def _listed(self, items: list[Object]) -> None:
        """A (re)list: the namespace's memories as they stand now."""
        read = await asyncio.to_thread(lambda: [_read(item) for item in items])
        self._heard.clear()
        for item, memory in zip(items, read, strict=True):
            self._take(item, memory)
        names = {_name(item) for item in items}
        for name in set(self._refused) - names:
            del self._refused[name]
        self._changed.set()

    async def _event(self, kind: str, obj: Object) -> None:
        if kind == "DELETED":
            name = _name(obj)
            self._heard.pop(name, None)
            self._refused.pop(name, None)
            self._expired.pop(name, None)
        else:
            # Decoding a thousand machines takes some 15 ms: off the loop.
            self._take(obj, await asyncio.to_thread(_read, obj))
        self._changed.set()

    def _take(self, obj: Object, memory: PodMemory | MemoryFormatError) -> None:
        name = _name(obj)
        version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
        if isinstance(memory, MemoryFormatError):
            self._heard.pop(name, None)
            if self._refused.get(name) != version:
                self._refused[name] = version
                log.warning("memory ignored object=%s reason=%s", self._where(name), memory)
            return
        self._refused.pop(name, None)
        self._expired.pop(name, None)
        self._heard[name] = (version, memory)

    def hear(self) -> int:
        """Take every fresh peer memory into this pod's priors (replacing what was heard
        before); memories older than a day are set aside for deletion. Returns the number
        of pods heard (this one included, when its own memory is there)."""
        dispatcher = self.dispatcher
        now, wall_now = dispatcher.now(), time.time()
        newest: dict[str, PodMemory] = {}
        for name, (version, memory) in list(self._heard.items()):
            if wall_now - memory.written_at > MAX_RESTORE_AGE_SECONDS:
                del self._heard[name]
                self._expired[name] = version
                continue
            # One memory per pod, the newest: never one pod's evidence twice.
            held = newest.get(memory.pod)
            if held is None or memory.written_at > held.written_at:
                newest[memory.pod] = memory
        hear_fleet(
            newest.values(),
            self.pod,
            dispatcher.ledger,
            dispatcher.scores,
            now,
            wall_now,
            breakers=dispatcher.breakers,
            trip_expiry=self.trip_expiry,
            load=dispatcher.load,
        )
        dispatcher.metrics.memory_peers.set(sum(1 for pod in newest if pod != self.pod))
        return len(newest)

    async def _hear_forever(self, session: aiohttp.ClientSession) -> None:
        while True:
            # A change is heard at once; without one, the ages are re-weighed each interval.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=self.publish_seconds)
            self._changed.clear()
            try:
                pods = self.hear()
            except Exception:  # a bug: said loudly, and the pod goes on routing
                log.exception("memories not heard")
            else:
                log.debug("memories heard pods=%d", pods)
            if self._expired:
                await self._delete_expired(session)
            await asyncio.sleep(HEAR_EVERY_SECONDS)

    async def _delete_expired(self, session: aiohttp.ClientSession) -> None:
        try:
            access = await asyncio.to_thread(load_access, self.kubeconfig)
            for name, version in list(self._expired.items()):
                # Only the version seen: an object written since is fresh, and stays.
                deleted = await delete(session, access, f"{self._collection}/{name}", version)
                if self._expired.get(name) == version:
                    del self._expired[name]
                if deleted:
                    log.info("memory older than a day deleted object=%s", self._where(name))
        except asyncio.CancelledError:
            raise
        except Exception as error:  # tried again at the next hearing
            log.warning("memory older than a day not deleted error=%s", describe_error(error))

    # -- the whole ------------------------------------------------------------------------

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Forever: watch the namespace's memories, hear them, publish this pod's own."""
        watch = ListWatch(
            path=self._collection,
            selector={"labelSelector": SELECTOR},
            describe=f"proxymemories {self.namespace}",
            kubeconfig=self.kubeconfig,
            on_listed=self._listed,
            on_event=self._event,
            log=log,
        )
        async with asyncio.TaskGroup() as group:
            group.create_task(watch.run(session), name="rolegate-memory-watch")
            group.create_task(self._hear_forever(session), name="rolegate-memory-hear")
            group.create_task(self._publish_forever(session), name="rolegate-memory-publish")
