"""The OpenAI chat-completions protocol, as rolegate speaks it to a provider: the request it
sends, and what it reads from a completion, a stream chunk and an error, as typed values.

The provider's own bytes are what reaches the client (pass-through); this module only
reads them. What it reads is routing metadata: finish reasons, token counts, the machine
and model an answer names (made safe by `names.upstream_name`), and of an error its
status, its code when that is one of a known set, whether it is about the request, and the
machine it names. The text of an error message is read only to classify it and is never
kept, logged or repeated (SPEC E6): an error that quotes the prompt, or a 401 that echoes
the key, goes no further than this module.
"""

from __future__ import annotations

from typing import Any, Final

import orjson

from ..core.arm_end import RequestFault
from ..core.exclusions import is_request_fault
from ..core.routing import MachineRouting
from ..core.tool_calls import ToolCallPiece, assembled
from .aggregator import provider_field
from .answers import NO_PIECES, Chunk, Completion, NotTheProtocol, UpstreamError
from .caller_provider import NO_PREFERENCES, CallerProvider
from .chat_request import EncodedBody
from .names import upstream_name
from .sse import decode_event_json, encode_event, event_data

# Error codes and types the OpenAI-compatible servers we know send; one of these may be
# repeated in a decision row or to the client. Anything else is left out.
KNOWN_CODES: Final = frozenset(
    {
        "authentication_error",
        "content_filter",
        "content_policy_violation",
        "context_length_exceeded",
        "insufficient_quota",
        "invalid_api_key",
        "invalid_request_error",
        "model_not_found",
        "not_found_error",
        "overloaded_error",
        "permission_error",
        "rate_limit_error",
        "rate_limit_exceeded",
        "server_error",
        "service_unavailable",
        "timeout",
    }
)
_CONTEXT_MARKERS: Final = ("context_length", "context length", "maximum context", "too many tokens")
_FILTER_MARKERS: Final = (
    "content_filter", "content filter", "content_policy", "moderation", "flagged"
)  # fmt: skip
# OpenRouter's answer when no machine is left for the model under the routing it was sent:
# about the candidate, not the request.
_UNROUTABLE_MARKERS: Final = ("no endpoints found",)


def parse_error(status: int | None, body: bytes | dict[str, Any], *, named: bool) -> UpstreamError:
    """An error status's body, or the error object of a 200 body or a chunk (`status` None).
    `named`: the provider names machines in its answers (an aggregator)."""
    payload = body if isinstance(body, dict) else _json_object(body)
    error = payload.get("error") if payload is not None else None
    text = ""
    code: str | None = None
    if isinstance(error, dict):
        for candidate in (error.get("code"), error.get("type")):
            if isinstance(candidate, str) and candidate in KNOWN_CODES:
                code = candidate
                break
        text = " ".join(str(error.get(k) or "") for k in ("code", "type", "message")).lower()
    elif isinstance(error, str):
        text = error.lower()
    unroutable = status == 404 and any(marker in text for marker in _UNROUTABLE_MARKERS)
    fault = None
    if status is not None and is_request_fault(status) and not unroutable:
        fault = _request_fault(text)
    return UpstreamError(
        status, code, fault, unroutable, machine_named_in(payload) if named else None
    )


def _request_fault(text: str) -> RequestFault:
    if any(marker in text for marker in _CONTEXT_MARKERS):
        return RequestFault.CONTEXT_LENGTH
    if any(marker in text for marker in _FILTER_MARKERS):
        return RequestFault.CONTENT_FILTER
    return RequestFault.INVALID


def machine_named_in(payload: dict[str, Any] | None) -> str | None:
    """The sub-provider an aggregator's answer names: `provider` at the top level, or
    OpenRouter's `error.metadata.provider_name`."""
    if payload is None:
        return None
    named = upstream_name(payload.get("provider"))
    if named is not None:
        return named
    error = payload.get("error")
    metadata = error.get("metadata") if isinstance(error, dict) else None
    if isinstance(metadata, dict):
        return upstream_name(metadata.get("provider_name"))
    return None


# --- the request -------------------------------------------------------------------------


