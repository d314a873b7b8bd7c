"""What the proxy fleet says it serves and whether it can read its keys (SPEC D4).

Each proxy pod's report on a ProviderPolicy carries the hash of the configuration it
serves and whether it could read that provider's API key. From the live reports this
module derives two conditions:

- `Programmed` (both kinds): True when every live proxy pod serves the configuration the
  operator last compiled, and that configuration holds the resource's current generation.
  `Accepted` says the operator took a generation; `Programmed` says the proxies run it.
- `ResolvedRefs` (ProviderPolicy): False with reason `SecretNotFound` when a pod could not
  read the key `spec.apiKeySecretRef` names, naming the Secret and key (the pods report
  only found / not found, never the key).

Pure code: the clock and the reports come in as arguments.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from rolegate_operator.conditions import DesiredCondition
from rolegate_policy.status import (
    PROGRAMMED,
    RESOLVED_REFS,
    ConditionStatus,
    KeyResolution,
    PodReport,
)

# Reasons of `Programmed`.
SERVED: Final = "Served"
ROLLING_OUT: Final = "RollingOut"
NOT_ACCEPTED: Final = "NotAccepted"
NO_PROXY_REPORTS: Final = "NoProxyReports"
# Reasons of `ResolvedRefs`.
RESOLVED: Final = "Resolved"
SECRET_NOT_FOUND: Final = "SecretNotFound"
# How many pod names a message lists before it says "and N more".
_NAMED_PODS: Final = 5


@dataclass(frozen=True)
class Fleet:
    """The live proxy pods and the configuration each serves (None: it did not say)."""

    serving: Mapping[str, str | None]

    @classmethod
    def from_reports(cls, reports: Iterable[PodReport]) -> Fleet:
        """Every pod's newest report wins (a pod reports on every ProviderPolicy)."""
        newest: dict[str, PodReport] = {}
        for report in reports:
            known = newest.get(report.pod)
            if known is None or report.observed_at > known.observed_at:
                newest[report.pod] = report
        return cls({pod: report.served_hash for pod, report in sorted(newest.items())})


def programmed(
    generation: int, served_generation: int | None, config_hash: str, fleet: Fleet
) -> DesiredCondition:
    """Whether the proxies serve `generation` of the resource: the configuration
    `config_hash` (the operator's last compile) holds it when `served_generation` is it."""
    if served_generation != generation:
        held = (
            f"generation {served_generation}, the last accepted, is what the proxies get"
            if served_generation is not None
            else "nothing of it is in the configuration"
        )
        return _programmed(
            ConditionStatus.FALSE,
            NOT_ACCEPTED,
            f"Generation {generation} is not accepted (see Accepted); {held}.",
            generation,
        )
    if not fleet.serving:
        return _programmed(
            ConditionStatus.UNKNOWN,
            NO_PROXY_REPORTS,
            "No proxy pod is reporting, so nothing says which configuration they serve.",
            generation,
        )
    lagging = [pod for pod, served in fleet.serving.items() if served != config_hash]
    total = len(fleet.serving)
    if not lagging:
        return _programmed(
            ConditionStatus.TRUE,
            SERVED,
            f"{_every(total)} configuration {config_hash}, which holds generation {generation}.",
            generation,
        )
    return _programmed(
        ConditionStatus.FALSE,
        ROLLING_OUT,
        f"{total - len(lagging)} of {_pods(total)} serve configuration {config_hash} with "
        f"generation {generation}; waiting for {_names(lagging)}.",
        generation,
    )


def resolved_refs(
    spec: Mapping[str, Any], generation: int, reports: Iterable[PodReport]
) -> DesiredCondition | None:
    """Whether the proxy pods could read the API key; None while no pod said."""
    said = {report.pod: report.api_key for report in reports if report.api_key is not None}
    ref = spec.get("apiKeySecretRef")
    if not isinstance(ref, Mapping):
        return _resolved(ConditionStatus.TRUE, RESOLVED, "No Secret is referenced.", generation)
    if not said:
        return None
    secret = f"Secret {ref.get('name')}, key {ref.get('key')}"
    missing = sorted(pod for pod, found in said.items() if found is KeyResolution.NOT_FOUND)
    if missing:
        return _resolved(
            ConditionStatus.FALSE,
            SECRET_NOT_FOUND,
            f"{secret} (spec.apiKeySecretRef) was not found by {len(missing)} of "
            f"{_pods(len(said))} ({_names(missing)}): requests to this provider fail until "
            "it exists in the ProviderPolicy's namespace and is mounted into the proxies "
            "(chart value proxy.apiKeySecrets); the pods re-read keys every 30 s.",
            generation,
        )
    return _resolved(
        ConditionStatus.TRUE,
        RESOLVED,
        f"Every proxy pod ({len(said)}) read the API key from {secret}.",
        generation,
    )


def _programmed(
    status: ConditionStatus, reason: str, message: str, generation: int
) -> DesiredCondition:
    return DesiredCondition(PROGRAMMED, status, reason, message, generation)


def _resolved(
    status: ConditionStatus, reason: str, message: str, generation: int
) -> DesiredCondition:
    return DesiredCondition(RESOLVED_REFS, status, reason, message, generation)


def _every(count: int) -> str:
    """Who serves it, spelled for one pod or many."""
    return "The 1 proxy pod serves" if count == 1 else f"All {count} proxy pods serve"


def _pods(count: int) -> str:
    return f"{count} proxy pod{'' if count == 1 else 's'}"


def _names(pods: list[str]) -> str:
    shown = ", ".join(pods[:_NAMED_PODS])
    rest = len(pods) - _NAMED_PODS
    return shown if rest <= 0 else f"{shown} and {rest} more"
