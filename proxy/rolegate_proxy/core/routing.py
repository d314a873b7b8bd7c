"""The candidates for a request, in order, and the aggregator body that routes among machines.

A role lists its models in order; each model is a candidate on every accepted provider that
serves it, before the next model is. Which machines of a candidate may be sent to is the
breaker's decision (dispatch.py); this module turns that into the aggregator's `provider`
object following the role's effective ruling (SPEC B4): `Order` ranks the admitted
machines, puts the refused ones in `ignore` (an order is only a ranking the aggregator may
ignore) and lets it fall back; `Only` makes the admitted set a demand. An empty admitted
set is never sent as an empty `only`: the candidate is skipped instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rolegate_policy.config import (
    CompiledModel,
    CompiledProvider,
    CompiledRole,
    ProxyConfig,
)
from rolegate_policy.enums import (
    Dialect,
    Ruling,
)


@dataclass(frozen=True, slots=True)
class Candidate:
    provider: CompiledProvider
    model: CompiledModel

    @property
    def is_aggregator(self) -> bool:
        return self.provider.dialect is Dialect.AGGREGATOR

    def machine_names(self) -> tuple[str, ...]:
        return tuple(machine.name for machine in self.model.machines)


@dataclass(frozen=True, slots=True)
class Attempt:
    """One upstream attempt: a candidate and, for an aggregator, its routing object."""

    provider: CompiledProvider
    model: CompiledModel
    # The aggregator's `provider` routing object, or None for a plain OpenAI server.
    provider_routing: dict[str, Any] | None = None

    @property
    def single_machine(self) -> str | None:
        """The machine that will serve, when only one can (a direct provider)."""
        if self.provider.dialect is Dialect.OPENAI and self.model.machines:
            return self.model.machines[0].name
        return None

    @property
    def is_aggregator(self) -> bool:
        return self.provider.dialect is Dialect.AGGREGATOR


def plan_candidates(role: CompiledRole, config: ProxyConfig) -> list[Candidate]:
    candidates: list[Candidate] = []
    for model_name in role.models:
        for provider in config.providers:
            model = provider.model(model_name)
            if model is not None:
                candidates.append(Candidate(provider, model))
    return candidates


def aggregator_routing(
    role: CompiledRole, admitted: Sequence[str], refused: Sequence[str]
) -> dict[str, Any]:
    if not admitted:
        raise ValueError("an empty admitted set must never become a routing object")
    if role.effective_ruling is Ruling.ONLY:
        return {"only": list(admitted), "allow_fallbacks": False}
    routing: dict[str, Any] = {"order": list(admitted), "allow_fallbacks": True}
    if refused:
        routing["ignore"] = list(refused)
    return routing
