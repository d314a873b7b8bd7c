"""From the watched objects to the proxy configuration and each resource's status.

Pure: a store snapshot and the operator's memory of each resource's last accepted
version go in; the configuration, the status every resource should carry and the updated
memory come out. `compile_manifests` does the judging; this module adds the
**last-known-good rule** (SPEC D2, "the last good configuration stays in force"):

    A resource whose current generation is rejected, and which was accepted at an
    earlier generation (same uid), is compiled at that earlier generation instead. What it
    contributed keeps serving; its status says `Accepted=False`, names the field to fix,
    and says which generation is still served.

Order matters when several resources change at once: rejections a resource causes by
itself (`InvalidSpec`, `InvalidManifest`) are substituted first and the set is compiled
again, so a RoleTable that was only rejected because a ProviderPolicy it relies on broke
is judged against that policy's last good version rather than being rolled back too.
Only when no such rejection is left are the remaining ones (`NoServedModel`,
`DuplicateName` caused by the resource's own edit) substituted. The substituted set only
grows, so this ends after at most one pass per remembered resource.

A resource never accepted has nothing to fall back to and is left out; a deleted (or
deleted and re-created) resource is forgotten.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from rolegate_operator.conditions import (
    EFFECTIVE_RULINGS,
    ROLE_COUNT,
    RULINGS,
    DesiredCondition,
    OwnedStatus,
)
from rolegate_operator.store import ResourceKey, StoredResource
from rolegate_policy.compile import compile_manifests
from rolegate_policy.config import (
    ProxyConfig,
)
from rolegate_policy.field_errors import shorten
from rolegate_policy.manifests import Manifest, manifest_from_object
from rolegate_policy.model import ROLE_TABLE_KIND
from rolegate_policy.status import (
    ACCEPTED,
    ConditionStatus,
    EffectiveRulingStatus,
    rulings_summary,
)
from rolegate_policy.verdicts import AcceptedReason, CompileResult, EffectiveRuling, ResourceVerdict

# Rejections caused by the resource alone, whatever the other resources say.
INTRINSIC: Final = frozenset({AcceptedReason.INVALID_SPEC, AcceptedReason.INVALID_MANIFEST})
_RULING_REASON_LIMIT: Final = 1024


@dataclass(frozen=True)
class AcceptedVersion:
    """The last version of a resource that compile accepted."""

    uid: str
    generation: int
    spec: Mapping[str, Any]


@dataclass(frozen=True)
class ResourceFate:
    """What became of one resource in this compile."""

    key: ResourceKey
    uid: str
    status: OwnedStatus
    # The generation whose content is in the configuration: the current one, an earlier
    # accepted one (last-known-good), or None when nothing of the resource is served.
    served_generation: int | None

    @property
    def accepted(self) -> bool:
        return self.status.accepted.status is ConditionStatus.TRUE


@dataclass(frozen=True)
class ReconcileResult:
    config: ProxyConfig
    outcomes: Mapping[ResourceKey, ResourceFate]
    # The memory to keep for the next compile.
    accepted: Mapping[ResourceKey, AcceptedVersion]

    @property
    def rejected(self) -> list[ResourceFate]:
        return [outcome for outcome in self.outcomes.values() if not outcome.accepted]


def reconcile(
    snapshot: Mapping[ResourceKey, StoredResource],
    accepted: Mapping[ResourceKey, AcceptedVersion],
) -> ReconcileResult:
    """Compile the snapshot with the last-known-good rule; see the module docstring."""
    remembered = {
        key: version
        for key, version in accepted.items()
        if key in snapshot and snapshot[key].uid == version.uid
    }
    current = {key: _manifest(resource.as_object()) for key, resource in snapshot.items()}
    fallback = {
        key: _manifest(_with_spec(snapshot[key], version)) for key, version in remembered.items()
    }
    # key -> the verdict on its current version that made it fall back.
    substituted: dict[ResourceKey, ResourceVerdict] = {}
    while True:
        result = compile_manifests(
            [fallback[key] if key in substituted else manifest for key, manifest in current.items()]
        )
        verdicts = _by_key(result)
        candidates = {
            key: verdict
            for key, verdict in verdicts.items()
            if not verdict.accepted
            and key not in substituted
            and key in remembered
            and remembered[key].generation != snapshot[key].generation
        }
        chosen = {k: v for k, v in candidates.items() if v.reason in INTRINSIC} or candidates
        if not chosen:
            break
        substituted.update(chosen)

    outcomes: dict[ResourceKey, ResourceFate] = {}
    memory: dict[ResourceKey, AcceptedVersion] = {}
    for key, resource in snapshot.items():
        final = verdicts[key]
        own = substituted.get(key)
        if own is None:
            outcome = _judged(resource, final)
            if final.accepted:
                memory[key] = AcceptedVersion(resource.uid, resource.generation, resource.spec)
            elif key in remembered:
                memory[key] = remembered[key]
        else:
            outcome = _fallen_back(resource, own, final, remembered[key])
            memory[key] = remembered[key]
        outcomes[key] = outcome
    return ReconcileResult(config=result.config, outcomes=outcomes, accepted=memory)


def _judged(resource: StoredResource, verdict: ResourceVerdict) -> ResourceFate:
    if verdict.accepted:
        condition = _condition(resource, ConditionStatus.TRUE, verdict.reason, verdict.message)
        served: int | None = resource.generation
    else:
        message = _sentence(verdict.message) + " Nothing of this resource is served."
        condition = _condition(resource, ConditionStatus.FALSE, verdict.reason, message)
        served = None
    return _outcome(resource, condition, verdict.effective_rulings, served)


def _fallen_back(
    resource: StoredResource,
    own: ResourceVerdict,
    final: ResourceVerdict,
    last: AcceptedVersion,
) -> ResourceFate:
    """A rejected resource compiled at its last accepted generation instead."""
    if final.accepted:
        tail = (
            f" Generation {last.generation}, the last accepted, is still served until "
            "this is fixed."
        )
        served: int | None = last.generation
    else:
        tail = (
            f" Its last accepted generation {last.generation} is rejected too "
            f"({final.reason}: {_sentence(final.message)}), so nothing of this resource "
            "is served."
        )
        served = None
    condition = _condition(
        resource, ConditionStatus.FALSE, own.reason, _sentence(own.message) + tail
    )
    return _outcome(resource, condition, own.effective_rulings, served)


def _outcome(
    resource: StoredResource,
    condition: DesiredCondition,
    rulings: tuple[EffectiveRuling, ...],
    served: int | None,
) -> ResourceFate:
    extra: dict[str, Any] = {}
    if resource.key.kind == ROLE_TABLE_KIND:
        # Both describe the evaluated generation (observedGeneration), like the condition.
        roles = resource.spec.get("roles")
        extra[ROLE_COUNT] = len(roles) if isinstance(roles, list) else 0
        statuses = [
            EffectiveRulingStatus(
                role=ruling.role,
                declared=ruling.declared,
                effective=ruling.effective,
                reason=shorten(ruling.reason, _RULING_REASON_LIMIT),
                declared_delivery=ruling.declared_delivery,
                delivery=ruling.delivery,
            )
            for ruling in rulings
        ]
        extra[EFFECTIVE_RULINGS] = [
            status.model_dump(mode="json", by_alias=True) for status in statuses
        ]
        if statuses:
            extra[RULINGS] = rulings_summary(statuses)
    status = OwnedStatus(observed_generation=resource.generation, accepted=condition, extra=extra)
    return ResourceFate(key=resource.key, uid=resource.uid, status=status, served_generation=served)


def _condition(
    resource: StoredResource, status: ConditionStatus, reason: str, message: str
) -> DesiredCondition:
    return DesiredCondition(
        type=ACCEPTED,
        status=status,
        reason=reason,
        message=message,
        observed_generation=resource.generation,
    )


def _sentence(text: str) -> str:
    text = text.strip()
    return text if text.endswith((".", "!", "?", "…")) else text + "."


def _manifest(obj: Mapping[str, Any]) -> Manifest:
    return manifest_from_object(obj, _source(obj))


def _source(obj: Mapping[str, Any]) -> str:
    metadata = obj["metadata"]
    return f"{metadata['namespace']}/{metadata['name']}"


def _with_spec(resource: StoredResource, version: AcceptedVersion) -> dict[str, Any]:
    obj = resource.as_object()
    obj["metadata"]["generation"] = version.generation
    obj["spec"] = dict(version.spec)
    return obj


def _by_key(result: CompileResult) -> dict[ResourceKey, ResourceVerdict]:
    verdicts: dict[ResourceKey, ResourceVerdict] = {}
    for verdict in result.verdicts:
        if verdict.kind is not None and verdict.namespace is not None and verdict.name is not None:
            verdicts[ResourceKey(verdict.kind, verdict.namespace, verdict.name)] = verdict
    return verdicts
