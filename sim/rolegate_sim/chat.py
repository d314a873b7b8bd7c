"""`POST /v1/chat/completions`: parse, route like an aggregator, apply the fault, answer.

Every request gets a record the moment it arrives; whatever happens (including the
handler being cancelled because the client went away) the record is finished exactly once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import secrets
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from rolegate_sim.answer import (
    NO_TOOLS,
    RichAnswer,
    ToolCall,
    ToolChoice,
    compose,
    malformed,
    select_calls,
)
from rolegate_sim.completion import Plan, send_completion, send_stream
from rolegate_sim.faults import FaultDecision, decide, request_rng
from rolegate_sim.pacing import Pacer
from rolegate_sim.routing import (
    NO_PREFERENCES,
    PreferenceError,
    ProviderPreferences,
    parse_preferences,
    preference_list,
    route_fields,
)
from rolegate_sim.scenario import (
    EmptyFault,
    Fault,
    KeepAliveCommentsFault,
    LateFirstTokenFault,
    MalformedToolCallFault,
    MojibakeFault,
    NoResponseFault,
    NoUsageFault,
    RateCollapseFault,
    RateLimitFault,
    RefusePrefillFault,
    ReplacementCharFault,
    ResetFault,
    ServerErrorFault,
    SplitWritesFault,
    ToolCallSpec,
)
from rolegate_sim.state import MachineState, ModelState, Outcome, RequestRecord, SimState
from rolegate_sim.stream import (
    await_cancellation,
    close_connection,
    error_body,
    reset_connection,
    send_body,
)
from rolegate_sim.text import (
    estimate_prompt_tokens,
    message_text,
    mojibake,
    tokenize,
    with_replacement_characters,
)

SIM_STATE: web.AppKey[SimState] = web.AppKey("rolegate_sim.state", SimState)


class BadRequest(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str
    messages: list[Any]
    stream: bool
    include_usage: bool
    max_tokens: int | None
    # None when the body had no `provider` object at all.
    preferences: ProviderPreferences | None
    route_fields: dict[str, Any] | None = None
    tools: ToolChoice = NO_TOOLS


def parse_chat_request(raw: bytes) -> ChatRequest:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("`model` is required and must be a string")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("`messages` is required and must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"`messages[{i}]` must be an object with a string `role`")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("`stream` must be a boolean")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("`stream_options` must be an object")
    include_usage = options.get("include_usage", False) is True
    # OpenAI's newer name wins when both are sent, as it does upstream.
    max_tokens: Any = body.get("max_completion_tokens")
    field = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, field = body.get("max_tokens"), "max_tokens"
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise BadRequest(f"`{field}` must be a positive integer")
    try:
        preferences = None if "provider" not in body else parse_preferences(body["provider"])
    except PreferenceError as exc:
        raise BadRequest(str(exc)) from exc
    return ChatRequest(
        model,
        messages,
        stream,
        include_usage,
        max_tokens,
        preferences,
        route_fields(body),
        parse_tool_choice(body),
    )


def parse_tool_choice(body: dict[str, Any]) -> ToolChoice:
    """What `tools`, `tool_choice` and `parallel_tool_calls` let the model call. The tools
    themselves are not read: the scenario says what the model calls."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("`tools` must be a list")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest("`parallel_tool_calls` must be a boolean")
    choice = body.get("tool_choice")
    only: str | None = None
    if isinstance(choice, dict):
        function = choice.get("function")
        only = function.get("name") if isinstance(function, dict) else None
        if not isinstance(only, str):
            raise BadRequest(
                'a `tool_choice` object must name a function: {"type": "function", '
                '"function": {"name": "..."}}'
            )
    elif choice is not None and not isinstance(choice, str):
        raise BadRequest('`tool_choice` must be "none", "auto", "required" or an object')
    if not tools or choice == "none":
        return NO_TOOLS
    return ToolChoice(allowed=True, only=only, parallel=parallel is not False)


async def handle_chat(request: web.Request) -> web.StreamResponse:
    state = request.app[SIM_STATE]
    record = state.open_record()
    auth = request.headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        record.bearer_sha256 = hashlib.sha256(auth[7:].encode()).hexdigest()[:12]
    record.traceparent = request.headers.get("traceparent")
    connection = request.transport
    now = time.monotonic()
    if connection is not None and state.closed_for_idleness(connection, now):
        # The server closed this connection while it sat idle; the request crossed the
        # close on the wire and is lost before any byte of an answer.
        record.finish(Outcome.IDLE_CLOSED)
        reset_connection(request)
        await await_cancellation()
    try:
        response = await _serve(request, state, record)
    except asyncio.CancelledError:
        # The client went away (aiohttp cancels the handler on connection loss) or the
        # server is stopping. Record it, and let the cancellation propagate.
        record.finish(Outcome.SERVER_STOPPED if state.stopping else Outcome.CLIENT_DISCONNECTED)
        raise
    except ConnectionError:
        # Lost while reading the body: no response can be sent, and the cancellation
        # from the lost connection is on its way.
        record.finish(Outcome.CLIENT_DISCONNECTED)
        await await_cancellation()
    except web.HTTPException as exc:  # e.g. 413 from aiohttp's body size limit
        record.status = exc.status
        record.finish(Outcome.ERROR_STATUS)
        raise
    except Exception:
        record.status = 500
        record.finish(Outcome.ERROR_STATUS)
        raise
    if connection is not None:
        state.answered_on(connection, time.monotonic())
    return response


