"""Typed models of the custom resource specs: `RoleTable`, `ProviderPolicy` and
`AccessGrant` (the policy `compile` reads), and `ProxyMemory` (what each proxy pod
learned, shared with its fleet; never compiled).

These models are the single source of truth for what a valid spec is. Field
descriptions and constraints are written for `kubectl explain`: the CRD's OpenAPI schema
is generated from `model_json_schema(by_alias=True)`, so every field carries a
`description`, every limit is a pydantic constraint (which becomes a schema keyword),
list semantics are declared with `x-kubernetes-list-type`, and each cross-field rule
has both a Python validator (for the standalone proxy and the operator's compile) and
an `x-kubernetes-validations` CEL twin (so `kubectl apply` rejects it up front).

Field names are snake_case in Python and camelCase on the wire (the Kubernetes
convention); a misspelled or unknown field is an error that names it.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any, Final

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from rolegate_policy import endpoint as endpoint_rules
from rolegate_policy.enums import (
    BypassField,
    Delivery,
    Dialect,
    Ruling,
    TransportScope,
    Visibility,
)
from rolegate_policy.field_errors import Loc, SpecRuleError, register_pattern_hint, shorten

ROLE_TABLE_KIND: Final = "RoleTable"
PROVIDER_POLICY_KIND: Final = "ProviderPolicy"
ACCESS_GRANT_KIND: Final = "AccessGrant"
PROXY_MEMORY_KIND: Final = "ProxyMemory"

ROLE_NAME_PATTERN: Final = register_pattern_hint(
    r"^[a-z0-9]([-a-z0-9._]*[a-z0-9])?$",
    "lower-case letters, digits, '-', '.' or '_', starting and ending with a letter or digit",
)
# Upstream model and machine names are the provider's own (`qwen/qwen3-coder`,
# `Google AI Studio`), so they are free-form; only surrounding whitespace is refused,
# because `"qwen/qwen3-coder "` would silently never match anything.
UPSTREAM_NAME_PATTERN: Final = register_pattern_hint(
    r"^\S(.*\S)?$", "non-empty, without leading or trailing whitespace"
)
DNS_SUBDOMAIN_PATTERN: Final = register_pattern_hint(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
    "a DNS subdomain: lower-case letters, digits, '-' and '.', starting and ending "
    "with a letter or digit",
)
DNS_LABEL_PATTERN: Final = register_pattern_hint(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
    "a DNS label (a namespace name): lower-case letters, digits and '-', starting and "
    "ending with a letter or digit",
)
SECRET_KEY_PATTERN: Final = register_pattern_hint(
    r"^[-._a-zA-Z0-9]+$", "letters, digits, '-', '.' or '_'"
)

MAX_SECONDS: Final = 3600.0

ModelName = Annotated[
    str, StringConstraints(min_length=1, max_length=256, pattern=UPSTREAM_NAME_PATTERN)
]


# What a large aggregator lists: roles in one RoleTable (each gets an effective ruling in
# its status) and machines serving one model. The CRDs' CEL rules stay within the API
# server's cost budget at these bounds (tests/k8s/test_crds.py).
MAX_ROLES_PER_TABLE: Final = 256
MAX_MACHINES_PER_MODEL: Final = 512


class SpecModel(BaseModel):
    """Base of every spec model: camelCase on the wire, frozen, unknown fields refused."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        # YAML spells infinity `.inf`; no deadline or price is infinite.
        allow_inf_nan=False,
    )


def _duplicates(
    names: list[str], list_field: str, name_field: str | None, what: str, why: str
) -> list[tuple[Loc, str]]:
    """One problem per repeated name, pointing at the repeat and naming the first use."""
    first_index: dict[str, int] = {}
    problems: list[tuple[Loc, str]] = []
    for index, name in enumerate(names):
        if name not in first_index:
            first_index[name] = index
            continue
        loc: Loc = (list_field, index, name_field) if name_field else (list_field, index)
        problems.append(
            (
                loc,
                f"{what} {shorten(name)} is listed twice (first at {list_field}"
                f"[{first_index[name]}]); {why}",
            )
        )
    return problems


def _cel(rule: str, message: str, field_path: str | None = None) -> dict[str, Any]:
    """An `x-kubernetes-validations` rule. The message follows the API conventions
    ("must ...", field names in back-quotes) and names the field it is about, because
    the API server reports it after the path of the node the rule sits on."""
    rule_entry: dict[str, Any] = {"rule": rule, "message": message}
    if field_path is not None:
        rule_entry["fieldPath"] = field_path
    return rule_entry


