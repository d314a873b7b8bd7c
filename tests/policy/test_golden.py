"""Golden tests: each `golden/<case>/input/` directory compiles to exactly the stored
`expected.json` (stdout of `rolegate compile`) and `expected-report.txt` (stderr).

Regenerate after an intended change with `ROLEGATE_UPDATE_GOLDEN=1 pytest tests/policy`,
then read the diff: it is the change in behaviour.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from rolegate_policy.compile import run_compile
from rolegate_policy.config import (
    ProxyConfig,
)

from .builders import GOLDEN, PLANTED_SECRET

CASES = sorted(path.name for path in GOLDEN.iterdir() if path.is_dir())
UPDATE = os.environ.get("ROLEGATE_UPDATE_GOLDEN") == "1"


def _compile(case: str) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    status = run_compile(GOLDEN / case / "input", stdout, stderr)
    return status, stdout.getvalue(), stderr.getvalue()


def _check(path: Path, actual: str) -> None:
    if UPDATE:
        path.write_text(actual, encoding="utf-8")
    assert path.exists(), f"{path} is missing; run with ROLEGATE_UPDATE_GOLDEN=1 to create it"
    expected = path.read_text(encoding="utf-8")
    assert actual == expected, f"{path} differs; if the change is intended, regenerate it"


def test_every_golden_case_is_collected() -> None:
    assert set(CASES) >= {
        "valid_mixed",
        "invalid_among_valid",
        "duplicates",
        "unserved_role",
        "yaml_syntax_error",
        "api_key_in_spec",
        "non_rolegate_kinds",
        "broken_envelopes",
    }


@pytest.mark.parametrize("case", CASES)
def test_golden(case: str) -> None:
    status, stdout, stderr = _compile(case)
    _check(GOLDEN / case / "expected.json", stdout)
    _check(GOLDEN / case / "expected-report.txt", stderr)

    document = json.loads(stdout)
    rejected = [v for v in document["verdicts"] if not v["accepted"]]
    assert status == (1 if rejected or not document["verdicts"] else 0)
    # The configuration inside the output is the one the proxy would load: its hash checks.
    config = ProxyConfig.from_json(json.dumps(document["config"]))
    assert config.hash.startswith("sha256:")


@pytest.mark.parametrize("case", CASES)
def test_no_planted_secret_in_any_output(case: str) -> None:
    _, stdout, stderr = _compile(case)
    assert PLANTED_SECRET not in stdout
    assert PLANTED_SECRET not in stderr
    assert "sk-" not in stdout + stderr


def test_secrets_were_actually_planted() -> None:
    """Guards the test above: it proves nothing if no input carries the secret."""
    planted = [
        path
        for path in GOLDEN.glob("*/input/*")
        if PLANTED_SECRET in path.read_text(encoding="utf-8")
    ]
    assert {path.parts[-3] for path in planted} >= {
        "api_key_in_spec",
        "yaml_syntax_error",
        "non_rolegate_kinds",
    }


def test_invalid_resource_leaves_the_others_compiled() -> None:
    _, stdout, _ = _compile("invalid_among_valid")
    document = json.loads(stdout)
    assert [p["name"] for p in document["config"]["providers"]] == ["good"]
    assert [r["name"] for r in document["config"]["roles"]] == ["agent"]
    by_name = {v["name"]: v for v in document["verdicts"]}
    assert by_name["broken"]["reason"] == "InvalidSpec"
    assert [e["field"] for e in by_name["broken"]["errors"]] == [
        "spec.models[0].machines[1].tokensPerSecond",
        "spec.breaker.maxCooldownSeconds",
        "spec.timeout",
    ]
    assert by_name["agents"]["accepted"] is True
    assert by_name["typos"]["accepted"] is False
