"""How a role's declared fallback ruling (SPEC B4) and delivery (SPEC E5) resolve.

`Order` asks an aggregator for a ranking with fallbacks allowed: a slow answer beats no
answer. `Only` demands exactly the admitted machines: a busy pool becomes a refusal.
`Auto` picks `Only` exactly where a slow answer is worth no more than none, which is
when nobody watches the stream (the whole call is dead time) and the deadline is short.
"""

from __future__ import annotations

from rolegate_policy.enums import (
    Delivery,
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


def resolve_delivery(declared: Delivery, visibility: Visibility) -> tuple[Delivery, str]:
    """The effective delivery (`Live` or `Buffered`) and a sentence saying why: `Auto`
    holds the answer until it is complete and judged exactly when nobody reads it as it
    arrives."""
    if declared is not Delivery.AUTO:
        return declared, DECLARED
    if visibility is Visibility.WATCHED:
        return Delivery.LIVE, "Auto: Watched, so a person reads the answer as it arrives (Live)"
    return Delivery.BUFFERED, (
        "Auto: Unwatched, so the answer is held until complete and judged, and a broken one "
        "is replaced unseen (Buffered)"
    )


def seconds(value: float) -> str:
    """`4s`, `2.5s`: compact, and the same on every platform (deterministic output)."""
    return f"{value:g}s"
