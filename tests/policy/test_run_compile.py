"""`run_compile`, the function behind `rolegate compile DIR`: streams and exit status."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

from rolegate_policy.compile import run_compile

from .builders import EXAMPLES


def run(directory: Path) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    return run_compile(directory, stdout, stderr), stdout.getvalue(), stderr.getvalue()


def test_examples_compile_cleanly() -> None:
    status, stdout, stderr = run(EXAMPLES)
    assert status == 0
    document = json.loads(stdout)
    assert set(document) == {"config", "verdicts", "ignored"}
    assert document["config"]["hash"].startswith("sha256:")
    assert stdout.startswith('{\n  "config": {\n')  # pretty, 2-space, keys sorted
    assert stderr.splitlines()[:2] == [
        "✓ AccessGrant rolegate/local-open-access (access.yaml): accepted; 1 subject granted "
        "roles *",
        "✓ ProviderPolicy rolegate/sim-router (providers.yaml): accepted; 2 models on 5 "
        "machines (Aggregator dialect)",
    ]
    # One line per role beneath its table, by role name.
    roles = [line for line in stderr.splitlines() if line.startswith("  role ")]
    assert [line.split(":")[0] for line in roles] == [
        "  role rolegate/agents agent",
        "  role rolegate/agents batch",
        "  role rolegate/agents reflex",
    ]
    assert "ruling Auto → Only (Auto: Unwatched and patience 4s is under the 10s" in roles[2]
    assert "delivery Auto → Buffered (Auto: Unwatched, so the answer is held until" in roles[2]
    assert roles[0].endswith("; models qwen/qwen3-coder, deepseek/deepseek-v3")
    assert stderr.rstrip().endswith("3 resources accepted")


def test_a_rejection_exits_1_naming_file_resource_and_field(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(
        "apiVersion: rolegate.dev/v1alpha1\nkind: ProviderPolicy\n"
        "metadata: {name: p, namespace: ns}\n"
        "spec:\n  endpoint: http://h/v1\n  dialect: Aggregator\n"
        "  models:\n    - name: m\n      machines:\n"
        "        - {name: a}\n        - {name: b, tokensPerSecond: -1}\n",
        encoding="utf-8",
    )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; "
            "from rolegate_policy.compile import run_compile; "
            "sys.exit(run_compile(Path(sys.argv[1]), sys.stdout, sys.stderr))",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        encoding="utf-8",
        check=False,
        timeout=30,
    )
    assert result.returncode == 1
    assert (
        "✗ ProviderPolicy ns/p (p.yaml): rejected (InvalidSpec): "
        "spec.models[0].machines[1].tokensPerSecond: must be greater than 0"
    ) in result.stderr
    document = json.loads(result.stdout)
    assert document["config"]["providers"] == []
    assert document["verdicts"][0]["errors"] == [
        {
            "field": "spec.models[0].machines[1].tokensPerSecond",
            "message": "must be greater than 0",
        }
    ]


def test_missing_directory_exits_1_with_a_message_and_no_json(tmp_path: Path) -> None:
    status, stdout, stderr = run(tmp_path / "absent")
    assert status == 1
    assert stdout == ""
    assert stderr.startswith("rolegate compile: ")
    assert "absent" in stderr


def test_directory_without_rolegate_resources_exits_1(tmp_path: Path) -> None:
    status, stdout, stderr = run(tmp_path)
    assert status == 1
    assert json.loads(stdout)["verdicts"] == []
    assert "no RoleTable or ProviderPolicy (rolegate.dev) found" in stderr
    assert "no *.yaml or *.yml files" in stderr

    (tmp_path / "s.yaml").write_text("apiVersion: v1\nkind: Secret\nmetadata: {name: s}\n")
    status, _, stderr = run(tmp_path)
    assert status == 1
    assert "1 file(s) read" in stderr
    assert "- v1 Secret s (s.yaml): ignored" in stderr
