"""Answers that are more than text: which tool calls a request lets the model make, the
pieces an answer is generated in, each piece's `delta` as it goes on the wire, and the
message the pieces add up to when not streamed.

A piece is to such an answer what a token is to a plain one: one event, one step of
pacing, one unit of `max_tokens`, of a fault's `afterTokens` or `atEvent`, and of usage.
A plain text answer never comes here: it streams from the tokens `state.ModelState`
encoded once per scenario, the path the benchmarks measure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from rolegate_sim.scenario import MalformedToolCallFault, ToolCallSpec
from rolegate_sim.stream import dumps
from rolegate_sim.text import encode_json_string


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """What a request lets the model call (`tools`, `tool_choice`, `parallel_tool_calls`)."""

    # A non-empty `tools` list, and a `tool_choice` other than "none".
    allowed: bool
    # The one function a `tool_choice` object names.
    only: str | None = None
    # `parallel_tool_calls: false`: one call at most.
    parallel: bool = True


NO_TOOLS = ToolChoice(allowed=False)


def select_calls(calls: Sequence[ToolCallSpec], choice: ToolChoice) -> tuple[ToolCallSpec, ...]:
    """The scenario's calls this request gets, in scenario order."""
    if not choice.allowed:
        return ()
    chosen = tuple(call for call in calls if choice.only is None or call.name == choice.only)
    return chosen if choice.parallel else chosen[:1]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call as this answer sends it: its id decided, its name and arguments as sent."""

    id: str
    name: str
    arguments: str


def malformed(call: ToolCall, fault: MalformedToolCallFault) -> ToolCall:
    """`call` with the flaw the fault gives it."""
    if fault.flaw == "name":
        return replace(call, name=call.name + "_undeclared")
    return replace(call, arguments=call.arguments[:-1])


class PieceKind(Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    # A tool call's first event: its index, id, type and name, with empty arguments.
    CALL = "call"
    # One fragment of a tool call's arguments.
    ARGUMENTS = "arguments"


@dataclass(frozen=True, slots=True)
class Piece:
    kind: PieceKind
    # The reasoning or content token, the call's name, or the fragment of its arguments.
    text: str
    # The chunk's `delta` object, JSON-encoded.
    delta: bytes
    # The tool call a CALL or ARGUMENTS piece belongs to: its index in the answer.
    call: int = -1


@dataclass(frozen=True, slots=True)
class RichAnswer:
    """The pieces of one answer, in the order they are generated."""

    pieces: tuple[Piece, ...]
    # Every call the answer makes, by index; `pieces` may stop before some (max_tokens).
    calls: tuple[ToolCall, ...]
    # The message field reasoning goes in (the scenario's `reasoningField`).
    reasoning_field: str

    def truncated(self, count: int) -> RichAnswer:
        """The first `count` pieces: what a `max_tokens` of `count` lets through."""
        return RichAnswer(self.pieces[:count], self.calls, self.reasoning_field)

    def deltas(self) -> tuple[bytes, ...]:
        return tuple(piece.delta for piece in self.pieces)

    def call_starts(self) -> tuple[int, ...]:
        """The index of each tool call's first piece, in order."""
        return tuple(i for i, piece in enumerate(self.pieces) if piece.kind is PieceKind.CALL)

    def message(self) -> dict[str, Any]:
        """The non-streamed `message` these pieces add up to: a call cut short by
        `max_tokens` has the arguments that were generated."""
        reasoning: list[str] = []
        content: list[str] = []
        arguments: dict[int, list[str]] = {}
        for piece in self.pieces:
            kind = piece.kind
            if kind is PieceKind.REASONING:
                reasoning.append(piece.text)
            elif kind is PieceKind.CONTENT:
                content.append(piece.text)
            elif kind is PieceKind.CALL:
                arguments[piece.call] = []
            else:
                arguments[piece.call].append(piece.text)
        text = "".join(content)
        # OpenAI's shape: no text beside tool calls is `null`, not "".
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None if not text and arguments else text,
        }
        if reasoning:
            message[self.reasoning_field] = "".join(reasoning)
        if arguments:
            message["tool_calls"] = [
                _call_json(self.calls[index], "".join(fragments))
                for index, fragments in arguments.items()
            ]
        return message


def compose(
    reasoning: Sequence[str],
    content: Sequence[str],
    calls: Sequence[ToolCall],
    *,
    reasoning_field: str,
    argument_piece_chars: int,
) -> RichAnswer:
    """Reasoning, then the reply, then the tool calls one after another, as a model
    generates them (and OpenAI streams calls)."""
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
    for index, call in enumerate(calls):
        head = {"index": index, **_call_json(call, "")}
        pieces.append(Piece(PieceKind.CALL, call.name, dumps({"tool_calls": [head]}), index))
        for fragment in fragments(call.arguments, argument_piece_chars):
            delta = {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}
            pieces.append(Piece(PieceKind.ARGUMENTS, fragment, dumps(delta), index))
    return RichAnswer(tuple(pieces), tuple(calls), reasoning_field)


def fragments(text: str, size: int) -> list[str]:
    """`text` in pieces of `size` characters (the last one shorter); none for ""."""
    return [text[i : i + size] for i in range(0, len(text), size)]


def _call_json(call: ToolCall, arguments: str) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": arguments},
    }
