"""Affinity (SPEC B3): the machine that last answered for a role leads that role's next
order, as a tie-break among comparable machines and never a reason to stay slow.

The pin is dropped when its machine is refused (and does not come back when the refusal
clears: only a new answer pins again), falls below the top quality tier, or is marked
slow by the ranking (far slower than a machine of equal quality). A machine slow only
because of its queue keeps the pin without leading while its queue lasts.

Pure: nothing here reads a clock.
"""

from __future__ import annotations

from typing import Final

from .beliefs import MachineKey
from .choice import MachineFate, Ranked

# Roles whose affinity pin is remembered at most (roles come from the RoleTable).
MAX_PINS: Final = 1024


class Affinity:
    """Each role's pin: the machine that last answered for it."""

    def __init__(self) -> None:
        self._pins: dict[str, MachineKey] = {}

    def answered(self, role: str, key: MachineKey) -> None:
        """The machine `key` answered for `role`: it leads that role's next order."""
        self._pins.pop(role, None)
        self._pins[role] = key
        while len(self._pins) > MAX_PINS:
            del self._pins[next(iter(self._pins))]

    def pinned(self, role: str) -> MachineKey | None:
        return self._pins.get(role)

    def position(self, role: str, ranked: Ranked) -> int | None:
        """Where the role's pin stands among the ranking's admitted, to lead; None when it
        is on another candidate, or dropped: a refused machine never keeps the pin, nor
        does one the ranking placed below the top tier or marked slow."""
        pin = self._pins.get(role)
        if pin is None or pin.provider != ranked.provider or pin.model != ranked.model:
            return None
        index = ranked.position(pin.machine)
        admitted = ranked.admitted
        if pin.machine in ranked.refused_names() or (
            admitted and (index is None or not leads(admitted[index]))
        ):
            del self._pins[role]
            return None
        return index


def leads(fate: MachineFate) -> bool:
    """Whether a machine may lead by the affinity pin: in the top quality tier, and not far
    slower than a machine of equal quality."""
    placement = fate.placement
    return placement is None or (placement[0] == 0 and not placement[3])


def still_leads(ranked: Ranked, pinned: int | None, queued: list[MachineFate]) -> int | None:
    """Where the pinned machine stands in the order the queues made, when it may still
    lead there; a busy one keeps the pin without leading while another is expected sooner
    (SPEC B8: the pin must not pile requests onto one machine while an equal one has
    room)."""
    if pinned is None:
        return None
    machine = ranked.admitted[pinned].machine
    for index, fate in enumerate(queued):
        if fate.machine == machine:
            waits = fate.queue_seconds > 0 and index > 0
            return index if leads(fate) and not waits else None
    return None
