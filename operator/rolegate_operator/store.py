"""The operator's in-memory view of every RoleTable and ProviderPolicy it watches.

Fed by kopf's watch events (`observe`), read by the compile loop (`snapshot`). It keeps
what compile and the status writer need: each object's spec, generation, uid and current
status. Plain code: no kopf, no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

from rolegate_operator.conditions import owned_status_view
from rolegate_policy import API_VERSION, GROUP, VERSION
from rolegate_policy.model import ACCESS_GRANT_KIND, PROVIDER_POLICY_KIND, ROLE_TABLE_KIND

__all__ = [
    "API_VERSION",
    "GROUP",
    "KINDS",
    "VERSION",
    "Kind",
    "ResourceKey",
    "Store",
    "StoredResource",
]


@dataclass(frozen=True)
class Kind:
    """A custom resource kind the operator watches."""

    name: str
    plural: str


KINDS: Final[Mapping[str, Kind]] = MappingProxyType(
    {
        ROLE_TABLE_KIND: Kind(name=ROLE_TABLE_KIND, plural="roletables"),
        PROVIDER_POLICY_KIND: Kind(name=PROVIDER_POLICY_KIND, plural="providerpolicies"),
        ACCESS_GRANT_KIND: Kind(name=ACCESS_GRANT_KIND, plural="accessgrants"),
    }
)


@dataclass(frozen=True, order=True)
class ResourceKey:
    kind: str
    namespace: str
    name: str

    @property
    def display_name(self) -> str:
        return f"{self.namespace}/{self.name}"

    def __str__(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}"


@dataclass(frozen=True)
class StoredResource:
    """One object as last seen on the watch (or returned by one of our own writes)."""

    key: ResourceKey
    uid: str
    generation: int
    resource_version: str
    spec: Mapping[str, Any]
    status: Mapping[str, Any]

    def as_object(self) -> dict[str, Any]:
        """The object in the shape `manifest_from_object` reads."""
        return {
            "apiVersion": API_VERSION,
            "kind": self.key.kind,
            "metadata": {
                "name": self.key.name,
                "namespace": self.key.namespace,
                "generation": self.generation,
                "uid": self.uid,
            },
            "spec": _plain(self.spec),
        }


class Store:
    """Every watched object, keyed by kind, namespace and name."""

    def __init__(self) -> None:
        self._objects: dict[ResourceKey, StoredResource] = {}
        # uids seen since start (including deleted ones): the initial-sync barrier asks
        # whether the watch has caught up with a listing. Dropped once it has.
        self._seen_uids: set[str] | None = set()

    def __len__(self) -> int:
        return len(self._objects)

    def get(self, key: ResourceKey) -> StoredResource | None:
        return self._objects.get(key)

    def snapshot(self) -> Mapping[ResourceKey, StoredResource]:
        """An immutable copy: later events do not change it."""
        return MappingProxyType(dict(self._objects))

    def observe(self, event_type: str | None, body: Mapping[str, Any]) -> bool:
        """Apply one watch event; True when it changes what the compile loop looks at.

        `event_type` is the watch's `ADDED` / `MODIFIED` / `DELETED`, or None for objects
        from kopf's initial listing. A change only to metadata other than generation and
        uid (labels, annotations, managedFields), or to status fields the operator does
        not own (the proxies' breaker reports), is stored but is not a change.
        """
        resource = _resource_from(body)
        if resource is None:
            return False
        if self._seen_uids is not None:
            self._seen_uids.add(resource.uid)
        previous = self._objects.get(resource.key)
        if event_type == "DELETED":
            if previous is None or previous.uid != resource.uid:
                return False
            del self._objects[resource.key]
            return True
        self._objects[resource.key] = resource
        return previous is None or _differs(previous, resource)

    def record_write(self, body: Mapping[str, Any]) -> None:
        """Take the object a status write returned, so the next compile compares against
        what is now on the server even before the watch delivers it."""
        resource = _resource_from(body)
        if resource is None:
            return
        previous = self._objects.get(resource.key)
        if previous is not None and previous.uid == resource.uid:
            self._objects[resource.key] = resource

    def has_seen(self, uid: str) -> bool:
        """Whether the watch has delivered the object with this uid (present or deleted)."""
        if self._seen_uids is None:
            return any(resource.uid == uid for resource in self._objects.values())
        return uid in self._seen_uids

    def stop_tracking_uids(self) -> None:
        self._seen_uids = None


def _differs(old: StoredResource, new: StoredResource) -> bool:
    return (
        old.uid != new.uid
        or old.generation != new.generation
        or old.spec != new.spec
        or owned_status_view(old.status) != owned_status_view(new.status)
    )


def _resource_from(body: Mapping[str, Any]) -> StoredResource | None:
    kind = body.get("kind")
    metadata = body.get("metadata")
    if kind not in KINDS or not isinstance(metadata, Mapping):
        return None
    name = metadata.get("name")
    namespace = metadata.get("namespace")
    uid = metadata.get("uid")
    if not (isinstance(name, str) and isinstance(namespace, str) and isinstance(uid, str)):
        return None
    generation = metadata.get("generation")
    spec = body.get("spec")
    status = body.get("status")
    return StoredResource(
        key=ResourceKey(kind=str(kind), namespace=namespace, name=name),
        uid=uid,
        generation=generation if isinstance(generation, int) else 0,
        resource_version=str(metadata.get("resourceVersion") or ""),
        spec=_plain(spec) if isinstance(spec, Mapping) else {},
        status=_plain(status) if isinstance(status, Mapping) else {},
    )


def _plain(value: Any) -> Any:
    """Plain dicts and lists all the way down: a copy kopf's later events cannot change."""
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value
