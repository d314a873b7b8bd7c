"""metav1.Condition rules and the owned-status patch: pure, the clock passed in."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from rolegate_operator.conditions import (
    DesiredCondition,
    EventNote,
    OwnedStatus,
    find_condition,
    format_time,
    owned_status_view,
    render_condition,
    status_patch,
    transition_event,
)
from rolegate_policy.status import ConditionStatus

T0 = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)
T1 = T0 + timedelta(minutes=5)


def accepted(
    status: ConditionStatus = ConditionStatus.TRUE,
    reason: str = "Accepted",
    message: str = "Accepted: 1 role (agent → Order).",
    generation: int = 1,
) -> DesiredCondition:
    return DesiredCondition(
        type="Accepted",
        status=status,
        reason=reason,
        message=message,
        observed_generation=generation,
    )


def owned(condition: DesiredCondition, **extra: Any) -> OwnedStatus:
    return OwnedStatus(
        observed_generation=condition.observed_generation, accepted=condition, extra=extra
    )


TRIPPED = {
    "type": "Tripped",
    "status": "True",
    "reason": "EmptyResponses",
    "message": "model qwen/qwen3-coder",
    "lastTransitionTime": "2025-01-01T00:00:00Z",
}


def test_time_is_rfc3339_utc_to_the_second() -> None:
    moment = datetime(2025, 3, 1, 14, 0, 0, 123456, tzinfo=timezone(timedelta(hours=2)))
    assert format_time(moment) == "2025-03-01T12:00:00Z"
    with pytest.raises(ValueError, match="timezone-aware"):
        format_time(datetime(2025, 3, 1))


@pytest.mark.parametrize("reason", ["Invalid-Spec", "invalid spec", "", "1Bad", "Trailing,"])
def test_a_reason_must_be_one_camel_case_word(reason: str) -> None:
    with pytest.raises(ValueError, match="reason"):
        accepted(reason=reason)


@pytest.mark.parametrize("type_", ["accepted", "Has Space", "Has-Hyphen"])
def test_a_type_must_be_pascal_case(type_: str) -> None:
    with pytest.raises(ValueError, match="type"):
        DesiredCondition(type_, ConditionStatus.TRUE, "Accepted", "", 1)


def test_long_messages_are_cut_to_the_api_limit() -> None:
    condition = accepted(message="x" * 40_000)
    assert len(condition.message) == 32768
    assert condition.message.endswith("…")


def test_a_first_condition_takes_the_clock() -> None:
    rendered = render_condition(accepted(), None, T0)
    assert rendered == {
        "type": "Accepted",
        "status": "True",
        "reason": "Accepted",
        "message": "Accepted: 1 role (agent → Order).",
        "observedGeneration": 1,
        "lastTransitionTime": "2025-03-01T12:00:00Z",
    }


def test_transition_time_is_kept_while_the_status_does_not_change() -> None:
    before = render_condition(accepted(), None, T0)
    # A new generation with another message, same status: still the old transition time.
    after = render_condition(accepted(message="Accepted: 2 roles.", generation=2), before, T1)
    assert after["lastTransitionTime"] == "2025-03-01T12:00:00Z"
    assert after["observedGeneration"] == 2


def test_transition_time_moves_when_the_status_changes() -> None:
    before = render_condition(accepted(), None, T0)
    after = render_condition(
        accepted(ConditionStatus.FALSE, "NoServedModel", "spec.roles[0].models: ..."), before, T1
    )
    assert after["lastTransitionTime"] == "2025-03-01T12:05:00Z"


def test_no_patch_when_only_the_clock_moved() -> None:
    desired = owned(accepted(), roleCount=1, effectiveRulings=[{"role": "agent"}])
    first = status_patch({}, desired, T0)
    assert first is not None
    assert status_patch(first, desired, T1) is None


def test_patch_when_an_owned_field_differs() -> None:
    current = status_patch({}, owned(accepted(), roleCount=1), T0)
    assert current is not None
    patch = status_patch(current, owned(accepted(), roleCount=2), T1)
    assert patch is not None
    assert patch["roleCount"] == 2
    # Same status, so the transition time is the first one.
    assert patch["conditions"][0]["lastTransitionTime"] == "2025-03-01T12:00:00Z"


def test_patch_when_the_generation_moved_on() -> None:
    current = status_patch({}, owned(accepted()), T0)
    assert current is not None
    patch = status_patch(current, owned(accepted(generation=2)), T1)
    assert patch is not None
    assert patch["observedGeneration"] == 2
    assert patch["conditions"][0]["observedGeneration"] == 2


def test_the_patch_carries_only_the_accepted_condition_and_owned_fields() -> None:
    """Server-side apply then leaves the proxies' `Tripped`, `tripped` and `reports` alone."""
    current = {
        "conditions": [TRIPPED],
        "tripped": "model qwen/qwen3-coder",
        "reports": [{"pod": "proxy-0"}],
    }
    patch = status_patch(current, owned(accepted()), T0)
    assert patch == {
        "observedGeneration": 1,
        "conditions": [render_condition(accepted(), None, T0)],
    }


