"""The CustomResourceDefinitions of rolegate's kinds (`RoleTable`, `ProviderPolicy`,
`AccessGrant`, `ProxyMemory`), generated from the policy model so the API server and
`compile` can never disagree about what a valid spec is.

`render_crds()` turns each spec model's JSON schema (pydantic, draft 2020-12) into the
*structural* OpenAPI v3 schema the API server requires: `$ref`s inlined, `title`s
dropped, `anyOf: [X, null]` turned into an optional X, `additionalProperties: false`
dropped (structural schemas forbid it; the API server's strict field validation rejects
unknown fields on `kubectl apply` instead), `exclusiveMinimum` in its OpenAPI v3.0 form,
and every node typed. Anything else the converter does not recognise is an error, so a
new pydantic feature cannot slip a non-structural schema into the CRDs.

The status schemas (written by the operator, and for ProviderPolicy also by the proxy
pods) are declared here as pydantic models too, so they go through the same converter.

`python -m rolegate_policy.crds DIR` writes the CRDs into DIR (`make crds`);
`python -m rolegate_policy.crds --check DIR` exits 1 with a diff when they are stale.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import inspect
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Required, TypedDict

import yaml
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue, NoDefault
from pydantic_core import core_schema

from rolegate_policy import GROUP, VERSION
from rolegate_policy.model import (
    ACCESS_GRANT_KIND,
    PROVIDER_POLICY_KIND,
    PROXY_MEMORY_KIND,
    ROLE_TABLE_KIND,
    AccessGrantSpec,
    ProviderPolicySpec,
    ProxyMemorySpec,
    RoleTableSpec,
)
from rolegate_policy.status import (
    AccessGrantStatus,
    ProviderPolicyStatus,
    ProxyMemoryStatus,
    RoleTableStatus,
)

# The resources ----------------------------------------------------------------------


class PrinterColumn(TypedDict, total=False):
    """One of a CRD version's `additionalPrinterColumns`."""

    name: Required[str]
    type: Required[str]
    jsonPath: Required[str]
    description: str
    # 1: shown only by `kubectl get -o wide`.
    priority: int


# The columns both kinds show. `-o wide` adds the priority-1 ones; kubectl shows every
# column in the order declared, so those come after Age, as `kubectl get pods -o wide`
# puts its extra columns last.
_ACCEPTED_COLUMN: Final[PrinterColumn] = {
    "name": "Accepted",
    "type": "string",
    "jsonPath": '.status.conditions[?(@.type=="Accepted")].status',
    "description": "Whether the operator compiled the resource into the proxy configuration.",
}
_PROGRAMMED_COLUMN: Final[PrinterColumn] = {
    "name": "Programmed",
    "type": "string",
    "jsonPath": '.status.conditions[?(@.type=="Programmed")].status',
    "description": "Whether the proxy configuration that carries the resource is written.",
}
_ACCEPTED_REASON_COLUMN: Final[PrinterColumn] = {
    "name": "Reason",
    "type": "string",
    "jsonPath": '.status.conditions[?(@.type=="Accepted")].reason',
    "description": "Why it is accepted or not (e.g. `NoServedModel`, `UnknownRole`).",
}
_AGE_COLUMN: Final[PrinterColumn] = {
    "name": "Age",
    "type": "date",
    "jsonPath": ".metadata.creationTimestamp",
}
_GENERATION_COLUMNS: Final[tuple[PrinterColumn, ...]] = (
    {
        "name": "Generation",
        "type": "integer",
        "jsonPath": ".metadata.generation",
        "description": "The spec's generation.",
        "priority": 1,
    },
    {
        "name": "Observed",
        "type": "integer",
        "jsonPath": ".status.observedGeneration",
        "description": "The generation the status describes; below Generation, it is behind.",
        "priority": 1,
    },
)


@dataclass(frozen=True)
class Resource:
    """What the CRD of one kind is made of."""

    kind: str
    plural: str
    singular: str
    short_names: tuple[str, ...]
    description: str
    spec: type[BaseModel]
    status: type[BaseModel]
    columns: tuple[PrinterColumn, ...]

    @property
    def crd_name(self) -> str:
        return f"{self.plural}.{GROUP}"

    @property
    def file_name(self) -> str:
        return f"{GROUP}_{self.plural}.yaml"


