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

from rolegate_operator.conditions import Condition, ConditionStatus, EventNote, render_condition

TRIPPED: Final = "Tripped"
NOT_TRIPPED_REASON: Final = "NoOpenBreakers"
MAX_SUMMARY: Final = 256
# When reasons tie, the one a person should hear about first.
_REASON_ORDER: Final = (
    "MangledOutput",
    "EmptyResponses",
    "UpstreamErrors",
    "AuthFailure",
    "Quota",
    "RateLimited",
)


@dataclass(frozen=True, order=True)
class TrippedKey:
    scope: str  # Provider | Model | Machine
    model: str = ""
    machine: str = ""

    def describe(self) -> str:
        if self.scope == "Provider":
            return "the whole provider"
        if self.scope == "Model":
            return f"model {self.model}"
        return f"machine {self.machine} of {self.model}"

    def short(self) -> str:
        if self.scope == "Provider":
            return "provider"
        if self.scope == "Model":
            return self.model
        return f"{self.model}@{self.machine}"


@dataclass(frozen=True)
class TrippedEntry:
    key: TrippedKey
    reason: str
    pods: tuple[str, ...]


@dataclass(frozen=True)
class TrippedView:
    condition: Condition
    summary: str
    entries: tuple[TrippedEntry, ...]
    live_pods: tuple[str, ...]
    expired_pods: tuple[str, ...]

    def keys(self) -> dict[TrippedKey, TrippedEntry]:
        return {entry.key: entry for entry in self.entries}


def parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def aggregate(
    reports: Sequence[Mapping[str, Any]], generation: int, now: datetime, ttl_seconds: float
) -> TrippedView:
    live: list[Mapping[str, Any]] = []
    expired: list[str] = []
    for report in reports:
        pod = str(report.get("pod") or "")
        seen = parse_time(report.get("observedAt"))
        if seen is None or now - seen > timedelta(seconds=ttl_seconds):
            expired.append(pod)
        else:
            live.append(report)
    pods_by_key: dict[TrippedKey, set[str]] = {}
    reasons_by_key: dict[TrippedKey, Counter[str]] = {}
    for report in live:
        for breaker in report.get("breakers") or ():
            if not isinstance(breaker, Mapping):
                continue
            key = TrippedKey(
                str(breaker.get("scope") or "Provider"),
                str(breaker.get("model") or ""),
                str(breaker.get("machine") or ""),
            )
            pods_by_key.setdefault(key, set()).add(str(report.get("pod")))
            reasons_by_key.setdefault(key, Counter())[str(breaker.get("reason") or "Unknown")] += 1
    entries = tuple(
        TrippedEntry(key, _leading(reasons_by_key[key]), tuple(sorted(pods_by_key[key])))
        for key in sorted(pods_by_key)
    )
    live_pods = tuple(sorted(str(r.get("pod")) for r in live))
    return TrippedView(
        condition=_condition(entries, live_pods, generation),
        summary=_summary(entries),
        entries=entries,
        live_pods=live_pods,
        expired_pods=tuple(sorted(expired)),
    )


def _leading(reasons: Counter[str]) -> str:
    return min(
        reasons,
        key=lambda r: (-reasons[r], _REASON_ORDER.index(r) if r in _REASON_ORDER else 99, r),
    )


def _condition(
    entries: Sequence[TrippedEntry], live_pods: Sequence[str], generation: int
) -> Condition:
    reporting = len(live_pods)
    if not entries:
        return Condition(
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
    return Condition(
        TRIPPED,
        ConditionStatus.TRUE,
        _leading(overall),
        "Tripped: " + "; ".join(parts) + ".",
        generation,
    )


def _summary(entries: Sequence[TrippedEntry]) -> str:
    if not entries:
        return ""
    if any(entry.key.scope == "Provider" for entry in entries):
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
