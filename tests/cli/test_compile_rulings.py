"""`rolegate compile --rulings DIR` and the per-role lines of the report, as CI runs them:
the real command in a subprocess, over real manifest files, one version against another."""

from __future__ import annotations

import difflib
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_MANIFESTS = ROOT / "examples" / "manifests"
CLI = [sys.executable, "-m", "rolegate_cli.main"]

# One role: table, role, ruling and delivery as declared->effective, models in order.
RULINGS_LINE = re.compile(
    r"^\S+ \S+ ruling=(Auto|Order|Only)->(Order|Only) "
    r"delivery=(Auto|Live|Buffered)->(Live|Buffered) models=\S+$"
)
AGENT_MODELS = "models: [qwen/qwen3-coder, deepseek/deepseek-v3]"


def compile_(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "compile", *args],
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=60,
        cwd=ROOT,
        check=False,
    )


def copy_examples(directory: Path, *, replace: tuple[str, str] | None = None) -> Path:
    """The example manifests in `directory`, with one text replacement in roles.yaml."""
    directory.mkdir()
    for path in EXAMPLE_MANIFESTS.glob("*.yaml"):
        text = path.read_text(encoding="utf-8")
        if replace is not None and path.name == "roles.yaml":
            assert replace[0] in text, f"{replace[0]!r} is no longer in {path}"
            text = text.replace(replace[0], replace[1])
        (directory / path.name).write_text(text, encoding="utf-8")
    return directory


def changed_lines(before: str, after: str) -> list[str]:
    """The lines a unified diff marks as removed or added, prefixed `-` or `+`."""
    diff = difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
    return [line for line in diff if line[:1] in "+-" and line[:3] not in ("---", "+++")]


def test_rulings_prints_one_line_per_role_and_nothing_else() -> None:
    result = compile_("--rulings", str(EXAMPLE_MANIFESTS))
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        "rolegate/agents agent ruling=Auto->Order delivery=Auto->Live "
        "models=qwen/qwen3-coder,deepseek/deepseek-v3\n"
        "rolegate/agents batch ruling=Order->Order delivery=Auto->Buffered "
        "models=deepseek/deepseek-v3\n"
        "rolegate/agents reflex ruling=Auto->Only delivery=Auto->Buffered "
        "models=qwen/qwen3-coder\n"
    )
    # The report still goes to stderr, for the job log.
    assert result.stderr.splitlines()[-1].startswith("config sha256:")


def test_a_model_order_change_changes_exactly_one_line(tmp_path: Path) -> None:
    base = copy_examples(tmp_path / "base")
    head = copy_examples(
        tmp_path / "head",
        replace=(AGENT_MODELS, "models: [deepseek/deepseek-v3, qwen/qwen3-coder]"),
    )
    before, after = compile_("--rulings", str(base)), compile_("--rulings", str(head))
    assert (before.returncode, after.returncode) == (0, 0), after.stderr

    assert changed_lines(before.stdout, after.stdout) == [
        "-rolegate/agents agent ruling=Auto->Order delivery=Auto->Live "
        "models=qwen/qwen3-coder,deepseek/deepseek-v3",
        "+rolegate/agents agent ruling=Auto->Order delivery=Auto->Live "
        "models=deepseek/deepseek-v3,qwen/qwen3-coder",
    ]
    # The report changes in that role's line and in the hash, nowhere else.
    report = changed_lines(before.stderr, after.stderr)
    assert [line.split(":")[0] for line in report] == [
        "-  role rolegate/agents agent",
        "+  role rolegate/agents agent",
        "-config sha256",
        "+config sha256",
    ]
    assert report[1].endswith("; models deepseek/deepseek-v3, qwen/qwen3-coder")


def test_a_ruling_change_changes_only_that_roles_line(tmp_path: Path) -> None:
    base = copy_examples(tmp_path / "base")
    head = copy_examples(
        tmp_path / "head", replace=("patienceSeconds: 4\n", "patienceSeconds: 12\n")
    )
    before, after = compile_("--rulings", str(base)), compile_("--rulings", str(head))
    assert changed_lines(before.stdout, after.stdout) == [
        "-rolegate/agents reflex ruling=Auto->Only delivery=Auto->Buffered models=qwen/qwen3-coder",
        "+rolegate/agents reflex ruling=Auto->Order delivery=Auto->Buffered "
        "models=qwen/qwen3-coder",
    ]


def test_reordering_the_roles_in_the_yaml_changes_no_line(tmp_path: Path) -> None:
    """Roles are listed by name, not in declared order: callers select a role by name, so
    moving one within `spec.roles` changes nothing they get, and the diff stays empty."""
    roles = (EXAMPLE_MANIFESTS / "roles.yaml").read_text(encoding="utf-8")
    first_role = roles.index("    # Keypress lookups")
    second_role = roles.index("    # A coding agent")
    reflex_block = roles[first_role:second_role]
    base = copy_examples(tmp_path / "base")
    head = copy_examples(tmp_path / "head", replace=(reflex_block, ""))
    (head / "roles.yaml").write_text(
        (head / "roles.yaml").read_text(encoding="utf-8") + reflex_block, encoding="utf-8"
    )
    before, after = compile_("--rulings", str(base)), compile_("--rulings", str(head))
    assert after.returncode == 0, after.stderr
    assert after.stdout == before.stdout


def test_a_rejected_resource_exits_1_and_still_prints_only_role_lines(tmp_path: Path) -> None:
    manifests = copy_examples(tmp_path / "manifests")
    (manifests / "typo.yaml").write_text(
        "apiVersion: rolegate.dev/v1alpha1\nkind: RoleTable\n"
        "metadata: {name: typo, namespace: rolegate}\n"
        "spec:\n  roles:\n    - {name: lookup, models: [qwen/qwen3-codr], patienceSeconds: 4,"
        " visibility: Unwatched}\n",
        encoding="utf-8",
    )
    result = compile_("--rulings", str(manifests))
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert [line.split()[:2] for line in lines] == [
        ["rolegate/agents", "agent"],
        ["rolegate/agents", "batch"],
        ["rolegate/agents", "reflex"],
    ]
    assert all(RULINGS_LINE.match(line) for line in lines), lines
    assert "✗ RoleTable rolegate/typo (typo.yaml): rejected (NoServedModel)" in result.stderr


def test_a_missing_directory_exits_1_with_nothing_on_stdout(tmp_path: Path) -> None:
    result = compile_("--rulings", str(tmp_path / "absent"))
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith("rolegate compile: ")


def test_a_model_name_with_a_space_or_comma_stays_one_field(tmp_path: Path) -> None:
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    (manifests / "all.yaml").write_text(
        "apiVersion: rolegate.dev/v1alpha1\nkind: ProviderPolicy\nmetadata: {name: local}\n"
        "spec:\n  endpoint: http://127.0.0.1:8000/v1\n  dialect: OpenAI\n"
        "  models:\n    - {name: 'llama 3, 8b%'}\n    - {name: plain}\n"
        "---\n"
        "apiVersion: rolegate.dev/v1alpha1\nkind: RoleTable\nmetadata: {name: roles}\n"
        "spec:\n  roles:\n    - {name: r, models: ['llama 3, 8b%', plain], patienceSeconds: 30,"
        " visibility: Watched}\n",
        encoding="utf-8",
    )
    result = compile_("--rulings", str(manifests))
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        "roles r ruling=Auto->Order delivery=Auto->Live models=llama%203%2C%208b%25,plain\n"
    )
