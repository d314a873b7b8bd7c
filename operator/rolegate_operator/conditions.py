"""`metav1.Condition` rules and the status fields the operator owns.

The operator owns, on every RoleTable and ProviderPolicy, `status.observedGeneration` and
the `Accepted` entry of `status.conditions`; on a RoleTable also `status.roleCount` and
`status.effectiveRulings`. It writes them with server-side apply as the field manager
`rolegate-operator`, sending only those fields, so the `Tripped` condition and the
`tripped` / `reports` fields the proxy pods write under their own field managers are never
touched (the CRDs declare `conditions` a list-map keyed by `type`).

Pure code: the clock comes in as an argument.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from rolegate_policy.status import ACCEPTED, Condition, ConditionStatus

# What metav1.Condition allows (k8s.io/apimachinery/pkg/apis/meta/v1/types.go).
TYPE_PATTERN: Final = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Z][A-Za-z0-9]*$"
)
REASON_PATTERN: Final = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
MAX_MESSAGE: Final = 32768
# Status fields other than conditions the operator owns (RoleTable only).
ROLE_COUNT: Final = "roleCount"
EFFECTIVE_RULINGS: Final = "effectiveRulings"
RULINGS: Final = "rulings"
_OWNED_FIELDS: Final = ("observedGeneration", ROLE_COUNT, EFFECTIVE_RULINGS, RULINGS)


@dataclass(frozen=True)
class DesiredCondition:
    """A condition as the operator wants it, before a transition time is given to it."""

    type: str
    status: ConditionStatus
    reason: str
    message: str
    observed_generation: int

    def __post_init__(self) -> None:
        if not TYPE_PATTERN.match(self.type):
            raise ValueError(f"condition type {self.type!r} is not PascalCase")
        if not REASON_PATTERN.match(self.reason):
            raise ValueError(f"condition reason {self.reason!r} is not one CamelCase word")
        if len(self.message) > MAX_MESSAGE:
            object.__setattr__(self, "message", self.message[: MAX_MESSAGE - 1] + "…")

    def render(self, last_transition_time: str) -> dict[str, Any]:
        """The condition as written: through the status model the CRD is generated from, so
        a condition the API server would refuse fails here, by name."""
        condition = Condition(
            type=self.type,
            status=self.status,
            observed_generation=self.observed_generation,
            last_transition_time=datetime.fromisoformat(last_transition_time),
            reason=self.reason,
            message=self.message,
        )
        rendered = condition.model_dump(mode="json", by_alias=True)
        # The time as it was given (kept verbatim when the status does not change).
        rendered["lastTransitionTime"] = last_transition_time
        return rendered


@dataclass(frozen=True)
class OwnedStatus:
    """Every status field the operator owns on one resource, as it should be."""

    observed_generation: int
    accepted: DesiredCondition
    # RoleTable only: roleCount and effectiveRulings; empty for a ProviderPolicy.
    extra: Mapping[str, Any] = field(default_factory=dict)


def format_time(moment: datetime) -> str:
    """RFC 3339 in UTC to the second, as metav1.Time serialises."""
    if moment.tzinfo is None:
        raise ValueError("a condition time must be timezone-aware")
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def find_condition(status: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    conditions = status.get("conditions")
    if not isinstance(conditions, Sequence) or isinstance(conditions, str):
        return None
    for condition in conditions:
        if isinstance(condition, Mapping) and condition.get("type") == type_:
            return condition
    return None


def render_condition(
    desired: DesiredCondition, existing: Mapping[str, Any] | None, now: datetime
) -> dict[str, Any]:
    """The condition to write: `lastTransitionTime` is kept unless the status changes."""
    kept = existing.get("lastTransitionTime") if existing is not None else None
    if existing is not None and existing.get("status") == desired.status.value and kept:
        return desired.render(str(kept))
    return desired.render(format_time(now))


def owned_status_view(status: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a status the operator owns, without `lastTransitionTime`: two statuses
    with equal views need no write."""
    view = {name: status[name] for name in _OWNED_FIELDS if name in status}
    # Server-side apply of an empty list sometimes leaves `[]` and sometimes no field at
    # all; both mean "no rulings".
    if not view.get(EFFECTIVE_RULINGS):
        view.pop(EFFECTIVE_RULINGS, None)
    accepted = find_condition(status, ACCEPTED)
    if accepted is not None:
        view["accepted"] = {
            key: value for key, value in accepted.items() if key != "lastTransitionTime"
        }
        # A condition without a transition time is malformed: rewriting it repairs it.
        view["acceptedHasTime"] = bool(accepted.get("lastTransitionTime"))
    return view


def status_body(owned: OwnedStatus, existing: Mapping[str, Any], now: datetime) -> dict[str, Any]:
    """The owned fields to apply: `observedGeneration`, the `Accepted` condition (only that
    entry of the list) and the extra fields."""
    accepted = render_condition(owned.accepted, find_condition(existing, ACCEPTED), now)
    return {
        "observedGeneration": owned.observed_generation,
        "conditions": [accepted],
        **{name: value for name, value in owned.extra.items()},
    }


def status_patch(
    current: Mapping[str, Any], owned: OwnedStatus, now: datetime
) -> dict[str, Any] | None:
    """The status to apply, or None when the current status already says all of it
    (compared without `lastTransitionTime`, which must not cause a write)."""
    desired = status_body(owned, current, now)
    if owned_status_view(desired) == owned_status_view(current):
        return None
    return desired


@dataclass(frozen=True)
class EventNote:
    """A Kubernetes Event to post about a resource."""

    type: str  # "Warning" or "Normal"
    reason: str
    message: str


COMPILED_REASON: Final = "Compiled"


def transition_event(
    previous: Mapping[str, Any] | None, desired: DesiredCondition, config_hash: str
) -> EventNote | None:
    """The Event an `Accepted` write deserves, if any, given the condition the resource
    carried before (`previous`) and the hash of the configuration this pass serves:

    - a Warning when a resource becomes rejected, or is rejected for a different reason or
      message;
    - a Normal one (the condition's reason and message) when a rejected resource recovers;
    - a Normal `Compiled` one naming the generation and `config_hash` when a resource is
      accepted at a new generation, having been accepted before or being new.

    Nothing when the verdict and the generation are unchanged, so a recompile caused by
    another resource posts nothing for this one."""
    old_status = previous.get("status") if previous is not None else None
    if desired.status is ConditionStatus.FALSE:
        same = (
            previous is not None
            and old_status == ConditionStatus.FALSE.value
            and previous.get("reason") == desired.reason
            and previous.get("message") == desired.message
        )
        return None if same else EventNote("Warning", desired.reason, desired.message)
    if desired.status is not ConditionStatus.TRUE:
        return None
    if old_status == ConditionStatus.FALSE.value:
        return EventNote("Normal", desired.reason, desired.message)
    if (
        previous is None
        or old_status != ConditionStatus.TRUE.value
        or previous.get("observedGeneration") != desired.observed_generation
    ):
        generation = desired.observed_generation
        return EventNote(
            "Normal",
            COMPILED_REASON,
            f"Generation {generation} compiled; served in configuration {config_hash}.",
        )
    return None
