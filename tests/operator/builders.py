"""Objects as the API server returns them (uid, generation, status), for the unit tests."""

from __future__ import annotations

import copy
from typing import Any

from rolegate_operator.store import ResourceKey, Store
from tests.policy.builders import provider, role, role_table

__all__ = ["as_stored", "key_of", "provider", "role", "role_table", "store_with"]


def as_stored(
    obj: dict[str, Any],
    *,
    uid: str | None = None,
    generation: int = 1,
    status: dict[str, Any] | None = None,
    resource_version: str = "1",
) -> dict[str, Any]:
    """`obj` (a builder's manifest) with what the API server adds."""
    stored = copy.deepcopy(obj)
    metadata = stored["metadata"]
    metadata.setdefault("namespace", "llm")
    metadata["uid"] = uid or f"uid-{stored['kind']}-{metadata['name']}"
    metadata["generation"] = generation
    metadata["resourceVersion"] = resource_version
    if status is not None:
        stored["status"] = status
    return stored


def key_of(obj: dict[str, Any]) -> ResourceKey:
    metadata = obj["metadata"]
    return ResourceKey(obj["kind"], metadata.get("namespace", "llm"), metadata["name"])


def store_with(*objects: dict[str, Any]) -> Store:
    store = Store()
    for obj in objects:
        store.observe(None, obj)
    return store
