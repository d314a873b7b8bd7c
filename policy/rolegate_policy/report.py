"""Rendering a compile result: JSON for machines, verdict lines for people."""

from __future__ import annotations

import json

from rolegate_policy.verdicts import CompileResult, ResourceVerdict


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
    """One line per resource (✓ accepted / ✗ rejected), details indented beneath, one
    line per ignored document, then a summary naming the configuration hash."""
    lines: list[str] = []
    for verdict in result.verdicts:
        lines.extend(_verdict_lines(verdict))
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


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def _verdict_lines(verdict: ResourceVerdict) -> list[str]:
    if verdict.kind is None and verdict.name is None:
        subject = verdict.source
    else:
        subject = f"{verdict.kind or '<no kind>'} {verdict.display_name} ({verdict.source})"
    if verdict.accepted:
        # The verdict message reads "Accepted: <summary>." (plus warnings, listed below).
        detail = "; " + verdict.message.removeprefix("Accepted: ").split("; ")[0].rstrip(".")
        if verdict.effective_rulings:
            detail = "; roles: " + ", ".join(
                f"{ruling.role} → {ruling.effective.value} ({ruling.reason}), "
                f"{ruling.delivery.value} ({ruling.delivery_reason})"
                for ruling in verdict.effective_rulings
            )
        lines = [f"✓ {subject}: accepted{detail}"]
    else:
        head = f"✗ {subject}: rejected ({verdict.reason.value})"
        if len(verdict.errors) == 1:
            lines = [f"{head}: {verdict.errors[0]}"]
        else:
            lines = [f"{head}:"] + [f"    {error}" for error in verdict.errors]
    lines.extend(f"  ! {warning}" for warning in verdict.warnings)
    return lines
