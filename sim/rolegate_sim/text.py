"""How a reply becomes "tokens", and the ways a fault can garble them.

A token is a run of non-space characters plus the whitespace after it (`\\S+\\s*`), or
leading whitespace on its own. That is nothing like a real tokenizer, but it is simple to
reason about in tests ("the third token") and joins back to the exact reply text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

_TOKEN = re.compile(r"\S+\s*|\s+")
_NON_ASCII = re.compile(r"[^\x00-\x7f]")
REPLACEMENT_CHARACTER = "\ufffd"


def tokenize(text: str) -> tuple[str, ...]:
    return tuple(_TOKEN.findall(text))


def encode_json_string(text: str) -> bytes:
    # ensure_ascii=False: non-ASCII travels as raw UTF-8, as real providers send it, so a
    # client that decodes bytes as latin-1 or splits reads mid-character really breaks.
    return json.dumps(text, ensure_ascii=False).encode("utf-8")


def mojibake(tokens: Sequence[str]) -> tuple[str, ...]:
    """Double-encode like a latin-1 fallback: UTF-8 bytes read as latin-1, re-sent as UTF-8.

    Applied per token (not to the joined text) so the token count stays that of the clean
    reply: a mangled character can contain U+0085, which `\\s` would treat as a space.
    """
    return tuple(t.encode("utf-8").decode("latin-1") for t in tokens)


def with_replacement_characters(tokens: Sequence[str]) -> tuple[str, ...]:
    """Every non-ASCII character becomes U+FFFD, what a lossy decoder leaves behind; a pure
    ASCII reply gets one U+FFFD appended to its first token so the fault is always visible.
    """
    replaced = tuple(_NON_ASCII.sub(REPLACEMENT_CHARACTER, t) for t in tokens)
    if replaced and replaced == tuple(tokens):
        first = replaced[0].rstrip()
        trailing = replaced[0][len(first) :]
        replaced = (first + REPLACEMENT_CHARACTER + trailing, *replaced[1:])
    return replaced


def estimate_prompt_tokens(messages: Sequence[object]) -> int:
    """Roughly four characters per token over the text content of all messages.

    Deliberately crude and O(number of messages): the benchmark sends large prompts and the
    hot path must not scan them.
    """
    chars = 0
    for message in messages:
        if isinstance(message, dict):
            chars += len(message_text(message.get("content")))
    return (chars + 3) // 4


def message_text(content: object) -> str:
    """The text of a message's `content`: a string, or the text parts of a parts list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""
