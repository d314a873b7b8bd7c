"""What rolegate itself writes into a caller's stream, whatever dialect served it: callers
speak OpenAI chat completions, so these are OpenAI's events. The upstream's own events are
forwarded as its bytes; only these are ours."""

from __future__ import annotations

import time
from typing import Final

from .sse import encode_event

DONE: Final = b"data: [DONE]\n\n"
# An SSE comment: clients ignore it, and their idle timers restart.
KEEPALIVE: Final = b": rolegate: working\n\n"


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


def estimated_usage_event(
    request_id: str, model: str | None, prompt_tokens: int, completion_tokens: int
) -> bytes:
    """The usage chunk a caller asked for (`stream_options.include_usage`) when no upstream
    sent one, or when the answer was spliced from several: counted by rolegate, and marked
    `estimated` (prompt tokens are characters / 4, completion tokens the content deltas)."""
    return encode_event(
        {
            "id": f"rolegate-{request_id}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
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
