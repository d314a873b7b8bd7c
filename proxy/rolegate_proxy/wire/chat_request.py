"""Validating the client's chat-completions request and choosing its role (SPEC E1, E2)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

from rolegate_policy.config import (
    CompiledRole,
    ProxyConfig,
)

from ..core.tool_calls import NO_TOOLS, DeclaredTools, declared_tools
from ..core.verdicts import PromptProfile, profile_texts, strings_in
from .caller_provider import NO_PREFERENCES, CallerProvider, parse_caller_provider, refuse_bypass
from .errors import ProxyError, bad_request

ROLE_HEADER = "X-Rolegate-Role"


# orjson writes at most this many levels of nesting; a body it could not write upstream is
# refused here, before anything is sent anywhere.
MAX_NESTING = 254


# Not frozen: one is made for every request (a frozen dataclass sets its field through
# object.__setattr__). Nothing changes one once made: hashed as if frozen.
@dataclass(slots=True, unsafe_hash=True)
class EncodedBody:
    """The client's body without `model` and `provider` (rolegate sets both per attempt,
    the `provider` field merged from the role's routing and the caller's preferences),
    encoded once per request as UTF-8 JSON: non-ASCII goes out as it came, never as
    `\\u` escapes."""

    rest: bytes

    def with_head(self, head: bytes) -> bytes:
        """`head` (a JSON object) followed by the rest of the body, as one JSON object."""
        if self.rest == b"{}":
            return head
        return head[:-1] + b"," + self.rest[1:]


# A body with nothing but what rolegate sets per attempt.
EMPTY_BODY: Final = EncodedBody(b"{}")


def encode_body(body: dict[str, Any]) -> EncodedBody:
    rest = {key: value for key, value in body.items() if key not in ("model", "provider")}
    try:
        return EncodedBody(orjson.dumps(rest))
    except orjson.JSONEncodeError:
        raise too_deep() from None


def too_deep() -> ProxyError:
    return bad_request(
        f"The request body is nested more than {MAX_NESTING} levels deep; "
        "flatten it (no chat request needs that many).",
        code="invalid_body",
    )


# The caller's token limits, newer name first: a continuation is sent what is left of each.
TOKEN_LIMITS: Final = ("max_completion_tokens", "max_tokens")


# orjson's reader refuses JSON nested past 1024 levels, with this message: valid JSON, so
# "not valid JSON" would not say what to fix.
_READ_TOO_DEEP = "depth limit exceeded"


# Not frozen: one is made for every request, and a frozen dataclass sets each of its
# fields through object.__setattr__. Nothing changes one once made (`continued` makes
# another).
@dataclass(slots=True)
class ChatRequest:
    role: CompiledRole
    body: dict[str, Any]
    stream: bool
    # The prompt's charset profile (pure ASCII or not, and its non-ASCII characters):
    # computed once per request because degraded-output attribution (SPEC A3) needs it and
    # the prompt is never kept.
    prompt: PromptProfile
    # Estimated input tokens (for the expected cost of each machine).
    prompt_tokens: int = 0
    # The body as sent upstream, but for the model and the routing.
    encoded: EncodedBody = EMPTY_BODY
    # The caller's own routing preferences (its `provider` object), merged with the role's
    # routing per attempt, never replacing it (SPEC F3).
    caller: CallerProvider = NO_PREFERENCES
    # The tools it declares: what a tool call in the answer may call (SPEC A2).
    tools: DeclaredTools = NO_TOOLS
    # Its stop sequences, which a continuation must keep across the seam (SPEC E7).
    stops: tuple[str, ...] = ()
    # Answers it asks for (`n`): more than one is never spliced from two machines.
    choices: int = 1

    def continued(self, delivered: str, spent: int) -> ChatRequest:
        """This request with the text already delivered as a partial assistant message, for
        a machine that continues it (SPEC B6, E7), and its token limits less the `spent`
        output already delivered (`token_budget` says whether any is left)."""
        messages = [*self.body.get("messages", []), {"role": "assistant", "content": delivered}]
        body = {**self.body, "messages": messages}
        for name in TOKEN_LIMITS:
            limit = _limit(self.body, name)
            if limit is not None:
                body[name] = max(limit - spent, 1)
        return ChatRequest(
            role=self.role,
            body=body,
            stream=self.stream,
            prompt=self.prompt,
            prompt_tokens=self.prompt_tokens,
            encoded=encode_body(body),
            caller=self.caller,
            tools=self.tools,
            stops=self.stops,
            choices=self.choices,
        )

    def token_budget(self, spent: int) -> int | None:
        """Output tokens the caller's limits leave once `spent` were delivered (None: it
        set none); at most zero when a continuation would go past them."""
        limits = [limit for name in TOKEN_LIMITS if (limit := _limit(self.body, name)) is not None]
        return None if not limits else min(limits) - spent

    @property
    def wants_usage(self) -> bool:
        """A stream whose caller asked for a usage chunk (`stream_options.include_usage`)."""
        options = self.body.get("stream_options")
        return self.stream and isinstance(options, dict) and options.get("include_usage") is True

    @property
    def prompt_is_ascii(self) -> bool:
        return self.prompt.is_ascii

    def client_capped(self, finish_reason: str | None) -> bool:
        """The answer stopped at the caller's own token limit: not the model's fault."""
        return finish_reason == "length" and any(name in self.body for name in TOKEN_LIMITS)


def _limit(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    return value if type(value) is int else None


def _stops(value: object) -> tuple[str, ...]:
    """The stop sequences of `stop`: a string or a list of strings (anything else is the
    upstream's to refuse)."""
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list):
        return tuple(stop for stop in value if isinstance(stop, str) and stop)
    return ()


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if exc.msg == _READ_TOO_DEEP:
            raise too_deep() from None
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise bad_request(
                f"Request body is not UTF-8 (invalid byte at position {bad.start}); "
                "encode the JSON body as UTF-8.",
                code="invalid_encoding",
            ) from None
        raise bad_request(
            f"Request body is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
            "send a JSON object with `model` and `messages`.",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise bad_request(
            f"Request body must be a JSON object, got a JSON {_json_type(body)}; "
            "send an object with `model` and `messages`.",
            code="invalid_body",
        )
    return body


def choose_role(
    body: dict[str, Any],
    header_role: str | None,
    config: ProxyConfig,
    granted: Callable[[], Sequence[str]],
) -> CompiledRole:
    """The role a request names. Errors list only the `granted` roles (those the caller
    may use: asked for only when there is an error), never every role there is."""
    if header_role is not None:
        role = config.role(header_role)
        if role is None:
            raise unknown_role(granted, by_header=True)
        return role
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request(
            "`model` is required and must be a string naming a role (your roles: "
            f"{_listed(granted)}), or send the {ROLE_HEADER} header.",
            param="model",
            code="missing_model",
        )
    role = config.role(model)
    if role is None:
        raise unknown_role(granted, by_header=False)
    return role


def unknown_role(granted: Callable[[], Sequence[str]], *, by_header: bool) -> ProxyError:
    """404 for a role the caller cannot have: one that does not exist, and one that exists
    but no grant gives this caller (the edge raises this for both, word for word, so that
    asking reveals nothing about which roles exist). The name asked for is never repeated:
    it is the client's text."""
    where = f"the {ROLE_HEADER} header" if by_header else "`model`"
    return ProxyError(
        404,
        f"The role named by {where} does not exist or is not granted to this caller. "
        f"Your roles: {_listed(granted)}.",
        code="unknown_role",
        param=ROLE_HEADER if by_header else "model",
    )


def _listed(granted: Callable[[], Sequence[str]]) -> str:
    return ", ".join(granted())


def validate_chat_request(body: dict[str, Any], role: CompiledRole) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request(
            "`messages` is required and must be a non-empty array of message objects.",
            param="messages",
            code="invalid_messages",
        )
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(
                f"`messages[{index}]` must be an object with a string `role` "
                "(system, user, assistant or tool).",
                param=f"messages[{index}]",
                code="invalid_messages",
            )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request(
            f"`stream` must be true or false, got a JSON {_json_type(stream)}.",
            param="stream",
            code="invalid_stream",
        )
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise bad_request(
            '`stream_options` must be an object such as {"include_usage": true}.',
            param="stream_options",
        )
    refuse_bypass(body, role)
    # The prompt's strings, walked once: its size and its charset profile read them both
    # (the profile also every string of `tools`, which a model may echo too).
    texts = strings_in(messages)
    tools = body.get("tools")
    choices = body.get("n", 1)
    return ChatRequest(
        role=role,
        body=body,
        stream=stream,
        prompt=profile_texts(texts if tools is None else [*texts, *strings_in(tools)]),
        prompt_tokens=estimate_prompt_tokens(texts),
        encoded=encode_body(body),
        caller=parse_caller_provider(body.get("provider")),
        tools=declared_tools(body),
        stops=_stops(body.get("stop")),
        choices=choices if type(choices) is int else 1,
    )


def estimate_prompt_tokens(texts: list[str]) -> int:
    """A rough input size from the prompt's strings (`strings_in(messages)`) for the
    expected cost (about four characters a token): ranking only compares machines on the
    same request, so a shared error cancels out."""
    return sum(map(len, texts)) // 4


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"