def chat_url(endpoint: str) -> str:
    return endpoint.rstrip("/") + "/chat/completions"


def request_body(
    body: EncodedBody, model: str, routing: MachineRouting | None, caller: CallerProvider
) -> bytes:
    """The client's body with the role replaced by the concrete model and, for an
    aggregator, the role's routing merged with the caller's preferences as its `provider`
    field. A provider that is its one machine gets no `provider` field: it routes nothing."""
    if caller is not NO_PREFERENCES:
        return body.with_head(_head(model, routing, caller))
    # Most callers state no preferences: their heads are the same few per model and
    # routing, encoded once (bounded: routings differ in their machines' order).
    # (Keyed by the routing's parts: a plain tuple hashes and compares in C.)
    key = (model,) if routing is None else (model, routing.kind, routing.machines, routing.ignore)
    head = _HEADS.get(key)
    if head is None:
        if len(_HEADS) >= MAX_HEADS:
            _HEADS.clear()
        head = _HEADS[key] = _head(model, routing, NO_PREFERENCES)
    return body.with_head(head)


# The encoded heads of callers without preferences, by model and routing.
MAX_HEADS: Final = 1024
_HEADS: dict[tuple[object, ...], bytes] = {}


def _head(model: str, routing: MachineRouting | None, caller: CallerProvider) -> bytes:
    head = (
        {"model": model}
        if routing is None
        else {"model": model, "provider": provider_field(routing, caller)}
    )
    return orjson.dumps(head)


def request_headers(key: str | None, *, stream: bool) -> dict[str, str]:
    headers = {
        "Content-Type": "application/json",
        "Accept": "text/event-stream" if stream else "application/json",
    }
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return headers


# --- answers -----------------------------------------------------------------------------


def parse_completion(raw: bytes, *, named: bool) -> Completion | UpstreamError:
    """A 200 body: the completion, or the error object it carries instead. Raises
    NotTheProtocol for anything else. Decoded as UTF-8 whatever the Content-Type says."""
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise NotTheProtocol("not UTF-8 JSON") from None
    if not isinstance(payload, dict):
        raise NotTheProtocol("not a JSON object")
    choices = payload.get("choices")
    if not isinstance(choices, list):
        if isinstance(payload.get("error"), (dict, str)):
            return parse_error(None, payload, named=named)
        raise NotTheProtocol("no `choices`")
    first = choices[0] if choices and isinstance(choices[0], dict) else {}
    message = first.get("message")
    message = message if isinstance(message, dict) else {}
    content = message.get("content")
    usage = payload.get("usage")
    return Completion(
        content if isinstance(content, str) else "",  # text
        _finish_reason(first),  # finish_reason
        assembled(_tool_call_pieces(message, 0, whole=True)),  # tool_calls
        bool(_text(message, "refusal")),  # refusal
        _count(usage, "prompt_tokens"),  # prompt_tokens
        _count(usage, "completion_tokens"),  # completion_tokens
        upstream_name(payload.get("model")),  # model
        upstream_name(payload.get("provider")) if named else None,  # machine
    )


