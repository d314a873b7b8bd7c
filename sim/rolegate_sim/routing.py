"""OpenRouter-style provider routing: which machines may serve a request, in which order.

The request body's `provider` object uses OpenRouter's field names exactly: `order`,
`only`, `ignore`, `allow_fallbacks`. Other OpenRouter provider fields (`sort`,
`data_collection`, ...) are accepted and not routed on, as a client written for OpenRouter
sends them; they are recorded as they came, so a test can read what the aggregator was
asked. So are the top-level fields with which OpenRouter routes beyond the one model
(`ROUTE_FIELDS`). Machine names match exactly (case-sensitive).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

# Top-level body fields with which OpenRouter routes a request beyond its `model` (model
# fallbacks, routing strategy, prompt transforms, plugins): recorded, never acted on.
ROUTE_FIELDS: Final[tuple[str, ...]] = ("models", "route", "transforms", "plugins")
_ROUTED_ON: Final = frozenset({"order", "only", "ignore", "allow_fallbacks"})


class PreferenceError(ValueError):
    """The `provider` object is malformed; the message names the offending field."""


@dataclass(frozen=True, slots=True)
class ProviderPreferences:
    # None means "not sent", kept apart from an empty list so records show what arrived.
    order: tuple[str, ...] | None = None
    only: tuple[str, ...] | None = None
    ignore: tuple[str, ...] | None = None
    allow_fallbacks: bool | None = None
    # The other fields of the object, as they came (`data_collection`, `zdr`, ...).
    others: tuple[tuple[str, Any], ...] = ()

    def as_record(self) -> dict[str, Any]:
        return {
            "order": None if self.order is None else list(self.order),
            "only": None if self.only is None else list(self.only),
            "ignore": None if self.ignore is None else list(self.ignore),
            "allow_fallbacks": self.allow_fallbacks,
            **dict(self.others),
        }


NO_PREFERENCES = ProviderPreferences()


def parse_preferences(value: object) -> ProviderPreferences:
    if value is None:
        return NO_PREFERENCES
    if not isinstance(value, dict):
        raise PreferenceError("`provider` must be an object")
    allow = value.get("allow_fallbacks")
    if allow is not None and not isinstance(allow, bool):
        raise PreferenceError("`provider.allow_fallbacks` must be a boolean")
    return ProviderPreferences(
        order=_names(value, "order"),
        only=_names(value, "only"),
        ignore=_names(value, "ignore"),
        allow_fallbacks=allow,
        others=tuple((k, v) for k, v in value.items() if k not in _ROUTED_ON),
    )


def route_fields(body: dict[str, Any]) -> dict[str, Any] | None:
    """The `ROUTE_FIELDS` the body carries, as they came; None when it carries none."""
    found = {name: body[name] for name in ROUTE_FIELDS if name in body}
    return found or None


def _names(value: dict[str, Any], field: str) -> tuple[str, ...] | None:
    names = value.get(field)
    if names is None:
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise PreferenceError(f"`provider.{field}` must be a list of provider names")
    return tuple(names)


def preference_list(machines: Sequence[str], prefs: ProviderPreferences) -> list[str]:
    """The machines to try, in order; the first one that is not down serves.

    Eligible machines are the model's machines minus `ignore`, intersected with `only`.
    With `order`: its eligible entries in that order, then (if fallbacks are allowed) the
    other eligible machines in scenario order, so the aggregator may serve from a machine
    the caller never named. Without `order` the default ordering is scenario order and
    `allow_fallbacks: false` keeps only its first eligible machine, OpenRouter's "primary".
    """
    ignored = set(prefs.ignore or ())
    allowed = None if prefs.only is None else set(prefs.only)
    eligible = [m for m in machines if m not in ignored and (allowed is None or m in allowed)]
    fallbacks = prefs.allow_fallbacks is not False
    if prefs.order is None:
        return eligible if fallbacks else eligible[:1]
    eligible_set = set(eligible)
    preferred: list[str] = []
    # Membership in a set: a list test made a 1,000-machine model quadratic (9 ms a request).
    placed: set[str] = set()
    for name in prefs.order:
        if name in eligible_set and name not in placed:
            preferred.append(name)
            placed.add(name)
    if fallbacks:
        preferred.extend(m for m in eligible if m not in placed)
    return preferred
