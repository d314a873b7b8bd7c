"""Change counters per (provider, model): what lets a reader keep what it derived from a
store (the ledger's beliefs, the scoreboard's scores) until the store changes under it.

`of(provider, model)` grows whenever anything about a machine of that pair changes, and
whenever the whole store changes at once (a new sheet, a restore, the fleet's evidence);
it never goes back, so a reader compares the number it kept with the number now."""

from __future__ import annotations

import math


class Versions:
    __slots__ = ("_all", "_at", "_count", "_pairs")

    def __init__(self) -> None:
        self._count = 0
        # The count at the last change of everything.
        self._all = 0
        self._pairs: dict[tuple[str, str], int] = {}
        # When each pair last changed, on the store's clock (see `changed_at`).
        self._at: dict[tuple[str, str], float] = {}

    def changed(self, provider: str, model: str, at: float) -> None:
        """Something about a machine of (provider, model) changed at `at`."""
        self._count += 1
        pair = (provider, model)
        self._pairs[pair] = self._count
        self._at[pair] = at

    def changed_all(self) -> None:
        """Everything may have changed (a new sheet, a restore, what the fleet said)."""
        self._count += 1
        self._all = self._count

    @property
    def count(self) -> int:
        """Grows with every change of any pair: equal to an earlier reading exactly while
        nothing at all changed."""
        return self._count

    def of(self, provider: str, model: str) -> int:
        """The pair's version: equal to an earlier reading exactly while nothing changed."""
        return max(self._all, self._pairs.get((provider, model), 0))

    def changed_at(self, provider: str, model: str) -> float:
        """When a machine of the pair last changed on its own (-inf: never)."""
        return self._at.get((provider, model), -math.inf)
