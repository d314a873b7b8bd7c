"""Which upstream attempts a request gets, in order (SPEC E1; the chooser later ranks machines).

A role lists its models in order; each model is tried on every accepted provider that
serves it before the next model is tried. For an aggregator the body field `provider`
carries the machines, following the role's effective ruling (SPEC B4): `Order` ranks
them and lets the aggregator fall back, `Only` makes them a demand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rolegate_policy.config import (
    CompiledModel,
    CompiledProvider,
    CompiledRole,
    Dialect,
    ProxyConfig,
    Ruling,
)


@dataclass(frozen=True, slots=True)
class Attempt:
    provider: CompiledProvider
    model: CompiledModel
    # The aggregator's `provider` routing object, or None for a plain OpenAI server.
    provider_routing: dict[str, Any] | None

    @property
    def single_machine(self) -> str | None:
        """The machine that will serve, when only one can (a direct provider)."""
        if self.provider.dialect is Dialect.OPENAI and self.model.machines:
            return self.model.machines[0].name
        return None


def plan_attempts(role: CompiledRole, config: ProxyConfig) -> list[Attempt]:
    attempts: list[Attempt] = []
    for model_name in role.models:
        for provider in config.providers:
            model = provider.model(model_name)
            if model is not None:
                attempts.append(Attempt(provider, model, _routing(provider, model, role)))
    return attempts


def _routing(
    provider: CompiledProvider, model: CompiledModel, role: CompiledRole
) -> dict[str, Any] | None:
    if provider.dialect is not Dialect.AGGREGATOR:
        return None
    machines = [machine.name for machine in model.machines]
    if role.effective_ruling is Ruling.ONLY and machines:
        return {"only": machines, "allow_fallbacks": False}
    return {"order": machines, "allow_fallbacks": True}
