"""Rendering a compile result: JSON for machines, verdict lines for people, and one
plain line per role for diffing two versions.

Roles are listed the same way in the report and in `--rulings`: tables in namespace/name
order, then the table's roles by name. Neither order depends on how the YAML is laid out
(file names, document order, the order of `spec.roles`), just as the configuration hash
does not, so a diff of two versions shows what callers get, not how the files moved.
"""

from __future__ import annotations

import json

from rolegate_policy.config import CompiledRole
from rolegate_policy.model import ROLE_TABLE_KIND
from rolegate_policy.verdicts import CompileResult, EffectiveRuling, ResourceVerdict


def render_json(result: CompileResult) -> str:
    """`{"config", "verdicts", "ignored"}` as pretty JSON (2-space indent, sorted keys,
    UTF-8 kept as is), ending with a newline. Deterministic for a given result."""
    document = {
        "config": result.config.model_dump(mode="json"),
        "verdicts": [verdict.model_dump(mode="json") for verdict in result.verdicts],
        "ignored": [document.model_dump(mode="json") for document in result.ignored],
    }
    return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def format_report(result: CompileResult) -> str:
    """One line per resource (✓ accepted / ✗ rejected), details indented beneath (an
    accepted RoleTable's roles one per line), one line per ignored document, then a
    summary naming the configuration hash."""
    lines: list[str] = []
    for verdict in result.verdicts:
        lines.extend(_verdict_lines(verdict, result))
    for ignored in result.ignored:
        name = f" {ignored.name}" if ignored.name else ""
        lines.append(
            f"- {ignored.api_version} {ignored.kind}{name} ({ignored.source}): ignored, "
            "not a rolegate.dev resource"
        )
    config = result.config
    rejected = len(result.rejected)
    total = _count(len(result.verdicts), "resource")
    outcome = f"{rejected} of {total} rejected" if rejected else f"{total} accepted"
    lines.append(
        f"config {config.hash}: {_count(len(config.providers), 'provider')}, "
        f"{_count(len(config.roles), 'role')}; {outcome}"
    )
    return "\n".join(lines) + "\n"


def format_rulings(result: CompileResult) -> str:
    """`rolegate compile --rulings`: one line per compiled role, nothing else, e.g.

        team-a/roles agent ruling=Auto->Order delivery=Auto->Live models=vendor/a,vendor/b

    Plain space-separated fields for grep, cut and diff: the table, the role, its ruling
    and delivery as declared -> effective, and its models in fallback order, so reordering
    them changes the line. Roles of rejected tables are not compiled and so not listed.
    """
    return "".join(
        f"{table} {ruling.role} ruling={ruling.declared.value}->{ruling.effective.value} "
        f"delivery={ruling.declared_delivery.value}->{ruling.delivery.value} "
        f"models={','.join(_plain(model) for model in role.models)}\n"
        for table, ruling, role in _compiled_roles(result)
    )


def _compiled_roles(result: CompileResult) -> list[tuple[str, EffectiveRuling, CompiledRole]]:
    """(table, ruling, compiled role) for every role in the configuration, in the order
    the module docstring gives: verdicts come sorted by namespace/name already."""
    return [
        (verdict.display_name, ruling, role)
        for verdict in result.verdicts
        if verdict.accepted and verdict.kind == ROLE_TABLE_KIND
        for ruling, role in _table_roles(verdict, result)
    ]


def _table_roles(
    verdict: ResourceVerdict, result: CompileResult
) -> list[tuple[EffectiveRuling, CompiledRole]]:
    """An accepted RoleTable's roles by name, each with what it compiled to: the ruling
    carries what was declared, the compiled role the models that are actually served."""
    pairs: list[tuple[EffectiveRuling, CompiledRole]] = []
    for ruling in sorted(verdict.effective_rulings, key=lambda ruling: ruling.role):
        role = result.config.role(ruling.role)
        # Every role of an accepted table is compiled; None is for the type checker.
        if role is not None:
            pairs.append((ruling, role))
    return pairs


def _plain(model: str) -> str:
    """A model name as one field of a plain line: a name may hold spaces or commas (only
    its ends are trimmed), so those, `%` and anything unprintable are %-escaped as in URLs."""
    return "".join(
        char
        if char.isprintable() and not char.isspace() and char not in ",%"
        else "".join(f"%{byte:02X}" for byte in char.encode("utf-8"))
        for char in model
    )


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def _verdict_lines(verdict: ResourceVerdict, result: CompileResult) -> list[str]:
    if verdict.kind is None and verdict.name is None:
        subject = verdict.source
    else:
        subject = f"{verdict.kind or '<no kind>'} {verdict.display_name} ({verdict.source})"
    if verdict.accepted and verdict.kind == ROLE_TABLE_KIND:
        lines = [f"✓ {subject}: accepted; {_count(len(verdict.effective_rulings), 'role')}"]
        lines.extend(
            _role_line(verdict.display_name, ruling, role)
            for ruling, role in _table_roles(verdict, result)
        )
    elif verdict.accepted:
        # The verdict message reads "Accepted: <summary>." (plus warnings, listed below).
        summary = verdict.message.removeprefix("Accepted: ").split("; ")[0].rstrip(".")
        lines = [f"✓ {subject}: accepted; {summary}"]
    else:
        head = f"✗ {subject}: rejected ({verdict.reason.value})"
        if len(verdict.errors) == 1:
            lines = [f"{head}: {verdict.errors[0]}"]
        else:
            lines = [f"{head}:"] + [f"    {error}" for error in verdict.errors]
    lines.extend(f"  ! {warning}" for warning in verdict.warnings)
    return lines


def _role_line(table: str, ruling: EffectiveRuling, role: CompiledRole) -> str:
    """One role of an accepted table, whole on one line so that a diff of two reports
    shows a changed role as one changed line: each resolution with its reason, then the
    models that serve it in fallback order."""
    return (
        f"  role {table} {ruling.role}: "
        f"ruling {ruling.declared.value} → {ruling.effective.value} ({ruling.reason}); "
        f"delivery {ruling.declared_delivery.value} → {ruling.delivery.value} "
        f"({ruling.delivery_reason}); models {', '.join(role.models)}"
    )