def derived_default(schema: dict[str, Any]) -> None:
    """A field whose default depends on another field's value: the schema states none (the
    API server would apply a fixed one), the model's validator derives it."""
    schema.pop("default", None)


# RoleTable --------------------------------------------------------------------------


class RetrySpec(SpecModel):
    """How a role's request retries before it moves on, and how long it pauses between
    attempts. Every wait stays within the role's patience."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "!has(self.maxBackoffSeconds) || !has(self.backoffSeconds) || "
                    "self.maxBackoffSeconds >= self.backoffSeconds",
                    "`maxBackoffSeconds` must be at least `backoffSeconds`",
                    ".maxBackoffSeconds",
                ),
            ]
        }
    )

    attempts_per_model: int = Field(
        default=2,
        ge=1,
        le=10,
        description=(
            "Attempts at one model on one provider (any of its machines) before that model's "
            "next provider or the role's next model is tried. A transient failure (a 5xx, a "
            "reset, a timeout) is retried on the same model, avoiding the machine that "
            "failed when an aggregator named it; "
            "a 429 is retried after its Retry-After when that fits the remaining patience. A "
            "400 is never resent unchanged."
        ),
    )
    max_attempts: int = Field(
        default=8,
        ge=1,
        le=32,
        description=(
            "Attempts of one request in all, across models (a pooled connection the upstream "
            "had closed, sent again at once, is not one)."
        ),
    )
    backoff_seconds: float = Field(
        default=0.05,
        ge=0,
        le=60,
        description=(
            "Pause before the second attempt; it doubles with each failure, up to "
            "maxBackoffSeconds, and is jittered to between half and all of it."
        ),
    )
    max_backoff_seconds: float = Field(
        default=1.0,
        ge=0,
        le=300,
        description="Longest pause between two attempts.",
    )

    @model_validator(mode="after")
    def _backoff_ordered(self) -> RetrySpec:
        if self.max_backoff_seconds < self.backoff_seconds:
            raise SpecRuleError(
                [
                    (
                        ("maxBackoffSeconds",),
                        f"must be at least backoffSeconds ({self.backoff_seconds:g}); raise "
                        "it or lower backoffSeconds",
                    )
                ]
            )
        return self


class RoleSpec(SpecModel):
    """One class of caller traffic: the models that may serve it and how long it waits."""

    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=ROLE_NAME_PATTERN,
        description=(
            "Name of the role. Callers select the role by sending this as the OpenAI "
            "`model` value (or in a header), so it must be unique across all RoleTables "
            "the proxy serves."
        ),
    )
    models: list[ModelName] = Field(
        min_length=1,
        max_length=16,
        # An ordered preference list: atomic, so server-side apply never merges two
        # managers' entries in an undefined order; uniqueness is a CEL rule instead.
        json_schema_extra={
            "x-kubernetes-list-type": "atomic",
            "x-kubernetes-validations": [
                _cel(
                    "self.all(m, self.exists_one(n, n == m))",
                    "`models` must not list a model twice",
                )
            ],
        },
        description=(
            "Upstream model names, in order of preference, exactly as a ProviderPolicy "
            "lists them (e.g. `qwen/qwen3-coder`). The next model serves only when no "
            "machine of the one before it can. Each model may appear once."
        ),
    )
    patience_seconds: float = Field(
        gt=0,
        le=MAX_SECONDS,
        description=(
            "Deadline, in seconds, for a usable answer. A machine whose expected time to "
            "a usable answer (time to first token plus expectedOutputTokens at its "
            "token rate) exceeds it is refused for this role."
        ),
    )
    visibility: Visibility = Field(
        description=(
            "Whether a person reads the stream as it arrives (`Watched`) or nobody does "
            "and the whole call is dead time (`Unwatched`). Decides what `Auto` "
            "resolves to."
        ),
    )
    ruling: Ruling = Field(
        default=Ruling.AUTO,
        description=(
            "What to ask an aggregator for once slow machines are refused. `Order`: a "
            "ranking with fallbacks allowed (a slow answer beats no answer). `Only`: "
            "exactly the admitted machines (a busy pool becomes a refusal). `Auto`: "
            "`Only` when the role is Unwatched and patienceSeconds is under the table's "
            "autoOnlyBelowSeconds, `Order` otherwise."
        ),
    )
    delivery: Delivery = Field(
        default=Delivery.AUTO,
        description=(
            "How a streamed answer reaches the caller. `Live`: as it arrives (a person reads "
            "it). `Buffered`: held until complete and judged, so an empty, mangled, cut or "
            "stalled answer is replaced invisibly by a retry or a fallback; a streaming "
            "caller receives SSE comments meanwhile, then the whole verified answer. `Auto`: "
            "`Buffered` exactly when the role is Unwatched."
        ),
    )
    retry: RetrySpec = Field(
        default_factory=RetrySpec,
        description="Attempts per model and in all, and the pause between attempts.",
    )
    expected_output_tokens: int = Field(
        default=512,
        ge=1,
        le=1_000_000,
        description=(
            "Typical answer length in tokens for this role, used to turn a machine's "
            "tokens per second into an expected time to a usable answer."
        ),
    )
    quality_tolerance: float = Field(
        default=0.05,
        ge=0,
        le=1,
        description=(
            "How far apart two machines' operational scores (0 to 1, the smoothed share "
            "of usable answers) may be and still count as equal quality; inside it the "
            "cheaper machine leads, then the faster. A machine behind the best by part of "
            "the tolerance leads that part less often, so traffic shifts gradually. 0: "
            "strictly by score."
        ),
    )
    speed_tolerance: float = Field(
        default=1.5,
        ge=1,
        le=1000,
        description=(
            "How many times slower than the fastest machine of equal quality (within "
            "qualityTolerance) a machine may be expected to deliver a usable answer and "
            "still lead: a slower one is ordered after it, and loses the role's affinity. "
            "Expected times include each machine's queue (requests in flight against its "
            "concurrency)."
        ),
    )
    exploration_share: float | None = Field(
        default=None,
        ge=0,
        le=0.5,
        description=(
            "Share of this role's routing decisions in which a machine other than the "
            "best leads, so an untried or demoted machine keeps being observed and can win "
            "its traffic back: the machine with the least evidence first, then the one "
            "unobserved longest. Omit for the proxy's default (`--explore-share`, 0.02); "
            "0 turns exploration off for the role."
        ),
    )

    caller_may_bypass: list[BypassField] = Field(
        default_factory=list,
        max_length=len(BypassField),
        # A set of enum values: the API server refuses a repeat.
        json_schema_extra={"x-kubernetes-list-type": "set"},
        description=(
            "Top-level request fields an aggregator routes by beyond the one model, which a "
            "caller of this role may send: `models` (model fallbacks), `route`, "
            "`transforms`, `plugins`. Each lets a request leave the role's models or "
            "routing, so by default a request carrying one is refused with a 400 naming "
            "it; listed here, it is passed to the provider unchanged."
        ),
    )

    @model_validator(mode="after")
    def _models_unique(self) -> RoleSpec:
        problems = _duplicates(
            self.models, "models", None, "model", "list each model once, in order of preference"
        )
        problems += _duplicates(
            [field.value for field in self.caller_may_bypass],
            "callerMayBypass",
            None,
            "field",
            "list each field once",
        )
        if problems:
            raise SpecRuleError(problems)
        return self


class RoleTableSpec(SpecModel):
    """The roles callers can select, each with its models, patience, visibility and ruling."""

    auto_only_below_seconds: float = Field(
        default=10.0,
        gt=0,
        le=MAX_SECONDS,
        description=(
            "Patience threshold for the `Auto` ruling: an Unwatched role whose "
            "patienceSeconds is below this resolves to `Only`; every other `Auto` role "
            "resolves to `Order`."
        ),
    )
    roles: list[RoleSpec] = Field(
        min_length=1,
        max_length=MAX_ROLES_PER_TABLE,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
        },
        description="The roles of this table. Role names are unique across all RoleTables.",
    )

    @model_validator(mode="after")
    def _role_names_unique(self) -> RoleTableSpec:
        problems = _duplicates(
            [role.name for role in self.roles],
            "roles",
            "name",
            "role",
            "callers select a role by name, so each name may be defined once",
        )
        if problems:
            raise SpecRuleError(problems)
        return self


# ProviderPolicy ---------------------------------------------------------------------


class SecretKeyRef(SpecModel):
    """A key of a Kubernetes Secret in the ProviderPolicy's namespace."""

    name: str = Field(
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="Name of the Secret, in the same namespace as the ProviderPolicy.",
    )
    key: str = Field(
        min_length=1,
        max_length=253,
        pattern=SECRET_KEY_PATTERN,
        description="Key within the Secret whose value is the API key, sent as a Bearer token.",
    )


