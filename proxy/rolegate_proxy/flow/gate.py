"""Whether an attempt may be sent, and to which machines: the `Gate` of one request.

The chooser picks a candidate's machines (SPEC B1-B4, B8, B9: what this request remembers
is avoided), the caller's `provider.only`/`ignore` narrows them (F3), and the breakers
admit the attempt at the moment it is sent (a half-open key lets exactly one attempt
through: the gate holds that probe, and the exchange gives back whatever it still holds
when the request ends). Every machine or candidate refused is on the decision with why.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from ..core.beliefs import MachineKey
from ..core.breaker import Admission
from ..core.decisions import Decision
from ..core.routing import Attempt, Candidate, MachineRouting
from ..wire.aggregator import CallerRefusal, merge
from ..wire.chat_request import ChatRequest
from .services import Services


@dataclass(slots=True)
class Gate:
    services: Services
    chat: ChatRequest
    decision: Decision
    # Probes taken (a half-open key's one attempt), held until the request ends.
    probes: list[Admission] = field(default_factory=list)

    def choose(self, candidate: Candidate, avoid: Collection[MachineKey]) -> Attempt | None:
        """The chooser's choice of `candidate`'s machines (`avoid` left out), admitted; every
        machine refused is on the decision with why; None when nothing may be sent."""
        services, decision = self.services, self.decision
        provider, model = candidate.provider.name, candidate.model.name
        choice = services.chooser.choose(
            self.chat.role, candidate, services.breakers.exclusion, services.now(),
            avoid=avoid, prompt_tokens=self.chat.prompt_tokens,
        )  # fmt: skip
        for fate in (f for f in choice.fates if not f.admitted):
            machine = fate.machine if candidate.is_aggregator else None
            decision.skip(provider, model, machine, f"{fate.reason}: {fate.detail}")
        if not choice.sendable:
            # Never an empty `only`, never an order of nobody: the candidate is skipped.
            decision.skip(provider, model, None, choice.skip_reason or "no machine admitted")
            return None
        return self.admitted(Attempt(candidate.provider, candidate.model, choice.routing))

    def admitted(self, attempt: Attempt) -> Attempt | None:
        """The caller's narrowing, then the breakers' word at the moment of sending; probes
        taken are held."""
        asked = self._as_the_caller_asks(attempt)
        if asked is None:
            return None
        attempt = asked
        routing = attempt.routing
        machines = () if routing is None else routing.machines
        admission = self.services.breakers.admit_attempt(
            attempt.provider.name, attempt.model.name, machines, self.services.now()
        )
        self.services.recorder.transitions(admission.transitions)
        if admission.probes:
            self.probes.append(admission)
        if not admission.allowed:
            why = admission.exclusion.describe() if admission.exclusion else (
                "every machine's re-probe is in flight"
            )  # fmt: skip
            self.decision.skip(attempt.provider.name, attempt.model.name, None, why)
            return None
        if routing is None or not admission.refused:
            return attempt
        for machine in admission.refused:
            self.decision.skip(
                attempt.provider.name, attempt.model.name, machine, "a re-probe is in flight"
            )
        kept = tuple(m for m in routing.machines if m not in admission.refused)
        narrowed = MachineRouting(routing.kind, kept, (*routing.ignore, *admission.refused))
        return Attempt(attempt.provider, attempt.model, narrowed)

    def _as_the_caller_asks(self, attempt: Attempt) -> Attempt | None:
        """The attempt's machines narrowed by the caller's `provider.only`/`ignore` (SPEC
        F3); when none is left the candidate is skipped, as a role's `Only` with no machine
        is. A direct provider's one machine is narrowed by name like any other."""
        caller = self.chat.caller
        if not caller.narrows_machines:
            return attempt
        refusal: CallerRefusal | None = None
        if attempt.routing is not None:
            merged = merge(attempt.routing, caller)
            if isinstance(merged, CallerRefusal):
                refusal = merged
            else:
                attempt = Attempt(attempt.provider, attempt.model, merged.routing)
        elif attempt.single_machine is not None and not caller.admits(attempt.single_machine):
            field = "provider.only" if caller.only is not None else "provider.ignore"
            refusal = CallerRefusal(f"the caller's {field} leaves out this provider's machine")
        if refusal is None:
            return attempt
        self.decision.skip(attempt.provider.name, attempt.model.name, None, refusal.reason)
        return None
