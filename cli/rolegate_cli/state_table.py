"""The proxy's state snapshot (`GET /v1/rolegate/state`) as a table a person can read.

One row per machine: its operational score with the observations behind it and their
weight (confidence), its semantic score (`-` until an evaluator has judged it, with who
judged), the belief about its speed, and its breaker or exclusion if it has one.
"""

from __future__ import annotations

from typing import Any

COLUMNS = (
    ("machine", "<"),
    ("operational", ">"),
    ("n", ">"),
    ("conf", ">"),
    ("semantic", ">"),
    ("judged by", "<"),
    ("ttft s", ">"),
    ("tok/s", ">"),
    ("breaker", "<"),
)


def render_state(state: dict[str, Any]) -> str:
    beliefs = {_key(b): b for b in state.get("beliefs", [])}
    breakers: dict[tuple[str, str, str], list[str]] = {}
    for breaker in state.get("breakers", []):
        where = (breaker["provider"], breaker.get("model") or "*", breaker.get("machine") or "*")
        breakers.setdefault(where, []).append(
            f"{breaker['state']} ({breaker['reason'] or breaker['cause']})"
        )
    rows = []
    for score in state.get("scores", []):
        key = _key(score)
        op, sem = score["operational"], score["semantic"]
        belief = beliefs.get(key, {})
        tripped = [
            text
            for (provider, model, machine), found in breakers.items()
            if provider == key[0] and model in (key[1], "*") and machine in (key[2], "*")
            for text in found
        ]
        rows.append(
            (
                f"{key[0]}/{key[1]} @ {key[2]}",
                f"{op['score']:.3f}",
                str(op["n"]),
                f"{op['confidence']:.2f}",
                "-" if sem is None else f"{sem['score']:.3f} (n {sem['n']})",
                ", ".join(f"{name} x{count}" for name, count in score["evaluators"].items()) or "-",
                _number(belief.get("expected_ttft_seconds"), "{:.2f}"),
                _number(belief.get("expected_tokens_per_second"), "{:.0f}"),
                "; ".join(tripped) or "closed",
            )
        )
    widths = [
        max(len(title), *(len(row[i]) for row in rows)) if rows else len(title)
        for i, (title, _) in enumerate(COLUMNS)
    ]
    lines = [
        "  ".join(
            f"{title:{align}{w}}" for (title, align), w in zip(COLUMNS, widths, strict=True)
        ).rstrip()
    ]
    lines.append("-" * len(lines[0]))
    for row in rows:
        lines.append(
            "  ".join(
                f"{cell:{align}{w}}"
                for cell, (_, align), w in zip(row, COLUMNS, widths, strict=True)
            ).rstrip()
        )
    channel = state.get("outcomes", {})
    lines.append(
        f"outcomes emitted {channel.get('emitted', 0)}, dropped {channel.get('dropped', 0)}; "
        f"config {state.get('config_hash', '')[:19]}"
    )
    return "\n".join(lines)


def _key(row: dict[str, Any]) -> tuple[str, str, str]:
    return (row["provider"], row["model"], row["machine"])


def _number(value: Any, form: str) -> str:
    return "-" if value is None else form.format(value)