@dataclass(frozen=True, slots=True)
class _Routed:
    machine: MachineState
    number: int
    decision: FaultDecision
    # The request's own RNG (None when nothing random applies): fault draws, then jitter.
    rng: random.Random | None


def _route(
    state: SimState,
    model: ModelState,
    prefs: ProviderPreferences,
    record: RequestRecord,
    *,
    prefilled: bool,
) -> _Routed | None:
    seed = state.scenario.seed
    for name in preference_list(model.machine_names, prefs):
        machine = model.machines[name]
        number = machine.next_request_number()
        rng = request_rng(seed, model.name, name, number) if machine.uses_rng else None
        decision = decide(machine.faults, number, rng, machine.faults_age(), prefilled=prefilled)
        if decision.down:
            record.skipped_down.append(name)
            continue
        return _Routed(machine, number, decision, rng)
    return None


async def _serve(
    request: web.Request, state: SimState, record: RequestRecord
) -> web.StreamResponse:
    raw = await request.read()
    record.body_sha256 = hashlib.sha256(raw).hexdigest()[:16]
    try:
        chat = parse_chat_request(raw)
    except BadRequest as exc:
        return await _error(request, state, record, 400, str(exc), "invalid_request_error")
    record.model = chat.model
    record.stream = chat.stream
    record.provider = None if chat.preferences is None else chat.preferences.as_record()
    record.route_fields = chat.route_fields

    model = state.models.get(chat.model)
    if model is None:
        known = ", ".join(state.models)
        message = f"model {chat.model!r} does not exist on this simulator (it serves: {known})"
        return await _error(request, state, record, 404, message, "not_found_error")

    prefilled = chat.messages[-1].get("role") == "assistant"
    routed = _route(state, model, chat.preferences or NO_PREFERENCES, record, prefilled=prefilled)
    if routed is None:
        message = f"No endpoints found for {chat.model} matching your provider preferences"
        return await _error(request, state, record, 404, message, "not_found_error")

    machine, decision = routed.machine, routed.decision
    fault, split = decision.fault, decision.split
    if isinstance(fault, RefusePrefillFault) and not prefilled:
        fault = None  # it refuses prefills only
    calls = select_calls(model.spec.tool_calls, chat.tools)
    if isinstance(fault, MalformedToolCallFault) and not calls:
        fault = None  # nothing to break
    record.machine = machine.name
    record.machine_request = routed.number
    record.fault = None if fault is None else fault.kind
    record.split_writes = split is not None

    if isinstance(fault, RateLimitFault):
        retry = fault.retry_after_seconds
        headers = () if retry is None else (("Retry-After", str(retry)),)
        kind = fault.error_type or "rate_limit_error"
        return await _error(
            request, state, record, 429, fault.message, kind, split, headers, fault.error_code
        )
    if isinstance(fault, RefusePrefillFault):
        return await _error(
            request, state, record, 400, fault.message, "invalid_request_error", split, (),
            fault.error_code,
        )  # fmt: skip
    if isinstance(fault, ServerErrorFault):
        kind = fault.error_type or (
            "server_error" if fault.status >= 500 else "invalid_request_error"
        )
        return await _error(
            request, state, record, fault.status, fault.message, kind, split, (), fault.error_code
        )
    if isinstance(fault, ResetFault):
        record.finish(Outcome.RESET)
        reset_connection(request)
        await await_cancellation()
    if isinstance(fault, NoResponseFault):
        await asyncio.sleep(fault.seconds)
        record.finish(Outcome.NO_RESPONSE)
        close_connection(request)
        await await_cancellation()

    # Only an answer takes a slot: the refusals above come at once, as a server's do.
    queued_at = time.monotonic()
    record.queued_behind = machine.slots.ahead
    async with machine.slots.held():
        record.queued_seconds = time.monotonic() - queued_at
        # Planned once the slot is ours: the TTFT and pacing start when generation does.
        plan = _plan(state, model, routed, chat, record, fault, calls)
        if chat.stream:
            return await send_stream(request, plan, record)
        return await send_completion(request, plan, record)