class ChunkReader:
    """Reads one stream's events (their `data`), in order.

    Nearly every event of an answer is a content delta whose bytes are the event before's
    but for the text: same id, model, machine, the one choice, no finish reason, no usage.
    Once one such event has been read whole, and its text's place in its bytes is beyond
    doubt (`_around_text`), a later event made of the same bytes around another JSON string
    is that string's text (`str`) and nothing else, read without parsing the rest: a JSON
    reader is context-free, so a string in the same place parses the same document with
    only that value changed. The event it was learned from went out whole first, so its
    consumers have the model and machine it names. Anything else is parsed whole
    (`read_chunk`), and a string that is no JSON string falls back to that too."""

    __slots__ = ("_after", "_before", "_named")

    def __init__(self, *, named: bool) -> None:
        self._named = named
        # The bytes around the text of the content delta learned from; none yet.
        self._before: bytes | None = None
        self._after = b""

    @staticmethod
    def rewrite(event: bytes, chunk: Chunk) -> bytes:
        """The event (one block, as framed) saying `chunk`'s text and reasoning instead of
        its own, and nothing else changed: its ids, its logprobs, its finish, its tool
        calls and usage stay the provider's. For a seam in a stream whose caller speaks
        this protocol too (an echo trimmed, reasoning held back)."""
        payload = decode_event_json(event_data(event))
        choices = payload.get("choices")
        first = choices[0] if type(choices) is list and choices else None
        delta = first.get("delta") if type(first) is dict else None
        if type(delta) is dict:
            if chunk.content:
                delta["content"] = chunk.content
            elif _text(delta, "content"):
                delta["content"] = ""
            if not chunk.reasoning:
                for name in ("reasoning_content", "reasoning"):
                    delta.pop(name, None)
        return encode_event(payload)

    def read(self, data: bytes) -> Chunk | str:
        """The event's chunk, or (a content delta like the one learned from) its text.
        Raises `sse.MalformedEvent` for data that is not a JSON object."""
        before = self._before
        if (
            before is not None
            and len(data) > len(before) + len(self._after)
            and data.startswith(before)
            and data.endswith(self._after)
        ):
            text = _json_text(data[len(before) : len(data) - len(self._after)])
            if text:
                return text
        payload = decode_event_json(data)
        if before is None and (text := _plain_text(payload)) is not None:
            around = _around_text(data, text)
            if around is not None:
                self._before, self._after = around
        return read_chunk(payload, named=self._named)


def _json_text(token: bytes) -> str | None:
    """The text a JSON string token spells; None for anything else."""
    try:
        text = orjson.loads(token)
    except orjson.JSONDecodeError:
        return None
    return text if type(text) is str else None


def _plain_text(payload: dict[str, Any]) -> str | None:
    """The text of a chunk that says nothing else `read_chunk` reads: one choice, whose
    delta has text and nothing else that is not empty (its role aside), no finish reason,
    no usage, no error (its model and machine aside). None for any other chunk: a later
    event in its shape is read as its text alone, so whatever else the shape held would
    be lost."""
    choices = payload.get("choices")
    if type(choices) is not list or len(choices) != 1 or "usage" in payload:
        return None
    if "error" in payload:
        return None
    choice = choices[0]
    delta = choice.get("delta") if type(choice) is dict else None
    if type(delta) is not dict or choice.get("finish_reason"):
        return None
    for key, value in delta.items():
        if value and key not in _PLAIN_KEYS:
            return None
    content = delta.get("content")
    return content if type(content) is str and content else None


# What a plain text delta may say besides its text.
_PLAIN_KEYS: Final = frozenset({"content", "role"})
_CONTENT_KEY = b'"content":'
_QUOTE = 0x22
_BACKSLASH = 0x5C


def _around_text(data: bytes, text: str) -> tuple[bytes, bytes] | None:
    """The bytes before and after the JSON string that is this plain content delta's text,
    when no doubt is possible: the text follows the only `"content":` outside it, and no
    backslash is outside it. Then every key outside the string is spelled as it reads
    (an escape would need a backslash), so that key is the only `content` key of the
    document, the one the text was read from; and with every quote outside the string a
    delimiter, an even count before the key puts the key outside any string."""
    key = data.find(_CONTENT_KEY)
    start = key + len(_CONTENT_KEY)
    if key < 0 or start >= len(data) or data[start] != _QUOTE:
        return None
    end = _string_end(data, start)
    if end is None:
        return None
    before, after = data[:start], data[end:]
    if (
        _BACKSLASH in before
        or _BACKSLASH in after
        or before.count(b'"') % 2
        or before.count(b'"content"') != 1
        or b'"content"' in after
        or _json_text(data[start:end]) != text
    ):
        return None
    return before, after


def _string_end(data: bytes, start: int) -> int | None:
    """Just past the JSON string opening at `start`: its first quote preceded by an even
    number of backslashes (an odd number escapes it)."""
    at = start + 1
    while (at := data.find(b'"', at)) >= 0:
        escapes = 0
        while data[at - 1 - escapes] == _BACKSLASH:
            escapes += 1
        if escapes % 2 == 0:
            return at + 1
        at += 1
    return None


