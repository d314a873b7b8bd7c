"""Structural verdicts, their signatures and attribution (SPEC A2-A4), against fixed bytes.

Every mangled sample is built from its exact UTF-8 bytes and decoded strictly: mangled text
is valid UTF-8, so a decode-failure check would catch none of it (SPEC A2).
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rolegate_policy.config import (
    CompiledRole,
)
from rolegate_policy.enums import (
    Ruling,
    Visibility,
)
from rolegate_policy.signatures import Signature
from rolegate_proxy.core.tool_calls import DeclaredTools, ToolCall
from rolegate_proxy.core.verdicts import (
    ASCII_PROMPT,
    DOUBLE_ENCODED,
    MAX_PROFILE_CHARS,
    ROW_KIND,
    Confidence,
    PromptProfile,
    Verdict,
    VerdictKind,
    VerdictLog,
    VerdictRow,
    judge,
    profile_prompt,
    profile_texts,
    signatures,
    strings_in,
)
from rolegate_proxy.wire.chat_request import estimate_prompt_tokens, validate_chat_request

EM_DASH_DOUBLE_ENCODED = "c3a2c280c294"  # U+2014 as UTF-8 (e2 80 94), read as latin-1, re-encoded


def text(hex_bytes: str) -> str:
    """Text from its exact UTF-8 bytes; strict decoding proves the text is valid UTF-8."""
    return bytes.fromhex(hex_bytes).decode("utf-8", errors="strict")


SOUND_CALL = ToolCall("call_1", "read_file", '{"path": "a.txt"}')
DECLARED = DeclaredTools(frozenset({"read_file"}))


def verdict_of(
    answer: str | None,
    prompt: PromptProfile = ASCII_PROMPT,
    *,
    finish_reason: str | None = "stop",
    has_tool_calls: bool = False,
    status: int = 200,
    client_capped: bool = False,
) -> Verdict:
    return judge(
        answer,
        finish_reason=finish_reason,
        status=status,
        prompt=prompt,
        client_capped=client_capped,
        tool_calls=(SOUND_CALL,) if has_tool_calls else (),
        declared=DECLARED,
    )


def prompt_of(*texts: str) -> PromptProfile:
    return profile_prompt([{"role": "user", "content": t} for t in texts])


JAPANESE_PROMPT = prompt_of("日本の首都はどこですか？日本語で答えてください。")  # noqa: RUF001
FRENCH_PROMPT = prompt_of("Réponds en français, s’il te plaît : où est la tour Eiffel ?")  # noqa: RUF001


# --- each signature, positive and negative ----------------------------------------------------


def test_the_double_encoded_em_dash_is_high_confidence_mangling() -> None:
    answer = "ok " + text(EM_DASH_DOUBLE_ENCODED) + " done"
    assert answer.encode("utf-8").hex().count(EM_DASH_DOUBLE_ENCODED) == 1
    assert [hex(ord(c)) for c in text(EM_DASH_DOUBLE_ENCODED)] == ["0xe2", "0x80", "0x94"]

    verdict = verdict_of(answer)

    assert verdict.kind is VerdictKind.MANGLED
    assert verdict.signature is Signature.DOUBLE_ENCODED_UTF8
    assert verdict.confidence is Confidence.HIGH
    assert verdict.attributable
    assert verdict.steers


@pytest.mark.parametrize(
    ("hex_bytes", "original"),
    [
        ("636166c383c2a9", "café"),  # c3 83 lead pair: é (c3 a9) double-encoded
        ("c382c2b043", "°C"),  # c3 82 lead pair: ° (c2 b0) double-encoded
        ("c383c289", "É"),  # Ã then a C1 control
        ("c3a2c280c29c71756f7465c3a2c280c29d", "“quote”"),
        ("c3a2c286c292", "→"),
        ("c3a6c297c2a5", "日"),
        ("c3b0c29fc299c28a", "🙊"),
        ("c383c692", "Ã"),  # Ã through cp1252: U+00C3 then ƒ
        ("c3a2e282ace2809d", "—"),  # the em dash through cp1252 instead of latin-1
    ],
)
def test_double_encoded_sequences_are_found(hex_bytes: str, original: str) -> None:
    answer = text(hex_bytes)
    assert answer != original
    assert verdict_of(answer).signature is Signature.DOUBLE_ENCODED_UTF8


@pytest.mark.parametrize(
    "hex_bytes",
    [
        "e28094",  # the em dash itself
        "636166c3a9",  # café, correctly encoded
        "e2809c71756f7465e2809d",  # “quote”
        "4ec3834f",  # NÃO: U+00C3 followed by an ASCII letter, correct Portuguese
        "6ec3a9c2a0c2bb",  # né\u00a0»: French typography, lead-shaped but no C1
        "c3a0c2a03f",  # à\u00a0?
        "e697a5e69cace8aa9e",  # 日本語
        "d0bfd180d0b8d0b2d0b5d182",  # привет
        "e282ac3530",  # €50: the euro sign alone is not the cp1252 shape
    ],
)
def test_correct_non_ascii_is_not_double_encoding(hex_bytes: str) -> None:
    answer = text(hex_bytes)
    assert next(signatures(answer), None) is None
    verdict = verdict_of(answer)
    # In an answer to an ASCII prompt it is only the low-confidence diagnostic.
    assert verdict.signature is Signature.NON_ASCII_NOT_IN_PROMPT
    assert verdict.confidence is Confidence.LOW
    assert not verdict.steers


def test_the_replacement_character_is_high_confidence_mangling() -> None:
    answer = text("636166efbfbd")  # caf\ufffd
    verdict = verdict_of(answer)
    assert verdict.kind is VerdictKind.MANGLED
    assert verdict.signature is Signature.REPLACEMENT_CHARACTER
    assert verdict.confidence is Confidence.HIGH
    assert verdict.attributable
    assert verdict.steers


def test_no_replacement_character_no_signature() -> None:
    assert verdict_of(text("636166c3a9")).signature is not Signature.REPLACEMENT_CHARACTER
    assert verdict_of("plain ascii answer") == Verdict(VerdictKind.OK)


def test_non_ascii_absent_from_an_ascii_prompt_is_low_confidence_and_never_steers() -> None:
    answer = text("e2809c736d6172742071756f7465e2809d")  # “smart quote”
    verdict = verdict_of(answer)
    assert verdict.kind is VerdictKind.MANGLED
    assert verdict.signature is Signature.NON_ASCII_NOT_IN_PROMPT
    assert verdict.confidence is Confidence.LOW
    assert not verdict.attributable
    assert not verdict.steers


def test_the_low_signature_is_only_about_ascii_prompts() -> None:
    # "Absent from an ASCII input": a non-ASCII prompt makes non-ASCII answers unremarkable.
    assert verdict_of("“quoted” — and 日本", FRENCH_PROMPT).kind is VerdictKind.OK
    assert verdict_of("all ascii", ASCII_PROMPT).kind is VerdictKind.OK


def test_double_encoding_is_reported_before_a_later_replacement_character() -> None:
    answer = text(EM_DASH_DOUBLE_ENCODED) + "\ufffd"
    assert verdict_of(answer).signature is Signature.DOUBLE_ENCODED_UTF8
    assert verdict_of("\ufffd" + text(EM_DASH_DOUBLE_ENCODED)).signature is (
        Signature.REPLACEMENT_CHARACTER
    )


# --- attribution (SPEC A3) --------------------------------------------------------------------


def test_a_non_ascii_prompt_makes_mangling_not_attributable_even_with_u_fffd() -> None:
    verdict = verdict_of("東京です\ufffd", JAPANESE_PROMPT)
    assert verdict.kind is VerdictKind.MANGLED
    assert verdict.signature is Signature.REPLACEMENT_CHARACTER
    assert verdict.confidence is Confidence.HIGH
    assert not verdict.attributable
    assert not verdict.steers


def test_an_ascii_prompt_makes_mangling_attributable() -> None:
    verdict = verdict_of("Tokyo\ufffd", prompt_of("What is the capital of Japan?"))
    assert verdict.attributable
    assert verdict.steers


def test_double_encoding_after_a_non_ascii_prompt_is_recorded_not_attributed() -> None:
    verdict = verdict_of("r" + text("c383c2a9") + "ponse", FRENCH_PROMPT)
    assert verdict.signature is Signature.DOUBLE_ENCODED_UTF8
    assert not verdict.attributable


def test_echoing_mangled_text_the_prompt_carried_is_no_verdict_at_all() -> None:
    pasted = "fix this: caf" + text("c383c2a9") + " and " + "\ufffd"
    prompt = prompt_of(pasted)
    assert verdict_of("It should read caf" + text("c383c2a9") + " → café", prompt).kind is (
        VerdictKind.OK
    )
    assert verdict_of("The \ufffd is a replacement character.", prompt).kind is VerdictKind.OK


def test_empty_on_a_2xx_without_tool_calls_is_attributable_malformed() -> None:
    for empty in ("", None, "  \n\t"):
        verdict = verdict_of(empty)
        assert verdict.kind is VerdictKind.MALFORMED
        assert verdict.detail == "empty response"
        assert verdict.signature is Signature.EMPTY_RESPONSE
        assert verdict.attributable
        assert verdict.steers
    # The prompt's charset has nothing to do with an empty answer.
    assert verdict_of("", JAPANESE_PROMPT).attributable


def test_tool_calls_make_an_answer_unverifiable() -> None:
    for answer in ("", None, "\ufffd", text(EM_DASH_DOUBLE_ENCODED)):
        verdict = verdict_of(answer, has_tool_calls=True)
        assert verdict.kind is VerdictKind.UNVERIFIABLE
        assert verdict.detail == "tool calls"
        assert not verdict.attributable


def test_a_length_cap_the_client_set_makes_an_answer_unverifiable() -> None:
    verdict = verdict_of("", finish_reason="length", client_capped=True)
    assert verdict.kind is VerdictKind.UNVERIFIABLE
    assert not verdict.attributable
    # Capped by someone else, an empty answer is still empty.
    assert verdict_of("", finish_reason="length").kind is VerdictKind.MALFORMED


def test_a_character_cut_in_half_by_a_length_limit_is_not_mangling() -> None:
    cut = "Tokyo is the capital\ufffd"
    assert verdict_of(cut, finish_reason="length").confidence is Confidence.LOW
    assert verdict_of(cut, JAPANESE_PROMPT, finish_reason="length").kind is VerdictKind.OK
    # Anywhere else, or without the limit, it is mangling.
    assert verdict_of(cut, finish_reason="stop").steers
    assert verdict_of("a\ufffd b", finish_reason="length").steers


def test_a_content_filter_stop_is_unverifiable_not_empty() -> None:
    verdict = verdict_of("", finish_reason="content_filter")
    assert verdict.kind is VerdictKind.UNVERIFIABLE
    assert not verdict.attributable


def test_an_error_status_is_not_an_answer() -> None:
    verdict = verdict_of("", status=503)
    assert verdict.kind is VerdictKind.UNVERIFIABLE
    assert not verdict.attributable


# --- correct non-ASCII answers get no verdict -------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "answer"),
    [
        (JAPANESE_PROMPT, "日本の首都は東京です。人口は約1400万人です。"),
        (JAPANESE_PROMPT, "東京です 🗼 — 「首都」"),
        (
            FRENCH_PROMPT,
            "La tour Eiffel se trouve à Paris, près du Champ-de-Mars\u00a0; élégante\u00a0!",
        ),
        (FRENCH_PROMPT, "« Ça se trouve là\u00a0», dit-il, né à Besançon."),
        (prompt_of("Übersetze: the street"), "Die Straße — „Grüße“ aus Köln."),
        (prompt_of("Переведи: hello"), "Привет, мир! Это ответ на русском."),
    ],
)
def test_a_correct_non_ascii_answer_to_a_non_ascii_prompt_gets_no_verdict(
    prompt: PromptProfile, answer: str
) -> None:
    assert verdict_of(answer, prompt) == Verdict(VerdictKind.OK)


# --- the prompt profile -----------------------------------------------------------------------


def test_the_profile_covers_every_string_a_model_might_echo() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "naïve"}, {"type": "image_url"}]},
        {
            "role": "assistant",
            "tool_calls": [{"function": {"name": "f", "arguments": '{"q": "größe"}'}}],
        },
        {"role": "tool", "content": "résultat"},
    ]
    profile = profile_prompt(messages)
    assert not profile.is_ascii
    assert {"ï", "ö", "ß", "é"} <= profile.chars
    assert all(c > "\x7f" for c in profile.chars)
    tools = [{"function": {"name": "f", "description": "Suche nach „Dingen“"}}]
    assert profile_prompt([{"role": "user", "content": "hi"}], tools).chars == {"„", "“"}


def test_strings_in_finds_every_string_at_any_depth_and_nothing_else() -> None:
    value = [{"a": "x", "b": [1, None, True, {"c": "y"}], "d": 2.5}, "z", [[["w"]]]]
    assert sorted(strings_in(value)) == ["w", "x", "y", "z"]
    assert strings_in(None) == []
    assert strings_in("alone") == ["alone"]


def test_the_prompt_size_is_a_quarter_of_its_characters() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "abcdefgh"}]}]
    # "user", "text" and "abcdefgh": 16 characters, 4 tokens.
    assert estimate_prompt_tokens(strings_in(messages)) == 4
    assert estimate_prompt_tokens([]) == 0


def test_an_ascii_prompt_profile_is_shared_and_empty() -> None:
    assert profile_prompt([{"role": "user", "content": "plain"}]) is ASCII_PROMPT
    assert ASCII_PROMPT.is_ascii
    assert ASCII_PROMPT.chars == frozenset()


def test_a_prompt_with_too_many_distinct_characters_overflows_to_holding_everything() -> None:
    many = "".join(chr(0x4E00 + i) for i in range(MAX_PROFILE_CHARS + 1))
    profile = profile_texts([many])
    assert profile.overflow
    assert profile.chars == frozenset()
    assert profile.holds_all("\ufffd" + text(EM_DASH_DOUBLE_ENCODED))
    # It is still not ASCII: nothing after it is attributable.
    assert verdict_of("\ufffd", profile).kind is VerdictKind.OK


def test_a_validated_chat_request_carries_the_profile_once() -> None:
    role = CompiledRole(
        name="agent",
        source="test",
        models=("m",),
        patience_seconds=30,
        visibility=Visibility.UNWATCHED,
        ruling=Ruling.ORDER,
        effective_ruling=Ruling.ORDER,
        ruling_reason="test",
        expected_output_tokens=100,
    )
    ascii_request = validate_chat_request({"messages": [{"role": "user", "content": "hi"}]}, role)
    assert ascii_request.prompt is ASCII_PROMPT
    assert ascii_request.prompt_is_ascii
    japanese = validate_chat_request({"messages": [{"role": "user", "content": "日本"}]}, role)
    assert not japanese.prompt_is_ascii
    assert japanese.prompt.chars == {"日", "本"}


# --- no text kept (SPEC A4) -------------------------------------------------------------------


SECRET_ANSWER = "the secret answer is caf\ufffd"


def test_verdicts_and_rows_carry_no_text() -> None:
    verdict = verdict_of(SECRET_ANSWER)
    row = VerdictRow.of(verdict, provider="openrouter", model="m", machine="DeepInfra", at=12.5)
    assert [f.name for f in dataclasses.fields(Verdict)] == [
        "kind",
        "attributable",
        "signature",
        "confidence",
        "detail",
    ]
    assert [f.name for f in dataclasses.fields(VerdictRow)] == [
        "kind",
        "verdict",
        "signature",
        "confidence",
        "detail",
        "provider",
        "model",
        "machine",
        "attributable",
        "at",
    ]
    for value in (*dataclasses.astuple(verdict), *dataclasses.astuple(row)):
        assert "secret" not in str(value)
        assert "\ufffd" not in str(value)
    assert row.kind == ROW_KIND == "structural"
    assert row.verdict is VerdictKind.MANGLED
    assert row.attributable


def test_the_verdict_log_is_bounded_and_counts_what_it_drops() -> None:
    log = VerdictLog(maxlen=3)
    rows = [
        VerdictRow.of(verdict_of("x"), provider="p", model="m", machine=None, at=float(i))
        for i in range(5)
    ]
    for row in rows:
        log.append(row)
    assert len(log) == 3
    assert log.dropped == 2
    assert log.maxlen == 3
    assert log.rows() == rows[2:]
    assert log.drain() == rows[2:]
    assert len(log) == 0
    assert log.rows() == []
    assert log.dropped == 2
    with pytest.raises(ValueError, match="at least one row"):
        VerdictLog(maxlen=0)


# --- properties -------------------------------------------------------------------------------

# Characters that make the detectors' life hard: latin-1 leads and continuations, C1
# controls, cp1252's euro sign and punctuation, U+FFFD, plus ordinary letters of several scripts.
HARD_CHARS = st.sampled_from(
    [chr(c) for c in range(0x80, 0x100)]
    + ["\u20ac", "\u201d", "\u2019", "\u2026", "\ufffd", "\u2014", "日", "本", "ж", "🙊", "a", " "]
)
ANY_CHARS = st.characters(codec="utf-8")  # every valid scalar value: no lone surrogates
PROPERTY = settings(max_examples=400, database=None, deadline=None)


def _detectable(c: str) -> bool:
    """Whether double encoding leaves a high-confidence trace of `c`: its UTF-8 lead byte is
    c2/c3 (U+0080..U+00FF) or one of its continuation bytes is 80..9f (a C1 control)."""
    encoded = c.encode("utf-8")
    return len(encoded) > 1 and (encoded[0] in (0xC2, 0xC3) or any(b < 0xA0 for b in encoded[1:]))


@PROPERTY
@given(data=st.data(), prompt_text=st.text(st.one_of(HARD_CHARS, ANY_CHARS), min_size=1))
def test_no_mangled_verdict_for_text_whose_non_ascii_all_appears_in_the_prompt(
    data: st.DataObject, prompt_text: str
) -> None:
    alphabet = sorted(set(prompt_text) | set("abc xyz.\n"))
    answer = data.draw(st.text(st.sampled_from(alphabet)))
    for finish_reason in ("stop", "length", None):
        verdict = verdict_of(answer, prompt_of(prompt_text), finish_reason=finish_reason)
        assert verdict.kind is not VerdictKind.MANGLED


@PROPERTY
@given(original=st.text(st.one_of(HARD_CHARS, ANY_CHARS)))
def test_double_encoding_is_found_exactly_when_it_leaves_a_c2_c3_lead_or_a_c1_byte(
    original: str,
) -> None:
    mojibake = original.encode("utf-8").decode("latin-1")
    found = DOUBLE_ENCODED.search(mojibake) is not None
    assert found == any(_detectable(c) for c in original)
    first = next(signatures(mojibake), None)
    assert (first is not None and first.lastgroup == "double") == found
    if not original.isascii():
        verdict = verdict_of(mojibake)
        if found:
            assert verdict.signature is Signature.DOUBLE_ENCODED_UTF8
            assert verdict.steers
        else:
            # e.g. Greek alpha U+03B1 (ce b1), Cyrillic a U+0430 (d0 b0): only the low diagnostic.
            assert verdict.confidence is Confidence.LOW


@PROPERTY
@given(original=st.text(HARD_CHARS, min_size=1))
def test_latin_1_and_general_punctuation_are_always_found_double_encoded(original: str) -> None:
    latin = "".join(c for c in original if "\u0080" <= c <= "\u00ff") or "é"
    punctuation = "\u2014\u201c\u201d\u2019\u2026"
    for source in (latin, punctuation, "🙊"):
        assert DOUBLE_ENCODED.search(source.encode("utf-8").decode("latin-1"))


@PROPERTY
@given(answer=st.text(ANY_CHARS))
def test_correct_text_without_the_rare_trace_characters_never_matches(answer: str) -> None:
    trace = set("\u00c2\u00c3\u20ac\ufffd") | {chr(c) for c in range(0x80, 0xA0)}
    clean = "".join(c for c in answer if c not in trace)
    assert next(signatures(clean), None) is None
    assert DOUBLE_ENCODED.search(clean) is None


@settings(
    max_examples=300, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    answer=st.one_of(st.none(), st.text(st.one_of(HARD_CHARS, ANY_CHARS))),
    prompt_text=st.text(st.one_of(HARD_CHARS, ANY_CHARS)),
    finish_reason=st.sampled_from(["stop", "length", "content_filter", None]),
    has_tool_calls=st.booleans(),
    status=st.sampled_from([200, 201, 204, 400, 429, 500]),
    client_capped=st.booleans(),
)
def test_only_an_empty_answer_or_mangling_after_an_ascii_prompt_is_attributable(
    answer: str | None,
    prompt_text: str,
    finish_reason: str | None,
    has_tool_calls: bool,
    status: int,
    client_capped: bool,
) -> None:
    prompt = prompt_of(prompt_text)
    verdict = judge(
        answer,
        finish_reason=finish_reason,
        status=status,
        prompt=prompt,
        client_capped=client_capped,
        tool_calls=(SOUND_CALL,) if has_tool_calls else (),
        declared=DECLARED,
    )
    if verdict.attributable:
        assert 200 <= status < 300
        assert not has_tool_calls
        assert verdict.kind is VerdictKind.MALFORMED or (
            prompt.is_ascii and verdict.confidence is Confidence.HIGH
        )
    assert verdict.steers == verdict.attributable