class MachineSpec(SpecModel):
    """One concrete backend serving a model, with the figures its operator publishes.

    The figures seed the proxy's belief about the machine (the sheet prior); measured
    answers then move the belief. A machine without figures starts with no prior.
    """

    name: str = Field(
        min_length=1,
        max_length=256,
        pattern=UPSTREAM_NAME_PATTERN,
        description=(
            "Machine name. For an Aggregator, the sub-provider name it routes by and "
            "reports (e.g. `DeepInfra`); for the OpenAI dialect, any label."
        ),
    )
    ttft_seconds: float | None = Field(
        default=None,
        ge=0,
        le=MAX_SECONDS,
        description="Published time to first token, in seconds.",
    )
    tokens_per_second: float | None = Field(
        default=None,
        gt=0,
        le=1_000_000,
        description="Published output rate, in tokens per second.",
    )
    price_input_per_mtok: float | None = Field(
        default=None,
        alias="priceInputPerMTok",
        ge=0,
        le=1_000_000,
        description="Price of input (prompt) tokens, in USD per million tokens.",
    )
    price_output_per_mtok: float | None = Field(
        default=None,
        alias="priceOutputPerMTok",
        ge=0,
        le=1_000_000,
        description="Price of output (completion) tokens, in USD per million tokens.",
    )
    max_concurrency: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description=(
            "How many requests this machine serves at once (a llama.cpp server's slots, a "
            "vLLM server's batch); more wait in its queue. Unset: learned from how its "
            "time to first token grows with the requests in flight on it."
        ),
    )
    continues_partial_message: bool = Field(
        default=False,
        description=(
            "Whether this machine continues a partial assistant message sent as the last "
            "message. Only then can a slow stream that has already reached the client be "
            "moved here mid-answer."
        ),
    )
    echoes_partial_message: bool = Field(
        default=False,
        description=(
            "Whether this machine, continuing a partial assistant message, first repeats "
            "that message (llama.cpp's llama-server does): the repetition is then dropped, "
            "so the client gets each byte once. Only a machine declared so is trimmed: an "
            "answer may legitimately repeat itself."
        ),
    )


