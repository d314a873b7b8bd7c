"""What one client request remembers of where not to go again (SPEC B9).

Every choice inside a request (a retry, a race's rival, a move, a rescue, the next
candidate, the last resort) reads one `RequestMemory`: the machines this request saw fail,
refuse it, lose a race or be moved away from, each with why, and the models that refused
its body as a request fault. Every arm's end passes through it (`Exchange.record`), so
no path of the request can forget what another saw.

Two exceptions, both narrow:

* The same model may be retried per the role's retry settings for a transient fault
  (`retriable`): the exchange's retry loop may go back to a machine whose only mark here
  is such a fault, when it has nothing narrower to avoid (a direct provider's one machine,
  a 429 whose Retry-After it waited out). No other path may.
* A request fault is about a body. The plain body is never resent to a model that refused
  it. A continuation (the request plus the text delivered, as a partial assistant
  message) is a different body, so a refusal of the plain body blocks it only for context
  length: a continuation is the same prompt and more, and can only be longer. A
  continuation refused as a request fault (a machine that will not take a prefilled
  assistant message) keeps that machine from every later continuation of the request,
  never from the plain body it did not refuse, nor the model from it.

Routing metadata only: names, causes and our own words; never text of the request.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from ..core.arm_end import ArmEnd, Cause, RequestFault
from ..core.beliefs import MachineKey

# Causes worth another attempt at the same machine: the upstream failed this once, not
# for the request (a timeout would spend the patience again).
TRANSIENT: Final = frozenset(
    {Cause.HTTP_ERROR, Cause.REFUSED, Cause.CUT, Cause.IN_BAND_ERROR, Cause.MALFORMED}
)
# Ends that say nothing against the machine: it answered, the client or a shutdown ended
# the request, or our own pooled connection was stale (charged to nobody).
_FORGOTTEN: Final = frozenset(
    {Cause.ANSWERED, Cause.CLIENT_LEFT, Cause.SHUTDOWN, Cause.STALE_CONNECTION}
)


class Why(StrEnum):
    """Why a machine is not chosen again by this request."""

    FAILED = "failed earlier in this request"
    REFUSED = "refused this request"
    LOST_RACE = "lost a race earlier in this request"
    MOVED_FROM = "was moved away from earlier in this request"
    REFUSED_CONTINUATION = "refused to continue a partial answer earlier in this request"


_WHY_OF: Final = {
    Cause.REJECTED: Why.REFUSED,
    Cause.RACE_LOST: Why.LOST_RACE,
    Cause.MOVED: Why.MOVED_FROM,
}


@dataclass(slots=True)
class Mark:
    """What this request saw of one machine: why it is avoided (the first reason), and
    whether every end it saw there was a transient fault (so a retry may go back)."""

    why: Why
    retriable: bool


@dataclass(slots=True)
class RequestMemory:
    machines: dict[MachineKey, Mark] = field(default_factory=dict)
    # Models that refused the plain body, and how (any provider: SPEC E4, never resent
    # unchanged to the same model).
    bodies: dict[str, RequestFault] = field(default_factory=dict)
    # Machines that refused a continuation (a prefilled assistant message): never sent
    # another, but free to take the plain body, which they did not refuse.
    continuations: set[MachineKey] = field(default_factory=set)

    def note(self, end: ArmEnd, *, continuation: bool = False) -> None:
        """One arm's end: its machine remembered unless nothing in it speaks against the
        machine; a request fault of the plain body remembered against its model."""
        if end.cause in _FORGOTTEN or end.machine is None:
            return
        key = MachineKey(end.provider, end.model, end.machine)
        if continuation and end.cause is Cause.REJECTED:
            self.continuations.add(key)
            return
        transient = end.cause in TRANSIENT
        mark = self.machines.get(key)
        if mark is None:
            self.machines[key] = Mark(_WHY_OF.get(end.cause, Why.FAILED), transient)
        else:
            mark.retriable = mark.retriable and transient
        fault = end.request_fault if end.cause is Cause.REJECTED else None
        if fault is not None and not continuation:
            self.bodies.setdefault(end.model, fault)

    def why(self, key: MachineKey, *, continuation: bool = False) -> Why | None:
        """Why `key` is not chosen again (None: it may be); `continuation`: for a
        continuation, which a machine that refused one is not sent again either."""
        mark = self.machines.get(key)
        if mark is not None:
            return mark.why
        if continuation and key in self.continuations:
            return Why.REFUSED_CONTINUATION
        return None

    def retriable(self, key: MachineKey) -> bool:
        """All this request saw of `key` was transient faults: a retry may go back to it."""
        mark = self.machines.get(key)
        return mark is not None and mark.retriable

    def avoided(
        self, provider: str, model: str, *, retrying: MachineKey | None = None
    ) -> set[MachineKey]:
        """The machines of (provider, model) this request does not choose again; `retrying`:
        the one a retry goes back to after a transient fault, left out when that is all
        this request saw of it."""
        found: set[MachineKey] = set()
        for key, mark in self.machines.items():
            if key.provider != provider or key.model != model:
                continue
            if key == retrying and mark.retriable:
                continue
            found.add(key)
        return found

    def all_avoided(self, *, continuation: bool = False) -> frozenset[MachineKey]:
        """Every machine this request does not choose again (`continuation`: for a
        continuation, with those that refused one)."""
        if continuation:
            return frozenset((*self.machines, *self.continuations))
        return frozenset(self.machines)

    def without(self, keys: Iterable[MachineKey]) -> list[MachineKey]:
        """`keys` less the machines this request does not choose again, in order."""
        return [key for key in keys if key not in self.machines]

    def body_refused(self, model: str, *, continuation: bool = False) -> RequestFault | None:
        """How `model` refused this request's plain body, when sending it `continuation`
        (or the plain body again) would repeat that refusal; None: it may be sent."""
        fault = self.bodies.get(model)
        if fault is None:
            return None
        if continuation and fault is not RequestFault.CONTEXT_LENGTH:
            return None
        return fault