RESOURCES: Final = (
    Resource(
        kind=ROLE_TABLE_KIND,
        plural="roletables",
        singular="roletable",
        short_names=("rt",),
        description=(
            "RoleTable declares roles: the classes of caller traffic the rolegate proxy "
            "serves. A caller selects a role by sending its name as the OpenAI `model`; the "
            "role says which upstream models may serve it, in order of preference, how long "
            "the caller waits for a usable answer (patience), whether a person watches the "
            "stream, and how an aggregator may fall back. The operator compiles every "
            "RoleTable and ProviderPolicy into the proxy configuration and reports the "
            "outcome in each resource's status."
        ),
        spec=RoleTableSpec,
        status=RoleTableStatus,
        columns=(
            {
                "name": "Roles",
                "type": "integer",
                "jsonPath": ".status.roleCount",
                "description": "Number of roles in the table.",
            },
            {
                "name": "Rulings",
                "type": "string",
                "jsonPath": ".status.rulings",
                "description": "Each role's effective ruling and delivery.",
            },
            _ACCEPTED_COLUMN,
            _ACCEPTED_REASON_COLUMN,
            _PROGRAMMED_COLUMN,
            _AGE_COLUMN,
            *_GENERATION_COLUMNS,
            {
                "name": "Message",
                "type": "string",
                "jsonPath": '.status.conditions[?(@.type=="Accepted")].message',
                "description": "The Accepted condition's message: the field and what to fix.",
                "priority": 1,
            },
        ),
    ),
    Resource(
        kind=PROVIDER_POLICY_KIND,
        plural="providerpolicies",
        singular="providerpolicy",
        short_names=("pp",),
        description=(
            "ProviderPolicy declares one upstream chat-completions endpoint (an OpenRouter-"
            "style aggregator or a plain OpenAI-compatible server): the models it serves, "
            "the machines serving each, the figures they publish, and the circuit breaker "
            "that takes it out of rotation when it fails or degrades. The operator compiles "
            "it into the proxy configuration; proxy pods report their breaker state in its "
            "status, so `kubectl get providerpolicies` shows what is tripped right now."
        ),
        spec=ProviderPolicySpec,
        status=ProviderPolicyStatus,
        columns=(
            _ACCEPTED_COLUMN,
            _PROGRAMMED_COLUMN,
            {
                "name": "Tripped",
                "type": "string",
                "jsonPath": '.status.conditions[?(@.type=="Tripped")].status',
                "description": "Whether a breaker has taken the provider or a model out.",
            },
            {
                "name": "Scope",
                "type": "string",
                "jsonPath": ".status.tripped",
                "description": "What is tripped: the provider, or which models.",
            },
            {
                # Not the Tripped condition's reason: that one is also set (`NoOpenBreakers`)
                # when nothing is tripped, and a JSONPath filter cannot test two fields.
                "name": "Reason",
                "type": "string",
                "jsonPath": ".status.trippedReason",
                "description": "Why it tripped; empty when nothing is.",
            },
            _AGE_COLUMN,
            {
                "name": "Endpoint",
                "type": "string",
                "jsonPath": ".spec.endpoint",
                "description": "Base URL of the provider's API.",
                "priority": 1,
            },
            {
                "name": "Secrets",
                "type": "string",
                "jsonPath": '.status.conditions[?(@.type=="ResolvedRefs")].status',
                "description": "Whether the API key Secret it references resolves.",
                "priority": 1,
            },
            *_GENERATION_COLUMNS,
        ),
    ),
    Resource(
        kind=ACCESS_GRANT_KIND,
        plural="accessgrants",
        singular="accessgrant",
        short_names=("ag",),
        description=(
            "AccessGrant says which callers may use which roles of the rolegate proxy: "
            "callers that present a Kubernetes ServiceAccount token (of one "
            "account, or of any account of a namespace), an API key kept in a Secret, or "
            "(only when a grant says so) no credential at all. A request is served only "
            "when some grant admits its caller for the role it names."
        ),
        spec=AccessGrantSpec,
        status=AccessGrantStatus,
        columns=(
            {
                "name": "Roles",
                "type": "string",
                "jsonPath": ".spec.roles",
                "description": "The roles its callers may select.",
            },
            {
                "name": "Admin",
                "type": "boolean",
                "jsonPath": ".spec.admin",
                "description": "Whether its callers may read the explanations and judge.",
            },
            _ACCEPTED_COLUMN,
            _ACCEPTED_REASON_COLUMN,
            _PROGRAMMED_COLUMN,
            _AGE_COLUMN,
            *_GENERATION_COLUMNS,
            {
                "name": "Limits",
                "type": "string",
                "jsonPath": ".spec.limits",
                "description": "What its callers may use together, per proxy pod.",
                "priority": 1,
            },
        ),
    ),
    Resource(
        kind=PROXY_MEMORY_KIND,
        plural="proxymemories",
        singular="proxymemory",
        short_names=("pmem",),
        description=(
            "ProxyMemory holds what one rolegate proxy pod learned of each machine (its own "
            "evidence of their speed and its operational scores), written by that pod "
            "every 30 seconds (its `--memory-publish-seconds`) and read by the other proxy "
            "pods of its namespace, so the "
            "whole fleet routes from what any pod learned, and a restarted pod takes its "
            "own memory back. One object per pod, named after it; not compiled by the "
            "operator. Delete them (and restart the proxies) to make the fleet forget."
        ),
        spec=ProxyMemorySpec,
        status=ProxyMemoryStatus,
        columns=(
            {
                "name": "Pod",
                "type": "string",
                "jsonPath": ".spec.pod",
                "description": "The proxy pod whose memory this is.",
            },
            {
                "name": "Machines",
                "type": "integer",
                "jsonPath": ".spec.machines",
                "description": "Machines the memory holds.",
            },
            {
                "name": "Written",
                "type": "date",
                "jsonPath": ".spec.writtenAt",
                "description": "When the pod last wrote it.",
            },
            _AGE_COLUMN,
        ),
    ),
)


