"""How a routing among machines is spelled to an OpenRouter-style aggregator: the body
field `provider`, with `order` + `ignore` + `allow_fallbacks: true`, or `only` +
`allow_fallbacks: false` (SPEC B4). The one place that spelling is written."""

from __future__ import annotations

from typing import Any

from ..core.routing import MachineRouting, RoutingKind


def provider_field(routing: MachineRouting) -> dict[str, Any]:
    if routing.kind is RoutingKind.ONLY:
        return {"only": list(routing.machines), "allow_fallbacks": False}
    field: dict[str, Any] = {"order": list(routing.machines), "allow_fallbacks": True}
    if routing.ignore:
        field["ignore"] = list(routing.ignore)
    return field
