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
from .aggregator import provider_field
from .answers import Chunk, Completion, NotTheProtocol, UpstreamError
from .caller_provider import NO_PREFERENCES, CallerProvider
from .chat_request import EncodedBody
from .names import upstream_name

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
        bool(message.get("tool_calls")),  # has_tool_calls
        _count(usage, "prompt_tokens"),  # prompt_tokens
        _count(usage, "completion_tokens"),  # completion_tokens
        upstream_name(payload.get("model")),  # model
        upstream_name(payload.get("provider")) if named else None,  # machine
    )


def read_chunk(payload: dict[str, Any], raw: bytes, *, named: bool) -> Chunk:
    if isinstance(payload.get("error"), (dict, str)):
        error = parse_error(None, payload, named=named)
        return Chunk(
            raw, "", False, False, False, None, None, None, False, None, error.machine, error
        )
    texts: list[str] = []
    has_content = has_output = tool_calls = False
    finish: str | None = None
    for choice in payload.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        finish = _finish_reason(choice) or finish
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            continue
        content = delta.get("content")
        if isinstance(content, str) and content:
            texts.append(content)
        if delta.get("tool_calls"):
            tool_calls = True
        has_output = has_output or bool(content) or bool(delta.get("tool_calls"))
        has_content = has_content or has_output or bool(delta.get("reasoning"))
    usage = payload.get("usage")
    return Chunk(
        raw,
        "".join(texts),
        has_content or finish is not None,
        has_output,
        tool_calls,
        finish,
        None if usage is None else _count(usage, "prompt_tokens"),
        None if usage is None else _count(usage, "completion_tokens"),
        "usage" in payload,
        upstream_name(payload.get("model")),
        upstream_name(payload.get("provider")) if named else None,
        None,
    )


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
