"""What a caller may ask of the routing (SPEC F3): its OpenRouter-style `provider` object,
read into typed preferences, and the top-level fields with which an aggregator would route
beyond the role (`models`, `route`, `transforms`, `plugins`).

A caller may narrow the machines its role admits and keep its privacy preferences; it may
never widen the role. So every field of the caller's `provider` object is one of three
kinds (the table in docs/proxy.md, "What a caller may ask for"):

- a narrowing of the machines (`only`, `ignore`, `allow_fallbacks: false`), merged with
  the role's routing per attempt (`aggregator.merge`);
- a preference that only ever narrows what the aggregator may use (`data_collection:
  "deny"`, `zdr`, `enforce_distillable_text`, `require_parameters`, `quantizations`,
  `max_price`), sent as it came; its permissive value (`"allow"`, `false`) is the default
  and is not sent, so it can loosen nothing;
- a ranking (`order`, `sort`, `preferred_min_throughput`, `preferred_max_latency`): the
  role's ranking is rolegate's (beliefs, scores, affinity), so these are checked and not
  sent.

Any other field is refused: rolegate cannot tell whether it narrows or widens. Errors name
the field, never the value the caller sent (SPEC E6).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from rolegate_policy.config import CompiledRole, ProxyConfig
from rolegate_policy.enums import BypassField

from ..core.routing import plan_candidates
from .errors import ProxyError, bad_request

# At most this many names in `only`, `ignore`, `order` or `quantizations`.
MAX_NAMES: Final = 64
MAX_NAME_CHARS: Final = 256

# The preferences that narrow and are sent as they came, when not at their default.
_NARROWING_FLAGS: Final = ("require_parameters", "zdr", "enforce_distillable_text")
# Rankings: checked for shape, not sent (the role ranks).
_RANKINGS: Final = ("order", "sort", "preferred_min_throughput", "preferred_max_latency")
KNOWN_FIELDS: Final = frozenset(
    {
        "only",
        "ignore",
        "allow_fallbacks",
        "data_collection",
        "quantizations",
        "max_price",
        *_NARROWING_FLAGS,
        *_RANKINGS,
    }
)
# A field name safe to repeat in an error: short, plain snake case.
_PLAIN_NAME: Final = re.compile(r"[a-z][a-z0-9_]{0,39}")

_BYPASS_WHY: Final[Mapping[BypassField, str]] = {
    BypassField.MODELS: "would let the aggregator serve the request with models outside role",
    BypassField.ROUTE: "would change how the aggregator routes among models, outside role",
    BypassField.TRANSFORMS: "would let the aggregator rewrite the request, outside role",
    BypassField.PLUGINS: "would put other services in the request's path, outside role",
}


# Every bypass field with its request field's name, for the check every request makes
# (iterating an enum class costs more than the check itself).
_BYPASS_FIELDS: Final = tuple((bypass, bypass.value) for bypass in BypassField)


@dataclass(frozen=True, slots=True)
class CallerProvider:
    """The caller's routing preferences, checked. `only` None: not sent."""

    only: tuple[str, ...] | None = None
    ignore: tuple[str, ...] = ()
    # False: the caller demands no fallback beyond the machines asked for.
    allow_fallbacks: bool = True
    # The narrowing preferences to send, as they came (only those not at their default).
    kept: Mapping[str, Any] = field(default_factory=dict)

    def admits(self, machine: str) -> bool:
        return machine not in self.ignore and (self.only is None or machine in self.only)

    @property
    def narrows_machines(self) -> bool:
        return self.only is not None or bool(self.ignore)


NO_PREFERENCES: Final = CallerProvider()