# Schema conversion ------------------------------------------------------------------


class SchemaConversionError(ValueError):
    """The model's JSON schema uses something a structural CRD schema cannot express."""


class _Generator(GenerateJsonSchema):
    """Pydantic's generator, plus the defaults `default_factory` fields stand for.

    A nested model built by its factory (`breaker: BreakerSpec = BreakerSpec()`) becomes
    `default: {}` on the object: the API server then fills in every nested default, as
    the model does. An empty list needs no default: omitted and empty mean the same.
    """

    def get_default_value(self, schema: core_schema.WithDefaultSchema) -> Any:
        factory = schema.get("default_factory")
        if factory is None:
            return super().get_default_value(schema)
        if schema.get("default_factory_takes_data"):
            raise SchemaConversionError("a default_factory that takes data has no CRD default")
        value = factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            return value.model_dump(mode="json", by_alias=True, exclude_defaults=True)
        if value == []:
            return NoDefault
        raise SchemaConversionError(f"cannot express the default {value!r} in a CRD")


# Keywords copied as they are (after the node's own conversion).
_PLAIN_KEYWORDS: Final = frozenset(
    {
        "type",
        "description",
        "default",
        "enum",
        "format",
        "minimum",
        "maximum",
        "minLength",
        "maxLength",
        "pattern",
        "minItems",
        "maxItems",
        "required",
    }
)
_DROPPED_KEYWORDS: Final = frozenset({"title"})


def json_schema(model: type[BaseModel]) -> JsonSchemaValue:
    """The model's validation JSON schema as pydantic writes it, with factory defaults."""
    return model.model_json_schema(by_alias=True, mode="validation", schema_generator=_Generator)


