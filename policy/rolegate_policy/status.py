"""The status of `RoleTable` and `ProviderPolicy`: one typed vocabulary for every writer
and reader of it.

The operator writes the `Accepted` and `Tripped` conditions and the RoleTable's rulings;
each proxy pod writes its own `PodReport` on a ProviderPolicy (the configuration hash it
serves, whether it could read the API key, its open breakers); the operator reads the
reports back to compute `Tripped`; `crds.py` renders these same models into the CRDs'
status schemas. All of them import the models and enums from here, so a field, a scope,
a state or a reason is spelled once.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from rolegate_policy.enums import (
    Delivery,
    Ruling,
)
from rolegate_policy.model import (
    DNS_SUBDOMAIN_PATTERN,
    MAX_ROLES_PER_TABLE,
    ROLE_NAME_PATTERN,
    ModelName,
)

# The condition types.
ACCEPTED: Final = "Accepted"
TRIPPED: Final = "Tripped"
PROGRAMMED: Final = "Programmed"
RESOLVED_REFS: Final = "ResolvedRefs"

# From metav1.Condition (k8s.io/apimachinery/pkg/apis/meta/v1/types.go).
CONDITION_TYPE_PATTERN: Final = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
)
CONDITION_REASON_PATTERN: Final = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
CAMEL_CASE_PATTERN: Final = r"^[A-Z][A-Za-z0-9]*$"
MAX_CONDITIONS: Final = 16
MAX_POD_REPORTS: Final = 64
MAX_BREAKERS_PER_REPORT: Final = 256
MAX_QUIRKS_PER_REPORT: Final = 8
MAX_TRIPPED_REASON: Final = 64


class StatusModel(BaseModel):
    """Base of the status models: camelCase on the wire, unknown fields refused."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(StatusModel):
    """One aspect of the resource's state (metav1.Condition)."""

    type: str = Field(
        max_length=316,
        pattern=CONDITION_TYPE_PATTERN,
        description=(
            "Type of the condition, in PascalCase: `Accepted` (the operator compiled the "
            "resource into the proxy configuration), `Programmed` (every live proxy pod "
            "reports serving the configuration that holds this generation) or, for a "
            "ProviderPolicy, `ResolvedRefs` (the proxy pods could read the API key "
            "`apiKeySecretRef` names) and `Tripped` (a breaker has taken the provider or some "
            "of its models out of rotation)."
        ),
    )
    status: ConditionStatus = Field(
        description="Status of the condition: `True`, `False` or `Unknown`.",
    )
    observed_generation: int | None = Field(
        default=None,
        ge=0,
        description=(
            "The `metadata.generation` the condition was computed from; when it is below "
            "the resource's current generation, the condition is out of date."
        ),
    )
    last_transition_time: datetime = Field(
        description="When the condition last changed from one status to another.",
    )
    reason: str = Field(
        min_length=1,
        max_length=1024,
        pattern=CONDITION_REASON_PATTERN,
        description=(
            "Why the condition has its status, as one CamelCase word (e.g. `InvalidSpec`, "
            "`EmptyResponses`); tools may match on it."
        ),
    )
    message: str = Field(
        max_length=32768,
        description="Details for a person, naming the fields or models concerned; may be empty.",
    )


_CONDITIONS_LIST: Final[dict[str, Any]] = {
    "x-kubernetes-list-type": "map",
    "x-kubernetes-list-map-keys": ["type"],
}


class EffectiveRulingStatus(StatusModel):
    """What one role's declared ruling resolved to."""

    role: str = Field(
        min_length=1,
        max_length=63,
        pattern=ROLE_NAME_PATTERN,
        description="Name of the role, as in `spec.roles`.",
    )
    declared: Ruling = Field(
        description="The ruling the spec declares: `Order`, `Only` or `Auto`.",
    )
    effective: Literal[Ruling.ORDER, Ruling.ONLY] = Field(
        description="The ruling the proxy applies: `Order` or `Only` (what `Auto` resolved to).",
    )
    reason: str = Field(
        max_length=1024,
        description="Why the effective ruling is what it is, as a sentence.",
    )
    declared_delivery: Delivery = Field(
        default=Delivery.AUTO,
        description="The delivery the spec declares: `Live`, `Buffered` or `Auto`.",
    )
    delivery: Literal[Delivery.LIVE, Delivery.BUFFERED] = Field(
        default=Delivery.LIVE,
        description=(
            "The delivery the proxy applies: `Live` or `Buffered` (what `Auto` resolved to)."
        ),
    )


MAX_RULINGS_SUMMARY: Final = 256


def rulings_summary(rulings: list[EffectiveRulingStatus]) -> str:
    """`agent Order/Live, batch Only/Buffered`: each role's effective ruling and delivery,
    for `kubectl get roletables` (cut short with an ellipsis when long)."""
    text = ", ".join(f"{r.role} {r.effective.value}/{r.delivery.value}" for r in rulings)
    return text if len(text) <= MAX_RULINGS_SUMMARY else text[: MAX_RULINGS_SUMMARY - 1] + "…"


