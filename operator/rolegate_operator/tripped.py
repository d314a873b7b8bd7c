"""The `Tripped` summary of a ProviderPolicy, from its proxy pods' reports (SPEC D4).

Each proxy pod writes its own entry of `status.reports` (its open and half-open breakers
for this provider). This module turns them into what a person reads: a `Tripped`
condition (reason such as `EmptyResponses`, `MangledOutput`, `UpstreamErrors`,
`RateLimited`; a message naming what is tripped and how many pods see it), the short
`status.tripped` summary the printer column shows, the pods whose reports expired (not
heard from within the TTL: they are dropped), and one Event per trip and per recovery.

Pure code: the clock comes in as an argument.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

from pydantic import ValidationError

from rolegate_operator.conditions import (
    DesiredCondition,
    EventNote,
    render_condition,
)
from rolegate_policy.signatures import DEGRADED_REASONS
from rolegate_policy.status import TRIPPED, ConditionStatus, PodReport, Scope, TripReason

NOT_TRIPPED_REASON: Final = "NoOpenBreakers"
MAX_SUMMARY: Final = 256
# When reasons tie, the one a person should hear about first: the degraded-output and
# transport families in the signature table's order of severity, then the exclusions the
# upstream imposed itself.
_REASON_ORDER: Final = (
    *DEGRADED_REASONS,
    TripReason.AUTH_FAILURE,
    TripReason.QUOTA,
    TripReason.RATE_LIMITED,
)
_SCOPE_ORDER: Final = {Scope.PROVIDER: 0, Scope.MODEL: 1, Scope.MACHINE: 2}


@dataclass(frozen=True)
class TrippedKey:
    scope: Scope
    model: str = ""
    machine: str = ""

    def sort_key(self) -> tuple[int, str, str]:
        return (_SCOPE_ORDER[self.scope], self.model, self.machine)

    def describe(self) -> str:
        if self.scope is Scope.PROVIDER:
            return "the whole provider"
        if self.scope is Scope.MODEL:
            return f"model {self.model}"
        return f"machine {self.machine} of {self.model}"

    def short(self) -> str:
        if self.scope is Scope.PROVIDER:
            return "provider"
        if self.scope is Scope.MODEL:
            return self.model
        return f"{self.model}@{self.machine}"


@dataclass(frozen=True)
class TrippedEntry:
    key: TrippedKey
    reason: TripReason
    pods: tuple[str, ...]


@dataclass(frozen=True)
class TrippedView:
    condition: DesiredCondition
    summary: str
    entries: tuple[TrippedEntry, ...]
    live_pods: tuple[str, ...]
    expired_pods: tuple[str, ...]
    # The live reports themselves (what else they say: served hash, key resolution).
    live_reports: tuple[PodReport, ...] = ()

    def keys(self) -> dict[TrippedKey, TrippedEntry]:
        return {entry.key: entry for entry in self.entries}


def read_reports(raw: Sequence[Mapping[str, Any]]) -> tuple[list[PodReport], list[str]]:
    """The reports as the proxy pods wrote them (the shared status models), and the pods
    whose entry could not be read (the API server validated them, so only a schema older
    than this operator could cause one): those are treated as expired."""
    reports: list[PodReport] = []
    unreadable: list[str] = []
    for entry in raw:
        try:
            reports.append(PodReport.model_validate(entry))
        except ValidationError:
            unreadable.append(str(entry.get("pod") or ""))
    return reports, unreadable


def aggregate(
    raw_reports: Sequence[Mapping[str, Any]],
    generation: int,
    now: datetime,
    ttl_seconds: float,
    *,
    listening_since: datetime | None = None,
) -> TrippedView:
    """The view of one ProviderPolicy's reports at `now`. A report expires when its pod was
    not heard from for `ttl_seconds` **while the operator could hear it**: silence before
    `listening_since` (when the operator last regained the API server) does not count, so
    after an outage every pod has a full TTL to report again."""
    reports, expired = read_reports(raw_reports)
    live: list[PodReport] = []
    ttl = timedelta(seconds=ttl_seconds)
    for report in reports:
        heard = report.observed_at
        if listening_since is not None and listening_since > heard:
            heard = listening_since
        if now - heard > ttl:
            expired.append(report.pod)
        else:
            live.append(report)
    pods_by_key: dict[TrippedKey, set[str]] = {}
    reasons_by_key: dict[TrippedKey, Counter[TripReason]] = {}
    for report in live:
        for breaker in report.breakers:
            key = TrippedKey(breaker.scope, breaker.model or "", breaker.machine or "")
            pods_by_key.setdefault(key, set()).add(report.pod)
            reasons_by_key.setdefault(key, Counter())[breaker.reason] += 1
    entries = tuple(
        TrippedEntry(key, _leading(reasons_by_key[key]), tuple(sorted(pods_by_key[key])))
        for key in sorted(pods_by_key, key=TrippedKey.sort_key)
    )
    live_pods = tuple(sorted(report.pod for report in live))
    return TrippedView(
        condition=_condition(entries, live_pods, generation),
        summary=_summary(entries),
        entries=entries,
        live_pods=live_pods,
        expired_pods=tuple(sorted(expired)),
        live_reports=tuple(live),
    )


def _leading(reasons: Counter[TripReason]) -> TripReason:
    return min(reasons, key=lambda r: (-reasons[r], _REASON_ORDER.index(r), r.value))


def _condition(
    entries: Sequence[TrippedEntry], live_pods: Sequence[str], generation: int
) -> DesiredCondition:
    reporting = len(live_pods)
    if not entries:
        return DesiredCondition(
            TRIPPED,
            ConditionStatus.FALSE,
            NOT_TRIPPED_REASON,
            f"No proxy pod reports an open breaker ({reporting} pod"
            f"{'' if reporting == 1 else 's'} reporting).",
            generation,
        )
    overall = Counter(entry.reason for entry in entries)
    parts = [
        f"{entry.key.describe()} ({entry.reason}) on {len(entry.pods)} of {reporting} pods"
        for entry in entries
    ]
    return DesiredCondition(
        TRIPPED,
        ConditionStatus.TRUE,
        _leading(overall),
        "Tripped: " + "; ".join(parts) + ".",
        generation,
    )


def _summary(entries: Sequence[TrippedEntry]) -> str:
    if not entries:
        return ""
    if any(entry.key.scope is Scope.PROVIDER for entry in entries):
        return "provider"
    text = ", ".join(entry.key.short() for entry in entries)
    return text if len(text) <= MAX_SUMMARY else text[: MAX_SUMMARY - 1] + "…"


def events(previous: TrippedView | None, current: TrippedView) -> list[EventNote]:
    """One Warning per newly tripped key, one Normal per recovered key: not per report."""
    before = previous.keys() if previous is not None else {}
    after = current.keys()
    notes: list[EventNote] = []
    for key, entry in after.items():
        if key not in before:
            notes.append(
                EventNote(
                    "Warning",
                    entry.reason,
                    f"Tripped {key.describe()}: {entry.reason}, seen by "
                    f"{len(entry.pods)} of {len(current.live_pods)} proxy pods.",
                )
            )
    for key, entry in before.items():
        if key not in after:
            notes.append(
                EventNote("Normal", "Recovered", f"Recovered {key.describe()} ({entry.reason}).")
            )
    return notes


def condition_body(
    view: TrippedView, existing: Mapping[str, Any] | None, now: datetime
) -> dict[str, Any]:
    return render_condition(view.condition, existing, now)