def structural_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of `model`, ready for a CRD."""
    raw = json_schema(model)
    definitions: dict[str, Any] = raw.get("$defs", {})
    root = {key: value for key, value in raw.items() if key != "$defs"}
    return _convert(root, definitions, "")


def _resolve(node: Mapping[str, Any], definitions: Mapping[str, Any], at: str) -> dict[str, Any]:
    """`node` with `$ref`, `allOf: [one]` and `anyOf: [X, null]` folded into one schema;
    the node's own keywords (description, default) win over the referenced ones."""
    node = dict(node)
    if "$ref" in node:
        name = str(node.pop("$ref")).removeprefix("#/$defs/")
        if name not in definitions:
            raise SchemaConversionError(f"{at or '<root>'}: unknown $ref {name}")
        base = _resolve(definitions[name], definitions, at)
        return _merge(base, node)
    if "allOf" in node:
        (single,) = node.pop("allOf")
        return _merge(_resolve(single, definitions, at), node)
    if "anyOf" in node:
        branches = [b for b in node.pop("anyOf") if b != {"type": "null"}]
        if len(branches) != 1:
            raise SchemaConversionError(
                f"{at or '<root>'}: anyOf is not structural; only `X | None` is supported"
            )
        if node.get("default", NoDefault) is None:
            del node["default"]
        return _merge(_resolve(branches[0], definitions, at), node)
    return node


