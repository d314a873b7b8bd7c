"""The generated CRDs: committed files up to date, schemas structural, and every field of
the pydantic models present in the CRD with the same type, constraints, default and enum.

The agreement test reads the models' own field definitions (annotations, annotated-types
constraints, defaults), not the JSON schema the CRDs are generated from, so a converter
that drops or bends a constraint fails it.
"""

from __future__ import annotations

import datetime
import enum
import re
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import annotated_types
import pytest
from pydantic import BaseModel, Field, StringConstraints
from pydantic.fields import FieldInfo

from rolegate_policy import GROUP, VERSION
from rolegate_policy.crds import (
    RESOURCES,
    Resource,
    SchemaConversionError,
    clean_description,
    crd,
    main,
    render_crds,
    structural_schema,
)
from rolegate_policy.endpoint import ENDPOINT_RULES
from rolegate_policy.model import ProviderPolicySpec, RoleTableSpec, derived_default, parse_spec

CRD_DIR = Path(__file__).parents[2] / "deploy" / "crds"
BY_KIND = {resource.kind: resource for resource in RESOURCES}


def openapi(resource: Resource) -> dict[str, Any]:
    schema: dict[str, Any] = crd(resource)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def nodes(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema node with its path (`.spec.roles[].name`)."""
    yield path or "<root>", schema
    for name, child in schema.get("properties", {}).items():
        yield from nodes(child, f"{path}.{name}")
    if "items" in schema:
        yield from nodes(schema["items"], f"{path}[]")


# The committed files --------------------------------------------------------------------


def test_committed_crds_are_generated_from_the_model() -> None:
    rendered = render_crds()
    assert sorted(rendered) == [
        "rolegate.dev_accessgrants.yaml",
        "rolegate.dev_providerpolicies.yaml",
        "rolegate.dev_proxymemories.yaml",
        "rolegate.dev_roletables.yaml",
    ]
    for name, text in rendered.items():
        path = CRD_DIR / name
        assert path.is_file(), f"{path} is missing; run `make crds`"
        assert path.read_text() == text, f"{path} is stale; run `make crds` and commit it"


def test_rendering_is_deterministic() -> None:
    assert render_crds() == render_crds()


def test_check_mode_reports_a_stale_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(tmp_path)]) == 0
    assert main(["--check", str(tmp_path)]) == 0
    stale = tmp_path / "rolegate.dev_roletables.yaml"
    stale.write_text(stale.read_text().replace("maxItems: 256", "maxItems: 257", 1))
    capsys.readouterr()
    assert main(["--check", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert "-                maxItems: 257" in out
    assert "+                maxItems: 256" in out
    assert "make crds" in err
    (tmp_path / "rolegate.dev_providerpolicies.yaml").unlink()
    assert main(["--check", str(tmp_path)]) == 1


# The CRD objects ------------------------------------------------------------------------


@pytest.mark.parametrize("resource", RESOURCES, ids=lambda r: r.kind)
def test_crd_names_scope_versions_and_columns(resource: Resource) -> None:
    obj = crd(resource)
    spec = obj["spec"]
    assert obj["metadata"]["name"] == f"{resource.plural}.{GROUP}"
    assert spec["group"] == GROUP
    assert spec["scope"] == "Namespaced"
    assert spec["names"]["categories"] == ["rolegate"]
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == (VERSION, True, True)
    assert version["subresources"] == {"status": {}}
    root = version["schema"]["openAPIV3Schema"]
    assert root["required"] == ["spec"]
    assert root["description"].startswith(resource.kind)
    printer = version["additionalPrinterColumns"]
    shown = [column["name"] for column in printer if column.get("priority", 0) == 0]
    wide = [column["name"] for column in printer if column.get("priority", 0) == 1]
    assert len(shown) + len(wide) == len(printer)
    expected = {
        "RoleTable": (
            ["Roles", "Rulings", "Accepted", "Reason", "Programmed", "Age"],
            ["Generation", "Observed", "Message"],
        ),
        "ProviderPolicy": (
            ["Accepted", "Programmed", "Tripped", "Scope", "Reason", "Age"],
            ["Endpoint", "Secrets", "Generation", "Observed"],
        ),
        "AccessGrant": (
            ["Roles", "Admin", "Accepted", "Reason", "Programmed", "Age"],
            ["Generation", "Observed", "Limits"],
        ),
        "ProxyMemory": (["Pod", "Machines", "Written", "Age"], []),
    }
    assert (shown, wide) == expected[resource.kind]
    # `-o wide` adds its columns after the others (kubectl keeps the declared order).
    assert [column["name"] for column in printer] == shown + wide
    for column in version["additionalPrinterColumns"]:
        # Every column points at a field the schema declares (or at a condition list).
        path = re.sub(r"\[\?\(.*\)\]\.", "[].", column["jsonPath"]).split(".")[1:]
        node = root
        for part in path:
            if part.endswith("[]"):
                node = node["properties"][part[:-2]]["items"]
            elif part == "metadata":
                break
            else:
                node = node["properties"][part]


def test_short_names() -> None:
    assert BY_KIND["RoleTable"].short_names == ("rt",)
    assert BY_KIND["ProviderPolicy"].short_names == ("pp",)
    assert BY_KIND["AccessGrant"].short_names == ("ag",)
    assert BY_KIND["ProxyMemory"].short_names == ("pmem",)


# Structural schemas ---------------------------------------------------------------------


@pytest.mark.parametrize("resource", RESOURCES, ids=lambda r: r.kind)
def test_schema_is_structural(resource: Resource) -> None:
    for path, node in nodes(openapi(resource)):
        assert "type" in node, f"{path}: no type"
        for forbidden in ("$ref", "$defs", "anyOf", "allOf", "oneOf", "not", "title"):
            assert forbidden not in node, f"{path}: {forbidden}"
        assert "additionalProperties" not in node, f"{path}: additionalProperties"
        assert "uniqueItems" not in node, f"{path}: uniqueItems"
        assert "x-kubernetes-preserve-unknown-fields" not in node, path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True, path
            assert "minimum" in node, path
        if node["type"] == "object" and path != ".metadata":
            assert node.get("properties"), f"{path}: an object without properties"


@pytest.mark.parametrize("resource", RESOURCES, ids=lambda r: r.kind)
def test_every_field_is_described_and_bounded(resource: Resource) -> None:
    for path, node in nodes(openapi(resource)):
        if path != ".metadata":
            assert node.get("description") or path.endswith("[]"), f"{path}: no description"
        # The CEL cost estimator needs a bound on every string and list it might walk.
        if node["type"] == "array":
            assert "maxItems" in node, f"{path}: no maxItems"
        if node["type"] == "string" and path not in (".apiVersion", ".kind"):
            assert "maxLength" in node or "enum" in node or node.get("format") == "date-time", (
                f"{path}: no maxLength"
            )


@pytest.mark.parametrize("resource", RESOURCES, ids=lambda r: r.kind)
def test_list_map_keys_are_required(resource: Resource) -> None:
    for path, node in nodes(openapi(resource)):
        if node.get("x-kubernetes-list-type") == "map":
            keys = node["x-kubernetes-list-map-keys"]
            assert set(keys) <= set(node["items"]["required"]), path


@pytest.mark.parametrize("resource", RESOURCES, ids=lambda r: r.kind)
def test_cel_rules_name_their_field_in_api_convention_style(resource: Resource) -> None:
    rules = 0
    for path, node in nodes(openapi(resource)):
        for rule in node.get("x-kubernetes-validations", []):
            rules += 1
            message = rule["message"]
            named = re.findall(r"`([A-Za-z*\[\].]+)`", message)
            assert named, f"{path}: {message!r} names no field in back-quotes"
            assert " must " in f" {message} ", f"{path}: {message!r} does not say what must be"
            if "fieldPath" in rule:
                # fieldPath points at a property of this node, and the message names it.
                target = rule["fieldPath"].lstrip(".")
                assert target in node["properties"], f"{path}: fieldPath {target}"
                assert any(name.startswith(target) for name in named), (path, message)
            else:
                assert path.rsplit(".", 1)[-1] in named, (path, message)
    least = {"RoleTable": 0, "ProviderPolicy": 5, "AccessGrant": 1, "ProxyMemory": 0}
    assert rules >= least[resource.kind]


def test_descriptions_read_as_paragraphs() -> None:
    assert clean_description("  One line\n  wrapped here.\n\n  Second   paragraph.\n") == (
        "One line wrapped here.\n\nSecond paragraph."
    )


def test_descriptions_spell_out_ranges_and_defaults() -> None:
    roles = openapi(BY_KIND["RoleTable"])["properties"]["spec"]["properties"]["roles"]
    role = roles["items"]["properties"]
    assert roles["description"].endswith("Must have at least 1 item and at most 256 items.")
    assert role["patienceSeconds"]["description"].endswith(
        "Must be greater than 0 and at most 3600."
    )
    assert role["expectedOutputTokens"]["description"].endswith(
        "Must be at least 1 and at most 1000000. Defaults to 512."
    )
    assert role["ruling"]["description"].endswith("Defaults to Auto.")
    machine = openapi(BY_KIND["ProviderPolicy"])["properties"]["spec"]["properties"]["models"]
    flag = machine["items"]["properties"]["machines"]["items"]["properties"]
    assert flag["continuesPartialMessage"]["description"].endswith("Defaults to false.")


# The converter refuses what a structural schema cannot say -------------------------------


class _Union(BaseModel):
    value: int | str = Field(description="either")


class _Set(BaseModel):
    value: set[str] = Field(description="unique")


class _Map(BaseModel):
    value: dict[str, int] = Field(description="free-form")


@pytest.mark.parametrize("model", [_Union, _Set, _Map])
def test_converter_refuses_non_structural_constructs(model: type[BaseModel]) -> None:
    with pytest.raises(SchemaConversionError):
        structural_schema(model)


# Field-by-field agreement with the pydantic models --------------------------------------

_CONSTRAINT_KEYWORDS = frozenset(
    {
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "minLength",
        "maxLength",
        "minItems",
        "maxItems",
        "pattern",
        "enum",
        "format",
    }
)


def _unwrap(annotation: Any) -> tuple[Any, list[Any]]:
    """`(type, constraint metadata)` of `X`, `X | None` or `Annotated[X, ...]`."""
    metadata: list[Any] = []
    while True:
        if typing.get_origin(annotation) is typing.Annotated:
            annotation, *extra = typing.get_args(annotation)
            metadata.extend(extra)
            continue
        if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
            arguments = [a for a in typing.get_args(annotation) if a is not type(None)]
            assert len(arguments) == 1, annotation
            annotation = arguments[0]
            continue
        return annotation, metadata


def _expected_constraints(metadata: list[Any], kind: str) -> dict[str, Any]:
    """The CRD keywords the model's constraints stand for, on a node of type `kind`."""
    expected: dict[str, Any] = {}
    length = ("minItems", "maxItems") if kind == "array" else ("minLength", "maxLength")
    for item in metadata:
        if isinstance(item, annotated_types.Gt):
            expected.update(minimum=item.gt, exclusiveMinimum=True)
        elif isinstance(item, annotated_types.Ge):
            expected["minimum"] = item.ge
        elif isinstance(item, annotated_types.Lt):
            expected.update(maximum=item.lt, exclusiveMaximum=True)
        elif isinstance(item, annotated_types.Le):
            expected["maximum"] = item.le
        elif isinstance(item, annotated_types.MinLen):
            expected[length[0]] = item.min_length
        elif isinstance(item, annotated_types.MaxLen):
            expected[length[1]] = item.max_length
        elif isinstance(item, StringConstraints):
            for attribute, keyword in (
                ("min_length", "minLength"),
                ("max_length", "maxLength"),
                ("pattern", "pattern"),
            ):
                if getattr(item, attribute) is not None:
                    expected[keyword] = getattr(item, attribute)
        elif getattr(item, "pattern", None) is not None:  # pydantic's general metadata
            expected["pattern"] = item.pattern
        else:
            raise AssertionError(f"unhandled constraint {item!r}")
    return expected


def _assert_agrees(annotation: Any, metadata: list[Any], node: dict[str, Any], at: str) -> None:
    """`node` (a CRD schema node) says exactly what `annotation` + `metadata` say."""
    inner, inner_metadata = _unwrap(annotation)
    if typing.get_origin(inner) is list:
        assert node["type"] == "array", at
        (item,) = typing.get_args(inner)
        expected = _expected_constraints(metadata, "array")
        assert {k: v for k, v in node.items() if k in _CONSTRAINT_KEYWORDS} == expected, at
        _assert_agrees(item, [], node["items"], f"{at}[]")
        return
    metadata = metadata + inner_metadata
    if isinstance(inner, type) and issubclass(inner, BaseModel):
        assert node["type"] == "object", at
        _assert_model_agrees(inner, node, at)
        return
    if typing.get_origin(inner) is typing.Literal:
        values = [getattr(v, "value", v) for v in typing.get_args(inner)]
        kind, expected = "string", {"enum": values}
    elif isinstance(inner, type) and issubclass(inner, enum.Enum):
        kind, expected = "string", {"enum": [member.value for member in inner]}
    elif inner is bool:
        kind, expected = "boolean", {}
    elif inner is int:
        kind, expected = "integer", {}
    elif inner is float:
        kind, expected = "number", {}
    elif inner is str:
        kind, expected = "string", {}
    elif inner is datetime.datetime:
        kind, expected = "string", {"format": "date-time"}
    else:
        raise AssertionError(f"{at}: unhandled type {inner!r}")
    assert node["type"] == kind, at
    expected.update(_expected_constraints(metadata, kind))
    actual = {k: v for k, v in node.items() if k in _CONSTRAINT_KEYWORDS}
    assert actual == expected, at


def _assert_default_agrees(field: FieldInfo, node: dict[str, Any], at: str) -> None:
    if field.is_required() or field.json_schema_extra is derived_default:
        assert "default" not in node, at
        return
    value = field.get_default(call_default_factory=True, validated_data={})
    if value is None or value == []:
        # Omitted means None / empty in the model; the API server stores nothing.
        assert "default" not in node, at
    elif isinstance(value, BaseModel):
        # The API server fills the nested defaults into `{}`; the model validates `{}`
        # into its own default.
        assert node["default"] == {}, at
        assert type(value).model_validate(node["default"]) == value, at
    elif isinstance(value, enum.Enum):
        assert node["default"] == value.value, at
    else:
        assert node["default"] == value, at
        assert type(node["default"]) is type(value), f"{at}: {node['default']!r} vs {value!r}"


def _assert_model_agrees(model: type[BaseModel], node: dict[str, Any], at: str) -> None:
    fields = {field.alias or name: field for name, field in model.model_fields.items()}
    assert list(node["properties"]) == list(fields), f"{at}: properties differ from fields"
    required = [alias for alias, field in fields.items() if field.is_required()]
    assert node.get("required", []) == required, f"{at}: required"
    extra = model.model_config.get("json_schema_extra") or {}
    assert isinstance(extra, dict)
    assert node.get("x-kubernetes-validations") == extra.get("x-kubernetes-validations"), at
    for alias, field in fields.items():
        child = node["properties"][alias]
        path = f"{at}.{alias}"
        assert field.description, f"{path}: no description in the model"
        assert clean_description(field.description) in child["description"], path
        _assert_default_agrees(field, child, path)
        extra_given = field.json_schema_extra
        field_extra = {} if callable(extra_given) else dict(extra_given or {})
        metadata = list(field.metadata)
        for key, value in field_extra.items():
            assert key.startswith("x-kubernetes-"), f"{path}: {key}"
            assert child[key] == value, f"{path}: {key}"
        for key in child:
            if key.startswith("x-kubernetes-"):
                assert key in field_extra or key == "x-kubernetes-validations", f"{path}: {key}"
        _assert_agrees(field.annotation, metadata, child, path)


@pytest.mark.parametrize("resource", RESOURCES, ids=lambda r: r.kind)
def test_every_model_field_is_in_the_crd_with_the_same_rules(resource: Resource) -> None:
    root = openapi(resource)
    assert list(root["properties"]) == ["apiVersion", "kind", "metadata", "spec", "status"]
    _assert_model_agrees(resource.spec, root["properties"]["spec"], ".spec")
    _assert_model_agrees(resource.status, root["properties"]["status"], ".status")


def test_agreement_check_catches_a_bent_constraint() -> None:
    node = openapi(BY_KIND["RoleTable"])["properties"]["spec"]
    node["properties"]["roles"]["items"]["properties"]["patienceSeconds"]["maximum"] = 7200
    with pytest.raises(AssertionError, match="patienceSeconds"):
        _assert_model_agrees(RoleTableSpec, node, ".spec")


def _apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """What the API server's defaulting does to `value` (objects and lists only)."""
    if isinstance(value, dict):
        result = dict(value)
        for name, child in schema.get("properties", {}).items():
            if name not in result and "default" in child:
                result[name] = child["default"]
            if name in result:
                result[name] = _apply_defaults(child, result[name])
        return result
    if isinstance(value, list):
        return [_apply_defaults(schema["items"], item) for item in value]
    return value


@pytest.mark.parametrize(
    ("kind", "spec"),
    [
        ("RoleTable", {"roles": [{"name": "a", "models": ["m"], "patienceSeconds": 4,
                                  "visibility": "Unwatched"}]}),
        ("ProviderPolicy", {"endpoint": "https://h/v1", "models": [{"name": "m"}]}),
        ("ProviderPolicy", {"endpoint": "https://h/v1", "models": [{"name": "m"}],
                            "breaker": {"cooldownSeconds": 5}}),
    ],
)  # fmt: skip
def test_schema_defaults_mean_what_the_model_defaults_mean(kind: str, spec: Any) -> None:
    schema = openapi(BY_KIND[kind])["properties"]["spec"]
    defaulted = _apply_defaults(schema, spec)
    assert defaulted != spec
    assert parse_spec(kind, defaulted) == parse_spec(kind, spec)


def test_provider_policy_defaults_fill_every_nested_setting() -> None:
    schema = openapi(BY_KIND["ProviderPolicy"])["properties"]["spec"]
    defaulted = _apply_defaults(schema, {"endpoint": "https://h/v1", "models": [{"name": "m"}]})
    spec = parse_spec("ProviderPolicy", defaulted)
    assert isinstance(spec, ProviderPolicySpec)
    # The cap's default follows cooldownSeconds: the schema leaves it to compile.
    assert "maxCooldownSeconds" not in defaulted["breaker"]
    assert spec.breaker.max_cooldown_seconds == 30
    assert defaulted["dialect"] == "OpenAI"
    assert set(defaulted["timeouts"]) == {"connectSeconds", "idleSeconds"}


# The endpoint: CEL rules, never a pattern ------------------------------------------------


def test_the_endpoint_is_judged_by_cel_rules_that_never_quote_it() -> None:
    spec = openapi(BY_KIND["ProviderPolicy"])["properties"]["spec"]
    endpoint = spec["properties"]["endpoint"]
    # A failed `pattern` makes the API server quote the value; a CEL message is fixed text.
    assert "pattern" not in endpoint
    rules = endpoint["x-kubernetes-validations"]
    assert [rule["message"] for rule in rules] == [rule.message for rule in ENDPOINT_RULES]
    # Each rule is in force only once the earlier ones hold: one message per mistake.
    for index, rule in enumerate(rules[1:], start=1):
        earlier = " && ".join(r.cel for r in ENDPOINT_RULES[:index])
        assert rule["rule"] == f"!({earlier}) || ({ENDPOINT_RULES[index].cel})"
    for resource in RESOURCES:
        for path, node in nodes(openapi(resource)):
            for rule in node.get("x-kubernetes-validations", []):
                assert "messageExpression" not in rule, f"{path}: a message must never quote"