def _observed_generation() -> Any:
    """Every kind's `status.observedGeneration`, spelled once."""
    return Field(
        default=None,
        ge=0,
        description="The `metadata.generation` of the spec this status describes.",
    )


class RoleTableStatus(StatusModel):
    """The state of the RoleTable as the operator last observed it. Written by the operator."""

    observed_generation: int | None = _observed_generation()
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=MAX_CONDITIONS,
        json_schema_extra=_CONDITIONS_LIST,
        description=(
            "Conditions of the RoleTable. `Accepted` says whether the operator compiled "
            "it into the proxy configuration, and if not, which field is wrong."
        ),
    )
    role_count: int | None = Field(
        default=None,
        ge=0,
        description="Number of roles in the spec (shown by `kubectl get roletables`).",
    )
    effective_rulings: list[EffectiveRulingStatus] = Field(
        default_factory=list,
        max_length=MAX_ROLES_PER_TABLE,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["role"],
        },
        description=(
            "Each role's effective ruling and delivery, so a reviewer of a change sees what "
            "`Auto` resolved to."
        ),
    )
    rulings: str | None = Field(
        default=None,
        max_length=MAX_RULINGS_SUMMARY,
        description=(
            "Each role's effective ruling and delivery in one line, for `kubectl get` "
            "(e.g. `agent Order/Live, batch Only/Buffered`)."
        ),
    )


# What a breaker takes out of rotation. (Enums here carry comments, not docstrings: a
# docstring would be appended to the description of every field typed by it.)
class Scope(StrEnum):
    PROVIDER = "Provider"
    MODEL = "Model"
    MACHINE = "Machine"


# Where a breaker is in its cycle. Reports list only the ones not `Closed`.
class BreakerPhase(StrEnum):
    OPEN = "Open"
    HALF_OPEN = "HalfOpen"
    CLOSED = "Closed"


# Why a key is out of rotation, as one CamelCase word (the `Tripped` condition's reason,
# SPEC D4).
class TripReason(StrEnum):
    EMPTY_RESPONSES = "EmptyResponses"
    MANGLED_OUTPUT = "MangledOutput"
    MALFORMED_TOOL_CALLS = "MalformedToolCalls"
    UPSTREAM_ERRORS = "UpstreamErrors"
    RATE_LIMITED = "RateLimited"
    AUTH_FAILURE = "AuthFailure"
    QUOTA = "Quota"


class BreakerReport(StatusModel):
    """One breaker that is not closed, as one proxy pod sees it."""

    scope: Scope = Field(
        description=(
            "What the breaker takes out of rotation: the whole `Provider`, one `Model` of "
            "it, or one `Machine` (sub-provider) serving a model."
        ),
    )
    model: ModelName | None = Field(
        default=None,
        description="The upstream model, for scope `Model` and `Machine`.",
    )
    machine: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="The machine, for scope `Machine`.",
    )
    state: Literal[BreakerPhase.OPEN, BreakerPhase.HALF_OPEN] = Field(
        description=(
            "`Open`: out of rotation until the cooldown ends. `HalfOpen`: one re-probe is "
            "allowed; the next clean answer closes the breaker."
        ),
    )
    reason: TripReason = Field(
        description=(
            "Why it tripped, as one CamelCase word: `EmptyResponses`, `MangledOutput`, "
            "`MalformedToolCalls`, `UpstreamErrors`, `RateLimited`, `AuthFailure` or `Quota`."
        ),
    )
    since: datetime = Field(description="When the breaker tripped.")
    until: datetime | None = Field(
        default=None,
        description="When the current cooldown ends and a re-probe is allowed (while `Open`).",
    )


# A way a provider's answers depart from the protocol that rolegate repairs or tolerates,
# noted on the status (SPEC A1, E4): never a fault.
class ProtocolQuirk(StrEnum):
    # Event streams whose Content-Type names no charset (decoded as UTF-8 anyway).
    MISSING_CHARSET = "MissingCharset"
    # Streams that end after their final chunk without `data: [DONE]` (supplied).
    MISSING_DONE = "MissingDone"
    # Streams that send no usage although the client asked for it (rolegate's estimate sent).
    MISSING_USAGE = "MissingUsage"


class QuirkReport(StatusModel):
    """How often one proxy pod has met a protocol quirk of this provider."""

    kind: ProtocolQuirk = Field(
        description=(
            "The quirk: `MissingCharset` (event streams without a charset, decoded as UTF-8 "
            "anyway), `MissingDone` (streams ending after their final chunk without "
            "`data: [DONE]`, which rolegate supplies) or `MissingUsage` (no usage although "
            "the client asked; rolegate sends its own estimate)."
        ),
    )
    count: int = Field(ge=0, description="Answers that showed it since the pod started.")
    last_seen: datetime = Field(description="When the pod last saw it.")


