"""What compile says about each resource it was given: accepted or not, and why.

A verdict is the raw material of a resource's `Accepted` condition (SPEC D2): `reason`
is one CamelCase word for `kubectl get`, `message` a sentence for `kubectl describe`,
and `errors` / `warnings` the details behind it, each naming a field path the way the
user wrote it (camelCase, e.g. `spec.roles[1].patienceSeconds`).
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from rolegate_policy.config import (
    ProxyConfig,
)
from rolegate_policy.enums import (
    Delivery,
    Ruling,
)
from rolegate_policy.field_errors import FieldError


class AcceptedReason(StrEnum):
    """The `reason` of a verdict: CamelCase, no hyphens, stable (tools match on it)."""

    ACCEPTED = "Accepted"
    # The document is not a usable resource: YAML syntax error, missing apiVersion/kind/
    # metadata.name, a rolegate.dev kind or version this compiler does not know.
    INVALID_MANIFEST = "InvalidManifest"
    # The spec breaks a field constraint or a cross-field rule.
    INVALID_SPEC = "InvalidSpec"
    # Another resource earlier in (namespace, name) order already claims the name.
    DUPLICATE_NAME = "DuplicateName"
    # A role none of whose models is served by an accepted ProviderPolicy.
    NO_SERVED_MODEL = "NoServedModel"
    # An AccessGrant naming a role no accepted RoleTable defines.
    UNKNOWN_ROLE = "UnknownRole"


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EffectiveRuling(_Record):
    """What a role's declared ruling and delivery resolved to, so a reviewer sees what
    `Auto` means."""

    role: str
    declared: Ruling
    effective: Ruling
    reason: str
    declared_delivery: Delivery = Delivery.AUTO
    delivery: Delivery = Delivery.LIVE
    delivery_reason: str = ""


class ResourceVerdict(_Record):
    """Compile's judgement of one resource (or of one document that failed to load)."""

    source: str
    # None only for a document so broken that kind or name could not be read.
    kind: str | None
    namespace: str | None
    name: str | None
    generation: int | None
    accepted: bool
    reason: AcceptedReason
    message: str
    errors: tuple[FieldError, ...] = ()
    warnings: tuple[str, ...] = ()
    effective_rulings: tuple[EffectiveRuling, ...] = ()

    @property
    def display_name(self) -> str:
        """`namespace/name`, `name`, or a placeholder when the name is unknown."""
        if self.name is None:
            return "<unnamed>"
        return f"{self.namespace}/{self.name}" if self.namespace else self.name

    def sort_key(self) -> tuple[str, str, str, str]:
        return (self.kind or "", self.namespace or "", self.name or "", self.source)


class IgnoredDocument(_Record):
    """A document that is not a rolegate.dev resource: reported, never an error."""

    source: str
    api_version: str
    kind: str
    name: str | None

    def sort_key(self) -> tuple[str, str, str, str]:
        return (self.source, self.api_version, self.kind, self.name or "")


class CompileResult(_Record):
    """The compiled configuration plus one verdict per resource, both deterministic."""

    config: ProxyConfig
    verdicts: tuple[ResourceVerdict, ...]
    ignored: tuple[IgnoredDocument, ...] = ()

    @property
    def rejected(self) -> tuple[ResourceVerdict, ...]:
        return tuple(verdict for verdict in self.verdicts if not verdict.accepted)

    @property
    def all_accepted(self) -> bool:
        return not self.rejected

    def verdict_for(self, kind: str, namespace: str | None, name: str) -> ResourceVerdict | None:
        for verdict in self.verdicts:
            if (verdict.kind, verdict.namespace, verdict.name) == (kind, namespace, name):
                return verdict
        return None


def join_errors(errors: tuple[FieldError, ...], limit: int = 5) -> str:
    """A condition message from field errors: the first few, then a count of the rest.

    Bounded because a Kubernetes condition message is read in `kubectl describe` and a
    spec with a hundred broken rows should not produce a hundred-line condition.
    """
    shown = "; ".join(str(error) for error in errors[:limit])
    rest = len(errors) - limit
    return f"{shown}; and {rest} more" if rest > 0 else shown
