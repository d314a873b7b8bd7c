"""Events aggregated and rate-limited (events.py, recorder.py): the correlator with the clock
passed in, the recorder against a recording writer, and the tripped loop when a machine
flaps. No server, no sleeping (the real API server: test_events_api.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from rolegate_operator.conditions import EventNote
from rolegate_operator.events import MESSAGE_LIMIT, Correlator, Create, EventKey, Hold, Update
from rolegate_operator.recorder import EventRecorder
from rolegate_operator.reports_loop import ReportsLoop
from rolegate_operator.store import ResourceKey, Store

from .builders import as_stored, key_of, provider

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
POLICY = ResourceKey("ProviderPolicy", "llm", "router")
TRIP = EventNote("Warning", "EmptyResponses", "Tripped machine m1 of qwen: EmptyResponses.")
KEY = EventKey.of(POLICY, "uid-1", TRIP)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


# --- the correlator ------------------------------------------------------------------------


def test_repeated_occurrences_are_one_event_whose_count_grows() -> None:
    correlator = Correlator()
    assert correlator.observe(KEY, at(0)) == Create(KEY, 1, at(0), at(0))
    correlator.written(KEY, "router.1", 1)
    # A minute on: the same Event is patched, its count and last timestamp moved.
    assert correlator.observe(KEY, at(60)) == Update(KEY, "router.1", 2, at(60))
    correlator.written(KEY, "router.1", 2)
    assert correlator.observe(KEY, at(300)) == Update(KEY, "router.1", 3, at(300))


def test_at_most_one_write_per_key_per_minute_and_the_held_count_is_carried() -> None:
    correlator = Correlator()
    assert isinstance(correlator.observe(KEY, at(0)), Create)
    correlator.written(KEY, "router.1", 1)
    # Six in about ten seconds (the flapping machine): one write, five held and counted.
    assert [correlator.observe(KEY, at(s)) for s in (2, 4, 6, 8, 10)] == [
        Hold(KEY, n) for n in (1, 2, 3, 4, 5)
    ]
    assert correlator.flush(at(59)) == []  # the minute has not passed
    assert correlator.flush(at(60)) == [Update(KEY, "router.1", 6, at(10))]
    correlator.written(KEY, "router.1", 6)
    assert correlator.flush(at(65)) == []  # nothing pending any more
    assert correlator.flush(at(200)) == []


def test_an_occurrence_after_the_minute_carries_the_held_ones_without_a_flush() -> None:
    correlator = Correlator()
    correlator.observe(KEY, at(0))
    correlator.written(KEY, "router.1", 1)
    assert correlator.observe(KEY, at(30)) == Hold(KEY, 1)
    assert correlator.observe(KEY, at(61)) == Update(KEY, "router.1", 3, at(61))
    correlator.written(KEY, "router.1", 3)
    # The write at 61 s starts the next minute.
    assert correlator.observe(KEY, at(90)) == Hold(KEY, 1)
    assert correlator.flush(at(120)) == []
    assert correlator.flush(at(121)) == [Update(KEY, "router.1", 4, at(90))]


def test_each_correlation_key_is_counted_and_limited_on_its_own() -> None:
    correlator = Correlator()
    others = [
        EventKey.of(POLICY, "uid-2", TRIP),  # the resource re-created
        EventKey.of(POLICY, "uid-1", EventNote("Normal", TRIP.reason, TRIP.message)),
        EventKey.of(POLICY, "uid-1", EventNote(TRIP.type, "MangledOutput", TRIP.message)),
        EventKey.of(POLICY, "uid-1", EventNote(TRIP.type, TRIP.reason, "Tripped model qwen.")),
    ]
    decisions = [correlator.observe(key, at(1)) for key in [KEY, *others]]
    assert decisions == [Create(key, 1, at(1), at(1)) for key in [KEY, *others]]


def test_after_a_quiet_window_the_key_starts_a_new_event() -> None:
    correlator = Correlator(window=timedelta(minutes=10))
    correlator.observe(KEY, at(0))
    correlator.written(KEY, "router.1", 1)
    # Within ten minutes of the last occurrence: the same Event.
    assert correlator.observe(KEY, at(600)) == Update(KEY, "router.1", 2, at(600))
    correlator.written(KEY, "router.1", 2)
    # More than ten minutes after it: a new Event, counted from one.
    assert correlator.observe(KEY, at(1201)) == Create(KEY, 1, at(1201), at(1201))
    correlator.written(KEY, "router.2", 1)
    # A flush forgets keys quiet for longer than the window, once nothing is pending.
    assert KEY in correlator
    assert correlator.flush(at(1801)) == []
    assert KEY in correlator
    assert correlator.flush(at(1802)) == []
    assert KEY not in correlator
    assert len(correlator) == 0


def test_the_cache_is_bounded_least_recently_used_first() -> None:
    correlator = Correlator(max_keys=3)
    keys = [EventKey.of(POLICY, "uid-1", EventNote("Warning", "R", f"m{n}")) for n in range(4)]
    for key in keys[:3]:
        correlator.observe(key, at(0))
        correlator.written(key, f"e{key.message}", 1)
    correlator.observe(keys[0], at(1))  # used again: now the most recent
    correlator.observe(keys[3], at(2))
    assert len(correlator) == 3
    assert [key in correlator for key in keys] == [True, False, True, True]
    # The dropped key starts over: a new Event.
    assert correlator.observe(keys[1], at(3)) == Create(keys[1], 1, at(3), at(3))
    assert len(correlator) == 3


def test_a_deleted_event_is_created_again_with_every_occurrence_counted() -> None:
    correlator = Correlator()
    correlator.observe(KEY, at(0))
    correlator.written(KEY, "router.1", 1)
    assert correlator.observe(KEY, at(61)) == Update(KEY, "router.1", 2, at(61))
    # The patch answered 404: a new Event replaces the remembered one.
    assert correlator.vanished(KEY) == Create(KEY, 2, at(0), at(61))
    correlator.written(KEY, "router.2", 2)
    assert correlator.observe(KEY, at(122)) == Update(KEY, "router.2", 3, at(122))


def test_a_failed_write_is_retried_with_its_count_after_the_minute() -> None:
    correlator = Correlator()
    assert isinstance(correlator.observe(KEY, at(0)), Create)  # ... and the create failed
    assert correlator.observe(KEY, at(5)) == Hold(KEY, 2)  # an attempt counts for the limit
    assert correlator.flush(at(60)) == [Create(KEY, 2, at(0), at(5))]
    # Still failing: retried once a minute, until the key has been quiet for the window.
    assert correlator.flush(at(90)) == []
    assert correlator.flush(at(120)) == [Create(KEY, 2, at(0), at(5))]
    assert correlator.flush(at(605)) == [Create(KEY, 2, at(0), at(5))]
    assert KEY in correlator
    assert correlator.flush(at(606)) == []
    assert KEY not in correlator


def test_a_long_message_is_cut_in_the_key() -> None:
    key = EventKey.of(POLICY, "uid-1", EventNote("Warning", "R", "x" * 40_000))
    assert len(key.message) == MESSAGE_LIMIT
    assert key.message.endswith("…")


# --- the recorder, through a recording writer -----------------------------------------------


@dataclass
class RecordingWriter:
    """Keeps Events like the API server would: by name, with their counts."""

    events: dict[str, dict[str, Any]] = field(default_factory=dict)
    writes: list[str] = field(default_factory=list)
    failing: bool = False

    def create_event(self, key: EventKey, count: int, first: datetime, last: datetime) -> str:
        self._maybe_fail()
        name = f"{key.resource.name}.{len(self.events) + 1}"
        self.events[name] = {"key": key, "count": count, "first": first, "last": last}
        self.writes.append(f"create {name} {count}")
        return name

    def patch_event_count(self, namespace: str, name: str, count: int, last: datetime) -> bool:
        self._maybe_fail()
        self.writes.append(f"patch {name} {count}")
        if name not in self.events:
            return False
        self.events[name] |= {"count": count, "last": last}
        return True

    def _maybe_fail(self) -> None:
        if self.failing:
            raise ConnectionError("API server unreachable")


def test_the_recorder_writes_one_event_and_flushes_the_counts_it_held() -> None:
    writer = RecordingWriter()
    recorder = EventRecorder(writer)
    made = [recorder.record(POLICY, "uid-1", TRIP, at(s)) for s in (0, 2, 4, 6, 8, 10)]
    assert made == [1, 0, 0, 0, 0, 0]
    assert writer.writes == ["create router.1 1"]
    assert recorder.flush(at(30)) == 0
    assert recorder.flush(at(60)) == 1
    assert writer.writes == ["create router.1 1", "patch router.1 6"]
    (event,) = writer.events.values()
    assert (event["count"], event["first"], event["last"]) == (6, at(0), at(10))


def test_the_recorder_creates_the_event_again_when_it_was_deleted() -> None:
    writer = RecordingWriter()
    recorder = EventRecorder(writer)
    recorder.record(POLICY, "uid-1", TRIP, at(0))
    del writer.events["router.1"]  # deleted by hand, or expired
    assert recorder.record(POLICY, "uid-1", TRIP, at(61)) == 1
    assert writer.writes == ["create router.1 1", "patch router.1 2", "create router.1 2"]
    recorder.record(POLICY, "uid-1", TRIP, at(122))
    assert writer.writes[-1] == "patch router.1 3"


def test_a_failed_write_never_raises_and_its_count_is_written_later() -> None:
    writer = RecordingWriter(failing=True)
    recorder = EventRecorder(writer)
    assert recorder.record(POLICY, "uid-1", TRIP, at(0)) == 0
    assert recorder.record(POLICY, "uid-1", TRIP, at(1)) == 0
    writer.failing = False
    assert recorder.flush(at(59)) == 0
    assert recorder.flush(at(60)) == 1
    (event,) = writer.events.values()
    assert event["count"] == 2


# --- the tripped loop when a machine flaps ------------------------------------------------


@dataclass
class StatusWriter:
    statuses: list[Mapping[str, Any]] = field(default_factory=list)

    def apply_status(
        self, key: ResourceKey, status: Mapping[str, Any], field_manager: str = ""
    ) -> Mapping[str, Any] | None:
        self.statuses.append(status)
        return None

    def remove_reports(self, key: ResourceKey, reports: Any, pods: Any) -> None:
        return None

    def check_reachable(self) -> None:
        return None


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


def _report(now: datetime, tripped: bool) -> dict[str, Any]:
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    breakers = [
        {"scope": "Machine", "model": "qwen", "machine": "m1", "state": "Open"}
        | {"reason": "EmptyResponses", "since": stamp}
    ]
    return {"pod": "proxy-a", "observedAt": stamp, "breakers": breakers if tripped else []}


def test_a_flapping_machine_writes_one_event_per_key_per_minute_and_loses_no_count() -> None:
    """The measured problem: six Events in about ten seconds. Now one per key, and the
    minute's flush carries the rest."""
    clock = Clock()
    writer = RecordingWriter()
    store = Store()
    loop = ReportsLoop(
        store, StatusWriter(), events=EventRecorder(writer), now=clock, ttl_seconds=90
    )
    policy = as_stored(provider("router"))
    for second in range(0, 12, 2):  # trips at 0, 4, 8; recovers at 2, 6, 10
        clock.now = at(second)
        status = {"reports": [_report(clock.now, tripped=second % 4 == 0)]}
        store.observe("MODIFIED", policy | {"status": status})
        loop.run_pass()
    assert sorted(writer.writes) == ["create router.1 1", "create router.2 1"]
    trip, recovery = writer.events.values()
    assert (trip["key"].type, trip["key"].reason) == ("Warning", "EmptyResponses")
    assert (recovery["key"].type, recovery["key"].reason) == ("Normal", "Recovered")
    assert trip["key"].resource == key_of(policy)

    # The ticks after each key's minute write what was held: three trips, three recoveries.
    clock.now = at(61)
    loop.run_pass()
    assert writer.writes[2:] == ["patch router.1 3"]
    clock.now = at(62)
    loop.run_pass()
    assert sorted(writer.writes[2:]) == ["patch router.1 3", "patch router.2 3"]
    assert (trip["count"], trip["last"]) == (3, at(8))
    assert (recovery["count"], recovery["last"]) == (3, at(10))
