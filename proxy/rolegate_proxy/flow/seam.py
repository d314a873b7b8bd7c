"""Where a continuation's events meet what the client already has (SPEC E7).

A machine that takes an answer over (a move, a rescue) writes the rest of it, and the
first of what it writes is checked at the seam (`core.splice.Splice`): an echo of the
delivered text from a machine declared to echo is dropped, a stop sequence across the
seam ends the answer there. Once the client has content, the continuation's reasoning is
held back: it would land after the answer had begun. An event that changes here is the
provider's event with that change alone (its reader's `rewrite`: ids and logprobs kept);
every other event is the upstream's own bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.splice import Splice
from ..wire.answers import NO_PIECES, Chunk


@dataclass(slots=True)
class Seam:
    # Open while the echo or a stop across the seam is undecided; None once settled.
    splice: Splice | None
    # The client has content: the continuation's reasoning is not forwarded.
    drop_reasoning: bool

    def through(self, chunk: Chunk) -> tuple[Chunk, bool]:
        """The chunk as the client gets it, and whether a stop sequence ended the answer
        at the seam. The very same chunk when nothing changed."""
        reasoning = "" if self.drop_reasoning else chunk.reasoning
        text = chunk.content
        splice = self.splice
        if splice is not None:
            passed = splice.feed(text) if text else None
            if passed is not None and passed.stopped:
                return chunk, True
            text = "" if passed is None else passed.text
            if chunk.tool_calls or chunk.finish_reason or chunk.refusal:
                text += splice.interrupt()  # the text is over: what was held goes on
            if splice.settled:
                self.splice = None
        if text == chunk.content and reasoning == chunk.reasoning:
            return chunk, False
        outputs = (
            chunk.outputs
            - bool(chunk.content) + bool(text)
            - bool(chunk.reasoning) + bool(reasoning)
        )  # fmt: skip
        return Chunk(
            text, outputs > 0 or chunk.finish_reason is not None, chunk.has_output or bool(text),
            chunk.tool_calls, reasoning, chunk.refusal, outputs, chunk.finish_reason,
            chunk.prompt_tokens, chunk.completion_tokens, chunk.has_usage, chunk.model,
            chunk.machine, None,
        ), False  # fmt: skip

    def rest(self, model: str | None) -> Chunk | None:
        """At the continuation's end: its text still held at the seam (no stop having
        ended it), as a chunk; an echo still open was an echo."""
        splice, self.splice = self.splice, None
        text = "" if splice is None else splice.interrupt()
        return as_chunk(text, model) if text else None


def as_chunk(item: Chunk | str, model: str | None) -> Chunk:
    """A decoded event as a chunk (text alone, as the text of a plain content chunk)."""
    if isinstance(item, Chunk):
        return item
    return Chunk(item, True, True, NO_PIECES, "", "", 1, None, None, None, False, model, None, None)