def _plan(
    state: SimState,
    model: ModelState,
    routed: _Routed,
    chat: ChatRequest,
    record: RequestRecord,
    fault: Fault | None,
    calls: tuple[ToolCallSpec, ...],
) -> Plan:
    machine = routed.machine
    spec = machine.spec
    gen_id = "gen-" + secrets.token_hex(12)
    tool_calls: tuple[ToolCall, ...] = ()
    if calls:
        # Ids unique to the call and the response, so that an agent's history never holds
        # two calls of one id however many turns it takes.
        tool_calls = tuple(
            ToolCall(call.id or f"call_{i}_{gen_id[4:12]}", call.name, call.arguments)
            for i, call in enumerate(calls)
        )
        if isinstance(fault, MalformedToolCallFault):
            tool_calls = (malformed(tool_calls[0], fault), *tool_calls[1:])
    tokens: tuple[str, ...] = model.tokens
    token_json: tuple[bytes, ...] | None = model.token_json
    reasoning: tuple[str, ...] = model.reasoning_tokens

    last = chat.messages[-1]
    if spec.continues_partial_message and last.get("role") == "assistant":
        prefill = message_text(last.get("content"))
        reply = model.spec.reply
        # Continue only when the reply really extends the prefill; otherwise the whole
        # reply is sent, as a model that cannot continue would.
        if prefill and reply.startswith(prefill):
            tokens, token_json = tokenize(reply[len(prefill) :]), None
            if spec.echoes_prefill:
                # As llama-server sends it: the prefill again, in the first event, with the
                # first new token (the echo is not generated, so it is no piece of its own).
                tokens = (prefill + tokens[0], *tokens[1:]) if tokens else (prefill,)
                record.echoed_prefill = True
            # Mid-answer, the thinking is over (unless the machine thinks again); the tool
            # calls, if any, are still to come.
            if not spec.reasons_again:
                reasoning = ()
            record.continued_partial = True

    if isinstance(fault, EmptyFault):
        tokens, token_json, reasoning, tool_calls = (), (), (), ()
    elif isinstance(fault, MojibakeFault):
        tokens, token_json, reasoning = mojibake(tokens), None, mojibake(reasoning)
    elif isinstance(fault, ReplacementCharFault):
        tokens, token_json = with_replacement_characters(tokens), None
        reasoning = with_replacement_characters(reasoning)

    # Plain text keeps its precomputed tokens; anything more is composed into pieces.
    rich: RichAnswer | None = None
    if reasoning or tool_calls:
        rich = compose(
            reasoning,
            tokens,
            tool_calls,
            reasoning_field=model.spec.reasoning_field,
            argument_piece_chars=model.spec.argument_piece_chars,
        )
        tokens, token_json = (), ()

    finish_reason = "tool_calls" if tool_calls else "stop"
    limit = chat.max_tokens
    if rich is None and limit is not None and len(tokens) > limit:
        tokens = tokens[:limit]
        token_json = None if token_json is None else token_json[:limit]
        finish_reason = "length"
    elif rich is not None and limit is not None and len(rich.pieces) > limit:
        rich = rich.truncated(limit)
        finish_reason = "length"
    if rich is not None:
        record.tool_call_starts = rich.call_starts()

    ttft = spec.ttft_seconds or 0.0
    if isinstance(fault, LateFirstTokenFault | KeepAliveCommentsFault):
        ttft = fault.seconds
    pacer = Pacer(
        start=asyncio.get_running_loop().time(),
        ttft_seconds=ttft,
        tokens_per_second=spec.tokens_per_second or 0.0,
        jitter=spec.jitter,
        rng=routed.rng,
        collapse=fault if isinstance(fault, RateCollapseFault) else None,
    )
    return Plan(
        gen_id=gen_id,
        created=int(time.time()),
        model=(model.name, model.name_json),
        provider=(machine.name, machine.name_json),
        tokens=tokens,
        token_json=token_json,
        rich=rich,
        finish_reason=finish_reason,
        prompt_tokens=estimate_prompt_tokens(chat.messages),
        include_usage=chat.include_usage and not isinstance(fault, NoUsageFault),
        fault=fault,
        split=routed.decision.split,
        pacer=pacer,
        content_type=state.sse_content_type if chat.stream else state.json_content_type,
    )


async def _error(
    request: web.Request,
    state: SimState,
    record: RequestRecord,
    status: int,
    message: str,
    error_type: str,
    split: SplitWritesFault | None = None,
    headers: tuple[tuple[str, str], ...] = (),
    code: str | None = None,
) -> web.StreamResponse:
    record.status = status
    try:
        response = await send_body(
            request,
            status=status,
            # A machine's own error names it, as every answer does; routing errors do not.
            body=error_body(status, message, error_type, provider=record.machine, code=code),
            content_type=state.json_content_type,
            split=split,
            headers=headers,
        )
    except ConnectionError:
        record.finish(Outcome.CLIENT_DISCONNECTED)
        await await_cancellation()
    record.finish(Outcome.ERROR_STATUS)
    return response
