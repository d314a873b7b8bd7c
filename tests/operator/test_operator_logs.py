"""`rolegate --log-format json operator`: every line the operator writes is a JSON object,
kopf's as well as ours, and kopf's lines about a resource name it under `object`."""

from __future__ import annotations

import json
from typing import Any

from tests.policy.builders import provider, role, role_table

from ..waiting import wait_for
from .conftest import Cluster, StartOperator
from .test_operator_e2e import observed


def entries(text: str) -> list[dict[str, Any]]:
    """The log's complete lines, each parsed as JSON (or the test fails)."""
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


def test_json_log_format_covers_kopfs_lines_and_ours(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    cluster.apply(provider("router", namespace=None))
    cluster.apply(role_table("roles", role("agent"), namespace=None))
    # At debug, kopf says what it did with each resource (at info it keeps that quiet).
    operator = start_operator(options=("--log-format", "json", "--log-level", "debug"))
    wait_for(lambda: observed(cluster, "rt", "roles", "True", 1), "accepted", alive=[operator])

    def kopf_named_the_table() -> list[dict[str, Any]]:
        return [
            entry
            for entry in entries(operator.log())
            if entry["logger"].startswith("kopf") and entry.get("object", {}).get("name") == "roles"
        ]

    [*_, about_table] = wait_for(kopf_named_the_table, "kopf's line on the RoleTable")
    assert about_table["object"]["kind"] == "RoleTable"
    assert about_table["object"]["namespace"] == cluster.namespace
    assert operator.stop() == 0
    lines = entries(operator.log())
    assert len(lines) == len(operator.log().splitlines())  # nothing but JSON lines
    for entry in lines:
        assert {"time", "level", "logger", "message"} <= entry.keys(), entry
        assert "settings" not in entry
    loggers = {entry["logger"] for entry in lines}
    assert "rolegate.operator" in loggers
    assert any(name.startswith("kopf.") for name in loggers)