def _merge(base: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    """A referenced schema with the referring node's keywords on top. Both descriptions
    are kept when both exist: the field's (what it is for), then the type's (what it is)."""
    merged = {**base, **node}
    if (
        "description" in base
        and "description" in node
        and base["description"] != node["description"]
    ):
        merged["description"] = f"{node['description']}\n\n{base['description']}"
    return merged


def _convert(node: Mapping[str, Any], definitions: Mapping[str, Any], at: str) -> dict[str, Any]:
    node = _resolve(node, definitions, at)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED_KEYWORDS:
            continue
        if key == "additionalProperties":
            if value is not False:
                raise SchemaConversionError(
                    f"{at}: additionalProperties {value!r} is not supported"
                )
            continue
        if key == "properties":
            out[key] = {
                name: _convert(child, definitions, f"{at}.{name}") for name, child in value.items()
            }
        elif key == "items":
            out[key] = _convert(value, definitions, f"{at}[]")
        elif key == "const":
            out["enum"] = [value]
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise SchemaConversionError(f"{at}: {key} must be a number in the model schema")
            bound = "minimum" if key == "exclusiveMinimum" else "maximum"
            out[bound] = value
            out[key] = True
        elif key == "description":
            out[key] = clean_description(str(value))
        elif key in _PLAIN_KEYWORDS or key.startswith("x-kubernetes-"):
            out[key] = copy.deepcopy(value)
        else:
            raise SchemaConversionError(f"{at or '<root>'}: keyword {key!r} is not supported")
    if "type" not in out:
        raise SchemaConversionError(f"{at or '<root>'}: every node needs a type")
    if out.get("default") is None:
        out.pop("default", None)
    facts = _facts(out)
    if facts and "description" in out:
        out["description"] = f"{out['description']}\n\n{facts}"
    return out


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _facts(node: Mapping[str, Any]) -> str:
    """What `kubectl explain` does not show by itself, said in the description: a
    scalar's range and default, a list's size limits."""
    facts: list[str] = []
    bounds: list[str] = []
    if "minimum" in node:
        word = "greater than" if node.get("exclusiveMinimum") else "at least"
        bounds.append(f"{word} {_number(node['minimum'])}")
    if "maximum" in node:
        word = "less than" if node.get("exclusiveMaximum") else "at most"
        bounds.append(f"{word} {_number(node['maximum'])}")
    if node["type"] == "array":
        if "minItems" in node:
            bounds.append(f"at least {node['minItems']} item{'s' * (node['minItems'] != 1)}")
        if "maxItems" in node:
            bounds.append(f"at most {node['maxItems']} item{'s' * (node['maxItems'] != 1)}")
    if bounds:
        facts.append(
            f"Must be {' and '.join(bounds)}."
            if node["type"] != "array"
            else f"Must have {' and '.join(bounds)}."
        )
    if "default" in node and node["type"] in ("string", "number", "integer", "boolean"):
        default = node["default"]
        shown = str(default).lower() if isinstance(default, bool) else _number(default)
        facts.append(f"Defaults to {shown}.")
    return " ".join(facts)


def clean_description(text: str) -> str:
    """Docstring-style text as `kubectl explain` shows it best: lines of a paragraph
    joined, paragraphs separated by one blank line."""
    paragraphs = re.split(r"\n\s*\n", inspect.cleandoc(text))
    return "\n\n".join(" ".join(p.split()) for p in paragraphs if p.strip())


def _sorted_schema(node: Any) -> Any:
    """Schema keys in a fixed order (alphabetical, as controller-gen writes them); the
    property names keep the model's field order."""
    if isinstance(node, list):
        return [_sorted_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    result: dict[str, Any] = {}
    for key in sorted(node):
        value = node[key]
        if key == "properties":
            result[key] = {name: _sorted_schema(child) for name, child in value.items()}
        elif key in ("default", "enum", "required", "x-kubernetes-validations"):
            result[key] = copy.deepcopy(value)
        else:
            result[key] = _sorted_schema(value)
    return result


def crd(resource: Resource) -> dict[str, Any]:
    """The CustomResourceDefinition of one kind, as a plain object."""
    spec = structural_schema(resource.spec)
    status = structural_schema(resource.status)
    root = {
        "type": "object",
        "description": resource.description,
        "required": ["spec"],
        "properties": {
            "apiVersion": {
                "type": "string",
                "description": (
                    "APIVersion defines the versioned schema of this representation of an "
                    "object. Servers should convert recognized schemas to the latest internal "
                    "value, and may reject unrecognized values."
                ),
            },
            "kind": {
                "type": "string",
                "description": (
                    "Kind is a string value representing the REST resource this object "
                    "represents. Servers may infer this from the endpoint the client submits "
                    "requests to. In CamelCase."
                ),
            },
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": resource.crd_name,
            "labels": {"app.kubernetes.io/part-of": "rolegate"},
        },
        "spec": {
            "group": GROUP,
            "names": {
                "kind": resource.kind,
                "listKind": f"{resource.kind}List",
                "plural": resource.plural,
                "singular": resource.singular,
                "shortNames": list(resource.short_names),
                "categories": ["rolegate"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [dict(column) for column in resource.columns],
                    "schema": {"openAPIV3Schema": _sorted_schema(root)},
                }
            ],
        },
    }


# YAML -------------------------------------------------------------------------------

_HEADER: Final = (
    "# Generated by `make crds` (python -m rolegate_policy.crds deploy/crds) from\n"
    "# policy/rolegate_policy/model.py and crds.py. Do not edit: change the model and "
    "regenerate.\n"
)


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def to_yaml(obj: Any) -> str:
    text = yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=100, allow_unicode=True)
    return _HEADER + "---\n" + text


def render_crds() -> dict[str, str]:
    """File name -> YAML text of every CRD; deterministic."""
    return {resource.file_name: to_yaml(crd(resource)) for resource in RESOURCES}


# Command line -----------------------------------------------------------------------


def check(directory: Path) -> list[str]:
    """Unified diffs of every committed CRD that differs from `render_crds()`."""
    diffs: list[str] = []
    for name, expected in render_crds().items():
        path = directory / name
        actual = path.read_text() if path.is_file() else ""
        if actual != expected:
            diffs.append(
                "".join(
                    difflib.unified_diff(
                        actual.splitlines(keepends=True),
                        expected.splitlines(keepends=True),
                        fromfile=str(path),
                        tofile=f"{path} (generated)",
                    )
                )
                or f"{path}: missing\n"
            )
    return diffs


def write(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_crds().items():
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rolegate_policy.crds",
        description="Generate the rolegate CRDs from the policy model.",
    )
    parser.add_argument("directory", type=Path, help="where the CRD files live (deploy/crds)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 with a diff when the files differ from the model",
    )
    args = parser.parse_args(argv)
    if args.check:
        diffs = check(args.directory)
        for diff in diffs:
            sys.stdout.write(diff)
        if diffs:
            sys.stderr.write(
                f"CRDs in {args.directory} are stale; regenerate them with `make crds`\n"
            )
            return 1
        return 0
    for path in write(args.directory):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
