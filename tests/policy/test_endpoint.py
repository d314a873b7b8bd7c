"""The endpoint rules as compile runs them, and the facts about Python and Go they rest on.

Whether the API server agrees is tests/k8s/test_crds.py's job (a real kube-apiserver
against compile, case by case); here: the rules' order, the regular expressions read the
same in both syntaxes, and the character sets still cover what Python treats specially.
"""

from __future__ import annotations

import re
import sys
import unicodedata

import pytest

from rolegate_policy.endpoint import (
    _NFKC_DELIMITERS,
    _SPACE_OR_CONTROL,
    ENDPOINT_RULES,
    first_broken,
    problem,
    re2,
)


@pytest.mark.parametrize(
    ("endpoint", "rule"),
    [
        # Several mistakes at once: the first rule broken is the one reported.
        ("ftp://u:key@h:0/v1?x#y", "scheme"),
        ("https://u:key@h:0/v1?x#y", "credentials"),
        ("https://h:0/v1?x#y", "query"),
        ("https://h:0/v1#y", "fragment"),
        ("https://h%41:0/v1", "host"),
        ("https://h:0/%zz", "port"),
        ("https://h/%zz", "escapes"),
        ("https://[::1::]/v1", "url"),
        ("https://h/v1 ?", "space"),
    ],
)
def test_the_first_rule_broken_is_reported(endpoint: str, rule: str) -> None:
    broken = first_broken(endpoint)
    assert broken is not None
    assert broken.name == rule
    assert problem(endpoint) == broken.message.removeprefix("`endpoint` ")


def test_a_valid_endpoint_breaks_no_rule() -> None:
    for endpoint in ("https://openrouter.ai/api/v1", "http://[fd00::1]:8000/v1", "http://h:/"):
        assert first_broken(endpoint) is None
        assert problem(endpoint) is None


def test_rules_have_distinct_names_and_name_the_field() -> None:
    assert len({rule.name for rule in ENDPOINT_RULES}) == len(ENDPOINT_RULES)
    for rule in ENDPOINT_RULES:
        assert rule.message.startswith("`endpoint` must "), rule.message


def test_re2_spells_unicode_escapes_its_way() -> None:
    assert re2(r"[\x00-\x20\u2000-\u200a]") == r"[\x00-\x20\x{2000}-\x{200a}]"
    # What RE2 cannot read, Python can (and the CRD has RE2's spelling).
    assert re.fullmatch(r"[\u2000-\u200a]", "\u2003")


def test_the_space_rule_refuses_everything_python_calls_whitespace_and_every_control() -> None:
    space = re.compile(_SPACE_OR_CONTROL)
    for code in range(sys.maxunicode + 1):
        character = chr(code)
        refused = bool(space.fullmatch(character))
        expected = character.isspace() or unicodedata.category(character) in ("Cc", "Zs")
        assert refused is expected, hex(code)


def test_the_host_rule_refuses_what_nfkc_turns_into_a_delimiter() -> None:
    """Python's `urlsplit` refuses a host that normalisation would turn into another URL;
    Go does not normalise. The host rule names those characters so both refuse them."""
    excluded = re.compile(f"[{_NFKC_DELIMITERS}]")
    for code in range(0x80, sys.maxunicode + 1):
        normalised = unicodedata.normalize("NFKC", chr(code))
        if normalised != chr(code) and any(c in normalised for c in "/?#@:"):
            assert excluded.fullmatch(chr(code)), hex(code)