def stream_reader(*, named: bool) -> ChunkReader:
    """A reader for one stream's events (`named`: the provider names machines)."""
    return ChunkReader(named=named)


def read_chunk(payload: dict[str, Any], *, named: bool) -> Chunk:
    """One event's answer events: every choice's text, reasoning, refusal and tool-call
    pieces, its finish and usage, or the error it carries instead."""
    if isinstance(payload.get("error"), (dict, str)):
        error = parse_error(None, payload, named=named)
        return Chunk(
            "", False, False, NO_PIECES, "", "", 0, None, None, None, False, None,
            error.machine, error,
        )  # fmt: skip
    texts: list[str] = []
    reasoning = refusal = ""
    pieces: tuple[ToolCallPiece, ...] = NO_PIECES
    outputs = 0
    has_output = False
    finish: str | None = None
    for at, choice in enumerate(payload.get("choices") or ()):
        if not isinstance(choice, dict):
            continue
        finish = _finish_reason(choice) or finish
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            continue
        index = choice.get("index")
        index = index if type(index) is int else at
        if content := _text(delta, "content"):
            texts.append(content)
            outputs += 1
            has_output = True
        if thought := _reasoning(delta):
            reasoning += thought
            outputs += 1
        if refused := _text(delta, "refusal"):
            refusal += refused
            outputs += 1
            has_output = True
        if delta.get("tool_calls") or delta.get("function_call"):
            found = tuple(_tool_call_pieces(delta, index, whole=False))
            if found:
                pieces = found if not pieces else (*pieces, *found)
                outputs += len(found)
                has_output = True
    usage = payload.get("usage")
    return Chunk(
        "".join(texts),
        outputs > 0 or finish is not None,
        has_output,
        pieces,
        reasoning,
        refusal,
        outputs,
        finish,
        None if usage is None else _count(usage, "prompt_tokens"),
        None if usage is None else _count(usage, "completion_tokens"),
        "usage" in payload,
        upstream_name(payload.get("model")),
        upstream_name(payload.get("provider")) if named else None,
        None,
    )


def _text(fields: dict[str, Any], name: str) -> str:
    value = fields.get(name)
    return value if type(value) is str else ""


def _reasoning(delta: dict[str, Any]) -> str:
    """Reasoning text: `reasoning_content` (llama.cpp, vLLM, DeepSeek) or OpenRouter's
    `reasoning`."""
    return _text(delta, "reasoning_content") or _text(delta, "reasoning")


def _tool_call_pieces(fields: dict[str, Any], choice: int, *, whole: bool) -> list[ToolCallPiece]:
    """The tool-call pieces of a delta (`whole`: of a complete message, one per call):
    `tool_calls` entries of function or custom tools, and the legacy `function_call` as
    call 0. An entry that is not an object is skipped."""
    pieces: list[ToolCallPiece] = []
    calls = fields.get("tool_calls")
    for at, call in enumerate(calls if type(calls) is list else ()):
        if type(call) is not dict:
            continue
        index = call.get("index")
        custom = call.get("type") == "custom" or type(call.get("custom")) is dict
        spec = call.get("custom" if custom else "function")
        spec = spec if type(spec) is dict else {}
        pieces.append(
            ToolCallPiece(
                index if type(index) is int and not whole else at,
                _text(call, "id") or None,
                _text(spec, "name") or None,
                _text(spec, "input" if custom else "arguments"),
                choice,
                custom,
            )
        )
    legacy = fields.get("function_call")
    if type(legacy) is dict:
        name = _text(legacy, "name") or None
        pieces.append(ToolCallPiece(0, None, name, _text(legacy, "arguments"), choice))
    return pieces


def _finish_reason(choice: dict[str, Any]) -> str | None:
    reason = choice.get("finish_reason")
    return reason if isinstance(reason, str) and reason else None


def _count(usage: object, name: str) -> int | None:
    """A token count of an answer's `usage` object (None: absent or not a count)."""
    count = usage.get(name) if isinstance(usage, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else None


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return payload if isinstance(payload, dict) else None
