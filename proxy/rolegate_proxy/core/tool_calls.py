"""Tool calls as an answer carries them, and what makes one broken (SPEC A2, E7).

A streamed answer writes its tool calls in pieces: the first piece of a call names its
place (its index among the choice's calls), its id and its tool; the pieces after it add
fragments of its arguments, often a few characters each, and several calls may be written
one after another or interleaved. `ToolCalls` puts them back together in the order they
came; `tool_call_fault` says whether the calls are what the request allows: arguments
that parse as JSON, tools the request declared. No text is kept beyond the request.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

import orjson

from rolegate_policy.signatures import Signature


class ToolCallPiece(NamedTuple):
    """One event's piece of one tool call."""

    # The call's index among its choice's calls (OpenAI's `tool_calls[].index`).
    call: int
    # On the call's first piece: its id and the tool it calls.
    id: str | None
    name: str | None
    # A fragment of the arguments' text (a custom tool's: of its free-form input).
    arguments: str
    # The choice it belongs to (a request with `n` > 1 has several).
    choice: int = 0
    # A custom tool (OpenAI's `type: custom`): its input is free text, never JSON.
    custom: bool = False


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One complete tool call."""

    id: str | None
    name: str
    arguments: str
    custom: bool = False


@dataclass(slots=True)
class _Building:
    id: str | None = None
    name: str = ""
    fragments: list[str] = field(default_factory=list)
    custom: bool = False


class ToolCalls:
    """The tool calls of one answer, assembled from their pieces as they come."""

    __slots__ = ("_calls",)

    def __init__(self) -> None:
        # By (choice, index), in the order each call's first piece came.
        self._calls: dict[tuple[int, int], _Building] = {}

    def add(self, piece: ToolCallPiece) -> None:
        call = self._calls.get((piece.choice, piece.call))
        if call is None:
            call = self._calls[piece.choice, piece.call] = _Building()
        if piece.id:
            call.id = piece.id
        if piece.name:
            # A name is sent whole on the call's first piece; a server that streams it in
            # pieces too is joined the same way as the arguments.
            call.name += piece.name
        if piece.arguments:
            call.fragments.append(piece.arguments)
        call.custom = call.custom or piece.custom

    def __bool__(self) -> bool:
        return bool(self._calls)

    def __len__(self) -> int:
        return len(self._calls)

    def calls(self) -> tuple[ToolCall, ...]:
        return tuple(
            ToolCall(call.id, call.name, "".join(call.fragments), call.custom)
            for call in self._calls.values()
        )


@dataclass(frozen=True, slots=True)
class DeclaredTools:
    """The tools a request declared: the names a call may use. Computed once per request."""

    # Function tools (`tools[].function.name`, and the legacy `functions[].name`).
    functions: frozenset[str] = frozenset()
    # Custom tools (`tools[].custom.name`): their input is free text.
    custom: frozenset[str] = frozenset()

    def declares(self, name: str) -> bool:
        return name in self.functions or name in self.custom


NO_TOOLS: Final = DeclaredTools()


def declared_tools(body: Mapping[str, Any]) -> DeclaredTools:
    """The tools a chat-completions body declares (malformed entries declare nothing)."""
    functions: set[str] = set()
    custom: set[str] = set()
    tools = body.get("tools")
    for tool in tools if isinstance(tools, list) else ():
        if not isinstance(tool, dict):
            continue
        kind = tool.get("type", "function")
        spec = tool.get(kind) if isinstance(kind, str) else None
        name = spec.get("name") if isinstance(spec, dict) else None
        if isinstance(name, str):
            (custom if kind == "custom" else functions).add(name)
    legacy = body.get("functions")
    for function in legacy if isinstance(legacy, list) else ():
        name = function.get("name") if isinstance(function, dict) else None
        if isinstance(name, str):
            functions.add(name)
    if not functions and not custom:
        return NO_TOOLS
    return DeclaredTools(frozenset(functions), frozenset(custom))


def tool_call_fault(calls: Sequence[ToolCall], declared: DeclaredTools) -> Signature | None:
    """What is wrong with an answer's tool calls, the model's fault either way: a call to a
    tool the request did not declare, or arguments that do not parse as JSON. None when
    every call is sound. Empty arguments are a call without any (`{}`), as clients read
    them; a custom tool's input is free text and never parsed."""
    for call in calls:
        if not declared.declares(call.name):
            return Signature.UNDECLARED_TOOL
    for call in calls:
        if call.custom or not call.arguments.strip():
            continue
        try:
            orjson.loads(call.arguments)
        except orjson.JSONDecodeError:
            return Signature.TOOL_ARGUMENTS_NOT_JSON
    return None


def assembled(pieces: Iterable[ToolCallPiece]) -> tuple[ToolCall, ...]:
    """The calls some pieces make (a non-streamed answer's, read as one piece each)."""
    calls = ToolCalls()
    for piece in pieces:
        calls.add(piece)
    return calls.calls()
