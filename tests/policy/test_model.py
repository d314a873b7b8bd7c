"""The spec models on their own: constraints, cross-field rules, and the messages users read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from rolegate_policy.enums import (
    Dialect,
    Ruling,
    TransportScope,
    Visibility,
)
from rolegate_policy.field_errors import translate
from rolegate_policy.model import (
    BreakerSpec,
    ProviderPolicySpec,
    ProxyMemorySpec,
    RoleSpec,
    RoleTableSpec,
    SpecModel,
    parse_spec,
)
from rolegate_policy.status import (
    ProviderPolicyStatus,
    ProxyMemoryStatus,
    RoleTableStatus,
)

from .builders import PLANTED_SECRET, provider, role, role_table


def errors_of(kind: str, spec: dict[str, Any]) -> dict[str, str]:
    """`{field path: message}` for a spec that must fail validation."""
    with pytest.raises(ValidationError) as caught:
        parse_spec(kind, spec)
    model = RoleTableSpec if kind == "RoleTable" else ProviderPolicySpec
    return {error.field: error.message for error in translate(caught.value, model, "spec")}


def table_errors(*roles: dict[str, Any], **spec: Any) -> dict[str, str]:
    return errors_of("RoleTable", role_table("t", *roles, **spec)["spec"])


def provider_errors(**overrides: Any) -> dict[str, str]:
    spec = provider(**{k: v for k, v in overrides.items() if k in ("dialect", "models")})["spec"]
    spec.update({k: v for k, v in overrides.items() if k not in ("dialect", "models")})
    return errors_of("ProviderPolicy", spec)


# RoleTable -----------------------------------------------------------------------------


def test_role_defaults() -> None:
    spec = parse_spec("RoleTable", {"roles": [role()]})
    assert isinstance(spec, RoleTableSpec)
    assert spec.auto_only_below_seconds == 10
    only = spec.roles[0]
    assert only.ruling is Ruling.AUTO
    assert only.expected_output_tokens == 512
    assert only.visibility is Visibility.WATCHED
    # No exploration share of its own: the proxy's --explore-share applies.
    assert only.exploration_share is None


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("patienceSeconds", 0, "must be greater than 0"),
        ("patienceSeconds", -1, "must be greater than 0"),
        ("patienceSeconds", 3601, "must be at most 3600"),
        ("patienceSeconds", "4", "must be a number"),
        ("visibility", "watched", "must be one of 'Watched' or 'Unwatched'"),
        ("ruling", "Fastest", "must be one of 'Order', 'Only' or 'Auto'"),
        ("expectedOutputTokens", 0, "must be at least 1"),
        ("expectedOutputTokens", 1_000_001, "must be at most 1000000"),
        ("expectedOutputTokens", 12.5, "must be an integer"),
        ("explorationShare", -0.01, "must be at least 0"),
        ("explorationShare", 0.51, "must be at most 0.5"),
        ("explorationShare", "0.1", "must be a number"),
        ("models", [], "must have at least 1 item"),
        ("models", [f"m{i}" for i in range(17)], "must have at most 16 items (has 17)"),
        ("models", "qwen/qwen3-coder", "must be a list"),
    ],
)
def test_role_field_constraints(field: str, value: Any, message: str) -> None:
    assert table_errors(role(**{field: value})) == {f"spec.roles[0].{field}": message}


@pytest.mark.parametrize("name", ["agent", "a", "batch.nightly", "x-1", "a_b", "7"])
def test_role_name_accepts_dns_label_like(name: str) -> None:
    parse_spec("RoleTable", {"roles": [role(name)]})


@pytest.mark.parametrize("name", ["Agent", "-agent", "agent-", "a b", "", "a" * 64, "agent/x"])
def test_role_name_rejects_others(name: str) -> None:
    (field, message), *_ = table_errors(role(name)).items()
    assert field == "spec.roles[0].name"
    assert message.startswith("must ")


@pytest.mark.parametrize("model", ["", " qwen", "qwen ", "x" * 257])
def test_role_model_names_are_trimmed_and_bounded(model: str) -> None:
    assert list(table_errors(role(models=["ok", model]))) == ["spec.roles[0].models[1]"]


def test_role_models_are_unique() -> None:
    errors = table_errors(role(models=["a", "b", "a"]))
    assert errors == {
        "spec.roles[0].models[2]": (
            "model a is listed twice (first at models[0]); list each model once, in order "
            "of preference"
        )
    }


def test_caller_may_bypass_names_request_fields_once_each() -> None:
    spec = parse_spec("RoleTable", {"roles": [role()]})
    assert isinstance(spec, RoleTableSpec)
    assert spec.roles[0].caller_may_bypass == []
    assert table_errors(role(callerMayBypass=["plugins", "Models"])) == {
        "spec.roles[0].callerMayBypass[1]": (
            "must be one of 'models', 'route', 'transforms' or 'plugins'"
        )
    }
    assert table_errors(role(callerMayBypass=["route", "plugins", "route"])) == {
        "spec.roles[0].callerMayBypass[2]": (
            "field route is listed twice (first at callerMayBypass[0]); list each field once"
        )
    }


def test_role_names_are_unique_within_a_table() -> None:
    errors = table_errors(role("a"), role("b"), role("a"))
    assert list(errors) == ["spec.roles[2].name"]
    assert "first at roles[0]" in errors["spec.roles[2].name"]


def test_roles_count_is_bounded() -> None:
    assert table_errors(*[role(f"r{i}") for i in range(257)]) == {
        "spec.roles": "must have at most 256 items (has 257)"
    }
    assert errors_of("RoleTable", {"roles": []}) == {"spec.roles": "must have at least 1 item"}


@pytest.mark.parametrize(("value", "ok"), [(0, False), (0.5, True), (3600, True), (3601, False)])
def test_auto_only_below_seconds_range(value: float, ok: bool) -> None:
    spec = {"roles": [role()], "autoOnlyBelowSeconds": value}
    if ok:
        parse_spec("RoleTable", spec)
    else:
        assert list(errors_of("RoleTable", spec)) == ["spec.autoOnlyBelowSeconds"]


def test_unknown_field_suggests_the_right_spelling() -> None:
    errors = table_errors(
        {**role(), "patience": 4},
    )
    assert errors["spec.roles[0].patience"] == "unknown field; did you mean patienceSeconds?"


def test_snake_case_is_not_a_field() -> None:
    """The API server only knows camelCase; standalone must not accept more."""
    spec = role()
    del spec["patienceSeconds"]
    spec["patience_seconds"] = 4
    errors = table_errors(spec)
    assert errors["spec.roles[0].patience_seconds"] == (
        "unknown field; did you mean patienceSeconds?"
    )
    assert errors["spec.roles[0].patienceSeconds"] == "is required"


def test_unknown_field_without_a_close_match_lists_the_allowed_ones() -> None:
    errors = errors_of("RoleTable", {"roles": [role()], "zzz": 1})
    assert errors == {"spec.zzz": "unknown field; allowed here: autoOnlyBelowSeconds, roles"}


def test_infinity_and_nan_are_not_numbers() -> None:
    assert table_errors(role(patienceSeconds=float("nan"))) == {
        "spec.roles[0].patienceSeconds": "must be a finite number"
    }
    assert list(table_errors(role(patienceSeconds=float("inf")))) == [
        "spec.roles[0].patienceSeconds"
    ]


def test_python_construction_by_field_name_still_works() -> None:
    built = RoleSpec(name="a", models=["m"], patience_seconds=3, visibility=Visibility.UNWATCHED)
    assert built.patience_seconds == 3
    with pytest.raises(ValidationError):
        built.name = "b"  # type: ignore[misc]  # frozen


# ProviderPolicy ------------------------------------------------------------------------


def test_provider_defaults_map_onto_compiled_settings() -> None:
    spec = parse_spec("ProviderPolicy", {"endpoint": "http://h/v1", "models": [{"name": "m"}]})
    assert isinstance(spec, ProviderPolicySpec)
    assert spec.dialect is Dialect.OPENAI
    assert spec.api_key_secret_ref is None
    assert spec.breaker == BreakerSpec()
    assert spec.breaker.transport_scope is TransportScope.PROVIDER
    assert (spec.breaker.cooldown_seconds, spec.breaker.max_cooldown_seconds) == (10, 30)
    assert (spec.breaker.rate_threshold, spec.breaker.rate_window) == (0.25, 100)
    assert spec.degraded_output.detect_empty
    assert spec.degraded_output.detect_mangled
    assert (spec.timeouts.connect_seconds, spec.timeouts.idle_seconds) == (5, 60)


def test_machine_figures_use_their_published_spelling() -> None:
    spec = parse_spec(
        "ProviderPolicy",
        {
            "endpoint": "https://h/v1",
            "dialect": "Aggregator",
            "models": [
                {
                    "name": "m",
                    "machines": [
                        {
                            "name": "Fireworks",
                            "ttftSeconds": 0.4,
                            "tokensPerSecond": 120,
                            "priceInputPerMTok": 0.45,
                            "priceOutputPerMTok": 1.8,
                            "continuesPartialMessage": True,
                        }
                    ],
                }
            ],
        },
    )
    assert isinstance(spec, ProviderPolicySpec)
    machine = spec.models[0].machines[0]
    assert machine.price_input_per_mtok == 0.45
    assert machine.price_output_per_mtok == 1.8
    assert machine.continues_partial_message is True


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("ttftSeconds", -0.1, "must be at least 0"),
        ("tokensPerSecond", 0, "must be greater than 0"),
        ("priceInputPerMTok", -1, "must be at least 0"),
        ("priceOutputPerMTok", "cheap", "must be a number"),
        ("continuesPartialMessage", "yes", "must be true or false"),
        ("priceInputPerMtok", 1, "unknown field; did you mean priceInputPerMTok?"),
    ],
)
def test_machine_constraints(field: str, value: Any, message: str) -> None:
    models = [{"name": "m", "machines": [{"name": "a", field: value}]}]
    errors = errors_of(
        "ProviderPolicy", {"endpoint": "https://h/v1", "dialect": "Aggregator", "models": models}
    )
    assert errors == {f"spec.models[0].machines[0].{field}": message}


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ("ftp://h/v1", "must start with http:// or https:// (in lower case), e.g. https://"),
        ("openrouter.ai/api/v1", "must start with http:// or https://"),
        ("https:///v1", "must name a host"),
        ("https://h:99999/v1", "must have no port or a port from 1 to 65535"),
        ("https://h:0/v1", "must have no port or a port from 1 to 65535"),
        ("https://h/v1?x=1", "must not have a query string"),
        ("https://h/v1#frag", "must not have a fragment"),
        ("https://h/v 1", "must not contain whitespace or control characters"),
        ("https://h/v1\u00a0", "must not contain whitespace or control characters"),
        ("https://user:pw@h/v1", "must not contain credentials"),
        ("https://h/%zz", "must use `%` only to start an escape"),
        ("https://[::1::]/v1", "must be a valid URL; in brackets, a host must be a valid IPv6"),
        ("", "must not be empty"),
    ],
)
def test_endpoint_rules(endpoint: str, message: str) -> None:
    errors = provider_errors(endpoint=endpoint)
    assert list(errors) == ["spec.endpoint"]
    assert errors["spec.endpoint"].startswith(message)


@pytest.mark.parametrize(
    "endpoint",
    [
        "https://openrouter.ai/api/v1",
        "http://127.0.0.1:8089/v1",
        "http://vllm.ns.svc:8000",
        "https://h/",
        "http://[fd00::1]:8000/v1",
        "http://h:/v1",
    ],
)
def test_endpoint_accepts_base_urls(endpoint: str) -> None:
    parse_spec("ProviderPolicy", {**provider()["spec"], "endpoint": endpoint})


def test_endpoint_errors_never_quote_the_url() -> None:
    for endpoint in (
        f"https://x:{PLANTED_SECRET}@h/v1",
        f"https://h/v1?key={PLANTED_SECRET}",
        f"https://h/v1#{PLANTED_SECRET}",
        f"{PLANTED_SECRET}://h",
        f"https://h/{PLANTED_SECRET} x",
    ):
        message = provider_errors(endpoint=endpoint)["spec.endpoint"]
        assert "sk-" not in message, message


def test_api_key_field_points_at_the_secret_ref() -> None:
    errors = provider_errors(apiKey=PLANTED_SECRET)
    assert list(errors) == ["spec.apiKey"]
    assert "apiKeySecretRef" in errors["spec.apiKey"]
    assert "Secret" in errors["spec.apiKey"]


@pytest.mark.parametrize("field", ["api_key", "token", "bearerToken", "password", "secret"])
def test_other_credential_fields_point_at_the_secret_ref(field: str) -> None:
    assert "apiKeySecretRef" in provider_errors(**{field: "x"})[f"spec.{field}"]


@pytest.mark.parametrize(
    ("ref", "field"),
    [
        ({"name": "Upper", "key": "k"}, "name"),
        ({"name": "a" * 254, "key": "k"}, "name"),
        ({"name": "ok", "key": "bad key"}, "key"),
        ({"name": "ok", "key": "k" * 254}, "key"),
        ({"name": "ok"}, "key"),
        ({"name": "ok", "key": "k", "value": "x"}, "value"),
    ],
)
def test_api_key_secret_ref(ref: dict[str, str], field: str) -> None:
    assert list(provider_errors(apiKeySecretRef=ref)) == [f"spec.apiKeySecretRef.{field}"]


def test_secret_ref_accepts_kubernetes_names() -> None:
    parse_spec(
        "ProviderPolicy",
        {**provider()["spec"], "apiKeySecretRef": {"name": "open.router-1", "key": "API_key.v-1"}},
    )


def test_openai_dialect_allows_at_most_one_machine() -> None:
    errors = provider_errors(dialect="OpenAI", models={"m": ["a", "b"], "n": []})
    assert list(errors) == ["spec.models[0].machines"]
    assert "dialect: Aggregator" in errors["spec.models[0].machines"]


def test_aggregator_needs_a_machine_per_model() -> None:
    errors = provider_errors(dialect="Aggregator", models={"m": ["a"], "n": []})
    assert list(errors) == ["spec.models[1].machines"]
    assert "at least one machine" in errors["spec.models[1].machines"]


def test_model_and_machine_names_are_unique() -> None:
    spec = provider()["spec"]
    spec["models"] = [
        {"name": "m", "machines": [{"name": "a"}, {"name": "b"}, {"name": "a"}]},
        {"name": "m", "machines": [{"name": "a"}]},
    ]
    errors = errors_of("ProviderPolicy", spec)
    assert list(errors) == ["spec.models[0].machines[2].name"]
    spec["models"][0]["machines"].pop()
    errors = errors_of("ProviderPolicy", spec)
    assert list(errors) == ["spec.models[1].name"]
    assert "first at models[0]" in errors["spec.models[1].name"]


def test_models_count_is_bounded() -> None:
    assert provider_errors(models={}) == {"spec.models": "must have at least 1 item"}
    many = {f"m{i}": ["a"] for i in range(257)}
    assert provider_errors(models=many) == {"spec.models": "must have at most 256 items (has 257)"}


@pytest.mark.parametrize(
    ("breaker", "fields"),
    [
        ({"cooldownSeconds": 0}, ["spec.breaker.cooldownSeconds"]),
        ({"cooldownSeconds": 700, "maxCooldownSeconds": 600}, ["spec.breaker.maxCooldownSeconds"]),
        ({"maxCooldownSeconds": 5}, ["spec.breaker.maxCooldownSeconds"]),
        ({"backoffMultiplier": 0.5}, ["spec.breaker.backoffMultiplier"]),
        ({"jitterFraction": 1.5}, ["spec.breaker.jitterFraction"]),
        ({"novelSignatureCount": 0}, ["spec.breaker.novelSignatureCount"]),
        ({"familiarSignatureCount": 0}, ["spec.breaker.familiarSignatureCount"]),
        ({"noveltyWindowSeconds": 0}, ["spec.breaker.noveltyWindowSeconds"]),
        ({"rateThreshold": 0}, ["spec.breaker.rateThreshold"]),
        ({"rateThreshold": 1.01}, ["spec.breaker.rateThreshold"]),
        ({"rateWindow": 0}, ["spec.breaker.rateWindow"]),
        ({"rateMinSamples": 0}, ["spec.breaker.rateMinSamples"]),
        ({"rateWindow": 10}, ["spec.breaker.rateMinSamples"]),
        (
            {"cooldownSeconds": 60, "maxCooldownSeconds": 30, "rateWindow": 5},
            ["spec.breaker.maxCooldownSeconds", "spec.breaker.rateMinSamples"],
        ),
        ({"transportScope": "Machine"}, ["spec.breaker.transportScope"]),
    ],
)
def test_breaker_rules(breaker: dict[str, Any], fields: list[str]) -> None:
    assert list(provider_errors(breaker=breaker)) == fields


def test_breaker_boundaries_are_inclusive_where_documented() -> None:
    parse_spec(
        "ProviderPolicy",
        {
            **provider()["spec"],
            "breaker": {
                "cooldownSeconds": 30,
                "maxCooldownSeconds": 30,
                "rateWindow": 20,
                "rateMinSamples": 20,
                "rateThreshold": 1,
                "jitterFraction": 0,
                "backoffMultiplier": 1,
            },
        },
    )


def test_cross_field_message_says_what_to_do() -> None:
    errors = provider_errors(breaker={"cooldownSeconds": 60, "maxCooldownSeconds": 30})
    assert errors == {
        "spec.breaker.maxCooldownSeconds": (
            "must be at least cooldownSeconds (60); raise it or lower cooldownSeconds"
        )
    }


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        ("timeouts", "connectSeconds", 0),
        ("timeouts", "idleSeconds", -1),
        ("timeouts", "idleSeconds", 3601),
        ("degradedOutput", "detectEmpty", "no"),
    ],
)
def test_timeouts_and_degraded_output(section: str, field: str, value: Any) -> None:
    assert list(provider_errors(**{section: {field: value}})) == [f"spec.{section}.{field}"]


# The generated schema ------------------------------------------------------------------


def _properties(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    found = [(name, prop) for name, prop in schema.get("properties", {}).items()]
    for definition in schema.get("$defs", {}).values():
        found.extend(_properties(definition))
    return found


@pytest.mark.parametrize("model", [RoleTableSpec, ProviderPolicySpec])
def test_every_field_is_described_for_kubectl_explain(model: type[BaseModel]) -> None:
    schema = model.model_json_schema(by_alias=True)
    properties = _properties(schema)
    assert properties
    undescribed = [name for name, prop in properties if not prop.get("description")]
    assert undescribed == []
    snake = [name for name, _ in properties if "_" in name]
    assert snake == []


def test_schema_carries_kubernetes_list_semantics_and_rules() -> None:
    schema = ProviderPolicySpec.model_json_schema(by_alias=True)
    assert schema["properties"]["models"]["x-kubernetes-list-map-keys"] == ["name"]
    assert "priceInputPerMTok" in schema["$defs"]["MachineSpec"]["properties"]
    # The endpoint's shape is all CEL rules: a failed `pattern` would quote the value back.
    assert "pattern" not in schema["properties"]["endpoint"]
    assert schema["properties"]["endpoint"]["x-kubernetes-validations"]
    rules = schema["$defs"]["BreakerSpec"]["x-kubernetes-validations"]
    assert {rule["fieldPath"] for rule in rules} == {".maxCooldownSeconds", ".rateMinSamples"}
    roles = RoleTableSpec.model_json_schema(by_alias=True)
    assert roles["properties"]["roles"]["x-kubernetes-list-type"] == "map"
    assert roles["$defs"]["RoleSpec"]["properties"]["models"]["x-kubernetes-list-type"] == "atomic"


def test_all_spec_models_forbid_extra_fields_and_are_frozen() -> None:
    models = SpecModel.__subclasses__()
    assert len(models) >= 9
    for model in models:
        assert model.model_config.get("extra") == "forbid", model
        assert model.model_config.get("frozen") is True, model


def test_reference_documents_every_field() -> None:
    reference = (Path(__file__).parents[2] / "docs" / "reference.md").read_text(encoding="utf-8")
    models: tuple[type[BaseModel], ...] = (
        RoleTableSpec, ProviderPolicySpec, ProxyMemorySpec,
        RoleTableStatus, ProviderPolicyStatus, ProxyMemoryStatus,
    )  # fmt: skip
    for model in models:
        for name, _ in _properties(model.model_json_schema(by_alias=True)):
            assert f"`{name}`" in reference, f"docs/reference.md does not document {name}"
