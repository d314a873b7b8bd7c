"""What every exchange of one proxy process shares, and the headers that say who served."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rolegate_policy.config import CompiledRole, ProxyConfig

from ..core.arm_end import ArmEnd, Cause
from ..core.breaker import Breakers
from ..core.chooser import Chooser
from ..core.routing import Candidate, plan_candidates
from .arms import ArmRun
from .recorder import Recorder
from .upstream import Upstreams


@dataclass(slots=True)
class Services:
    chooser: Chooser
    breakers: Breakers
    recorder: Recorder
    upstreams: Upstreams
    # Uniform on [0, 1): the backoff's jitter.
    draw: Callable[[], float]
    now: Callable[[], float]
    # Who ended an arm cancelled under its request: the client, or the proxy shutting down.
    cancelled_by: Callable[[], Cause]
    # How often a buffered stream's caller hears that the answer is being worked on.
    keepalive_seconds: float
    # Each role's candidates in a configuration (both immutable), by their identities.
    _plans: dict[tuple[int, int], tuple[ProxyConfig, CompiledRole, tuple[Candidate, ...]]] = field(
        default_factory=dict
    )

    def candidates(self, role: CompiledRole, config: ProxyConfig) -> tuple[Candidate, ...]:
        """`plan_candidates`, worked out once per role and configuration: every request,
        and every stream's rate test, asks."""
        found = self._plans.get((id(config), id(role)))
        if found is not None and found[0] is config and found[1] is role:
            return found[2]
        if len(self._plans) >= 256:
            self._plans.clear()  # configurations replaced long ago
        planned = tuple(plan_candidates(role, config))
        self._plans[(id(config), id(role))] = (config, role, planned)
        return planned

    def cancelled(self, run: ArmRun, when: str) -> ArmEnd:
        """`run`, ended by the cancellation of its request `when` (\"before the answer\")."""
        cause = self.cancelled_by()
        who = "the proxy shut down" if cause is Cause.SHUTDOWN else "the client went away"
        return run.end(cause, self.now(), f"{who} {when}")


def served_headers(run: ArmRun, model_named: str | None) -> dict[str, str]:
    """Which provider, model and machine served (names made safe by the wire layer)."""
    headers = {
        "X-Rolegate-Provider": run.attempt.provider.name,
        "X-Rolegate-Model": model_named or run.attempt.model.name,
    }
    if run.machine:
        headers["X-Rolegate-Machine"] = run.machine
    return headers