class ProviderModelSpec(SpecModel):
    """A model the provider serves, and the machines it serves it on."""

    name: ModelName = Field(
        description=(
            "Upstream model name as the provider spells it (e.g. `qwen/qwen3-coder`); "
            "RoleTables refer to models by this name."
        ),
    )
    machines: list[MachineSpec] = Field(
        default_factory=list,
        max_length=MAX_MACHINES_PER_MODEL,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
        },
        description=(
            "Machines serving this model. For the OpenAI dialect at most one (when "
            "omitted, one named after the ProviderPolicy); for an Aggregator at least "
            "one, each a sub-provider."
        ),
    )

    @model_validator(mode="after")
    def _machine_names_unique(self) -> ProviderModelSpec:
        problems = _duplicates(
            [machine.name for machine in self.machines],
            "machines",
            "name",
            "machine",
            "each machine of a model may be listed once",
        )
        if problems:
            raise SpecRuleError(problems)
        return self


class BreakerSpec(SpecModel):
    """When a provider (or one of its models) is taken out of rotation, and for how long.

    Trips come from transport faults (HTTP status >= 400, refused connections, timeouts)
    and from degraded output (empty or mangled answers). A trip is an availability
    skip: cooldown, exponential backoff, a half-open re-probe, recovery on the next
    clean answer.
    """

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "!has(self.maxCooldownSeconds) || !has(self.cooldownSeconds) || "
                    "self.maxCooldownSeconds >= self.cooldownSeconds",
                    "`maxCooldownSeconds` must be at least `cooldownSeconds`",
                    ".maxCooldownSeconds",
                ),
                _cel(
                    "!has(self.rateMinSamples) || !has(self.rateWindow) || "
                    "self.rateMinSamples <= self.rateWindow",
                    "`rateMinSamples` must not be greater than `rateWindow`, or the rate "
                    "could never trip the breaker",
                    ".rateMinSamples",
                ),
            ]
        }
    )

    cooldown_seconds: float = Field(
        default=10.0,
        gt=0,
        le=86400,
        description="Seconds a first trip keeps the provider or model out before a re-probe.",
    )
    max_cooldown_seconds: float = Field(
        default=30.0,
        gt=0,
        le=86400,
        # No default in the schema: the API server would apply it before the CEL rule
        # below, refusing a long cooldownSeconds that compile accepts (its cap follows it).
        json_schema_extra=derived_default,
        description=(
            "Upper bound on the cooldown after repeated trips; at least cooldownSeconds "
            "(when omitted: 30, or cooldownSeconds if that is longer). It bounds how long a "
            "recovered upstream waits to be noticed: one re-probe at most this often (with "
            "jitter) while it stays down."
        ),
    )
    backoff_multiplier: float = Field(
        default=2.0,
        ge=1,
        le=100,
        description="Factor the cooldown grows by on each trip that follows a failed re-probe.",
    )
    jitter_fraction: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description=(
            "Random spread applied to each cooldown, as a fraction of it, so replicas do "
            "not re-probe in lockstep."
        ),
    )
    novel_signature_count: int = Field(
        default=2,
        ge=1,
        le=10_000,
        description=(
            "Degraded answers with a signature unseen in the novelty window that trip "
            "the breaker. One bad answer is noise; two of a new kind is an incident."
        ),
    )
    familiar_signature_count: int = Field(
        default=5,
        ge=1,
        le=10_000,
        description=(
            "Degraded answers with a signature already seen in the novelty window that "
            "trip the breaker."
        ),
    )
    novelty_window_seconds: float = Field(
        default=86400.0,
        gt=0,
        le=2_592_000,
        description="Trailing window, in seconds, in which a signature counts as familiar.",
    )
    rate_threshold: float = Field(
        default=0.25,
        gt=0,
        le=1,
        description=(
            "Fraction of attributable degraded answers over the last rateWindow calls "
            "above which the breaker trips."
        ),
    )
    rate_window: int = Field(
        default=100,
        ge=1,
        le=100_000,
        description="Number of most recent calls the degraded-answer rate is computed over.",
    )
    rate_min_samples: int = Field(
        default=20,
        ge=1,
        le=100_000,
        description=(
            "Calls needed in the window before the rate can trip the breaker; at most rateWindow."
        ),
    )
    transport_scope: TransportScope = Field(
        default=TransportScope.PROVIDER,
        description=(
            "What a transport fault (HTTP status >= 400, refused connection, timeout) "
            "trips: the whole `Provider`, or only the `Model` it happened on. Degraded "
            "output is scoped by its signature regardless: encoding faults trip the "
            "provider, empty answers the model."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _cap_follows_a_long_cooldown(cls, data: Any) -> Any:
        """An omitted maxCooldownSeconds is never below a cooldownSeconds that was given."""
        if not isinstance(data, dict):
            return data
        given = data.get("cooldownSeconds", data.get("cooldown_seconds"))
        if "maxCooldownSeconds" in data or "max_cooldown_seconds" in data:
            return data
        if isinstance(given, int | float) and not isinstance(given, bool) and given > 30.0:
            return {**data, "maxCooldownSeconds": given}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> BreakerSpec:
        problems: list[tuple[Loc, str]] = []
        if self.max_cooldown_seconds < self.cooldown_seconds:
            problems.append(
                (
                    ("maxCooldownSeconds",),
                    f"must be at least cooldownSeconds ({self.cooldown_seconds:g}); raise it "
                    "or lower cooldownSeconds",
                )
            )
        if self.rate_min_samples > self.rate_window:
            problems.append(
                (
                    ("rateMinSamples",),
                    f"must not exceed rateWindow ({self.rate_window}), or the rate could "
                    "never trip; lower it or widen rateWindow",
                )
            )
        if problems:
            raise SpecRuleError(problems)
        return self


class DegradedOutputSpec(SpecModel):
    """Which kinds of degraded output count against the provider."""

    detect_empty: bool = Field(
        default=True,
        description="Treat a successful answer with no content and no tool calls as a fault.",
    )
    detect_mangled: bool = Field(
        default=True,
        description=(
            "Treat mangled text (double-encoded UTF-8, U+FFFD) in an answer to a pure "
            "ASCII prompt as a fault."
        ),
    )
    detect_malformed_tool_calls: bool = Field(
        default=True,
        description=(
            "Treat a tool call whose arguments are not JSON, or that calls a tool the "
            "request did not declare, as a fault."
        ),
    )


class TimeoutsSpec(SpecModel):
    """Transport time limits for calls to this provider."""

    connect_seconds: float = Field(
        default=5.0,
        gt=0,
        le=300,
        description="Seconds allowed to open a connection to the endpoint.",
    )
    idle_seconds: float = Field(
        default=60.0,
        gt=0,
        le=MAX_SECONDS,
        description=(
            "Longest silence, in seconds, tolerated between two chunks of an answer; a "
            "role's patience lowers it further per request."
        ),
    )


class ProviderPolicySpec(SpecModel):
    """An upstream chat-completions endpoint: what it serves, on which machines, and how
    the proxy protects itself from it."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "(has(self.dialect) && self.dialect != 'OpenAI') || "
                    "self.models.all(m, !has(m.machines) || size(m.machines) <= 1)",
                    "`models[*].machines` must have at most one item when `dialect` is "
                    "'OpenAI' (the endpoint itself); use `dialect` 'Aggregator' for an "
                    "endpoint that routes to sub-providers",
                    ".models",
                ),
                _cel(
                    "!has(self.dialect) || self.dialect != 'Aggregator' || "
                    "self.models.all(m, has(m.machines) && size(m.machines) >= 1)",
                    "`models[*].machines` must have at least one item when `dialect` is "
                    "'Aggregator' (each names a sub-provider to route by)",
                    ".models",
                ),
            ]
        }
    )

    endpoint: str = Field(
        min_length=1,
        max_length=2048,
        # CEL rules and no `pattern`: a failed pattern makes the API server quote the
        # value back, and this is where a key gets pasted (`https://user:sk-...@host`).
        json_schema_extra={"x-kubernetes-validations": endpoint_rules.cel_rules()},
        description=(
            "Base URL of the OpenAI-compatible API, e.g. `https://openrouter.ai/api/v1`; "
            "the proxy appends `/chat/completions`. http or https, with a host, without "
            "credentials, a query string or a fragment."
        ),
    )
    dialect: Dialect = Field(
        default=Dialect.OPENAI,
        description=(
            "`OpenAI`: a plain OpenAI-compatible server (vLLM, llama.cpp, a direct "
            "host), one machine per model. `Aggregator`: an OpenRouter-style router "
            "steered by the request body's `provider` field (order, only, ignore, "
            "allow_fallbacks); its machines are its sub-providers."
        ),
    )
    api_key_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description=(
            "The Secret key holding the API key. The key itself never appears in a "
            "spec or in the compiled configuration. Omit for endpoints without auth."
        ),
    )
    models: list[ProviderModelSpec] = Field(
        min_length=1,
        max_length=256,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
        },
        description="The models this provider serves. Model names are unique within it.",
    )
    breaker: BreakerSpec = Field(
        default_factory=BreakerSpec,
        description="Circuit-breaker settings for this provider.",
    )
    degraded_output: DegradedOutputSpec = Field(
        default_factory=DegradedOutputSpec,
        description="Which degraded answers trip the breaker.",
    )
    timeouts: TimeoutsSpec = Field(
        default_factory=TimeoutsSpec,
        description="Connection and idle time limits.",
    )
    propagate_trace_context: bool = Field(
        default=False,
        description=(
            "Send the W3C `traceparent` (and the caller's `tracestate`) of each attempt "
            "to this provider, so its own traces join rolegate's. Off by default: a trace "
            "id is information a third-party provider does not need."
        ),
    )

    @field_validator("endpoint")
    @classmethod
    def _check_endpoint(cls, value: str) -> str:
        # The same rules, in the same order, as the CEL rules the API server runs
        # (endpoint.py); like theirs, the message never quotes the URL.
        problem = endpoint_rules.problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _models_and_machines(self) -> ProviderPolicySpec:
        problems = _duplicates(
            [model.name for model in self.models],
            "models",
            "name",
            "model",
            "list each model once, with all its machines",
        )
        for index, model in enumerate(self.models):
            count = len(model.machines)
            if self.dialect is Dialect.OPENAI and count > 1:
                problems.append(
                    (
                        ("models", index, "machines"),
                        f"the OpenAI dialect serves a model from one machine, the endpoint "
                        f"itself, but {count} are listed; keep one, or set dialect: "
                        "Aggregator if the endpoint routes to sub-providers",
                    )
                )
            if self.dialect is Dialect.AGGREGATOR and count == 0:
                problems.append(
                    (
                        ("models", index, "machines"),
                        "an Aggregator routes by sub-provider, so each model needs at least "
                        "one machine naming one (e.g. {name: DeepInfra}); add one, or use "
                        "dialect: OpenAI for a direct endpoint",
                    )
                )
        if problems:
            raise SpecRuleError(problems)
        return self


# AccessGrant --------------------------------------------------------------------------

# A granted role: a role's name, or `*` for every role.
GRANTED_ROLE_PATTERN: Final = register_pattern_hint(
    r"^(\*|[a-z0-9]([-a-z0-9._]*[a-z0-9])?)$",
    "a role's name (lower-case letters, digits, '-', '.' or '_'), or * for every role",
)
GrantedRole = Annotated[
    str, StringConstraints(min_length=1, max_length=63, pattern=GRANTED_ROLE_PATTERN)
]


class ServiceAccountRef(SpecModel):
    """A Kubernetes ServiceAccount, the identity of the caller pods that run as it."""

    namespace: str | None = Field(
        default=None,
        min_length=1,
        max_length=63,
        pattern=DNS_LABEL_PATTERN,
        description="Its namespace; default: the AccessGrant's own.",
    )
    name: str = Field(
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="Its name.",
    )


class SubjectSpec(SpecModel):
    """Who a grant is for: exactly one of the four fields."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                # `namespace` is a CEL keyword: the API server spells the field
                # `__namespace__` inside rules.
                _cel(
                    "[has(self.serviceAccount), has(self.__namespace__), "
                    "has(self.apiKeySecretRef), has(self.anonymous) && self.anonymous]"
                    ".filter(x, x).size() == 1",
                    "each of `subjects[]` must name exactly one of `serviceAccount`, "
                    "`namespace`, `apiKeySecretRef` or `anonymous: true`",
                )
            ]
        }
    )

    service_account: ServiceAccountRef | None = Field(
        default=None,
        description=(
            "Callers that present a token of this ServiceAccount (audience `rolegate`), "
            "verified with a TokenReview."
        ),
    )
    namespace: str | None = Field(
        default=None,
        min_length=1,
        max_length=63,
        pattern=DNS_LABEL_PATTERN,
        description="Callers that present a token of any ServiceAccount of this namespace.",
    )
    api_key_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description=(
            "Callers outside the cluster that present this key as `Authorization: Bearer`; "
            "the key lives in a Secret (standalone: a file or an environment variable, as "
            "the providers' keys do) and is held only as a hash."
        ),
    )
    anonymous: bool | None = Field(
        default=None,
        description=(
            "`true`: callers that present no credential at all. Never implied: without an "
            "anonymous subject, a request without credentials is refused (401)."
        ),
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> SubjectSpec:
        named = [
            self.service_account is not None,
            self.namespace is not None,
            self.api_key_secret_ref is not None,
            self.anonymous is True,
        ]
        if sum(named) != 1:
            raise ValueError(
                "a subject must name exactly one of serviceAccount, namespace, "
                "apiKeySecretRef or anonymous: true"
            )
        return self


class GrantLimits(SpecModel):
    """How much a grant's callers may use, together. Each proxy pod counts on its own: with
    N replicas the callers may reach up to N times a figure (docs/access.md)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "has(self.requestsPerMinute) || has(self.tokensPerMinute) || "
                    "has(self.costPerDayUSD)",
                    "`limits` must set at least one of `requestsPerMinute`, "
                    "`tokensPerMinute` or `costPerDayUSD`",
                )
            ]
        }
    )

    requests_per_minute: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000,
        description=(
            "Requests a minute, refilled continuously (a token bucket of this size): a burst "
            "of this many, then one every 60/N seconds."
        ),
    )
    tokens_per_minute: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000_000,
        description=(
            "Input plus output tokens a minute, from each answer's usage, refilled "
            "continuously. Counted when an answer ends, so requests already running when "
            "the allowance runs out may overshoot it; the next request waits."
        ),
    )
    cost_per_day_usd: float | None = Field(
        default=None,
        alias="costPerDayUSD",
        gt=0,
        le=1e9,
        description=(
            "US dollars a day, from the serving machine's published prices "
            "(`priceInputPerMTok`, `priceOutputPerMTok`), refilled continuously at a 24th "
            "of it an hour. An unpriced machine's answers cost nothing here."
        ),
    )

    @model_validator(mode="after")
    def _some_limit(self) -> GrantLimits:
        if (
            self.requests_per_minute is None
            and self.tokens_per_minute is None
            and self.cost_per_day_usd is None
        ):
            raise ValueError(
                "`limits` must set at least one of `requestsPerMinute`, `tokensPerMinute` or "
                "`costPerDayUSD`"
            )
        return self


class AccessGrantSpec(SpecModel):
    """Which callers may use which roles, how much, and whether they may administer the
    proxy."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "(has(self.roles) && size(self.roles) > 0) || (has(self.admin) && self.admin)",
                    "`roles` must name at least one role unless `admin` is true",
                    field_path=".roles",
                )
            ]
        }
    )

    subjects: list[SubjectSpec] = Field(
        min_length=1,
        max_length=256,
        json_schema_extra={"x-kubernetes-list-type": "atomic"},
        description="The callers this grant is for.",
    )
    roles: list[GrantedRole] = Field(
        default_factory=list,
        max_length=256,
        json_schema_extra={"x-kubernetes-list-type": "set"},
        description=(
            "The roles (as in a RoleTable) its callers may select as `model`; `*` for every "
            "role, present and future."
        ),
    )
    limits: GrantLimits | None = Field(
        default=None,
        description=(
            "What the grant's callers may use together; without it, no limit. A caller over "
            "a limit is answered 429 with `Retry-After`."
        ),
    )
    admin: bool = Field(
        default=False,
        description=(
            "`true`: its callers may also read `/v1/rolegate/decisions` and "
            "`/v1/rolegate/state` and post `/v1/feedback` (routing metadata and judgments, "
            "never content)."
        ),
    )

    @model_validator(mode="after")
    def _grants_something(self) -> AccessGrantSpec:
        if not self.roles and not self.admin:
            raise SpecRuleError(
                [(("roles",), "`roles` must name at least one role unless `admin` is true")]
            )
        return self


