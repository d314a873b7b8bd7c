"""The typed answer events (SPEC E7): what the OpenAI reader makes of text, reasoning,
refusals and tool calls in pieces, what the chat writer makes of them again, and how tool
calls are put together and judged (SPEC A2)."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rolegate_policy.signatures import Signature
from rolegate_proxy.core.tokens import wide_bytes
from rolegate_proxy.core.tool_calls import (
    NO_TOOLS,
    DeclaredTools,
    ToolCall,
    ToolCallPiece,
    ToolCalls,
    declared_tools,
    tool_call_fault,
)
from rolegate_proxy.wire import openai
from rolegate_proxy.wire.answers import NO_PIECES, Chunk, Completion
from rolegate_proxy.wire.chat_writer import ChatWriter
from rolegate_proxy.wire.sse import decode_event_json


def _chunk(delta: dict[str, Any], **choice: Any) -> Chunk:
    payload = {"id": "c", "model": "m", "choices": [{"index": 0, "delta": delta, **choice}]}
    return openai.read_chunk(payload, named=False)


def test_a_tool_call_streamed_in_pieces_is_read_as_pieces_and_counted_as_output() -> None:
    opening = {"index": 0, "id": "call_1", "type": "function",
               "function": {"name": "write_file", "arguments": ""}}  # fmt: skip
    first = _chunk({"tool_calls": [opening]})
    assert first.tool_calls == (ToolCallPiece(0, "call_1", "write_file", ""),)
    assert (first.has_content, first.has_output, first.outputs) == (True, True, 1)
    fragment = _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"pa'}}]})
    assert fragment.tool_calls == (ToolCallPiece(0, None, None, '{"pa'),)
    assert fragment.outputs == 1
    assert fragment.content == ""


def test_parallel_calls_in_one_event_are_each_a_piece() -> None:
    chunk = _chunk({"tool_calls": [
        {"index": 0, "function": {"arguments": "{}"}},
        {"index": 1, "id": "b", "function": {"name": "ls", "arguments": ""}},
    ]})  # fmt: skip
    assert [piece.call for piece in chunk.tool_calls] == [0, 1]
    assert chunk.outputs == 2


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_reasoning_is_output_but_not_an_answer(field: str) -> None:
    chunk = _chunk({field: "Let me think."})
    assert chunk.reasoning == "Let me think."
    assert chunk.content == ""
    assert (chunk.has_content, chunk.has_output, chunk.outputs) == (True, False, 1)


def test_a_refusal_is_output_and_an_answer() -> None:
    chunk = _chunk({"refusal": "I can't help with that."})
    assert (chunk.refusal, chunk.has_output, chunk.outputs) == ("I can't help with that.", True, 1)


def test_a_custom_tool_call_and_the_legacy_function_call_are_tool_calls() -> None:
    call = {"index": 0, "id": "c1", "type": "custom",
            "custom": {"name": "apply_patch", "input": "*** Begin"}}  # fmt: skip
    custom = _chunk({"tool_calls": [call]})
    assert custom.tool_calls == (ToolCallPiece(0, "c1", "apply_patch", "*** Begin", 0, True),)
    legacy = _chunk({"function_call": {"name": "ls", "arguments": "{}"}})
    assert legacy.tool_calls == (ToolCallPiece(0, None, "ls", "{}"),)


def test_a_non_streamed_completion_carries_its_calls_whole() -> None:
    body = {
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": None, "reasoning_content": "hm",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "ls", "arguments": "{}"}},
                {"id": "b", "type": "function",
                 "function": {"name": "cat", "arguments": '{"p": 1}'}},
            ]}}],
    }  # fmt: skip
    completion = openai.parse_completion(orjson.dumps(body), named=False)
    assert isinstance(completion, Completion)
    assert completion.tool_calls == (ToolCall("a", "ls", "{}"), ToolCall("b", "cat", '{"p": 1}'))
    assert completion.text == ""
    assert completion.finish_reason == "tool_calls"


def test_calls_are_assembled_in_the_order_they_began_however_their_pieces_interleave() -> None:
    calls = ToolCalls()
    for piece in (
        ToolCallPiece(1, "b", "second", ""),
        ToolCallPiece(0, "a", "first", '{"x"'),
        ToolCallPiece(1, None, None, "[1,"),
        ToolCallPiece(0, None, None, ": 1}"),
        ToolCallPiece(1, None, None, "2]"),
    ):
        calls.add(piece)
    assert calls.calls() == (ToolCall("b", "second", "[1,2]"), ToolCall("a", "first", '{"x": 1}'))


READ = DeclaredTools(frozenset({"read_file"}), frozenset({"apply_patch"}))


@pytest.mark.parametrize(
    ("calls", "fault"),
    [
        ([ToolCall("a", "read_file", '{"path": "x"}')], None),
        ([ToolCall("a", "read_file", "")], None),  # no arguments: `{}` to a client
        ([ToolCall("a", "apply_patch", "*** not json", custom=True)], None),
        ([ToolCall("a", "read_file", '{"path": "x"')], Signature.TOOL_ARGUMENTS_NOT_JSON),
        ([ToolCall("a", "rm_rf", "{}")], Signature.UNDECLARED_TOOL),
        ([ToolCall("a", "read_file", "{}"), ToolCall("b", "read_file", "{")],
         Signature.TOOL_ARGUMENTS_NOT_JSON),
    ],
)  # fmt: skip
def test_a_call_is_broken_when_its_arguments_are_not_json_or_its_tool_undeclared(
    calls: list[ToolCall], fault: Signature | None
) -> None:
    assert tool_call_fault(calls, READ) is fault


def test_the_tools_a_request_declares() -> None:
    body = {
        "tools": [
            {"type": "function", "function": {"name": "read_file", "parameters": {}}},
            {"type": "custom", "custom": {"name": "apply_patch"}},
            "not a tool",
            {"type": "function"},
        ],
        "functions": [{"name": "legacy"}],
    }
    assert declared_tools(body) == DeclaredTools(
        frozenset({"read_file", "legacy"}), frozenset({"apply_patch"})
    )
    assert declared_tools({}) is NO_TOOLS
    # A request that declares none: any call is to an undeclared tool.
    assert tool_call_fault([ToolCall("a", "read_file", "{}")], NO_TOOLS) is (
        Signature.UNDECLARED_TOOL
    )


PIECE_TEXT = st.text(max_size=12)
PIECES = st.lists(
    st.builds(
        ToolCallPiece,
        st.integers(0, 3),
        st.none() | st.text(min_size=1, max_size=5),
        st.none() | st.text(min_size=1, max_size=8),
        PIECE_TEXT,
        st.just(0),
        st.booleans(),
    ),
    max_size=3,
)


@given(
    content=PIECE_TEXT,
    reasoning=PIECE_TEXT,
    refusal=PIECE_TEXT,
    pieces=PIECES,
    finish=st.none() | st.sampled_from(["stop", "length", "tool_calls"]),
)
def test_what_the_writer_writes_the_reader_reads_back(
    content: str, reasoning: str, refusal: str, pieces: list[ToolCallPiece], finish: str | None
) -> None:
    """A chunk rolegate writes anew (at a seam) says to the client exactly what it said."""
    outputs = bool(content) + bool(reasoning) + bool(refusal) + len(pieces)
    chunk = Chunk(
        content, outputs > 0 or finish is not None, bool(content or refusal or pieces),
        tuple(pieces) or NO_PIECES, reasoning, refusal, outputs, finish, None, None, False,
        "m", None, None,
    )  # fmt: skip
    event = ChatWriter("r1").chunk(chunk, "m")
    assert event.startswith(b"data: ")
    assert event.endswith(b"\n\n")
    payload = decode_event_json(event[6:-2])
    assert payload["object"] == "chat.completion.chunk"
    assert openai.read_chunk(payload, named=False) == chunk
    json.loads(event[6:])  # one JSON document, whatever the text held


def test_a_seam_changes_a_providers_event_only_where_it_must() -> None:
    """The echo trimmed from a llama-server event keeps the logprobs of the token it
    generated, its id and its fingerprint; reasoning held back goes, the rest stays."""
    logprobs = {"content": [{"id": 3730, "token": " blue", "logprob": -2.29}]}
    event = b"data: " + orjson.dumps({
        "id": "chatcmpl-1", "system_fingerprint": "b0", "object": "chat.completion.chunk",
        "choices": [{"index": 0, "finish_reason": None, "logprobs": logprobs,
                     "delta": {"content": "The sea is wide and blue", "reasoning_content": "hm"}}],
    }) + b"\n\n"  # fmt: skip
    trimmed = _chunk({"content": " blue"})
    payload = decode_event_json(openai.ChunkReader.rewrite(event, trimmed)[6:-2])
    choice = payload["choices"][0]
    assert choice["delta"] == {"content": " blue"}
    assert choice["logprobs"] == logprobs
    assert (payload["id"], payload["system_fingerprint"]) == ("chatcmpl-1", "b0")


@pytest.mark.parametrize(
    ("text", "wide"),
    [("plain ascii", 0), ("café", 1), ("日本", 4), ("🎉", 3), ("𓀀𓀁", 6), ("", 0)],
)
def test_a_characters_wide_bytes_are_the_tokens_byte_fallback_may_add(text: str, wide: int) -> None:
    assert wide_bytes(text) == wide
