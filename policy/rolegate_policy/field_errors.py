"""Turning validation failures into field errors a user can act on.

Pydantic reports `('roles', 1, 'patienceSeconds')` and "Input should be greater than 0";
a user wants `spec.roles[1].patienceSeconds: must be greater than 0`. This module does
that translation, and it enforces one rule everywhere: a message never echoes the value
the user wrote (pydantic's `input` is never read), so a credential pasted into the wrong
field cannot leak into a status condition, a log line or the compiled report.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

Loc = tuple[str | int, ...]

# Words of a field name that say someone is putting a credential into the spec. Whole
# words, so `expected_output_tokens` (a misspelled expectedOutputTokens) is not one.
_CREDENTIAL_WORDS = frozenset(
    {
        "apikey",
        "token",
        "secret",
        "password",
        "passwd",
        "credential",
        "credentials",
        "auth",
        "authorization",
        "bearer",
    }
)
_KEY_QUALIFIERS = frozenset({"api", "access", "private", "secret", "auth"})

# Patterns get a plain-language gloss; a bare regular expression is not a fix.
_PATTERN_HINTS: dict[str, str] = {}


class FieldError(BaseModel):
    """One problem, pinned to the field path it is about."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


def register_pattern_hint(pattern: str, hint: str) -> str:
    """Record how to explain `pattern` in an error message; returns the pattern."""
    _PATTERN_HINTS[pattern] = hint
    return pattern


class SpecRuleError(ValueError):
    """A cross-field rule broken, with the paths (relative to the model) it is about.

    Raised from model validators: pydantic would otherwise pin every cross-field error on
    the model itself, and the user would read `spec.breaker: ...` instead of
    `spec.breaker.maxCooldownSeconds: ...`.
    """

    def __init__(self, problems: Sequence[tuple[Loc, str]]) -> None:
        super().__init__("; ".join(message for _, message in problems))
        self.problems = tuple(problems)


def shorten(value: object, limit: int = 48) -> str:
    """A user-supplied name, cut short so a message never carries a long value."""
    text = str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def field_path(prefix: str, loc: Iterable[str | int]) -> str:
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            part = shorten(part, 40)
            path = f"{path}.{part}" if path else part
    return path


def translate(error: ValidationError, model: type[BaseModel], prefix: str) -> list[FieldError]:
    """Every problem in `error`, as field errors with paths under `prefix`."""
    result: list[FieldError] = []
    for detail in error.errors(include_url=False, include_input=False):
        loc: Loc = tuple(detail["loc"])
        ctx: dict[str, Any] = dict(detail.get("ctx") or {})
        rule = ctx.get("error")
        if detail["type"] == "value_error" and isinstance(rule, SpecRuleError):
            for relative, message in rule.problems:
                result.append(FieldError(field=field_path(prefix, loc + relative), message=message))
            continue
        message = _message(detail["type"], str(detail["msg"]), ctx, loc, model)
        result.append(FieldError(field=field_path(prefix, loc), message=message))
    return result


def _number(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _plural(count: object, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


_TYPE_MESSAGES = {
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be a whole number",
    "finite_number": "must be a finite number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "model_type": "must be a mapping of fields",
    "model_attributes_type": "must be a mapping of fields",
    "dict_type": "must be a mapping of fields",
}


def _message(kind: str, default: str, ctx: dict[str, Any], loc: Loc, model: type[BaseModel]) -> str:
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
        return _unknown_field(loc, model)
    if kind in _TYPE_MESSAGES:
        return _TYPE_MESSAGES[kind]
    if kind == "greater_than":
        return f"must be greater than {_number(ctx['gt'])}"
    if kind == "greater_than_equal":
        return f"must be at least {_number(ctx['ge'])}"
    if kind == "less_than":
        return f"must be less than {_number(ctx['lt'])}"
    if kind == "less_than_equal":
        return f"must be at most {_number(ctx['le'])}"
    if kind == "too_short":
        return f"must have at least {_plural(ctx['min_length'], 'item')}"
    if kind == "too_long":
        return (
            f"must have at most {_plural(ctx['max_length'], 'item')} "
            f"(has {ctx.get('actual_length', 'more')})"
        )
    if kind == "string_too_short":
        return (
            "must not be empty"
            if ctx["min_length"] == 1
            else f"must be at least {ctx['min_length']} characters"
        )
    if kind == "string_too_long":
        return f"must be at most {_plural(ctx['max_length'], 'character')}"
    if kind == "string_pattern_mismatch":
        pattern = str(ctx["pattern"])
        hint = _PATTERN_HINTS.get(pattern)
        return f"must be {hint} (pattern {pattern})" if hint else f"must match {pattern}"
    if kind == "enum":
        return f"must be one of {ctx['expected']}"
    if kind == "value_error":
        return default.removeprefix("Value error, ")
    return default


def _unknown_field(loc: Loc, model: type[BaseModel]) -> str:
    name = str(loc[-1]) if loc else ""
    known = _aliases_at(model, loc[:-1])
    if _looks_like_credential(name):
        return (
            "a credential does not belong in the spec, where anyone who can read the "
            "resource or the compiled configuration would see it; store it in a Secret "
            "and reference it with apiKeySecretRef: {name: <secret name>, key: <key in it>}"
        )
    hint = ""
    if known:
        camel = _camel(name)
        close = [camel] if camel in known else difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]}?" if close else f"; allowed here: {', '.join(known)}"
    return f"unknown field{hint}"


def _looks_like_credential(name: str) -> bool:
    words = [word.lower() for word in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+", name)]
    if name.lower() in ("key", "apikey") or _CREDENTIAL_WORDS.intersection(words):
        return True
    return any(
        word == "key" and index > 0 and words[index - 1] in _KEY_QUALIFIERS
        for index, word in enumerate(words)
    )


def _camel(name: str) -> str:
    head, *rest = re.split(r"[_-]", name)
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def _aliases_at(model: type[BaseModel], loc: Loc) -> list[str]:
    """The field names (as users spell them) of the model found at `loc`, if any."""
    current: type[BaseModel] | None = model
    for part in loc:
        if current is None:
            return []
        if isinstance(part, int):
            continue
        field = next(
            (f for n, f in current.model_fields.items() if part in (f.alias, n)),
            None,
        )
        current = _model_in(field.annotation) if field is not None else None
    if current is None:
        return []
    return [field.alias or name for name, field in current.model_fields.items()]


def _model_in(annotation: object) -> type[BaseModel] | None:
    """The pydantic model inside `X`, `list[X]`, `X | None` or `Annotated[X, ...]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin is None and not isinstance(annotation, types.UnionType):
        return None
    for argument in typing.get_args(annotation):
        found = _model_in(argument)
        if found is not None:
            return found
    return None
