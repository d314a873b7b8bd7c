"""What a provider's answer says, as typed values, whatever its dialect: a completion, a
stream chunk, an error. Each dialect's wire module (`wire/openai.py`) reads its own format
into these; the request path reads only these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..core.arm_end import RequestFault


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
    """A non-streamed answer: its text (kept only until it is judged) and its facts."""

    text: str
    finish_reason: str | None
    has_tool_calls: bool
    prompt_tokens: int | None
    completion_tokens: int | None
    model: str | None
    machine: str | None


class NotTheProtocol(ValueError):
    """A 200 body that is not a chat completion (not UTF-8 JSON, or without `choices`)."""


# Not frozen: one is made per stream event, and a frozen dataclass sets each of its eleven
# fields through object.__setattr__ (the hot loop; nothing changes one once made).
@dataclass(slots=True)
class Chunk:
    """What one decoded stream event says. Its bytes are not in it: the relay forwards
    the upstream's own, as spans of what it read."""

    # The text of its content deltas (kept only until the answer is judged).
    content: str
    # Content, a tool call or reasoning: something a client shows.
    has_content: bool
    # Content or a tool call: an answer, as opposed to reasoning only.
    has_output: bool
    has_tool_calls: bool
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    has_usage: bool
    model: str | None
    machine: str | None
    error: UpstreamError | None