# Whether a proxy pod could read a provider's API key (never the key itself).
class KeyResolution(StrEnum):
    # The key was found, in the environment or in the mounted Secret file, and not empty.
    RESOLVED = "Resolved"
    # Neither the environment variable nor the Secret file holds it (absent or empty).
    NOT_FOUND = "NotFound"
    # The ProviderPolicy names no `apiKeySecretRef`: requests go without a key.
    NOT_REQUIRED = "NotRequired"


# `sha256:` and 64 hex digits: the configuration hash (ProxyConfig.hash).
CONFIG_HASH_PATTERN: Final = r"^sha256:[0-9a-f]{64}$"


class PodReport(StatusModel):
    """What one proxy pod reports on this provider: the configuration it serves, whether
    it could read the API key, and the breakers it holds open. Each pod writes only its
    own entry, so replicas never overwrite each other."""

    pod: str = Field(
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="Name of the proxy pod that wrote this report.",
    )
    observed_at: datetime = Field(
        description=(
            "When the pod last wrote the report; the operator drops reports of pods not "
            "heard from in time."
        ),
    )
    served_hash: str | None = Field(
        default=None,
        max_length=71,
        pattern=CONFIG_HASH_PATTERN,
        description=(
            "Hash of the proxy configuration the pod was serving when it wrote the report "
            "(`sha256:` and 64 hex digits), as its `/readyz` shows it: equal to the "
            "ConfigMap's `rolegate.dev/config-hash` annotation once the pod has loaded the "
            "operator's latest configuration. Sent as soon as the pod loads a new one."
        ),
    )
    api_key: KeyResolution | None = Field(
        default=None,
        description=(
            "Whether the pod could read this provider's API key (never the key): "
            "`Resolved`; `NotFound`, when neither the environment variable nor the mounted "
            "file of the Secret named by `spec.apiKeySecretRef` holds it, or it is empty "
            "(requests to the provider then fail); or `NotRequired`, when the "
            "ProviderPolicy names no `apiKeySecretRef`. Sent as soon as it changes (a "
            "Secret created later is seen at the pod's next key refresh)."
        ),
    )
    breakers: list[BreakerReport] = Field(
        default_factory=list,
        max_length=MAX_BREAKERS_PER_REPORT,
        json_schema_extra={"x-kubernetes-list-type": "atomic"},
        description="The pod's breakers that are open or half-open; empty when all are closed.",
    )
    quirks: list[QuirkReport] = Field(
        default_factory=list,
        max_length=MAX_QUIRKS_PER_REPORT,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["kind"]},
        description=(
            "Protocol quirks the pod has met in this provider's answers: tolerated or "
            "repaired, never counted as faults."
        ),
    )


class ProviderPolicyStatus(StatusModel):
    """The state of the ProviderPolicy: written by the operator (`Accepted`, `Tripped`,
    `tripped`, `trippedReason`) and by each proxy pod (its own entry of `reports`)."""

    observed_generation: int | None = _observed_generation()
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=MAX_CONDITIONS,
        json_schema_extra=_CONDITIONS_LIST,
        description=(
            "Conditions of the ProviderPolicy. `Accepted` says whether the operator "
            "compiled it into the proxy configuration; `Tripped` whether a breaker has "
            "taken the provider or some of its models out of rotation (its reason says "
            "why, its message names what)."
        ),
    )
    tripped: str | None = Field(
        default=None,
        max_length=256,
        description=(
            "Summary of what is tripped, for `kubectl get`: `provider`, or the tripped "
            "models (e.g. `model qwen/qwen3-coder`); empty when nothing is tripped."
        ),
    )
    tripped_reason: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_TRIPPED_REASON,
        pattern=CONDITION_REASON_PATTERN,
        description=(
            "The leading reason while something is tripped (the `Tripped` condition's "
            "reason, e.g. `EmptyResponses`), for `kubectl get`; absent otherwise."
        ),
    )
    reports: list[PodReport] = Field(
        default_factory=list,
        max_length=MAX_POD_REPORTS,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["pod"],
        },
        description=(
            "What each proxy pod reports (the configuration it serves, whether it could "
            "read the API key, its open breakers), one entry per pod, keyed by `pod`. A pod "
            "that shuts down removes its own entry; reports of pods that vanish expire."
        ),
    )


class AccessGrantStatus(StatusModel):
    """The state of the AccessGrant as the operator last observed it. Written by the
    operator."""

    observed_generation: int | None = _observed_generation()
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=MAX_CONDITIONS,
        json_schema_extra=_CONDITIONS_LIST,
        description=(
            "Conditions of the AccessGrant. `Accepted` says whether the operator compiled "
            "it into the proxy configuration (a grant naming a role no accepted RoleTable "
            "defines is refused with `UnknownRole`); `Programmed` whether every proxy pod "
            "serves it."
        ),
    )


class ProxyMemoryStatus(StatusModel):
    """The status of a ProxyMemory: nothing is written to it today (the memory is all in
    the spec, written by its pod)."""

    observed_generation: int | None = _observed_generation()
