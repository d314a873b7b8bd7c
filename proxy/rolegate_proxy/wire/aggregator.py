"""How a routing among machines is spelled to an OpenRouter-style aggregator: the body
field `provider`, with `order` + `ignore` + `allow_fallbacks: true`, or `only` +
`allow_fallbacks: false` (SPEC B4), merged with the caller's own preferences, which may
narrow it and never widen it (SPEC F3). The one place that spelling is written."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.routing import MachineRouting, RoutingKind
from .caller_provider import NO_PREFERENCES, CallerProvider


@dataclass(frozen=True, slots=True)
class Merged:
    """The role's routing narrowed by the caller, and the `provider` field that says so."""

    routing: MachineRouting
    field: dict[str, Any]


@dataclass(frozen=True, slots=True)
class CallerRefusal:
    """The caller's `only`/`ignore` leave none of the machines this attempt admits: the
    attempt is refused, as the role's `Only` with no machine is (never an empty `only`).
    `reason` names the field, never the caller's values."""

    reason: str


def merge(routing: MachineRouting, caller: CallerProvider) -> Merged | CallerRefusal:
    """The role's routing for one attempt, merged with the caller's preferences.

    The machines: the role's admitted ones the caller admits (its `only` intersected, its
    `ignore` removed), in the role's order; the caller's `ignore` joins the role's. The
    ruling stays the role's: `only` stays a demand; `order` keeps fallbacks unless the
    caller declines them (`allow_fallbacks: false` narrows, `true` never loosens an
    `only`), and a caller's `only` is sent as the narrowed machines, so the aggregator's
    fallbacks stay inside them. The caller's narrowing preferences are added as they came.
    Idempotent: merging a merged routing again gives the same."""
    machines = tuple(m for m in routing.machines if caller.admits(m))
    if not machines:
        named = "provider.only" if caller.only is not None else "provider.ignore"
        return CallerRefusal(f"the caller's {named} leaves none of the admitted machines")
    ignore = tuple(dict.fromkeys((*routing.ignore, *caller.ignore)))
    narrowed = MachineRouting(routing.kind, machines, ignore)
    field: dict[str, Any]
    if narrowed.kind is RoutingKind.ONLY:
        field = {"only": list(machines), "allow_fallbacks": False}
    else:
        field = {"order": list(machines), "allow_fallbacks": caller.allow_fallbacks}
        if caller.only is not None:
            field["only"] = list(machines)
        if ignore:
            field["ignore"] = list(ignore)
    field.update(caller.kept)
    return Merged(narrowed, field)


def provider_field(
    routing: MachineRouting, caller: CallerProvider = NO_PREFERENCES
) -> dict[str, Any]:
    """The field to send for an attempt whose routing was merged when it was admitted."""
    merged = merge(routing, caller)
    if isinstance(merged, CallerRefusal):
        raise ValueError("an attempt the caller's preferences refuse is never sent")
    return merged.field
