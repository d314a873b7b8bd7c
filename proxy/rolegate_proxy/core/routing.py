"""The candidates for a request, in order, and the typed routing decision among machines.

A role lists its models in order; each model is a candidate on every accepted provider that
serves it, before the next model is. Which machines of a candidate may be sent to is the
chooser's decision; a `MachineRouting` says what to ask of a provider that routes among
machines (an aggregator), following the role's effective ruling (SPEC B4): `Order` ranks
the admitted machines, puts the refused ones in `ignore` (an order is only a ranking the
aggregator may ignore) and lets it fall back; `Only` makes the admitted set a demand. An
empty admitted set is never a routing: the candidate is skipped instead. How a routing is
spelled on the wire is the dialect's business (`wire/aggregator.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Final, NamedTuple

from rolegate_policy.config import (
    CompiledModel,
    CompiledProvider,
    CompiledRole,
    ProxyConfig,
)
from rolegate_policy.enums import Dialect, Ruling

# Whether a dialect's provider routes among machines itself (an aggregator), steered by a
# routing in the request, rather than being its one machine: the routing topology half of
# a dialect (the wire protocol is the other half, `wire/dialects.py`).
ROUTES_MACHINES: Final[Mapping[Dialect, bool]] = MappingProxyType(
    {Dialect.OPENAI: False, Dialect.AGGREGATOR: True}
)


def routes_machines(provider: CompiledProvider) -> bool:
    return ROUTES_MACHINES[provider.dialect]


class RoutingKind(StrEnum):
    # A ranking with fallbacks allowed; refused machines ignored.
    ORDER = "order"
    # A demand: these machines and no others.
    ONLY = "only"


@dataclass(frozen=True, slots=True)
class MachineRouting:
    """Which machines of an aggregator to ask for, in what order (never empty)."""

    kind: RoutingKind
    machines: tuple[str, ...]
    ignore: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.machines:
            raise ValueError("an empty admitted set must never become a routing")

    @property
    def allow_fallbacks(self) -> bool:
        return self.kind is RoutingKind.ORDER

    @property
    def head(self) -> str:
        """The machine expected to serve before the answer names one."""
        return self.machines[0]

    @classmethod
    def only(cls, machine: str) -> MachineRouting:
        """Exactly this machine (a race's rival, a continuation)."""
        return cls(RoutingKind.ONLY, (machine,))


# Candidate and Attempt are named tuples: made on every request (a frozen dataclass sets
# each field through object.__setattr__).
class Candidate(NamedTuple):
    provider: CompiledProvider
    model: CompiledModel

    @property
    def is_aggregator(self) -> bool:
        return routes_machines(self.provider)

    def machine_names(self) -> tuple[str, ...]:
        return tuple(machine.name for machine in self.model.machines)


class Attempt(NamedTuple):
    """One upstream attempt: a candidate and, for an aggregator, its routing."""

    provider: CompiledProvider
    model: CompiledModel
    routing: MachineRouting | None = None

    @property
    def single_machine(self) -> str | None:
        """The machine that will serve, when only one can (a direct provider)."""
        if not routes_machines(self.provider) and self.model.machines:
            return self.model.machines[0].name
        return None

    @property
    def is_aggregator(self) -> bool:
        return routes_machines(self.provider)

    @property
    def presumed_machine(self) -> str | None:
        """The machine expected to serve before the answer names one: a direct provider's,
        or the head of an aggregator's routing."""
        if self.single_machine is not None:
            return self.single_machine
        return None if self.routing is None else self.routing.head


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
) -> MachineRouting:
    if role.effective_ruling is Ruling.ONLY:
        return MachineRouting(RoutingKind.ONLY, tuple(admitted))
    return MachineRouting(RoutingKind.ORDER, tuple(admitted), tuple(refused))