def parse_caller_provider(value: Any) -> CallerProvider:
    """The body's `provider` value (absent or null: no preferences). Raises a 400 naming
    the field for anything malformed or unknown."""
    if value is None:
        return NO_PREFERENCES
    if not isinstance(value, dict):
        raise bad_request(
            "`provider` must be an object of routing preferences (`only`, `ignore`, "
            "`data_collection`, `zdr`, ...); see what a caller may ask for in the docs.",
            param="provider",
            code="invalid_provider",
        )
    for name in value:
        if name not in KNOWN_FIELDS:
            raise _unknown(name)
    only = _names(value, "only")
    if only is not None and not only:
        raise _invalid(
            "only", "must name at least one machine; leave it out to let the role choose"
        )
    _names(value, "order")
    kept: dict[str, Any] = {}
    allow_fallbacks = _flag(value, "allow_fallbacks")
    for flag in _NARROWING_FLAGS:
        if _flag(value, flag) is True:
            kept[flag] = True
    collection = value.get("data_collection")
    if collection is not None and collection not in ("allow", "deny"):
        raise _invalid("data_collection", 'must be "allow" or "deny"')
    if collection == "deny":
        kept["data_collection"] = "deny"
    quantizations = _names(value, "quantizations")
    if quantizations:
        kept["quantizations"] = list(quantizations)
    max_price = value.get("max_price")
    if max_price is not None:
        if not isinstance(max_price, dict) or not all(
            isinstance(key, str) and _price(price) for key, price in max_price.items()
        ):
            raise _invalid(
                "max_price",
                "must be an object of non-negative prices (`prompt`, `completion`, ...)",
            )
        if max_price:
            kept["max_price"] = dict(max_price)
    sort = value.get("sort")
    if sort is not None and not isinstance(sort, (str, dict)):
        raise _invalid("sort", "must be a string or an object")
    for preferred in ("preferred_min_throughput", "preferred_max_latency"):
        figure = value.get(preferred)
        if figure is not None and not (_price(figure) or isinstance(figure, dict)):
            raise _invalid(preferred, "must be a non-negative number or an object")
    return CallerProvider(
        only=only,
        ignore=_names(value, "ignore") or (),
        allow_fallbacks=allow_fallbacks is not False,
        kept=kept,
    )


def refuse_bypass(body: Mapping[str, Any], role: CompiledRole) -> None:
    """A 400 naming the first top-level field that would route beyond the role, unless the
    role lets its callers send it (`callerMayBypass`)."""
    for bypass, name in _BYPASS_FIELDS:
        if body.get(name) is None or bypass in role.caller_may_bypass:
            continue
        raise bad_request(
            f"`{bypass.value}` {_BYPASS_WHY[bypass]} {role.name}'s; remove it, or ask the "
            f"operator to list `{bypass.value}` in the role's `callerMayBypass`.",
            param=bypass.value,
            code="field_not_allowed",
        )


def role_machines(role: CompiledRole, config: ProxyConfig) -> tuple[str, ...]:
    """Every machine that could serve the role: each of its models' machines on every
    provider serving it, in the role's order, each once."""
    machines: dict[str, None] = {}
    for candidate in plan_candidates(role, config):
        machines.update(dict.fromkeys(candidate.machine_names()))
    return tuple(machines)


def refuse_unreachable(
    caller: CallerProvider, role: CompiledRole, machines: Collection[str]
) -> None:
    """A 400 when the caller's `only`/`ignore` leave none of the role's machines: no
    attempt could ever be sent. (Machines the caller leaves that are refused at the
    moment, for patience or by a breaker, are a refusal of the candidate instead.)"""
    if not caller.narrows_machines or any(caller.admits(m) for m in machines):
        return
    shown = ", ".join(list(machines)[:20]) + (", ..." if len(machines) > 20 else "")
    admits = f"role {role.name} is served by: {shown or '(no machine)'}"
    if caller.only is not None and not any(m in caller.only for m in machines):
        raise bad_request(
            f"`provider.only` names none of the machines {admits}. Name at least one of them, "
            "or leave `provider.only` out.",
            param="provider.only",
            code="no_machine_left",
        )
    raise bad_request(
        f"`provider.ignore` (with `provider.only`) leaves none of the machines {admits}. "
        "Ignore fewer of them.",
        param="provider.ignore",
        code="no_machine_left",
    )


def _names(value: Mapping[str, Any], name: str) -> tuple[str, ...] | None:
    names = value.get(name)
    if names is None:
        return None
    if (
        not isinstance(names, list)
        or len(names) > MAX_NAMES
        or not all(isinstance(n, str) and 0 < len(n) <= MAX_NAME_CHARS for n in names)
    ):
        raise _invalid(name, f"must be an array of at most {MAX_NAMES} names (strings)")
    return tuple(dict.fromkeys(names))


def _flag(value: Mapping[str, Any], name: str) -> bool | None:
    flag = value.get(name)
    if flag is not None and not isinstance(flag, bool):
        raise _invalid(name, "must be true or false")
    return flag


def _price(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def _invalid(name: str, must: str) -> ProxyError:
    return bad_request(
        f"`provider.{name}` {must}.", param=f"provider.{name}", code="invalid_provider"
    )


def _unknown(name: Any) -> ProxyError:
    known = ", ".join(f"`{k}`" for k in sorted(KNOWN_FIELDS))
    plain = isinstance(name, str) and _PLAIN_NAME.fullmatch(name) is not None
    what = f"`provider.{name}`" if plain else "A field of `provider`"
    return bad_request(
        f"{what} is not a routing preference rolegate knows, so it cannot tell whether it "
        f"would widen the role; remove it. Known: {known}.",
        param=f"provider.{name}" if plain else "provider",
        code="invalid_provider",
    )
