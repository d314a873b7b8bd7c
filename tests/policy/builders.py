"""Manifest builders and paths shared by the policy tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

GOLDEN = Path(__file__).parent / "golden"
EXAMPLES = Path(__file__).parents[2] / "examples" / "manifests"
# Planted in golden inputs wherever someone might paste a key; it must appear in no output.
PLANTED_SECRET = "sk-or-v1-DO-NOT-LEAK"


def provider(
    name: str = "router",
    *,
    namespace: str | None = "llm",
    dialect: str = "Aggregator",
    models: dict[str, list[str]] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if namespace:
        metadata["namespace"] = namespace
    served = models if models is not None else {"qwen/qwen3-coder": ["fastco"]}
    return {
        "apiVersion": "rolegate.dev/v1alpha1",
        "kind": "ProviderPolicy",
        "metadata": metadata,
        "spec": {
            "endpoint": "https://router.example/v1",
            "dialect": dialect,
            "models": [
                {"name": model, "machines": [{"name": m} for m in machines]}
                for model, machines in served.items()
            ],
            **spec,
        },
    }


def role(name: str = "agent", models: list[str] | None = None, **fields: Any) -> dict[str, Any]:
    return {
        "name": name,
        "models": ["qwen/qwen3-coder"] if models is None else models,
        "patienceSeconds": 30,
        "visibility": "Watched",
        **fields,
    }


def role_table(
    name: str = "roles", *roles: dict[str, Any], namespace: str | None = "llm", **spec: Any
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if namespace:
        metadata["namespace"] = namespace
    return {
        "apiVersion": "rolegate.dev/v1alpha1",
        "kind": "RoleTable",
        "metadata": metadata,
        "spec": {"roles": list(roles) or [role()], **spec},
    }
