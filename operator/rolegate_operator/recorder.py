"""The one way the operator posts Events: `EventRecorder`, shared by the compile loop and
the tripped loop, applies the correlator's decisions (`events`) through the API calls of
`kube.Kube` (`create_event`, `patch_event_count`).

Best effort: a failed write is logged (type and API status only) and its count stays
pending for a later flush; nothing here raises into a pass.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime
from typing import Protocol

from rolegate_operator.conditions import EventNote
from rolegate_operator.events import Correlator, EventKey, Hold, Update, Write
from rolegate_operator.kube import describe_error
from rolegate_operator.store import ResourceKey

log = logging.getLogger("rolegate.operator.events")


class EventWriter(Protocol):
    """The API calls behind the recorder; `kube.Kube` is the real one."""

    def create_event(self, key: EventKey, count: int, first: datetime, last: datetime) -> str:
        """Create an Event carrying `count`; its name."""
        ...

    def patch_event_count(self, namespace: str, name: str, count: int, last: datetime) -> bool:
        """Set an Event's `count` and `lastTimestamp`; False when it no longer exists."""
        ...


class EventSink(Protocol):
    """What the loops post Events through (`EventRecorder`)."""

    def record(self, key: ResourceKey, uid: str, note: EventNote, now: datetime) -> int: ...


class BufferedEventSink(EventSink, Protocol):
    """An `EventSink` that holds counts back and writes them at a `flush`."""

    def flush(self, now: datetime) -> int: ...


class EventRecorder:
    """The correlator and the writes behind one lock: the compile loop and the tripped loop
    record from their own threads. Never raises."""

    def __init__(self, writer: EventWriter, correlator: Correlator | None = None) -> None:
        self._writer = writer
        self._correlator = correlator if correlator is not None else Correlator()
        self._lock = threading.Lock()

    def record(self, key: ResourceKey, uid: str, note: EventNote, now: datetime) -> int:
        """One occurrence of `note` about the resource; how many writes were made (0 or 1)."""
        with self._lock:
            decision = self._correlator.observe(EventKey.of(key, uid, note), now)
            if isinstance(decision, Hold):
                log.debug(
                    "event held resource=%s reason=%s pending=%d",
                    key,
                    note.reason,
                    decision.pending,
                )
                return 0
            return self._apply(decision)

    def flush(self, now: datetime) -> int:
        """Write the pending counts whose minute has passed; how many writes were made."""
        with self._lock:
            return sum(self._apply(write) for write in self._correlator.flush(now))

    def _apply(self, write: Write) -> int:
        key = write.key
        try:
            if isinstance(write, Update):
                namespace = key.resource.namespace
                if self._writer.patch_event_count(namespace, write.name, write.count, write.last):
                    self._correlator.written(key, write.name, write.count)
                    _log_written("updated", write)
                    return 1
                replacement = self._correlator.vanished(key)
                if replacement is None:
                    return 0
                write = replacement
            name = self._writer.create_event(key, write.count, write.first, write.last)
        except Exception as error:  # best effort: the status says it all; a flush retries
            log.warning(
                "event not posted resource=%s reason=%s error=%s",
                key.resource,
                key.reason,
                describe_error(error),
            )
            return 0
        self._correlator.written(key, name, write.count)
        _log_written("created", write)
        return 1


def _log_written(what: str, write: Write) -> None:
    log.info(
        "event %s resource=%s type=%s reason=%s count=%d",
        what,
        write.key.resource,
        write.key.type,
        write.key.reason,
        write.count,
    )
