"""`Programmed` and `ResolvedRefs` from the pods' reports: pure."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from rolegate_operator.fleet import Fleet, programmed, resolved_refs
from rolegate_policy.status import KeyResolution, PodReport

NOW = datetime(2026, 12, 3, 12, 0, 0, tzinfo=UTC)
NEW = "sha256:" + "a" * 64
OLD = "sha256:" + "b" * 64
REF = {"apiKeySecretRef": {"name": "router-key", "key": "apiKey"}}


def report(
    pod: str, served: str | None = NEW, key: KeyResolution | None = None, age: float = 0
) -> PodReport:
    return PodReport(
        pod=pod, observed_at=NOW - timedelta(seconds=age), served_hash=served, api_key=key
    )


def test_every_pod_on_the_compiled_hash_is_programmed() -> None:
    fleet = Fleet.from_reports([report("a"), report("b")])
    condition = programmed(3, 3, NEW, fleet)
    assert (condition.status.value, condition.reason) == ("True", "Served")
    assert condition.observed_generation == 3
    assert "All 2 proxy pods serve configuration" in condition.message
    alone = programmed(3, 3, NEW, Fleet.from_reports([report("a")]))
    assert alone.message.startswith("The 1 proxy pod serves configuration")


def test_a_pod_on_an_older_hash_is_waited_for_by_name() -> None:
    fleet = Fleet.from_reports([report("a"), report("b", OLD), report("c", None)])
    condition = programmed(3, 3, NEW, fleet)
    assert (condition.status.value, condition.reason) == ("False", "RollingOut")
    assert condition.message.startswith("1 of 3 proxy pods")
    assert condition.message.endswith("waiting for b, c.")


def test_a_pods_newest_report_is_what_it_serves() -> None:
    # A pod reports on every ProviderPolicy; the newest of its reports wins.
    fleet = Fleet.from_reports([report("a", OLD, age=10), report("a", NEW, age=1)])
    assert fleet.serving == {"a": NEW}


def test_a_generation_not_accepted_is_not_programmed_whatever_the_pods_serve() -> None:
    fleet = Fleet.from_reports([report("a")])
    condition = programmed(4, 3, NEW, fleet)
    assert (condition.status.value, condition.reason) == ("False", "NotAccepted")
    assert "generation 3, the last accepted" in condition.message
    assert "nothing of it" in programmed(4, None, NEW, fleet).message


def test_no_reporting_pod_is_unknown() -> None:
    condition = programmed(1, 1, NEW, Fleet({}))
    assert (condition.status.value, condition.reason) == ("Unknown", "NoProxyReports")


def test_a_key_a_pod_cannot_read_names_the_secret_and_the_pods() -> None:
    reports = [report("a", key=KeyResolution.NOT_FOUND), report("b", key=KeyResolution.RESOLVED)]
    condition = resolved_refs(REF, 2, reports)
    assert condition is not None
    assert (condition.status.value, condition.reason) == ("False", "SecretNotFound")
    assert "Secret router-key, key apiKey" in condition.message
    assert "not found by 1 of 2 proxy pods (a)" in condition.message


def test_keys_read_everywhere_or_none_referenced_are_resolved() -> None:
    resolved = resolved_refs(REF, 1, [report("a", key=KeyResolution.RESOLVED)])
    assert resolved is not None
    assert (resolved.status.value, resolved.reason) == ("True", "Resolved")
    unkeyed = resolved_refs({}, 1, [])
    assert unkeyed is not None
    assert unkeyed.message == "No Secret is referenced."


def test_nothing_is_said_of_a_key_before_a_pod_reports_on_it() -> None:
    assert resolved_refs(REF, 1, [report("a")]) is None
