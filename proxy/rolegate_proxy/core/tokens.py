"""How many tokens some streamed output carried, when no upstream says (SPEC E7).

The leg of an answer that broke or was abandoned never reports its usage; what rolegate
saw of it are its pieces of output (one per event and kind) and their text. Two counts
come of them:

* the likely count, one token a piece: exact for a server that streams token by token,
  which is what rolegate's usage estimate reports (`"estimated": true`);
* the most it can have been, for a handover, which must not let the answer exceed its
  caller's `max_tokens`: a character a tokenizer writes in byte tokens (a hieroglyph,
  many emoji, rare CJK) waits until it is whole and comes in one piece, up to four tokens,
  one a byte. So each non-ASCII character may add as many tokens as it has bytes past its
  first (`wide_bytes`). A server that batches several tokens of ASCII text into one event
  is still counted low: no bound exists short of the text's length, which would cut every
  answer short.
"""

from __future__ import annotations


def wide_bytes(text: str) -> int:
    """The UTF-8 bytes of `text` past the first of each character: the tokens its
    non-ASCII characters may take beyond one a piece."""
    if text.isascii():
        return 0
    return len(text.encode("utf-8")) - len(text)