# ProxyMemory ------------------------------------------------------------------------

# Machines one pod's memory may hold (the proxy's ledger holds no more).
MAX_MEMORY_MACHINES: Final = 4096
# The memory's text, in characters: below etcd's 1.5 MiB limit on a stored object, with
# room for the object's metadata. (1,000 machines take about 128 KB.)
MAX_MEMORY_CHARS: Final = 1_400_000


class ProxyMemorySpec(SpecModel):
    """What one proxy pod learned of each machine, as it last wrote it."""

    pod: str = Field(
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="Name of the proxy pod whose memory this is; only that pod writes it.",
    )
    written_at: datetime = Field(
        description=(
            "When the pod wrote the memory. The other pods weigh it by its age (half as much "
            "every 30 minutes); one older than a day is ignored and deleted."
        ),
    )
    machines: int = Field(
        ge=0,
        le=MAX_MEMORY_MACHINES,
        description="Number of machines the memory holds, for `kubectl get`.",
    )
    memory: str = Field(
        min_length=1,
        max_length=MAX_MEMORY_CHARS,
        description=(
            "The memory, in the pod-memory format (compact JSON, the same a standalone "
            "proxy keeps in its `--state-file`): per machine, the pod's own evidence of its "
            "time to the first token and per-token gap, and its operational score's record. "
            "Numbers and machine names only, never a prompt, a completion or a credential. "
            "About 128 bytes a machine."
        ),
    )


SPEC_MODELS: Final[dict[str, type[SpecModel]]] = {
    ROLE_TABLE_KIND: RoleTableSpec,
    PROVIDER_POLICY_KIND: ProviderPolicySpec,
    ACCESS_GRANT_KIND: AccessGrantSpec,
}


def parse_spec(kind: str, spec: Any) -> SpecModel:
    """Validate a spec exactly as written in a manifest.

    Validation goes through JSON in strict mode, with field names accepted only in
    their camelCase spelling: that is what the API server's schema accepts, so a spec
    that compiles standalone also applies to a cluster (a quoted `"4"` is not a number
    there, and `patience_seconds` is not a field there).
    Raises `pydantic.ValidationError`.
    """
    model = SPEC_MODELS[kind]
    payload = json.dumps(spec, default=str)
    return model.model_validate_json(payload, strict=True, by_alias=True, by_name=False)
