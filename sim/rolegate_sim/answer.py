"""Answers that are more than text: the pieces they are generated in, each piece's `delta`
as it goes on the wire, and the message the pieces add up to when not streamed.

A piece is to such an answer what a token is to a plain one: one event, one step of
pacing, one unit of `max_tokens`, of a fault's `afterTokens` or `atEvent`, and of usage.
A plain text answer never comes here: it streams from the tokens `state.ModelState`
encoded once per scenario, the path the benchmarks measure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from rolegate_sim.text import encode_json_string


class PieceKind(Enum):
    REASONING = "reasoning"
    CONTENT = "content"


@dataclass(frozen=True, slots=True)
class Piece:
    kind: PieceKind
    # The reasoning or content token.
    text: str
    # The chunk's `delta` object, JSON-encoded.
    delta: bytes


@dataclass(frozen=True, slots=True)
class RichAnswer:
    """The pieces of one answer, in the order they are generated."""

    pieces: tuple[Piece, ...]
    # The message field reasoning goes in (the scenario's `reasoningField`).
    reasoning_field: str

    def truncated(self, count: int) -> RichAnswer:
        """The first `count` pieces: what a `max_tokens` of `count` lets through."""
        return RichAnswer(self.pieces[:count], self.reasoning_field)

    def deltas(self) -> tuple[bytes, ...]:
        return tuple(piece.delta for piece in self.pieces)

    def message(self) -> dict[str, Any]:
        """The non-streamed `message` these pieces add up to."""
        reasoning: list[str] = []
        content: list[str] = []
        for piece in self.pieces:
            (reasoning if piece.kind is PieceKind.REASONING else content).append(piece.text)
        message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
        if reasoning:
            message[self.reasoning_field] = "".join(reasoning)
        return message


def compose(
    reasoning: Sequence[str], content: Sequence[str], *, reasoning_field: str
) -> RichAnswer:
    """Reasoning first, then the reply, as a thinking model generates them."""
    # Both reasoning fields are ASCII identifiers: no escaping needed.
    reasoning_key = b'{"' + reasoning_field.encode("ascii") + b'":'
    pieces = [
        Piece(PieceKind.REASONING, token, reasoning_key + encode_json_string(token) + b"}")
        for token in reasoning
    ]
    pieces.extend(
        Piece(PieceKind.CONTENT, token, b'{"content":' + encode_json_string(token) + b"}")
        for token in content
    )
    return RichAnswer(tuple(pieces), reasoning_field)
