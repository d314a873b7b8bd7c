"""Structural verdicts on an upstream answer and whether they are the model's fault (SPEC A2-A4).

Pure: no I/O, no clock (the caller passes the time a row is recorded), no text kept. A
`Verdict` says what is wrong with an answer, never what the answer said; a `VerdictRow`
adds where it came from and when, and the `VerdictLog` keeps a bounded number of rows for
export. See docs/degraded-output.md.

Mangled text is valid UTF-8 (SPEC A2): the detectors look for the *shape* double encoding
leaves in decoded text, not for decode failures. When UTF-8 bytes are decoded as latin-1 and
re-encoded, each non-ASCII character becomes a lead character in U+00C2..U+00F4 followed by
one to three continuation characters in U+0080..U+00BF. Two forms of that are high
confidence because correct text essentially never contains them:

* U+00C2 or U+00C3 followed by a continuation (or by what cp1252 makes of one): every
  double-encoded Latin-1 character (`é` becomes `Ã©`, `°` becomes `Â°`);
* any lead followed by continuations that include a C1 control (U+0080..U+009F), the
  characters latin-1 gives bytes 0x80..0x9F: the em dash `e2 80 94` becomes U+00E2 U+0080
  U+0094 (UTF-8 `c3 a2 c2 80 c2 94`), smart quotes, arrows, emoji, most CJK. With cp1252
  instead of latin-1 the same punctuation appears as `â€` followed by a continuation.

A lead followed only by continuations in U+00A0..U+00BF is left alone: French typography
puts `é`, a no-break space and `»` in a row, which is exactly that shape.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from rolegate_policy.model import DegradedOutputSpec
from rolegate_policy.signatures import RULES, Signature, SignatureRule

from .tool_calls import NO_TOOLS, DeclaredTools, ToolCall, tool_call_fault

# --- verdicts -------------------------------------------------------------------------------


class VerdictKind(StrEnum):
    OK = "ok"
    MALFORMED = "malformed"
    UNVERIFIABLE = "unverifiable"
    MANGLED = "mangled"


class Confidence(StrEnum):
    HIGH = "high"
    # Recorded and surfaced, never acted on (SPEC A2).
    LOW = "low"


@dataclass(frozen=True, slots=True)
class Verdict:
    """The structural verdict on one answer. Carries no text of the answer or the prompt."""

    kind: VerdictKind
    # The model's fault (SPEC A3); only attributable verdicts may steer routing.
    attributable: bool = False
    signature: Signature | None = None
    confidence: Confidence | None = None
    detail: str | None = None

    @property
    def rule(self) -> SignatureRule | None:
        """What its signature does (the one table, `rolegate_policy.signatures`)."""
        return None if self.signature is None else RULES[self.signature]

    @property
    def steers(self) -> bool:
        """Whether this verdict may count against the machine whatever the settings: the
        model's fault (attributable), with a signature that acts, detected with high
        confidence where confidence applies (an empty answer has none)."""
        rule = self.rule
        if not self.attributable or rule is None or not rule.acts:
            return False
        return self.confidence is None or self.confidence is Confidence.HIGH

    def counts(self, degraded: DegradedOutputSpec) -> bool:
        """Whether it counts against the machine under this provider's degraded-output
        settings: the streamed and the non-streamed path both ask this, and only this."""
        rule = self.rule
        return self.steers and rule is not None and rule.counts(degraded)


OK: Final = Verdict(VerdictKind.OK)
EMPTY: Final = Verdict(
    VerdictKind.MALFORMED,
    attributable=True,
    signature=Signature.EMPTY_RESPONSE,
    detail="empty response",
)
TOOL_CALLS: Final = Verdict(VerdictKind.UNVERIFIABLE, detail="tool calls")
TOOL_CALLS_CUT: Final = Verdict(
    VerdictKind.UNVERIFIABLE, detail="tool calls cut short by the upstream's length limit"
)
REFUSAL: Final = Verdict(VerdictKind.UNVERIFIABLE, detail="refusal")
# A broken tool call is the model's fault, and steers like an empty answer (SPEC A2).
_TOOL_FAULTS: Final = {
    Signature.TOOL_ARGUMENTS_NOT_JSON: Verdict(
        VerdictKind.MALFORMED,
        attributable=True,
        signature=Signature.TOOL_ARGUMENTS_NOT_JSON,
        detail="tool-call arguments that are not JSON",
    ),
    Signature.UNDECLARED_TOOL: Verdict(
        VerdictKind.MALFORMED,
        attributable=True,
        signature=Signature.UNDECLARED_TOOL,
        detail="a call to a tool the request did not declare",
    ),
}
CLIENT_CAPPED: Final = Verdict(
    VerdictKind.UNVERIFIABLE, detail="length-capped by the client's max_tokens"
)
CONTENT_FILTERED: Final = Verdict(VerdictKind.UNVERIFIABLE, detail="content filter")
NON_ASCII_NOT_IN_PROMPT: Final = Verdict(
    VerdictKind.MANGLED,
    attributable=False,
    signature=Signature.NON_ASCII_NOT_IN_PROMPT,
    confidence=Confidence.LOW,
    detail="non-ASCII characters in an answer to an ASCII prompt",
)
_DETAILS: Final = {
    Signature.DOUBLE_ENCODED_UTF8: "double-encoded UTF-8",
    Signature.REPLACEMENT_CHARACTER: "U+FFFD replacement character",
}


def _mangled(signature: Signature, attributable: bool) -> Verdict:
    return Verdict(
        VerdictKind.MANGLED,
        attributable=attributable,
        signature=signature,
        confidence=Confidence.HIGH,
        detail=_DETAILS[signature],
    )


_HIGH: Final = {
    (signature, attributable): _mangled(signature, attributable)
    for signature in _DETAILS
    for attributable in (True, False)
}

# --- the prompt's charset profile -------------------------------------------------------------

# Distinct non-ASCII characters kept per prompt. Past this the prompt is treated as holding
# every character (no signature can then be an echo of it, so none is reported as one).
MAX_PROFILE_CHARS: Final = 8192


# Not frozen: one is made for every request with a non-ASCII prompt (a frozen dataclass
# sets each field through object.__setattr__). Nothing changes one once made: hashed as
# if frozen.
@dataclass(slots=True, unsafe_hash=True)
class PromptProfile:
    """What the answer's checker needs to know about the prompt, computed once per request:
    whether it was pure ASCII and which non-ASCII characters it held. Never the text."""

    is_ascii: bool
    chars: frozenset[str] = frozenset()
    # More distinct non-ASCII characters than MAX_PROFILE_CHARS: treat any as present.
    overflow: bool = False

    def holds_all(self, text: str) -> bool:
        """Whether every non-ASCII character of `text` also appears in the prompt."""
        if self.overflow:
            return True
        chars = self.chars
        return all(c in chars for c in text if c > "\x7f")


ASCII_PROMPT: Final = PromptProfile(is_ascii=True)


# The non-ASCII characters of a text, found in C (a text's ASCII never enters the set).
_NON_ASCII: Final = re.compile("[^\x00-\x7f]")


def profile_texts(texts: Iterable[str]) -> PromptProfile:
    """The charset profile of some texts. Pure-ASCII texts cost one `isascii()` each."""
    chars: set[str] = set()
    for text in texts:
        if text.isascii():
            continue
        chars.update(_NON_ASCII.findall(text))
        if len(chars) > MAX_PROFILE_CHARS:
            return PromptProfile(is_ascii=False, overflow=True)
    if not chars:
        return ASCII_PROMPT
    return PromptProfile(is_ascii=False, chars=frozenset(chars))


def profile_prompt(messages: Any, tools: Any = None) -> PromptProfile:
    """The charset profile of a chat request: every string in its `messages` (content,
    content parts, tool-call arguments, names) and `tools`, since a model may echo any of it."""
    return profile_texts(strings_in([messages, tools]))


def strings_in(value: Any) -> list[str]:
    """Every string in a JSON value, at any depth, in no particular order (a list: the
    request path walks a prompt's strings once and reads them twice)."""
    found: list[str] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


# --- detection ------------------------------------------------------------------------------

_CONT: Final = "\u0080-\u00bf"
_C1: Final = "\u0080-\u009f"
# What cp1252 (rather than latin-1) makes of the bytes 0x80..0x9F.
_CP1252_C1: Final = (
    "\u20ac\u201a\u0192\u201e\u2026\u2020\u2021\u02c6\u2030\u0160\u2039\u0152\u017d"
    "\u2018\u2019\u201c\u201d\u2022\u2013\u2014\u02dc\u2122\u0161\u203a\u0153\u017e\u0178"
)
DOUBLE_ENCODED: Final = re.compile(
    f"[\u00c2\u00c3][{_CONT}{_CP1252_C1}]"
    f"|[\u00c4-\u00f4][\u00a0-\u00bf]{{0,2}}[{_C1}]"
    f"|\u00e2\u20ac[{_CONT}{_CP1252_C1}]"
)
_SIGNATURES: Final = re.compile(f"(?P<double>{DOUBLE_ENCODED.pattern})|(?P<fffd>\ufffd)")
# Every signature holds one of these characters (a lead U+00C2/U+00C3, a C1 control, the
# cp1252 euro sign or U+FFFD), and correct text rarely does: a single-class scan finds the
# few places worth matching the full pattern at, several times faster than the pattern.
_CANDIDATE: Final = re.compile(f"[{_C1}\u00c2\u00c3\u20ac\ufffd]")
# The longest signature: a lead and three continuations.
_LONGEST: Final = 4


def signatures(text: str) -> Iterator[re.Match[str]]:
    """The mangling signatures in `text`, left to right, without overlaps. Each match's
    `lastgroup` is `double` (double-encoded UTF-8) or `fffd` (U+FFFD)."""
    pos = 0
    while (hit := _CANDIDATE.search(text, pos)) is not None:
        at = hit.start()
        match = _SIGNATURES.search(text, max(pos, at - _LONGEST + 1), at + _LONGEST)
        if match is None:
            pos = at + 1
        else:
            yield match
            pos = match.end()


def judge(
    text: str | None,
    *,
    finish_reason: str | None,
    status: int,
    prompt: PromptProfile,
    client_capped: bool,
    tool_calls: Sequence[ToolCall] = (),
    declared: DeclaredTools = NO_TOOLS,
    refusal: bool = False,
) -> Verdict:
    """The structural verdict on one answer (SPEC A2, A3).

    `text` is the answer's content as decoded (None when absent), `status` the upstream's
    HTTP status, `prompt` the request's charset profile and `client_capped` whether the
    client set its own `max_tokens`; `tool_calls` the answer's calls, `declared` the tools
    the request declared, `refusal` whether the model refused (OpenAI's `refusal`). One
    scan of the text at most.
    """
    if not 200 <= status < 300:
        return Verdict(VerdictKind.UNVERIFIABLE, detail=f"HTTP {status} is not an answer")
    if tool_calls:
        if finish_reason == "length":
            # Arguments cut short by a length limit are the limit's doing, not the model's.
            return CLIENT_CAPPED if client_capped else TOOL_CALLS_CUT
        fault = tool_call_fault(tool_calls, declared)
        return TOOL_CALLS if fault is None else _TOOL_FAULTS[fault]
    if refusal:
        return REFUSAL
    if finish_reason == "content_filter":
        return CONTENT_FILTERED
    if finish_reason == "length" and client_capped:
        return CLIENT_CAPPED
    if not text or text.isspace():
        return EMPTY
    if text.isascii():
        return OK
    if prompt.is_ascii:
        match = next(signatures(text), None)
        if match is not None and not _cut_mid_character(match, text, finish_reason):
            signature = (
                Signature.DOUBLE_ENCODED_UTF8
                if match.lastgroup == "double"
                else Signature.REPLACEMENT_CHARACTER
            )
            return _HIGH[signature, True]
        return NON_ASCII_NOT_IN_PROMPT
    for match in signatures(text):
        if prompt.holds_all(match.group()) or _cut_mid_character(match, text, finish_reason):
            continue  # the model echoing what it was given is behaving correctly
        signature = (
            Signature.DOUBLE_ENCODED_UTF8
            if match.lastgroup == "double"
            else Signature.REPLACEMENT_CHARACTER
        )
        return _HIGH[signature, False]
    return OK


def _cut_mid_character(match: re.Match[str], text: str, finish_reason: str | None) -> bool:
    """A U+FFFD that ends an answer stopped by a length limit is a character cut in half
    by the limit, not mangling."""
    return finish_reason == "length" and match.lastgroup == "fffd" and match.end() == len(text)


# --- rows and the bounded log -----------------------------------------------------------------

ROW_KIND: Final = "structural"


@dataclass(frozen=True, slots=True)
class VerdictRow:
    """One verdict as recorded and exported (SPEC A4): never any prompt or completion text."""

    kind: str
    verdict: VerdictKind
    signature: Signature | None
    confidence: Confidence | None
    detail: str | None
    provider: str
    model: str
    machine: str | None
    attributable: bool
    at: float

    @classmethod
    def of(
        cls, verdict: Verdict, *, provider: str, model: str, machine: str | None, at: float
    ) -> VerdictRow:
        return cls(
            kind=ROW_KIND,
            verdict=verdict.kind,
            signature=verdict.signature,
            confidence=verdict.confidence,
            detail=verdict.detail,
            provider=provider,
            model=model,
            machine=machine,
            attributable=verdict.attributable,
            at=at,
        )


class VerdictLog:
    """The most recent verdict rows, bounded: appending is O(1) and, when full, evicts the
    oldest row and counts it in `dropped`. Never slows a request, never grows."""

    __slots__ = ("_dropped", "_rows")

    def __init__(self, maxlen: int = 10_000) -> None:
        if maxlen < 1:
            raise ValueError(f"a verdict log holds at least one row, got maxlen={maxlen}")
        self._rows: deque[VerdictRow] = deque(maxlen=maxlen)
        self._dropped = 0

    @property
    def maxlen(self) -> int:
        maxlen = self._rows.maxlen
        assert maxlen is not None
        return maxlen

    @property
    def dropped(self) -> int:
        """Rows evicted unexported since the log was made."""
        return self._dropped

    def append(self, row: VerdictRow) -> None:
        if len(self._rows) == self._rows.maxlen:
            self._dropped += 1
        self._rows.append(row)

    def __len__(self) -> int:
        return len(self._rows)

    def rows(self) -> list[VerdictRow]:
        """The rows held, oldest first (a copy)."""
        return list(self._rows)

    def drain(self) -> list[VerdictRow]:
        """The rows held, oldest first, removing them (for export)."""
        rows = list(self._rows)
        self._rows.clear()
        return rows
