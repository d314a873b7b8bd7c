"""What a valid `ProviderPolicy.spec.endpoint` is, written once for both of its judges.

The API server judges it with CEL rules (`x-kubernetes-validations`), compile with
Python. Each rule below is checked by both from the same text: regular expressions in
the syntax RE2 (CEL's `matches`) and Python's `re` read alike, searched for (not
anchored unless they say so) by both. Only the last rule compares the two URL parsers
themselves (Go's `url.ParseRequestURI` behind CEL's `isURL`, Python's `urlsplit`); by
then everything else is settled, and what is left for them to judge is whether an IPv6
address in brackets is a valid one, which both check with their IP address parsers.

Why no schema `pattern`: when a `pattern` fails, the API server quotes the refused value
(`Invalid value: "https://user:sk-...@host/v1": ... should match ...`), and `kubectl`
prints it. A CEL rule's `message` is fixed text (`Invalid value: "string": ...`), so the
endpoint, the one field where someone might paste a key, is never echoed. No rule may
use `messageExpression`, which could quote it again.

The rules are ordered, and each CEL rule holds trivially unless every earlier one holds:
the API server then reports the first rule broken, exactly as compile does, instead of
the same mistake seen through several rules at once (`https://u:key@h` is a credential,
not also a bad port).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

from pydantic import JsonValue

FIELD: Final = "endpoint"
EXAMPLE: Final = "e.g. https://openrouter.ai/api/v1"

# Whitespace and control characters: every character Python's `str.isspace` accepts,
# every C0 and C1 control, DEL and the no-break space (Go's `\s` is ASCII-only, so the
# class is spelled out).
_SPACE_OR_CONTROL: Final = r"[\x00-\x20\x7f-\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
# Characters that compatibility normalisation (NFKC) turns into `/`, `?`, `#`, `@` or `:`.
# Python's `urlsplit` refuses them in a host (a host that changes meaning once
# normalised); Go accepts them. Refused in a host by both.
_NFKC_DELIMITERS: Final = (
    r"\u2047-\u2049\u2100\u2101\u2105\u2106\u2a74\ufe13\ufe16\ufe55\ufe56\ufe5f\ufe6b"
    r"\uff03\uff0f\uff1a\uff1f\uff20"
)
# A host: an IPv6 address in brackets, or a name. A name never has `%` (Python and Go
# disagree on escapes there), nor what Go refuses in a host and Python does not (`\`, `^`,
# the back-quote, `{`, `|`, `}`), nor `:`, `[` or `]` (Python and Go split those
# differently between host and port).
_HOST: Final = r"(\[[0-9A-Fa-f:.]+\]|[^/%\\:\[\]^`{|}" + _NFKC_DELIMITERS + r"]+)"
# The host as the port rule skips it (the host rule has judged it by then).
_ANY_HOST: Final = r"^https?://(\[[^\]]*\]|[^/:]*)"
# 0, and five digits above 65535; a port has at most five digits.
_PORT_OUT_OF_RANGE: Final = (
    r"(0+|6553[6-9]|655[4-9][0-9]|65[6-9][0-9]{2}|6[6-9][0-9]{3}|[7-9][0-9]{4})"
)


def re2(pattern: str) -> str:
    """`pattern` as RE2 (the API server's CEL) spells it: Python's four-hex-digit escape
    `\\u00a0` is written `\\x{00a0}` there."""
    return re.sub(r"\\u([0-9a-fA-F]{4})", r"\\x{\1}", pattern)


@dataclass(frozen=True)
class EndpointRule:
    """One thing a valid endpoint is: `cel` over `self` for the API server, `holds` for
    compile, one `message` (fixed text, never the value) for both."""

    name: str
    cel: str
    holds: Callable[[str], bool]
    message: str


def _cel_regex(pattern: str) -> str:
    # A raw CEL string: RE2 reads the backslashes, not CEL's string escapes.
    if "'" in pattern:
        raise ValueError(f"a quote would end the raw CEL string: {pattern}")
    return f"r'{re2(pattern)}'"


def _pattern_rule(
    name: str, message: str, *, found: tuple[str, ...] = (), absent: tuple[str, ...] = ()
) -> EndpointRule:
    """A rule made of regular expressions that must be found, and ones that must not."""
    compiled_found = [re.compile(p) for p in found]
    compiled_absent = [re.compile(p) for p in absent]
    clauses = [f"self.matches({_cel_regex(p)})" for p in found]
    clauses += [f"!self.matches({_cel_regex(p)})" for p in absent]

    def holds(value: str) -> bool:
        return all(p.search(value) for p in compiled_found) and not any(
            p.search(value) for p in compiled_absent
        )

    return EndpointRule(name, " && ".join(clauses), holds, message)


def _python_parses(value: str) -> bool:
    try:
        parts = urlsplit(value)
        _ = parts.port  # raises for a port Python cannot read
    except ValueError:
        return False
    return bool(parts.hostname)


ENDPOINT_RULES: Final = (
    _pattern_rule(
        "space",
        "`endpoint` must not contain whitespace or control characters",
        absent=(_SPACE_OR_CONTROL,),
    ),
    _pattern_rule(
        "scheme",
        f"`endpoint` must start with http:// or https:// (in lower case), {EXAMPLE}",
        found=(r"^https?://",),
    ),
    _pattern_rule(
        "credentials",
        "`endpoint` must not contain credentials (user:password@host), nor any `@`; store "
        "the API key in a Secret and reference it with `apiKeySecretRef`",
        absent=("@",),
    ),
    _pattern_rule(
        "query",
        "`endpoint` must not have a query string (`?`): it is a base URL the proxy "
        "appends /chat/completions to, and a key belongs in `apiKeySecretRef`",
        absent=(r"\?",),
    ),
    _pattern_rule(
        "fragment",
        "`endpoint` must not have a fragment (`#`)",
        absent=("#",),
    ),
    _pattern_rule(
        "host",
        "`endpoint` must name a host after the scheme: a DNS name, an IPv4 address or an "
        "IPv6 address in brackets (http://[fd00::1]:8000/v1), without `%`, a backslash or "
        "another character a host cannot have",
        found=(r"^https?://" + _HOST + r"(:|/|$)",),
    ),
    _pattern_rule(
        "port",
        "`endpoint` must have no port or a port from 1 to 65535 after the host "
        "(http://vllm:8000/v1)",
        found=(_ANY_HOST + r"(:[0-9]{0,5})?(/|$)",),
        absent=(_ANY_HOST + ":" + _PORT_OUT_OF_RANGE + r"(/|$)",),
    ),
    _pattern_rule(
        "escapes",
        "`endpoint` must use `%` only to start an escape of two hex digits (%20 for a space)",
        # `$` would also match before a final newline in Python; the first rule has
        # refused every newline by then.
        found=(r"^([^%]|%[0-9A-Fa-f]{2})*$",),
    ),
    EndpointRule(
        "url",
        "isURL(self)",
        _python_parses,
        "`endpoint` must be a valid URL; in brackets, a host must be a valid IPv6 address "
        "(http://[fd00::1]:8000/v1)",
    ),
)


def cel_rules() -> list[JsonValue]:
    """The `x-kubernetes-validations` of the endpoint: each rule in force only once every
    earlier one holds, so the API server reports the first one broken, as compile does."""
    rules: list[JsonValue] = []
    earlier: list[str] = []
    for rule in ENDPOINT_RULES:
        text = rule.cel if not earlier else f"!({' && '.join(earlier)}) || ({rule.cel})"
        rules.append({"rule": text, "message": rule.message})
        earlier.append(rule.cel)
    return rules


def first_broken(value: str) -> EndpointRule | None:
    """The first rule `value` breaks (the one the API server reports too), or None."""
    return next((rule for rule in ENDPOINT_RULES if not rule.holds(value)), None)


def problem(value: str) -> str | None:
    """What is wrong with `value` as compile says it (the message without the field name,
    which the error's path carries), or None when it is a valid endpoint."""
    broken = first_broken(value)
    return None if broken is None else broken.message.removeprefix(f"`{FIELD}` ")
