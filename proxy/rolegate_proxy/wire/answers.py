"""What a provider's answer says, as typed values, whatever its dialect: a completion, a
stream chunk (the answer events: text, tool-call pieces, reasoning, refusal, finish,
usage, an in-band error), an error. Each dialect's reader (`wire/openai.py`) reads its own
format into these, the caller's writer (`wire/chat_writer.py`) writes them in the caller's;
the request path reads only these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..core.arm_end import RequestFault
from ..core.tool_calls import ToolCall, ToolCallPiece


@dataclass(frozen=True, slots=True)
class UpstreamError:
    """An error answer in our terms (never its message text)."""

    # The HTTP status; None for an error inside a 200 body or a stream.
    status: int | None
    code: str | None = None
    request_fault: RequestFault | None = None
    # An aggregator had no machine left under our routing: the next model may answer.
    unroutable: bool = False
    machine: str | None = None

    def describe(self) -> str:
        """In our words: `HTTP 503 (server_error)`, `an error event`."""
        head = f"HTTP {self.status}" if self.status is not None else "an error inside the answer"
        return f"{head} ({self.code})" if self.code else head


class Completion(NamedTuple):
    """A non-streamed answer: its text and tool calls (kept only until it is judged) and
    its facts."""

    text: str
    finish_reason: str | None
    tool_calls: tuple[ToolCall, ...]
    refusal: bool
    prompt_tokens: int | None
    completion_tokens: int | None
    model: str | None
    machine: str | None


class NotTheProtocol(ValueError):
    """A 200 body that is not a chat completion (not UTF-8 JSON, or without `choices`)."""


NO_PIECES: tuple[ToolCallPiece, ...] = ()


# Not frozen: one is made per stream event, and a frozen dataclass sets each of its
# fields through object.__setattr__ (the hot loop; nothing changes one once made). Built
# positionally, per event.
@dataclass(slots=True)
class Chunk:
    """What one decoded stream event says. Its bytes are not in it: the relay forwards
    the upstream's own, as spans of what it read."""

    # The text of its content deltas (kept only until the answer is judged).
    content: str
    # Output of any kind, or a finish: what ends the wait for a first token.
    has_content: bool
    # Content, a refusal or a tool call: an answer, as opposed to reasoning only.
    has_output: bool
    # Its pieces of tool calls (NO_PIECES when none).
    tool_calls: tuple[ToolCallPiece, ...]
    # Its reasoning text (`reasoning_content`, or OpenRouter's `reasoning`).
    reasoning: str
    # Its refusal text (OpenAI's `refusal`).
    refusal: str
    # Pieces of output it carries, of every kind: what the rate test, the stall bound and
    # the token estimate count (SPEC E7).
    outputs: int
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    has_usage: bool
    model: str | None
    machine: str | None
    error: UpstreamError | None
