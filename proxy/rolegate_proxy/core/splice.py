"""Where a continuation meets what the client already has (SPEC E7): each byte once, and
the caller's stop sequences kept across the seam.

A machine asked to continue a partial assistant message may begin by repeating it: llama
server re-sends the prefilled text before going on. And a stop sequence can straddle the
seam: the client has `...ST`, the continuation writes `OP...`, and neither machine saw
`STOP` in its own output. `Splice` reads the continuation's first text, holding it only
as long as either question is open, and then steps aside.

Whether a machine echoes is declared (`echoesPartialMessage`), never guessed: an answer
may legitimately repeat itself (`a a a`, a table's identical rows, a code block written
twice), so a continuation that begins with the delivered text is not proof of an echo,
and trimming one that is not would lose the caller's text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Passed(NamedTuple):
    """What of a continuation's text goes on to the client now."""

    text: str
    # A stop sequence ends at the seam: the answer is over, nothing more is forwarded.
    stopped: bool = False


_NOTHING = Passed("")


class Splice:
    """The first text of one continuation, against the text the client has.

    The echo, of a machine that declares one: the continuation's start is dropped when it
    is the delivered text whole (or the delivered text less its trailing whitespace, which
    a server may trim from a prefill); while what came so far is still the start of the
    delivered text the question is open, and it is held. A continuation that departs from
    it before that is no echo after all, and passes whole.

    The seam: once the echo is settled, a stop sequence that starts in the delivered text's
    tail and ends in the continuation stops the answer there (the stop sequence is not
    part of the answer, as a machine's own stop is not; its first part was already
    delivered and cannot be taken back)."""

    __slots__ = ("_delivered", "_echoing", "_seen", "_stops", "_tail", "settled")

    def __init__(self, delivered: str, stops: Sequence[str], *, echoes: bool) -> None:
        self._delivered = delivered
        self._stops = tuple(stop for stop in stops if stop)
        longest = max(map(len, self._stops), default=0)
        self._tail = delivered[max(0, len(delivered) - longest + 1) :] if longest > 1 else ""
        self._echoing = echoes and bool(delivered)
        # The continuation's text held while a question is open.
        self._seen = ""
        # Nothing is open any more: the continuation passes as it comes.
        self.settled = not self._echoing and not self._tail

    def feed(self, text: str) -> Passed:
        """The continuation's next text; what of it (and of what was held) goes on now."""
        if self.settled:
            return Passed(text)
        seen = self._seen = self._seen + text
        if self._echoing:
            rest = self._after_echo(seen)
            if rest is None:
                return _NOTHING
            self._echoing = False
            seen = self._seen = rest
        return self._at_seam(seen)

    def interrupt(self) -> str:
        """Output other than text came (a tool call, a finish): the text is over. An echo
        still open was an echo; text held at the seam goes on, no stop having ended."""
        held = "" if self._echoing else self._seen
        self._echoing = False
        self._seen = ""
        self.settled = True
        return held

    def _after_echo(self, seen: str) -> str | None:
        """What follows the echo in `seen` (all of it when it is none); None while open."""
        delivered = self._delivered
        if seen.startswith(delivered):
            return seen[len(delivered) :]
        if delivered.startswith(seen):
            return None
        trimmed = delivered.rstrip()
        if trimmed and trimmed != delivered and seen.startswith(trimmed):
            return seen[len(trimmed) :]
        return seen

    def _at_seam(self, seen: str) -> Passed:
        tail = self._tail
        if not tail:
            self.settled = True
            self._seen = ""
            return Passed(seen)
        joined = tail + seen
        open_ = False
        for stop in self._stops:
            for start in range(max(0, len(tail) - len(stop) + 1), len(tail)):
                piece = joined[start : start + len(stop)]
                if piece == stop:
                    self.settled = True
                    self._seen = ""
                    return Passed("", stopped=True)
                if len(piece) < len(stop) and stop.startswith(piece):
                    open_ = True  # the stop could still end in text to come
        if open_:
            return _NOTHING
        self.settled = True
        self._seen = ""
        return Passed(seen)