def test_conditions_written_by_others_do_not_cause_a_write() -> None:
    mine = status_patch({}, owned(accepted()), T0)
    assert mine is not None
    with_tripped = {**mine, "conditions": [*mine["conditions"], TRIPPED], "tripped": "provider"}
    assert status_patch(with_tripped, owned(accepted()), T1) is None


def test_a_condition_without_transition_time_is_repaired() -> None:
    broken = render_condition(accepted(), None, T0)
    del broken["lastTransitionTime"]
    patch = status_patch({"observedGeneration": 1, "conditions": [broken]}, owned(accepted()), T1)
    assert patch is not None
    assert patch["conditions"][0]["lastTransitionTime"] == "2025-03-01T12:05:00Z"


def test_missing_and_empty_rulings_are_the_same() -> None:
    assert owned_status_view({"effectiveRulings": []}) == owned_status_view({})


def test_find_condition_tolerates_odd_shapes() -> None:
    assert find_condition({}, "Accepted") is None
    assert find_condition({"conditions": "nonsense"}, "Accepted") is None
    assert find_condition({"conditions": [None, TRIPPED]}, "Tripped") == TRIPPED


REJECTED = accepted(ConditionStatus.FALSE, "NoServedModel", "spec.roles[0].models: none served.")
HASH = "sha256:0123abcd"


def test_a_rejection_posts_one_warning() -> None:
    was_accepted = render_condition(accepted(), None, T0)
    assert transition_event(was_accepted, REJECTED, HASH) == EventNote(
        "Warning", "NoServedModel", "spec.roles[0].models: none served."
    )
    assert transition_event(None, REJECTED, HASH) is not None  # rejected on first sight


def test_an_unchanged_rejection_posts_nothing() -> None:
    """A recompile caused by another resource must not repeat the Warning."""
    already = render_condition(REJECTED, None, T0)
    assert transition_event(already, REJECTED, HASH) is None
    # Still rejected at a new generation with the same problem: no new event either.
    again = accepted(**{**_fields(REJECTED), "generation": 2})
    assert transition_event(already, again, HASH) is None


def test_a_different_rejection_posts_again() -> None:
    already = render_condition(REJECTED, None, T0)
    other = accepted(ConditionStatus.FALSE, "DuplicateName", "spec.roles[0].name: taken.")
    assert transition_event(already, other, HASH) == EventNote(
        "Warning", "DuplicateName", "spec.roles[0].name: taken."
    )


def test_recovery_posts_the_conditions_normal_event() -> None:
    rejected = render_condition(REJECTED, None, T0)
    assert transition_event(rejected, accepted(generation=2), HASH) == EventNote(
        "Normal", "Accepted", "Accepted: 1 role (agent → Order)."
    )


def test_a_new_accepted_generation_posts_compiled_with_the_hash_it_is_served_in() -> None:
    was = render_condition(accepted(), None, T0)
    assert transition_event(was, accepted(generation=2), HASH) == EventNote(
        "Normal", "Compiled", "Generation 2 compiled; served in configuration sha256:0123abcd."
    )
    # A new resource accepted on first sight is a successful change too.
    first = transition_event(None, accepted(), HASH)
    assert first is not None
    assert (first.type, first.reason) == ("Normal", "Compiled")
    assert "Generation 1 " in first.message
    # So is one whose verdict was still Unknown.
    unknown = render_condition(accepted(ConditionStatus.UNKNOWN, "Pending", "Waiting."), None, T0)
    assert transition_event(unknown, accepted(), HASH) == first


def test_staying_accepted_at_the_same_generation_posts_nothing() -> None:
    """A recompile caused by another resource (a new hash, even a new message about this
    one) is no change of this resource."""
    was = render_condition(accepted(), None, T0)
    assert transition_event(was, accepted(), HASH) is None
    assert transition_event(was, accepted(), "sha256:other") is None
    reworded = accepted(message="Accepted: 1 role (agent → Order); 2 providers.")
    assert transition_event(was, reworded, HASH) is None


def _fields(condition: DesiredCondition) -> dict[str, Any]:
    return {
        "status": condition.status,
        "reason": condition.reason,
        "message": condition.message,
    }
