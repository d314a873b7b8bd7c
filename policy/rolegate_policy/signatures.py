"""What each degraded-output signature does: one table (SPEC A2-A6).

A structural verdict names a signature (what a degraded answer looked like). This table
says, for each signature, which family of breaker evidence it is (the family decides the
key it is counted on: an encoding fault is the provider's pipeline, an empty answer the
model's), the `Tripped` reason it trips with, the ProviderPolicy toggle
(`spec.degradedOutput`) that switches it off, and whether it may act at all. The proxy's
verdict code, its breaker and both its streamed and non-streamed paths read it, and the
operator takes the order in which reasons are reported from it, so what a signature does
is decided here and nowhere else.

With its toggle off a signature is still detected and recorded (verdict rows, metrics,
the outcome record): it only stops counting against the machine, streamed or not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Final

from rolegate_policy.model import DegradedOutputSpec
from rolegate_policy.status import Scope, TripReason


class Family(StrEnum):
    """A kind of breaker evidence, each counted on its own key."""

    # The provider's pipeline mangled text: every model behind it is suspect.
    ENCODING = "encoding"
    # The model answered with nothing: that (provider, model) is suspect (measured: one
    # model at 35 % empty while three others on the same providers sat at 0 %).
    CONTENT = "content"
    # Errors, refusals, timeouts, broken streams: scoped by the machine the answer named,
    # else by the ProviderPolicy's `transportScope` (not by this table).
    TRANSPORT = "transport"


class Signature(StrEnum):
    """What a degraded answer looked like; the breaker keys and counts by it."""

    EMPTY_RESPONSE = "empty_response"
    DOUBLE_ENCODED_UTF8 = "double_encoded_utf8"
    REPLACEMENT_CHARACTER = "replacement_character"
    NON_ASCII_NOT_IN_PROMPT = "non_ascii_not_in_prompt"
    TOOL_ARGUMENTS_NOT_JSON = "tool_arguments_not_json"
    UNDECLARED_TOOL = "undeclared_tool"


def _detect_empty(degraded: DegradedOutputSpec) -> bool:
    return degraded.detect_empty


def _detect_mangled(degraded: DegradedOutputSpec) -> bool:
    return degraded.detect_mangled


def _detect_malformed_tool_calls(degraded: DegradedOutputSpec) -> bool:
    return degraded.detect_malformed_tool_calls


@dataclass(frozen=True, slots=True)
class SignatureRule:
    family: Family
    # The key a counted fault is recorded on (and trips).
    scope: Scope
    reason: TripReason
    # Whether a verdict with this signature may count against the machine at all; a
    # signature that may not is a diagnostic (recorded, and clean evidence for its family).
    acts: bool
    # The `spec.degradedOutput` toggle that switches it off.
    toggle: Callable[[DegradedOutputSpec], bool]
    # For people: what the answers looked like.
    description: str

    def counts(self, degraded: DegradedOutputSpec) -> bool:
        """Whether a verdict with this signature counts against the machine under these
        settings (the verdict must also be attributable, SPEC A3)."""
        return self.acts and self.toggle(degraded)


RULES: Final[Mapping[Signature, SignatureRule]] = MappingProxyType(
    {
        Signature.EMPTY_RESPONSE: SignatureRule(
            Family.CONTENT,
            Scope.MODEL,
            TripReason.EMPTY_RESPONSES,
            True,
            _detect_empty,
            "answers with no content and no tool calls on HTTP 200",
        ),
        Signature.DOUBLE_ENCODED_UTF8: SignatureRule(
            Family.ENCODING,
            Scope.PROVIDER,
            TripReason.MANGLED_OUTPUT,
            True,
            _detect_mangled,
            "double-encoded UTF-8 in answers to ASCII prompts",
        ),
        Signature.REPLACEMENT_CHARACTER: SignatureRule(
            Family.ENCODING,
            Scope.PROVIDER,
            TripReason.MANGLED_OUTPUT,
            True,
            _detect_mangled,
            "U+FFFD replacement characters in answers to ASCII prompts",
        ),
        Signature.NON_ASCII_NOT_IN_PROMPT: SignatureRule(
            Family.ENCODING,
            Scope.PROVIDER,
            TripReason.MANGLED_OUTPUT,
            False,
            _detect_mangled,
            "non-ASCII characters in an answer to an ASCII prompt (low confidence)",
        ),
        # A broken tool call is the model's, like an empty answer: it is counted on the
        # (provider, model) key with the other content faults, under its own reason.
        Signature.TOOL_ARGUMENTS_NOT_JSON: SignatureRule(
            Family.CONTENT,
            Scope.MODEL,
            TripReason.MALFORMED_TOOL_CALLS,
            True,
            _detect_malformed_tool_calls,
            "tool calls whose arguments are not JSON",
        ),
        Signature.UNDECLARED_TOOL: SignatureRule(
            Family.CONTENT,
            Scope.MODEL,
            TripReason.MALFORMED_TOOL_CALLS,
            True,
            _detect_malformed_tool_calls,
            "calls to a tool the request did not declare",
        ),
    }
)
# Each rule by its signature's value, as a breaker sample carries it.
RULES_BY_VALUE: Final[Mapping[str, SignatureRule]] = MappingProxyType(
    {signature.value: rule for signature, rule in RULES.items()}
)

# The reason each family trips with when no signature says otherwise (a fault rate over
# mixed signatures), most severe first: a provider-wide encoding fault before a model's
# empty answers before upstream errors.
FAMILY_REASONS: Final[Mapping[Family, TripReason]] = MappingProxyType(
    {
        Family.ENCODING: TripReason.MANGLED_OUTPUT,
        Family.CONTENT: TripReason.EMPTY_RESPONSES,
        Family.TRANSPORT: TripReason.UPSTREAM_ERRORS,
    }
)

# Every reason a degraded signature or a family trips with, most severe first: the order
# the operator reports reasons in (then the hard exclusions').
DEGRADED_REASONS: Final = (
    TripReason.MANGLED_OUTPUT,
    TripReason.EMPTY_RESPONSES,
    TripReason.MALFORMED_TOOL_CALLS,
    TripReason.UPSTREAM_ERRORS,
)


def reason_of(family: Family, signature: str | None) -> TripReason:
    """The reason a fault trips with: its signature's own when it is a degraded-output
    signature (a broken tool call is not an empty answer), else its family's."""
    rule = None if signature is None else RULES_BY_VALUE.get(signature)
    return FAMILY_REASONS[family] if rule is None else rule.reason
