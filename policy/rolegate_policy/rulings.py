"""How a role's declared fallback ruling resolves (SPEC B4).

`Order` asks an aggregator for a ranking with fallbacks allowed: a slow answer beats no
answer. `Only` demands exactly the admitted machines: a busy pool becomes a refusal.
`Auto` picks `Only` exactly where a slow answer is worth no more than none, which is
when nobody watches the stream (the whole call is dead time) and the deadline is short.
"""

from __future__ import annotations

from rolegate_policy.enums import (
    Ruling,
    Visibility,
)

DECLARED = "declared"


def resolve_ruling(
    declared: Ruling,
    visibility: Visibility,
    patience_seconds: float,
    auto_only_below_seconds: float,
) -> tuple[Ruling, str]:
    """The effective ruling (`Order` or `Only`) and a sentence saying why."""
    if declared is not Ruling.AUTO:
        return declared, DECLARED
    patience = seconds(patience_seconds)
    threshold = seconds(auto_only_below_seconds)
    if visibility is Visibility.WATCHED:
        return Ruling.ORDER, (
            "Auto: Watched, so a person reads the stream and a slow answer beats no answer (Order)"
        )
    if patience_seconds < auto_only_below_seconds:
        return Ruling.ONLY, (
            f"Auto: Unwatched and patience {patience} is under the {threshold} threshold, "
            "so a busy pool becomes a refusal (Only)"
        )
    return Ruling.ORDER, (
        f"Auto: Unwatched but patience {patience} is not under the {threshold} threshold, "
        "so a slow answer beats no answer (Order)"
    )


def seconds(value: float) -> str:
    """`4s`, `2.5s`: compact, and the same on every platform (deterministic output)."""
    return f"{value:g}s"
