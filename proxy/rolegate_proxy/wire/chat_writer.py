"""The caller's protocol, OpenAI chat completions, as rolegate writes it into a stream:
answer events (`wire.answers.Chunk`) as chunks, a finish, its own usage count, `[DONE]`,
keep-alives and its errors.

When the caller's protocol is the provider's, the upstream's events are forwarded as its
bytes (pass-through) and only what rolegate adds is written here: an event it had to
change at a seam (a continuation's echo trimmed, reasoning held back), a finish it
supplies, its usage estimate, `[DONE]`, keep-alives and errors. A writer for another
caller protocol writes the same events in that protocol's grammar.
"""

from __future__ import annotations

import time
from typing import Any, Final

from .answers import Chunk
from .sse import encode_event

DONE: Final = b"data: [DONE]\n\n"
# An SSE comment: clients ignore it, and their idle timers restart.
KEEPALIVE: Final = b": rolegate: working\n\n"


class ChatWriter:
    """Writes one request's stream events in the chat-completions grammar."""

    __slots__ = ("_created", "_id")

    def __init__(self, request_id: str) -> None:
        self._id = f"rolegate-{request_id}"
        self._created = int(time.time())

    def chunk(self, chunk: Chunk, model: str | None) -> bytes:
        """An answer event as one chunk: its text, reasoning, refusal, tool-call pieces
        and finish, each choice in its place. The usage a chunk carries is not written:
        a seam's usage is rolegate's own (`usage`)."""
        delta: dict[str, Any] = {}
        if chunk.reasoning:
            delta["reasoning_content"] = chunk.reasoning
        if chunk.content:
            delta["content"] = chunk.content
        if chunk.refusal:
            delta["refusal"] = chunk.refusal
        choices: dict[int, dict[str, Any]] = {}
        for piece in chunk.tool_calls:
            call: dict[str, Any] = {"index": piece.call}
            if piece.id:
                call["id"] = piece.id
            function: dict[str, Any] = {}
            if piece.name:
                function["name"] = piece.name
                call["type"] = "custom" if piece.custom else "function"
            function["input" if piece.custom else "arguments"] = piece.arguments
            call["custom" if piece.custom else "function"] = function
            choice_delta = delta if piece.choice == 0 else choices.setdefault(piece.choice, {})
            choice_delta.setdefault("tool_calls", []).append(call)
        listed = [{"index": 0, "delta": delta, "finish_reason": chunk.finish_reason}]
        listed += [
            {"index": index, "delta": other, "finish_reason": None}
            for index, other in sorted(choices.items())
        ]
        return self._event(model, listed)

    def finish(self, model: str | None, reason: str) -> bytes:
        """The final chunk of an answer rolegate ends itself (a stop at a seam, the
        caller's token limit reached at a handover)."""
        return self._event(model, [{"index": 0, "delta": {}, "finish_reason": reason}])

    def usage(self, model: str | None, prompt_tokens: int, completion_tokens: int) -> bytes:
        """The usage chunk a caller asked for (`stream_options.include_usage`) when no
        upstream sent one, or when the answer was spliced from several: counted by
        rolegate, and marked `estimated`."""
        return encode_event(
            {
                "id": self._id,
                "object": "chat.completion.chunk",
                "created": self._created,
                "model": model or "",
                "choices": [],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                    "estimated": True,
                },
            }
        )

    def _event(self, model: str | None, choices: list[dict[str, Any]]) -> bytes:
        return encode_event(
            {
                "id": self._id,
                "object": "chat.completion.chunk",
                "created": self._created,
                "model": model or "",
                "choices": choices,
            }
        )


def incomplete_event(message: str) -> bytes:
    """The error event that ends a stream which broke after content reached the caller:
    never a truncated answer presented as complete (SPEC E4). `message` is in our words."""
    return encode_event(
        {
            "error": {
                "message": message + "; the answer above is incomplete, retry the request",
                "type": "upstream_error",
                "code": "stream_incomplete",
            }
        }
    )
