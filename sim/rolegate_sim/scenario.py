"""The scenario file: which models the simulated aggregator serves, on which machines, and
how each machine misbehaves.

Everything here is a frozen pydantic model with camelCase aliases, so the YAML reads like
the rest of rolegate's manifests (`ttftSeconds`) while Python code uses snake_case. Bad
input never surfaces as a raw pydantic traceback: `load_scenario` and `parse_scenario`
raise `ScenarioError` with one line per problem naming the file, the field path and what
to do about it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Self

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

# Contains an em dash, an accented letter, CJK and an emoji (a 4-byte UTF-8 sequence) so
# that every default answer exercises multi-byte handling in the proxy.
DEFAULT_REPLY = (
    "Sure — here is the plan: meet at the café at noon, order the 日本語 menu, "
    "and celebrate with cake 🎉 afterwards."
)


class ScenarioError(ValueError):
    """A scenario (file or runtime fault list) is invalid; the message says where and why."""


class _Frozen(BaseModel):
    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
    )


# --- faults -----------------------------------------------------------------------------


class _FaultBase(_Frozen):
    """The trigger every fault carries: exactly one of probability, schedule, always,
    duringSeconds."""

    probability: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    schedule: tuple[Annotated[int, Field(ge=1)], ...] | None = None
    always: bool = False
    # [from, until): fires for requests arriving that many seconds after the machine's
    # faults were set (the simulator's start, a reset, or a PUT of its faults): an outage.
    during_seconds: tuple[Annotated[float, Field(ge=0)], Annotated[float, Field(gt=0)]] | None = (
        None
    )
    # Which requests it may hit: any, only fresh ones, or only those that continue a
    # prefilled assistant message (a machine that breaks first answers but not rescues).
    requests: Literal["all", "fresh", "continuations"] = "all"

    @model_validator(mode="after")
    def _exactly_one_trigger(self) -> Self:
        given = [
            name
            for name, present in (
                ("probability", self.probability is not None),
                ("schedule", self.schedule is not None),
                ("always", self.always),
                ("duringSeconds", self.during_seconds is not None),
            )
            if present
        ]
        if len(given) != 1:
            found = ", ".join(given) if given else "none"
            raise ValueError(
                "a fault needs exactly one trigger: `probability: 0..1`, `schedule: [n, ...]`, "
                f"`always: true` or `duringSeconds: [from, until]` (found {found})"
            )
        if self.during_seconds is not None and self.during_seconds[0] >= self.during_seconds[1]:
            raise ValueError("`duringSeconds: [from, until]` needs from < until")
        return self


class RateLimitFault(_FaultBase):
    kind: Literal["rateLimit"]
    # HTTP's Retry-After takes whole seconds; omitted means no header at all.
    retry_after_seconds: Annotated[int, Field(ge=0)] | None = None
    message: str = "Rate limit exceeded, please retry later"
    # The error's `code` and `type` in the body (default: the status, `rate_limit_error`):
    # what a provider of its own vocabulary sends (OpenAI's `rate_limit_exceeded`).
    error_code: str | None = None
    error_type: str | None = None


class ServerErrorFault(_FaultBase):
    kind: Literal["serverError"]
    # Any error status: 5xx for provider failures, 4xx to simulate a request the upstream rejects.
    status: Annotated[int, Field(ge=400, le=599)] = 503
    message: str = "The upstream provider is temporarily unavailable"
    # The error's `code` and `type` in the body (default: the status, and `server_error`
    # for a 5xx, `invalid_request_error` for a 4xx): OpenAI's 401 says `invalid_api_key`.
    error_code: str | None = None
    error_type: str | None = None


class ResetFault(_FaultBase):
    kind: Literal["reset"]


class NoResponseFault(_FaultBase):
    kind: Literal["noResponse"]
    seconds: Annotated[float, Field(gt=0)] = 300.0


class LateFirstTokenFault(_FaultBase):
    kind: Literal["lateFirstToken"]
    seconds: Annotated[float, Field(ge=0)]


class StallFault(_FaultBase):
    kind: Literal["stall"]
    after_tokens: Annotated[int, Field(ge=0)] = 1
    seconds: Annotated[float, Field(ge=0)] = 300.0
    # After the silence the connection is closed (no finish, no [DONE]) instead of resuming.
    then_close: bool = False


class CutFault(_FaultBase):
    kind: Literal["cut"]
    after_tokens: Annotated[int, Field(ge=0)] = 1


class NoDoneFault(_FaultBase):
    kind: Literal["noDone"]


class StreamErrorFault(_FaultBase):
    kind: Literal["streamError"]
    after_tokens: Annotated[int, Field(ge=0)] = 1
    message: str = "Upstream provider returned an error mid-stream"
    code: int = 502
    # The error's `code` as sent (default: `code`) and its `type` (default: none in the
    # event, `server_error` in a non-streamed body); the HTTP status stays `code`.
    error_code: str | None = None
    error_type: str | None = None


class EmptyFault(_FaultBase):
    kind: Literal["empty"]


class MojibakeFault(_FaultBase):
    kind: Literal["mojibake"]


class ReplacementCharFault(_FaultBase):
    kind: Literal["replacementChar"]


class RateCollapseFault(_FaultBase):
    kind: Literal["rateCollapse"]
    after_tokens: Annotated[int, Field(ge=0)] = 1
    tokens_per_second: Annotated[float, Field(gt=0)]


class SplitWritesFault(_FaultBase):
    kind: Literal["splitWrites"]
    # None: cut every write just after the lead byte of each multi-byte UTF-8 character,
    # which guarantees every such character straddles two writes without slowing ASCII.
    piece_bytes: Annotated[int, Field(ge=1)] | None = None
    pause_seconds: Annotated[float, Field(ge=0)] = 0.005


class DownFault(_FaultBase):
    kind: Literal["down"]


class LingerAfterDoneFault(_FaultBase):
    """The stream's `[DONE]` goes out, then the connection stays open this long before the
    body ends (as some servers do): a client that has its answer must not wait for it."""

    kind: Literal["lingerAfterDone"]
    seconds: Annotated[float, Field(gt=0)] = 0.5


class MultiLineEventsFault(_FaultBase):
    """Each chunk's JSON is written over two `data:` lines of one event (valid SSE: the
    lines of an event join with a newline, which JSON reads as whitespace)."""

    kind: Literal["multiLineEvents"]


class MalformedEventFault(_FaultBase):
    """One event whose data is not JSON (`data: {"choices": [`, a chunk cut short) is
    inserted just before the `atEvent`-th content event; the answer's own events are all
    sent, so its text stays whole."""

    kind: Literal["malformedEvent"]
    at_event: Annotated[int, Field(ge=1)] = 3


class KeepAliveCommentsFault(_FaultBase):
    """Queued: SSE comments (`: OPENROUTER PROCESSING`, as OpenRouter sends while a request
    waits for a machine) every `everySeconds` for `seconds`, then the answer. The comments
    replace the TTFT; a non-streamed answer is just that much later."""

    kind: Literal["keepAliveComments"]
    seconds: Annotated[float, Field(ge=0)]
    every_seconds: Annotated[float, Field(gt=0)] = 1.0
    text: Annotated[str, Field(pattern=r"^[^\r\n]*$")] = "OPENROUTER PROCESSING"


class RefusePrefillFault(_FaultBase):
    """A request whose last message is a prefilled assistant message is refused with an
    HTTP 400 (as providers without prefill support do); any other request is served."""

    kind: Literal["refusePrefill"]
    message: str = "Assistant message prefill is not supported by this model"
    error_code: str | None = None


class NoUsageFault(_FaultBase):
    """`stream_options.include_usage` is ignored: no usage chunk (real llama.cpp)."""

    kind: Literal["noUsage"]


class MalformedToolCallFault(_FaultBase):
    """The answer's first tool call goes out broken. `arguments`: its arguments lose their
    last character (a JSON object that never closes); `name`: it calls `<name>_undeclared`,
    a function the request never declared. An answer without tool calls is served as if the
    fault had not fired."""

    kind: Literal["malformedToolCall"]
    flaw: Literal["arguments", "name"] = "arguments"


Fault = Annotated[
    RateLimitFault
    | ServerErrorFault
    | ResetFault
    | NoResponseFault
    | LateFirstTokenFault
    | StallFault
    | CutFault
    | NoDoneFault
    | StreamErrorFault
    | EmptyFault
    | MojibakeFault
    | ReplacementCharFault
    | RateCollapseFault
    | SplitWritesFault
    | DownFault
    | LingerAfterDoneFault
    | MultiLineEventsFault
    | MalformedEventFault
    | KeepAliveCommentsFault
    | RefusePrefillFault
    | NoUsageFault
    | MalformedToolCallFault,
    Field(discriminator="kind"),
]

FAULT_KINDS: tuple[str, ...] = (
    "rateLimit",
    "serverError",
    "reset",
    "noResponse",
    "lateFirstToken",
    "stall",
    "cut",
    "noDone",
    "streamError",
    "empty",
    "mojibake",
    "replacementChar",
    "rateCollapse",
    "splitWrites",
    "down",
    "lingerAfterDone",
    "multiLineEvents",
    "malformedEvent",
    "keepAliveComments",
    "refusePrefill",
    "noUsage",
    "malformedToolCall",
)

_FAULT_LIST: TypeAdapter[tuple[Fault, ...]] = TypeAdapter(tuple[Fault, ...])


# --- models and machines ----------------------------------------------------------------


class MachineSpec(_Frozen):
    """One upstream behind the aggregator (OpenRouter calls these providers)."""

    # No `/`: the control API addresses a machine as the last path segment.
    name: Annotated[str, Field(min_length=1, pattern=r"^[^/\s]+$")]
    ttft_seconds: Annotated[float, Field(ge=0)] | None = None
    tokens_per_second: Annotated[float, Field(ge=0)] | None = None
    jitter: Annotated[float, Field(ge=0, le=1)] = 0.0
    continues_partial_message: bool = False
    # A continuing machine first re-sends the prefilled text itself, as content, then the
    # continuation: what real llama-server does.
    echoes_prefill: bool = False
    # Continuing a prefill, it thinks again first, as a reasoning model given a partial
    # answer may: its reasoning comes before the rest of the reply.
    reasons_again: bool = False
    # How many answers the machine produces at once (a single-slot llama.cpp server: 1);
    # the rest wait in arrival order before their first byte. None: no limit.
    slots: Annotated[int, Field(ge=1)] | None = None
    faults: tuple[Fault, ...] = ()


class ToolCallSpec(_Frozen):
    """A function call the model answers with when the request declares tools."""

    name: Annotated[str, Field(min_length=1)]
    # The arguments' JSON text exactly as it is sent: never parsed, so it may be anything.
    arguments: str
    # None: `call_<index>_<the first 8 hex digits of the response id>`, so unique to the
    # call and the response.
    id: Annotated[str, Field(min_length=1)] | None = None


class ModelSpec(_Frozen):
    name: Annotated[str, Field(min_length=1)]
    reply: str = DEFAULT_REPLY
    # What the model "thinks" before it answers, streamed ahead of the reply; "" is a model
    # that does not reason. Tokenised like the reply.
    reasoning: str = ""
    # The delta field reasoning travels in: `reasoning_content` is llama.cpp's, vLLM's and
    # DeepSeek's, `reasoning` OpenRouter's.
    reasoning_field: Literal["reasoning_content", "reasoning"] = "reasoning_content"
    # What the model calls, after its reply text, when the request declares tools.
    tool_calls: tuple[ToolCallSpec, ...] = ()
    # Streamed arguments go out in fragments of this many characters (not bytes: a JSON
    # string cannot split a character), so fragments cut keys, escapes and strings anywhere.
    argument_piece_chars: Annotated[int, Field(ge=1)] = 5
    machines: tuple[MachineSpec, ...]

    # Checked after item validation (not with `min_length`) so that a bad machine does not
    # also produce a confusing "too short" error for the list that contains it.
    @field_validator("machines")
    @classmethod
    def _machines_nonempty_unique(
        cls, machines: tuple[MachineSpec, ...]
    ) -> tuple[MachineSpec, ...]:
        _require_unique_nonempty([m.name for m in machines], "machine")
        return machines

    @field_validator("tool_calls")
    @classmethod
    def _tool_call_ids_unique(cls, calls: tuple[ToolCallSpec, ...]) -> tuple[ToolCallSpec, ...]:
        # A client pairs each tool result with its call by id: two calls cannot share one.
        ids = [call.id for call in calls if call.id is not None]
        for i, call_id in enumerate(ids):
            if call_id in ids[:i]:
                raise ValueError(
                    f"tool call id {call_id!r} appears more than once; ids must be unique"
                )
        return calls

    def machine(self, name: str) -> MachineSpec | None:
        for machine in self.machines:
            if machine.name == name:
                return machine
        return None


class Scenario(_Frozen):
    seed: int = 0
    # None mirrors OpenRouter: `text/event-stream` with no charset parameter, which is what
    # tempts clients into a latin-1 fallback. "utf-8" adds `; charset=utf-8`.
    charset: Literal["utf-8"] | None = None
    # A keep-alive connection idle longer than this is closed by the server; a request the
    # client sends on it afterwards (it crossed the close on the wire) is lost: the
    # connection is reset before any byte of an answer. None keeps connections open.
    idle_close_seconds: Annotated[float, Field(gt=0)] | None = None
    # Request records kept for /_sim/requests; the oldest are dropped beyond this.
    record_limit: Annotated[int, Field(ge=1)] = 100_000
    models: tuple[ModelSpec, ...]

    @field_validator("models")
    @classmethod
    def _models_nonempty_unique(cls, models: tuple[ModelSpec, ...]) -> tuple[ModelSpec, ...]:
        _require_unique_nonempty([m.name for m in models], "model")
        return models

    def model(self, name: str) -> ModelSpec | None:
        for model in self.models:
            if model.name == name:
                return model
        return None


def _require_unique_nonempty(names: Sequence[str], what: str) -> None:
    if not names:
        raise ValueError(f"at least one {what} is required; add a `- name: ...` entry")
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"{what} name {name!r} appears more than once; names must be unique")
        seen.add(name)


# --- loading ----------------------------------------------------------------------------


def load_scenario(path: Path) -> Scenario:
    """Read and validate a YAML scenario file."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read scenario file: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ScenarioError(f"{path}: scenario file is not valid UTF-8: {exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{path}: not valid YAML: {exc}") from exc
    return parse_scenario(data, source=str(path))


def parse_scenario(data: Any, *, source: str = "<scenario>") -> Scenario:
    """Validate already-parsed scenario data (a mapping, as loaded from YAML or JSON)."""
    if not isinstance(data, Mapping):
        raise ScenarioError(
            f"{source}: a scenario must be a mapping with at least `models:`, "
            f"got {type(data).__name__}"
        )
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(_describe(exc, source, "invalid scenario", prefix=())) from exc


def parse_faults(data: Any, *, source: str) -> tuple[Fault, ...]:
    """Validate a runtime fault list with the same rules as the scenario file."""
    try:
        return _FAULT_LIST.validate_python(data)
    except ValidationError as exc:
        raise ScenarioError(_describe(exc, source, "invalid faults", ("faults",))) from exc


def dump_faults(faults: Iterable[Fault]) -> list[dict[str, Any]]:
    """Faults as they would be written in a scenario file (camelCase, defaults omitted)."""
    return [f.model_dump(mode="json", by_alias=True, exclude_defaults=True) for f in faults]


def _describe(exc: ValidationError, source: str, what: str, prefix: tuple[str | int, ...]) -> str:
    lines = [f"{source}: {what} ({exc.error_count()} problem(s)):"]
    for error in exc.errors(include_url=False):
        path, fault_kind = _render_path(prefix + tuple(error["loc"]))
        lines.append(f"  {path or '<top level>'}: {_advice(error, fault_kind)}")
    return "\n".join(lines)


def _render_path(loc: tuple[str | int, ...]) -> tuple[str, str | None]:
    """`models[0].machines[1].faults[0].seconds`, dropping the union tag pydantic inserts
    after a fault's index (reported separately so the message can name the fault kind)."""
    out = ""
    fault_kind: str | None = None
    previous: str | int | None = None
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(previous, int) and part in FAULT_KINDS:
            fault_kind = part
        else:
            out += f".{part}" if out else part
        previous = part
    return out, fault_kind


def _advice(error: Any, fault_kind: str | None) -> str:
    kind = error["type"]
    where = f" (in a `{fault_kind}` fault)" if fault_kind else ""
    if kind == "extra_forbidden":
        field = str(error["loc"][-1])
        close = difflib.get_close_matches(field, _known_field_names(), n=1)
        hint = f"; did you mean `{close[0]}`?" if close else "; remove it"
        return f"unknown field `{field}`{where}{hint} (field names are camelCase)"
    if kind == "missing":
        return f"required field is missing{where}; add it"
    if kind == "union_tag_not_found":
        return f"a fault needs `kind:`, one of {', '.join(FAULT_KINDS)}"
    if kind == "union_tag_invalid":
        tag = error.get("ctx", {}).get("tag")
        return f"unknown fault kind {tag!r}; use one of {', '.join(FAULT_KINDS)}"
    message = str(error["msg"]).removeprefix("Value error, ")
    got = error.get("input")
    shown = "" if isinstance(got, dict | list) else f" (got {_short_repr(got)})"
    return f"{message}{shown}{where}"


def _short_repr(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _known_field_names() -> list[str]:
    classes: list[type[BaseModel]] = [Scenario, ModelSpec, MachineSpec, ToolCallSpec]
    classes.extend(_FaultBase.__subclasses__())
    names: set[str] = set()
    for cls in classes:
        for name, info in cls.model_fields.items():
            names.add(info.alias or name)
    return sorted(names)
