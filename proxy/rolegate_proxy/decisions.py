"""What the proxy decided for a request and why (SPEC A9, C8): routing metadata only.

Every candidate of a request is noted with what happened to it: sent (and how that
ended), or skipped and why (a breaker, a rate limit, the role's patience, a request fault
that made the rest pointless). Never any prompt or completion text. Kept in a bounded
in-memory log; a later endpoint serves it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum


class Action(StrEnum):
    SENT = "sent"
    SKIPPED = "skipped"


@dataclass(frozen=True, slots=True)
class CandidateNote:
    provider: str
    model: str
    machine: str | None
    action: Action
    reason: str


@dataclass(slots=True)
class Decision:
    request_id: str
    role: str
    ruling: str
    started_at: float
    notes: list[CandidateNote] = field(default_factory=list)
    served_provider: str | None = None
    served_model: str | None = None
    served_machine: str | None = None
    attempts: int = 0
    outcome: str = "pending"

    def skip(self, provider: str, model: str, machine: str | None, reason: str) -> None:
        self.notes.append(CandidateNote(provider, model, machine, Action.SKIPPED, reason))

    def sent(self, provider: str, model: str, machine: str | None, result: str) -> None:
        self.attempts += 1
        self.notes.append(CandidateNote(provider, model, machine, Action.SENT, result))

    def skipped_reasons(self) -> list[str]:
        return [
            f"{note.provider}/{note.model}"
            + (f"@{note.machine}" if note.machine else "")
            + f": {note.reason}"
            for note in self.notes
            if note.action is Action.SKIPPED
        ]


class DecisionLog:
    """The most recent decisions; appending is O(1) and the oldest fall off."""

    def __init__(self, maxlen: int = 2000) -> None:
        self._items: deque[Decision] = deque(maxlen=maxlen)

    def append(self, decision: Decision) -> None:
        self._items.append(decision)

    def recent(self) -> list[Decision]:
        return list(self._items)
