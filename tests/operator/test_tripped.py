"""The Tripped summary from the proxy pods' reports: pure, the clock passed in."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from rolegate_operator.tripped import NOT_TRIPPED_REASON, aggregate, events

NOW = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)


def _report(pod: str, *breakers: dict[str, Any], age: float = 1.0) -> dict[str, Any]:
    seen = (NOW - timedelta(seconds=age)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"pod": pod, "observedAt": seen, "breakers": list(breakers)}


SINCE = {"since": (NOW - timedelta(seconds=30)).strftime("%Y-%m-%dT%H:%M:%SZ")}
EMPTY = {"scope": "Model", "model": "nemotron", "state": "Open", "reason": "EmptyResponses"}
EMPTY |= SINCE
MANGLED = {"scope": "Provider", "state": "Open", "reason": "MangledOutput", **SINCE}
LIMITED = {"scope": "Machine", "model": "qwen", "machine": "fastco"}
LIMITED |= {"state": "Open", "reason": "RateLimited", **SINCE}


def test_no_reports_or_no_breakers_is_not_tripped() -> None:
    view = aggregate([_report("a"), _report("b")], generation=3, now=NOW, ttl_seconds=90)
    assert view.condition.status.value == "False"
    assert view.condition.reason == NOT_TRIPPED_REASON
    assert "2 pods reporting" in view.condition.message
    assert view.condition.observed_generation == 3
    assert view.summary == ""


def test_a_tripped_model_names_the_model_and_how_many_pods_see_it() -> None:
    view = aggregate([_report("a", EMPTY), _report("b")], generation=1, now=NOW, ttl_seconds=90)
    assert view.condition.status.value == "True"
    assert view.condition.reason == "EmptyResponses"
    assert "model nemotron (EmptyResponses) on 1 of 2 pods" in view.condition.message
    assert view.summary == "nemotron"


def test_a_provider_trip_summarises_as_provider_and_leads_the_reason() -> None:
    reports = [_report("a", MANGLED, LIMITED), _report("b", MANGLED)]
    view = aggregate(reports, generation=1, now=NOW, ttl_seconds=90)
    assert view.summary == "provider"
    assert view.condition.reason == "MangledOutput"
    assert "machine fastco of qwen (RateLimited) on 1 of 2 pods" in view.condition.message


def test_reports_of_pods_not_heard_from_expire() -> None:
    reports = [_report("gone", EMPTY, age=300), _report("here")]
    view = aggregate(reports, generation=1, now=NOW, ttl_seconds=90)
    assert view.expired_pods == ("gone",)
    assert view.live_pods == ("here",)
    assert view.condition.status.value == "False"


def test_one_event_per_trip_and_per_recovery_not_per_report() -> None:
    calm = aggregate([_report("a")], generation=1, now=NOW, ttl_seconds=90)
    tripped = aggregate([_report("a", EMPTY)], generation=1, now=NOW, ttl_seconds=90)
    again = aggregate([_report("a", EMPTY), _report("b", EMPTY)], 1, NOW, 90)
    (trip,) = events(calm, tripped)
    assert (trip.type, trip.reason) == ("Warning", "EmptyResponses")
    assert "model nemotron" in trip.message
    assert events(tripped, again) == []  # same key, another pod: no new Event
    (recovery,) = events(again, calm)
    assert (recovery.type, recovery.reason) == ("Normal", "Recovered")
    assert events(None, calm) == []


def test_a_report_the_shared_status_model_cannot_read_counts_as_expired() -> None:
    """Reports are read with the same models the proxy writes them with; one that does not
    fit them (a schema older than this operator) is dropped like a stale one."""
    odd = _report("old", {"scope": "Model", "state": "Open", "reason": "SomethingNew"})
    view = aggregate([odd, _report("a", EMPTY)], generation=1, now=NOW, ttl_seconds=90)
    assert view.expired_pods == ("old",)
    assert view.live_pods == ("a",)
