"""Events about the resources, aggregated and rate-limited like client-go's EventCorrelator.

Every Event the operator posts (a rejection, a recovery, a new generation compiled, a
breaker tripped or recovered) goes through one `EventRecorder`, shared by the compile loop
and the tripped loop. Occurrences with the same **correlation key** (the involved object's
uid, the type, the reason and the message) are one Event:

- **aggregation**: an occurrence within `WINDOW` (10 min) of the key's previous one counts
  into the same Event, whose `count` grows and whose `lastTimestamp` moves (a PATCH of the
  existing Event, not a new one); after a longer silence the key starts a new Event. If the
  remembered Event is gone (deleted by hand, or expired by the API server's event TTL), the
  PATCH answers 404 and a new Event is created carrying the count;
- **rate limit**: at most one write (create or patch) per key per `INTERVAL` (1 min).
  Occurrences in between are counted, not written; the next write carries them in its
  `count`, so nothing is lost. `flush(now)`, called from the tripped loop's tick (every
  5 s), writes the counts still pending once the key's minute has passed;
- **bounded memory**: at most `MAX_KEYS` (4096) keys, least recently used dropped first
  (with any count still pending on them), and keys quiet for longer than the window are
  forgotten at a flush (a failed write is retried every minute until then).

This module is the pure part: the clock comes in as an argument, and `Correlator` returns
decisions (`Create`, `Update`, `Hold`). `recorder.EventRecorder` applies them through the
API calls `kube.Kube.create_event` and `kube.Kube.patch_event_count`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

from rolegate_operator.conditions import EventNote
from rolegate_operator.store import ResourceKey

WINDOW: Final = timedelta(minutes=10)
INTERVAL: Final = timedelta(minutes=1)
MAX_KEYS: Final = 4096
# Event messages are shown in one line by `kubectl describe`; events.k8s.io caps notes at
# 1 KiB. Cut here, so the key (kept in memory) is bounded too.
MESSAGE_LIMIT: Final = 1024


@dataclass(frozen=True)
class EventKey:
    """What makes two occurrences the same Event."""

    resource: ResourceKey
    uid: str
    type: str
    reason: str
    message: str

    @classmethod
    def of(cls, resource: ResourceKey, uid: str, note: EventNote) -> EventKey:
        message = note.message
        if len(message) > MESSAGE_LIMIT:
            message = message[: MESSAGE_LIMIT - 1] + "…"
        return cls(resource, uid, note.type, note.reason, message)


@dataclass(frozen=True)
class Create:
    """Create a new Event for `key` carrying `count` occurrences."""

    key: EventKey
    count: int
    first: datetime
    last: datetime


@dataclass(frozen=True)
class Update:
    """Set the existing Event `name`'s `count` and `lastTimestamp`."""

    key: EventKey
    name: str
    count: int
    last: datetime


@dataclass(frozen=True)
class Hold:
    """Counted, not written now (the key's minute has not passed): `pending` occurrences
    wait for the next write."""

    key: EventKey
    pending: int


Write = Create | Update
Decision = Create | Update | Hold


@dataclass
class _Entry:
    first: datetime  # the first occurrence in this Event's life
    last: datetime  # the latest occurrence
    count: int  # occurrences in this Event's life
    written: int = 0  # the count the Event on the server carries (0: none created yet)
    name: str | None = None  # the Event's name once created
    attempted: datetime | None = None  # the latest write tried (successful or not)


class Correlator:
    """The pure bookkeeping: which occurrence is written how, and when."""

    def __init__(
        self,
        *,
        window: timedelta = WINDOW,
        interval: timedelta = INTERVAL,
        max_keys: int = MAX_KEYS,
    ) -> None:
        self._window = window
        self._interval = interval
        self._max_keys = max_keys
        self._entries: OrderedDict[EventKey, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def observe(self, key: EventKey, now: datetime) -> Decision:
        """One occurrence of `key` at `now`: a write if one is allowed now, else `Hold`."""
        entry = self._entries.get(key)
        if entry is None or now - entry.last > self._window:
            entry = _Entry(first=now, last=now, count=1)
            self._entries[key] = entry
        else:
            entry.count += 1
            entry.last = max(entry.last, now)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max_keys:
            self._entries.popitem(last=False)
        if not self._may_write(entry, now):
            return Hold(key, entry.count - entry.written)
        return self._write(key, entry, now)

    def flush(self, now: datetime) -> list[Write]:
        """The writes of counts still pending whose key's minute has passed. Keys quiet for
        longer than the window are forgotten: their counts were written within a minute,
        unless every write since failed (then retrying stops)."""
        writes: list[Write] = []
        for key, entry in list(self._entries.items()):
            if now - entry.last > self._window:
                del self._entries[key]
            elif entry.count > entry.written and self._may_write(entry, now):
                writes.append(self._write(key, entry, now))
        return writes

    def written(self, key: EventKey, name: str, count: int) -> None:
        """A write succeeded: the Event `name` carries `count`."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.name = name
            entry.written = max(entry.written, count)

    def vanished(self, key: EventKey) -> Create | None:
        """The remembered Event is gone (404 on the patch): a new one, with every
        occurrence counted, replaces it."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        entry.name = None
        entry.written = 0
        return Create(key, entry.count, entry.first, entry.last)

    def _may_write(self, entry: _Entry, now: datetime) -> bool:
        if entry.attempted is None:
            return True
        since = now - entry.attempted
        # A wall clock stepped backwards must not silence a key until it catches up.
        return since >= self._interval or since < timedelta(0)

    def _write(self, key: EventKey, entry: _Entry, now: datetime) -> Write:
        entry.attempted = now
        if entry.name is None:
            return Create(key, entry.count, entry.first, entry.last)
        return Update(key, entry.name, entry.count, entry.last)
