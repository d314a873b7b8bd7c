"""The CRDs on a real API server: what `kubectl apply` accepts, what it rejects and how it
says so, the defaults it fills in, the columns `kubectl get` shows and what `kubectl
explain` reads. Every invalid manifest is also fed to `compile`, which must reject it
naming the same field: the schema and the model are one set of rules.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from rolegate_cli.controlplane import REPO_ROOT, ControlPlane
from rolegate_policy.compile import compile_manifests
from rolegate_policy.crds import RESOURCES, clean_description
from rolegate_policy.endpoint import first_broken
from rolegate_policy.manifests import manifest_from_object
from rolegate_policy.model import ProviderPolicySpec, RoleTableSpec, parse_spec
from rolegate_policy.verdicts import AcceptedReason, ResourceVerdict

from ..support import compile_objects, kubectl_table, proxy_memory

EXAMPLES = REPO_ROOT / "examples" / "manifests"
FIXTURES = Path(__file__).parent / "fixtures"


def documents(path: Path) -> list[dict[str, Any]]:
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for doc in docs:
        doc["metadata"].pop("namespace", None)  # each test applies into its own namespace
    return docs


def apply(plane: ControlPlane, namespace: str, *objects: dict[str, Any], check: bool = True) -> Any:
    stream = "\n---\n".join(json.dumps(obj) for obj in objects)
    return plane.kubectl("apply", "-n", namespace, "-f", "-", input=stream, check=check)


def get_json(plane: ControlPlane, namespace: str, *what: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(
        plane.kubectl("get", "-n", namespace, *what, "-o", "json").stdout
    )
    return result


def compile_one(obj: dict[str, Any]) -> ResourceVerdict:
    result = compile_manifests([manifest_from_object({**obj, "metadata": {"name": "x"}}, "case")])
    (verdict,) = result.verdicts
    return verdict


def words(text: str) -> str:
    return " ".join(text.split())


# The CRDs themselves ------------------------------------------------------------------


def test_crds_are_established_and_structural(crds: ControlPlane) -> None:
    for resource in RESOURCES:
        got = json.loads(crds.kubectl("get", "crd", resource.crd_name, "-o", "json").stdout)
        conditions = {c["type"]: c["status"] for c in got["status"]["conditions"]}
        assert conditions.get("Established") == "True", conditions
        assert conditions.get("NamesAccepted") == "True", conditions
        assert "NonStructuralSchema" not in conditions, conditions
        assert got["status"]["acceptedNames"]["shortNames"] == list(resource.short_names)


# Valid manifests ----------------------------------------------------------------------

VALID_FILES = sorted(EXAMPLES.glob("*.yaml")) + sorted((FIXTURES / "valid").glob("*.yaml"))


@pytest.mark.parametrize("path", VALID_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_valid_manifests_apply_and_compile(crds: ControlPlane, namespace: str, path: Path) -> None:
    docs = documents(path)
    assert docs
    applied = apply(crds, namespace, *docs)
    for doc in docs:
        assert f"{doc['kind'].lower()}.rolegate.dev/{doc['metadata']['name']} created" in (
            applied.stdout
        )
    # compile accepts them too, given the providers the valid files declare (a role
    # needs an accepted ProviderPolicy serving one of its models).
    providers = [
        doc
        for other in VALID_FILES
        if other != path
        for doc in documents(other)
        if doc["kind"] == "ProviderPolicy"
    ]
    objects = [*docs, *providers]
    result = compile_manifests([manifest_from_object(o, f"#{i}") for i, o in enumerate(objects)])
    assert result.all_accepted, result.rejected


def test_the_examples_compile_together(crds: ControlPlane) -> None:
    objects = [doc for path in sorted(EXAMPLES.glob("*.yaml")) for doc in documents(path)]
    result = compile_manifests([manifest_from_object(o, f"#{i}") for i, o in enumerate(objects)])
    assert result.all_accepted, result.rejected


def test_schema_defaults_are_applied_and_agree_with_the_model(
    crds: ControlPlane, namespace: str
) -> None:
    table, provider = documents(FIXTURES / "valid" / "minimal.yaml")
    apply(crds, namespace, table, provider)
    stored_table = get_json(crds, namespace, "roletable", "minimal")["spec"]
    assert stored_table["autoOnlyBelowSeconds"] == 10
    (role,) = stored_table["roles"]
    assert role["ruling"] == "Auto"
    assert role["expectedOutputTokens"] == 512
    # No default: absent leaves the share to the proxy's --explore-share.
    assert "explorationShare" not in role
    stored_provider = get_json(crds, namespace, "providerpolicy", "vllm")["spec"]
    assert stored_provider["dialect"] == "OpenAI"
    # The cap's default follows cooldownSeconds: the schema has none, compile derives it.
    assert "maxCooldownSeconds" not in stored_provider["breaker"]
    assert stored_provider["breaker"]["cooldownSeconds"] == 10
    assert stored_provider["breaker"]["transportScope"] == "Provider"
    assert stored_provider["degradedOutput"] == {
        "detectEmpty": True, "detectMangled": True, "detectMalformedToolCalls": True
    }  # fmt: skip
    assert stored_provider["timeouts"] == {"connectSeconds": 5, "idleSeconds": 60}
    assert "machines" not in stored_provider["models"][0]
    # What the API server stored means exactly what the model makes of the bare manifest.
    assert parse_spec("RoleTable", stored_table) == parse_spec("RoleTable", table["spec"])
    assert parse_spec("ProviderPolicy", stored_provider) == parse_spec(
        "ProviderPolicy", provider["spec"]
    )


# Invalid manifests: the API server and compile reject them, naming the same field -------


def _role_table(**role: Any) -> dict[str, Any]:
    base = {"name": "agent", "models": ["qwen/qwen3-coder"], "patienceSeconds": 30,
            "visibility": "Watched"}  # fmt: skip
    return {
        "apiVersion": "rolegate.dev/v1alpha1",
        "kind": "RoleTable",
        "metadata": {"name": "bad"},
        "spec": {"roles": [{**base, **role}]},
    }


def _provider(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "rolegate.dev/v1alpha1",
        "kind": "ProviderPolicy",
        "metadata": {"name": "bad"},
        "spec": {"endpoint": "https://router.example/v1", "dialect": "Aggregator",
                 "models": [{"name": "qwen/qwen3-coder", "machines": [{"name": "fastco"}]}],
                 **spec},
    }  # fmt: skip


def _grant(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "rolegate.dev/v1alpha1",
        "kind": "AccessGrant",
        "metadata": {"name": "bad"},
        "spec": {"subjects": [{"namespace": "team-a"}], "roles": ["agent"], **spec},
    }


def _edit(obj: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    change(obj["spec"])
    return obj


@dataclass(frozen=True)
class Invalid:
    id: str
    manifest: dict[str, Any]
    # The field the API server's error names (`spec.roles[0].visibility`)...
    field: str
    # ...and what it says about it.
    api_says: str
    # The field compile's error names, when more precise than the API server can be
    # (a CEL rule on `spec` can only point at `spec.models`, compile at the model).
    compile_field: str | None = None


def _without_models(spec: dict[str, Any]) -> None:
    del spec["roles"][0]["models"]


def _duplicate_role(spec: dict[str, Any]) -> None:
    spec["roles"].append({**spec["roles"][0], "patienceSeconds": 5})


def _duplicate_model(spec: dict[str, Any]) -> None:
    spec["models"].append({"name": "qwen/qwen3-coder", "machines": [{"name": "slowco"}]})


def _duplicate_machine(spec: dict[str, Any]) -> None:
    spec["models"][0]["machines"].append({"name": "fastco"})


def _two_machines(spec: dict[str, Any]) -> None:
    spec["dialect"] = "OpenAI"
    _duplicate_machine(spec)
    spec["models"][0]["machines"][1]["name"] = "other"


def _no_machines(spec: dict[str, Any]) -> None:
    spec["models"].append({"name": "deepseek/deepseek-v3"})


def _without_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in obj.items() if key != "spec"}


RATE_MIN_SAMPLES_RULE = "`rateMinSamples` must not be greater than `rateWindow`"
INVALID = [
    Invalid("bad-enum", _role_table(visibility="Sometimes"),
            "spec.roles[0].visibility", 'Unsupported value: "Sometimes"'),
    Invalid("patience-zero", _role_table(patienceSeconds=0),
            "spec.roles[0].patienceSeconds", "should be greater than 0"),
    Invalid("patience-too-long", _role_table(patienceSeconds=99999),
            "spec.roles[0].patienceSeconds", "should be less than or equal to 3600"),
    Invalid("patience-as-string", _role_table(patienceSeconds="4"),
            "spec.roles[0].patienceSeconds", "must be of type number"),
    Invalid("tokens-not-whole", _role_table(expectedOutputTokens=12.5),
            "spec.roles[0].expectedOutputTokens", "must be of type integer"),
    Invalid("exploration-share-too-large", _role_table(explorationShare=0.6),
            "spec.roles[0].explorationShare", "should be less than or equal to 0.5"),
    Invalid("role-name-pattern", _role_table(name="Agent"),
            "spec.roles[0].name", "should match"),
    Invalid("role-without-models", _edit(_role_table(), _without_models),
            "spec.roles[0].models", "Required value"),
    Invalid("role-with-no-models", _role_table(models=[]),
            "spec.roles[0].models", "should have at least 1 items"),
    Invalid("role-model-twice", _role_table(models=["qwen/qwen3-coder", "qwen/qwen3-coder"]),
            "spec.roles[0].models", "must not list a model twice",
            compile_field="spec.roles[0].models[1]"),
    Invalid("role-name-twice", _edit(_role_table(), _duplicate_role),
            "spec.roles[1]", "Duplicate value", compile_field="spec.roles[1].name"),
    Invalid("no-roles", _edit(_role_table(), lambda s: s.update(roles=[])),
            "spec.roles", "should have at least 1 items"),
    Invalid("empty-spec", _edit(_role_table(), lambda s: s.clear()),
            "spec.roles", "Required value"),
    Invalid("no-spec", _without_spec(_role_table()), "spec", "spec: Required value",
            compile_field="spec.roles"),
    Invalid("max-cooldown-below-cooldown",
            _provider(breaker={"cooldownSeconds": 60, "maxCooldownSeconds": 30}),
            "spec.breaker.maxCooldownSeconds",
            "`maxCooldownSeconds` must be at least `cooldownSeconds`"),
    Invalid("cooldown-above-max",
            _provider(breaker={"cooldownSeconds": 900, "maxCooldownSeconds": 600}),
            "spec.breaker.maxCooldownSeconds",
            "`maxCooldownSeconds` must be at least `cooldownSeconds`"),
    Invalid("min-samples-above-window",
            _provider(breaker={"rateMinSamples": 50, "rateWindow": 40}),
            "spec.breaker.rateMinSamples", RATE_MIN_SAMPLES_RULE),
    Invalid("min-samples-above-default-window", _provider(breaker={"rateMinSamples": 200}),
            "spec.breaker.rateMinSamples", RATE_MIN_SAMPLES_RULE),
    Invalid("openai-two-machines", _edit(_provider(), _two_machines),
            "spec.models", "`models[*].machines` must have at most one item",
            compile_field="spec.models[0].machines"),
    Invalid("aggregator-without-machines", _edit(_provider(), _no_machines),
            "spec.models", "`models[*].machines` must have at least one item",
            compile_field="spec.models[1].machines"),
    Invalid("provider-model-twice", _edit(_provider(), _duplicate_model),
            "spec.models[1]", "Duplicate value", compile_field="spec.models[1].name"),
    Invalid("machine-twice", _edit(_provider(), _duplicate_machine),
            "spec.models[0].machines[1]", "Duplicate value",
            compile_field="spec.models[0].machines[1].name"),
    Invalid("bad-dialect", _provider(dialect="OpenRouter"),
            "spec.dialect", 'Unsupported value: "OpenRouter"'),
    Invalid("negative-ttft",
            _provider(models=[{"name": "m", "machines": [{"name": "a", "ttftSeconds": -1}]}]),
            "spec.models[0].machines[0].ttftSeconds", "should be greater than or equal to 0"),
    Invalid("api-key-in-spec", _provider(apiKey="sk-or-v1-planted"),
            "spec.apiKey", 'unknown field "spec.apiKey"'),
    Invalid("misspelled-nested-field", _provider(breaker={"cooldown": 5}),
            "spec.breaker.cooldown", 'unknown field "spec.breaker.cooldown"'),
    Invalid("secret-name-pattern", _provider(apiKeySecretRef={"name": "My_Secret", "key": "k"}),
            "spec.apiKeySecretRef.name", "should match"),
    Invalid("endpoint-port-zero", _provider(endpoint="https://router.example:0/v1"),
            "spec.endpoint", "`endpoint` must have no port or a port from 1 to 65535"),
    Invalid("endpoint-with-credentials", _provider(endpoint="https://u:p@router.example/v1"),
            "spec.endpoint", "`endpoint` must not contain credentials"),
    Invalid("endpoint-with-query", _provider(endpoint="https://router.example/v1?key=k"),
            "spec.endpoint", "`endpoint` must not have a query string"),
    Invalid("missing-endpoint", _edit(_provider(), lambda s: s.pop("endpoint")),
            "spec.endpoint", "Required value"),
    Invalid("grant-of-nothing", _grant(roles=[]),
            "spec.roles", "`roles` must name at least one role unless `admin` is true"),
    Invalid("grant-limits-empty", _grant(limits={}),
            "spec.limits", "`limits` must set at least one of `requestsPerMinute`"),
    Invalid("grant-limit-zero", _grant(limits={"requestsPerMinute": 0}),
            "spec.limits.requestsPerMinute", "should be greater than or equal to 1"),
    Invalid("grant-budget-negative", _grant(limits={"costPerDayUSD": -5}),
            "spec.limits.costPerDayUSD", "should be greater than 0"),
]  # fmt: skip


@pytest.fixture(scope="module")
def bad_namespace(crds: ControlPlane) -> Iterator[str]:
    """One namespace for the whole invalid corpus: nothing is ever created in it."""
    crds.kubectl("create", "namespace", "invalid-corpus")
    yield "invalid-corpus"
    leftovers = crds.kubectl("get", "rolegate", "-n", "invalid-corpus", "-o", "name").stdout
    assert leftovers.strip() == "", f"invalid manifests were stored: {leftovers}"


@pytest.mark.parametrize("case", INVALID, ids=lambda case: case.id)
def test_invalid_manifest_is_rejected_by_the_api_server_naming_the_field(
    crds: ControlPlane, bad_namespace: str, case: Invalid
) -> None:
    result = apply(crds, bad_namespace, case.manifest, check=False)
    assert result.returncode != 0, result.stdout
    error = result.stderr
    assert case.field in error, error
    assert case.api_says in error, error
    # One line of the error names this field and says this: a different field's
    # complaint would not do.
    assert any(case.field in line and case.api_says in line for line in error.splitlines())


@pytest.mark.parametrize("case", INVALID, ids=lambda case: case.id)
def test_compile_rejects_the_same_manifest_naming_the_same_field(case: Invalid) -> None:
    verdict = compile_one(case.manifest)
    assert not verdict.accepted
    assert verdict.reason is AcceptedReason.INVALID_SPEC, verdict
    expected = case.compile_field or case.field
    assert expected.startswith(case.field)
    assert expected in [error.field for error in verdict.errors], verdict.errors


# The endpoint: the API server (CEL) and compile (Python) agree, rule by rule -------------

ENDPOINTS = {
    "https://openrouter.ai/api/v1": True,
    "http://127.0.0.1:8089/v1": True,
    "http://vllm.ns.svc:8000": True,
    "http://[::1]:8080/v1": True,
    "http://[::ffff:1.2.3.4]/v1": True,
    "http://h:/v1": True,
    "http://h:080/v1": True,
    "http://h:65535": True,
    "https://h/": True,
    "http://h/a%20b": True,
    "http://ü.example/v1": True,
    "http://h/\uff20x": True,
    "HTTP://h/v1": False,
    "ftp://h/v1": False,
    "h/v1": False,
    "http://:80/v1": False,
    "http:///v1": False,
    "http://h:0/v1": False,
    "http://h:00000/v1": False,
    "http://h:65536/v1": False,
    "http://h:123456/v1": False,
    "http://h:00000080/v1": False,
    "http://h:+80/v1": False,
    "http://h:abc/v1": False,
    "http://h:1:2/v1": False,
    "http://[::1/v1": False,
    "http://[zz]/v1": False,
    "http://[::1::]/v1": False,
    "http://[1.2.3.4]/v1": False,
    "http://[::1]x/v1": False,
    "http://[fe80::1%25en0]/v1": False,
    "http://h%41/v1": False,
    "http://h\\x/v1": False,
    "http://h{x/v1": False,
    "http://h\uff20x/v1": False,
    "http://h/%zz": False,
    "http://h/a%2": False,
    "http://h/v 1": False,
    "http://h/v1\u00a0": False,
    "http://h/v1\u3000": False,
    "http://h/v\x01": False,
    "http://h/v\x85": False,
    "http://u:p@h/v1": False,
    "http://h/v1?k=v": False,
    "http://h/v1#f": False,
}


@pytest.mark.parametrize(("endpoint", "valid"), ENDPOINTS.items(), ids=ascii)
def test_api_server_and_compile_agree_on_endpoints(
    crds: ControlPlane, bad_namespace: str, endpoint: str, valid: bool
) -> None:
    obj = _provider(endpoint=endpoint)
    result = crds.kubectl(
        "create", "--dry-run=server", "-n", bad_namespace, "-f", "-",
        input=json.dumps(obj), check=False,
    )  # fmt: skip
    verdict = compile_one(obj)
    assert (result.returncode == 0) is valid, result.stderr
    assert verdict.accepted is valid, verdict.errors
    if not valid:
        (error,) = verdict.errors
        assert error.field == "spec.endpoint"
        # The same rule broken, and only that one: the API server reports the first rule
        # that fails, as compile does, in the same words.
        assert f'spec.endpoint: Invalid value: "string": `endpoint` {error.message}' in (
            result.stderr
        )
        assert result.stderr.count("`endpoint` must") == 1, result.stderr


# A key pasted into the endpoint is never echoed back ----------------------------------

SECRET = "sk-secret-123"
USER = "ops-alice"
# Bad endpoints that carry the key somewhere, each broken in a different way.
LEAKY_ENDPOINTS = {
    "credentials": f"https://{USER}:{SECRET}@example.com/v1",
    "query": f"https://example.com/v1?user={USER}&key={SECRET}",
    "fragment": f"https://example.com/v1#{USER}:{SECRET}",
    "whitespace": f"https://example.com/v1 {USER}:{SECRET}",
    "scheme": f"{USER}:{SECRET}//example.com/v1",
    "port": f"https://example.com:{USER}{SECRET}/v1",
    "escape": f"https://example.com/{USER}%{SECRET}",
    "host": f"https://{USER}\\{SECRET}/v1",
    "too-long": f"https://{USER}:{SECRET}@example.com/" + "a" * 2100,
}


@pytest.mark.parametrize("endpoint", LEAKY_ENDPOINTS.values(), ids=list(LEAKY_ENDPOINTS))
def test_a_refused_endpoint_is_never_quoted_by_kubectl(
    crds: ControlPlane, namespace: str, endpoint: str
) -> None:
    """`kubectl apply` refuses the endpoint naming the field and what to fix, and neither
    the key nor the user appears in anything kubectl prints, whichever way it writes."""
    good = _provider()
    apply(crds, namespace, {**good, "metadata": {"name": "existing"}})
    bad = json.dumps(_provider(endpoint=endpoint))
    broken = first_broken(endpoint)
    says = "Too long" if len(endpoint) > 2048 else (broken.message if broken else "")
    assert says, endpoint
    change = json.dumps({"spec": {"endpoint": endpoint}})
    attempts = {
        "apply": ("apply", "-f", "-"),
        "apply --dry-run=server": ("apply", "--dry-run=server", "-f", "-"),
        "apply --server-side": ("apply", "--server-side", "-f", "-"),
        "create": ("create", "-f", "-"),
        "create --dry-run=server": ("create", "--dry-run=server", "-f", "-"),
        "patch": ("patch", "providerpolicy/existing", "--type=merge", "-p", change),
    }
    for what, args in attempts.items():
        result = crds.kubectl("-n", namespace, *args, input=bad, check=False)
        printed = result.stdout + result.stderr
        assert result.returncode != 0, (what, printed)
        assert "spec.endpoint" in result.stderr, (what, printed)
        assert says in result.stderr, (what, printed)
        assert SECRET not in printed, (what, printed)
        assert USER not in printed, (what, printed)
    # Nothing was stored: the existing resource kept its endpoint, no other was created.
    stored = get_json(crds, namespace, "providerpolicy", "existing")
    assert stored["spec"]["endpoint"] == good["spec"]["endpoint"]
    names = crds.kubectl("get", "providerpolicy", "-n", namespace, "-o", "name").stdout.split()
    assert names == ["providerpolicy.rolegate.dev/existing"]


# Status, printer columns, explain ------------------------------------------------------


def _condition(type_: str, status: str, reason: str, message: str = "") -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": 1}  # fmt: skip


def patch_status(
    plane: ControlPlane, namespace: str, what: str, status: dict[str, Any], check: bool = True
) -> Any:
    return plane.kubectl(
        "patch", "-n", namespace, what, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": status}), check=check,
    )  # fmt: skip


def _show(plane: ControlPlane, namespace: str, *what: str) -> list[dict[str, str]]:
    """`kubectl get` as a person reads it (printed, for the record), one mapping per row."""
    output = plane.kubectl("get", "-n", namespace, *what).stdout
    print(f"\n$ kubectl get {' '.join(what)}\n{output}", end="")
    return kubectl_table(output)


def test_kubectl_get_shows_the_printer_columns(crds: ControlPlane, namespace: str) -> None:
    apply(crds, namespace, *documents(EXAMPLES / "roles.yaml"))
    apply(crds, namespace, *documents(EXAMPLES / "providers.yaml"))
    patch_status(crds, namespace, "roletable/agents", {
        "observedGeneration": 1, "roleCount": 3,
        "conditions": [_condition("Accepted", "True", "Accepted"),
                       _condition("Programmed", "True", "Programmed")],
        "effectiveRulings": [
            {"role": "reflex", "declared": "Auto", "effective": "Only", "reason": "Auto: ...",
             "declaredDelivery": "Auto", "delivery": "Buffered"},
        ],
        "rulings": "reflex Only/Buffered",
    })  # fmt: skip
    patch_status(crds, namespace, "providerpolicy/sim-router", {
        "observedGeneration": 1, "tripped": "model qwen/qwen3-coder",
        "trippedReason": "EmptyResponses",
        "conditions": [
            _condition("Accepted", "True", "Accepted"),
            _condition("Programmed", "True", "Programmed"),
            _condition("Tripped", "True", "EmptyResponses", "qwen/qwen3-coder: empty answers"),
        ],
        "reports": [{
            "pod": "rolegate-proxy-7d9f-abcde", "observedAt": "2026-01-01T00:00:05Z",
            "breakers": [{"scope": "Model", "model": "qwen/qwen3-coder", "state": "Open",
                          "reason": "EmptyResponses", "since": "2026-01-01T00:00:00Z",
                          "until": "2026-01-01T00:00:30Z"}],
        }],
    })  # fmt: skip

    (table,) = _show(crds, namespace, "rt")
    assert list(table) == ["NAME", "ROLES", "RULINGS", "ACCEPTED", "REASON", "PROGRAMMED", "AGE"]
    assert {name: cell for name, cell in table.items() if name != "AGE"} == {
        "NAME": "agents", "ROLES": "3", "RULINGS": "reflex Only/Buffered", "ACCEPTED": "True",
        "REASON": "Accepted", "PROGRAMMED": "True",
    }  # fmt: skip
    (provider,) = _show(crds, namespace, "pp")
    assert list(provider) == [
        "NAME", "ACCEPTED", "PROGRAMMED", "TRIPPED", "SCOPE", "REASON", "AGE",
    ]  # fmt: skip
    assert {name: cell for name, cell in provider.items() if name != "AGE"} == {
        "NAME": "sim-router", "ACCEPTED": "True", "PROGRAMMED": "True", "TRIPPED": "True",
        "SCOPE": "model qwen/qwen3-coder", "REASON": "EmptyResponses",
    }  # fmt: skip
    everything = crds.kubectl("get", "rolegate", "-n", namespace, "-o", "name").stdout.split()
    assert sorted(everything) == [
        "providerpolicy.rolegate.dev/sim-router",
        "roletable.rolegate.dev/agents",
    ]
    # Status writes do not touch the spec (status subresource): the generation stays 1.
    stored = get_json(crds, namespace, "providerpolicy", "sim-router")
    assert stored["metadata"]["generation"] == 1
    assert stored["status"]["reports"][0]["breakers"][0]["state"] == "Open"


def test_access_grants_show_roles_admin_and_in_wide_output_their_limits(
    crds: ControlPlane, namespace: str
) -> None:
    """The worked example of docs/access.md, as the API server stores and prints it."""
    grants = [
        _edit(_grant(), lambda s: s.update(roles=["batch"], limits={"costPerDayUSD": 20,
                                                                    "requestsPerMinute": 60})),
        _edit(_grant(), lambda s: s.update(roles=[], admin=True)),
    ]  # fmt: skip
    for grant, name in zip(grants, ("nightly-batch", "oncall"), strict=True):
        grant["metadata"]["name"] = name
        apply(crds, namespace, grant)
        patch_status(crds, namespace, f"accessgrant/{name}", {
            "observedGeneration": 1,
            "conditions": [_condition("Accepted", "True", "Accepted"),
                           _condition("Programmed", "True", "Programmed")],
        })  # fmt: skip
    rows = _show(crds, namespace, "ag")
    assert list(rows[0]) == ["NAME", "ROLES", "ADMIN", "ACCEPTED", "REASON", "PROGRAMMED", "AGE"]
    assert [(row["NAME"], row["ROLES"], row["ADMIN"]) for row in rows] == [
        ("nightly-batch", '["batch"]', "false"),
        ("oncall", "[]", "true"),
    ]
    wide = _show(crds, namespace, "ag", "-o", "wide")
    assert [row["LIMITS"] for row in wide] == [
        '{"costPerDayUSD":20,"requestsPerMinute":60}',
        "",
    ]


def _proxy_memory(**spec: Any) -> dict[str, Any]:
    memory = (
        '{"format":1,"pod":"rolegate-proxy-7d9f-abcde","writtenAt":1767225600.0,"machines":'
        '[["sim-router","qwen/qwen3-coder","deepinfra",42,[8.1,-3.2,1.9],null,[42,0.97,25.3]]]}'
    )
    return proxy_memory("rolegate-proxy-7d9f-abcde", memory, **spec)


def test_proxy_memories_show_their_pod_machines_and_when_they_were_written(
    crds: ControlPlane, namespace: str
) -> None:
    apply(crds, namespace, _proxy_memory())
    (row,) = _show(crds, namespace, "pmem")
    assert list(row) == ["NAME", "POD", "MACHINES", "WRITTEN", "AGE"]
    assert (row["NAME"], row["POD"], row["MACHINES"]) == (
        "memory-rolegate-proxy-7d9f-abcde", "rolegate-proxy-7d9f-abcde", "1",
    )  # fmt: skip
    assert crds.kubectl("get", "rolegate", "-n", namespace, "-o", "name").stdout.split() == [
        "proxymemory.rolegate.dev/memory-rolegate-proxy-7d9f-abcde"
    ]
    # Bounded below etcd's 1.5 MiB object limit, and refused naming the field.
    for spec, field in (
        ({"memory": "x" * 1_400_001}, "spec.memory"),
        ({"machines": 4097}, "spec.machines"),
        ({"pod": "Not_A_Pod"}, "spec.pod"),
        ({"writtenAt": "yesterday"}, "spec.writtenAt"),
    ):
        refused = apply(crds, namespace, _proxy_memory(**spec), check=False)
        assert refused.returncode != 0, spec.keys()
        assert field in refused.stderr, refused.stderr[:500]


def test_wide_output_adds_generations_the_message_the_endpoint_and_secrets(
    crds: ControlPlane, namespace: str
) -> None:
    """`-o wide` adds what a person looks at when something is off: whether the status is
    behind the spec, why a table is refused, the endpoint, whether the key resolves. And
    a provider that nothing trips shows no reason, though its condition has one."""
    apply(crds, namespace, *documents(EXAMPLES / "roles.yaml"))
    apply(crds, namespace, *documents(EXAMPLES / "providers.yaml"))
    refused = "Role reflex: none of its models is served by an accepted ProviderPolicy."
    patch_status(crds, namespace, "roletable/agents", {
        "observedGeneration": 1, "roleCount": 3,
        "conditions": [_condition("Accepted", "False", "NoServedModel", refused),
                       _condition("Programmed", "False", "NotAccepted")],
    })  # fmt: skip
    patch_status(crds, namespace, "providerpolicy/sim-router", {
        "observedGeneration": 1, "tripped": "",
        "conditions": [
            _condition("Accepted", "True", "Accepted"),
            _condition("Programmed", "True", "Programmed"),
            _condition("ResolvedRefs", "True", "ResolvedRefs"),
            _condition("Tripped", "False", "NoOpenBreakers", "No proxy pod reports one."),
        ],
    })  # fmt: skip
    # A spec change the operator has not seen yet: generation 2, the status still at 1.
    crds.kubectl(
        "patch", "-n", namespace, "roletable/agents", "--type=json",
        "-p", json.dumps([{"op": "replace", "path": "/spec/roles/0/patienceSeconds", "value": 5}]),
    )  # fmt: skip

    (table,) = _show(crds, namespace, "rt")
    (wide_table,) = _show(crds, namespace, "rt", "-o", "wide")
    assert list(wide_table) == [*table, "GENERATION", "OBSERVED", "MESSAGE"]
    assert {name: wide_table[name] for name in table if name != "AGE"} == {
        name: cell for name, cell in table.items() if name != "AGE"
    }
    assert (table["ACCEPTED"], table["REASON"], table["PROGRAMMED"]) == (
        "False", "NoServedModel", "False",
    )  # fmt: skip
    assert (wide_table["GENERATION"], wide_table["OBSERVED"]) == ("2", "1")
    assert wide_table["MESSAGE"] == refused

    (provider,) = _show(crds, namespace, "pp")
    (wide_provider,) = _show(crds, namespace, "pp", "-o", "wide")
    assert list(wide_provider) == [*provider, "ENDPOINT", "SECRETS", "GENERATION", "OBSERVED"]
    assert "ENDPOINT" not in provider
    # Tripped=False with reason NoOpenBreakers: the Reason column stays empty.
    assert (provider["TRIPPED"], provider["SCOPE"], provider["REASON"]) == ("False", "", "")
    assert {name: cell for name, cell in wide_provider.items() if name != "AGE"} == {
        "NAME": "sim-router", "ACCEPTED": "True", "PROGRAMMED": "True", "TRIPPED": "False",
        "SCOPE": "", "REASON": "", "ENDPOINT": "http://127.0.0.1:8089/v1", "SECRETS": "True",
        "GENERATION": "1", "OBSERVED": "1",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("what", "status", "field", "says"),
    [
        pytest.param(
            "roletable/minimal", {"conditions": [_condition("Accepted", "Yes", "Accepted")]},
            "status.conditions[0].status", 'Unsupported value: "Yes"', id="condition-status"),
        pytest.param(
            "roletable/minimal", {"conditions": [_condition("Accepted", "True", "Not-Camel")]},
            "status.conditions[0].reason", "should match", id="condition-reason"),
        pytest.param(
            "roletable/minimal", {"conditions": [{"type": "Accepted", "status": "True"}]},
            "status.conditions[0].reason", "Required value", id="condition-incomplete"),
        pytest.param(
            "roletable/minimal",
            {"effectiveRulings": [{"role": "reflex", "declared": "Auto", "effective": "Auto",
                                   "reason": ""}]},
            "status.effectiveRulings[0].effective", 'Unsupported value: "Auto"',
            id="effective-ruling"),
        pytest.param(
            "providerpolicy/vllm",
            {"reports": [{"pod": "p", "observedAt": "2026-01-01T00:00:00Z",
                          "breakers": [{"scope": "Pod", "state": "Open", "reason": "RateLimited",
                                        "since": "2026-01-01T00:00:00Z"}]}]},
            "status.reports[0].breakers[0].scope", 'Unsupported value: "Pod"',
            id="breaker-scope"),
        pytest.param(
            "providerpolicy/vllm",
            {"reports": [{"pod": "p", "observedAt": "2026-01-01T00:00:00Z"},
                         {"pod": "p", "observedAt": "2026-01-01T00:00:01Z"}]},
            "status.reports[1]", "Duplicate value", id="report-per-pod"),
        pytest.param(
            "providerpolicy/vllm", {"tripped": "x" * 257}, "status.tripped", "Too long",
            id="tripped-summary-length"),
        pytest.param(
            "providerpolicy/vllm", {"trippedReason": "Empty Responses"},
            "status.trippedReason", "should match", id="tripped-reason-pattern"),
        pytest.param(
            "providerpolicy/vllm", {"trippedReason": "E" * 65}, "status.trippedReason",
            "Too long", id="tripped-reason-length"),
    ],
)  # fmt: skip
def test_status_schema_rejects_malformed_status(
    crds: ControlPlane, namespace: str, what: str, status: dict[str, Any], field: str, says: str
) -> None:
    apply(crds, namespace, *documents(FIXTURES / "valid" / "minimal.yaml"))
    result = patch_status(crds, namespace, what, status, check=False)
    assert result.returncode != 0, result.stdout
    assert field in result.stderr, result.stderr
    assert says in result.stderr, result.stderr


def test_kubectl_explain_reads_the_descriptions(crds: ControlPlane) -> None:
    explained = crds.kubectl("explain", "providerpolicy.spec").stdout
    spec = words(explained)
    assert words(clean_description(ProviderPolicySpec.__doc__ or "")) in spec
    for name, info in ProviderPolicySpec.model_fields.items():
        assert f"{info.alias or name}\t" in explained, name
        assert words(clean_description(info.description or "")) in spec, name

    roles = words(crds.kubectl("explain", "roletable.spec.roles").stdout)
    assert words(clean_description(RoleTableSpec.model_fields["roles"].description or "")) in roles
    for field in ("patienceSeconds", "visibility", "ruling", "expectedOutputTokens"):
        assert f"{field} <" in roles, field
    assert "enum: Watched, Unwatched" in roles

    # Ranges and defaults, which `kubectl explain` does not show on its own, are spelled out.
    cooldown = words(crds.kubectl("explain", "pp.spec.breaker.cooldownSeconds").stdout)
    assert "Must be greater than 0 and at most 86400. Defaults to 10." in cooldown

    kind = words(crds.kubectl("explain", "providerpolicy").stdout)
    assert "ProviderPolicy declares one upstream chat-completions endpoint" in kind
    breakers = words(crds.kubectl("explain", "pp.status.reports.breakers").stdout)
    assert "One breaker that is not closed, as one proxy pod sees it." in breakers


def test_where_the_api_server_is_more_lenient_what_it_stores_compiles(
    crds: ControlPlane, namespace: str
) -> None:
    """Two spellings the API server normalises and compile (reading a file) refuses: a
    whole number written as a float (`12.0` is stored as 12) and an explicit `null`
    (pruned, then defaulted). The operator compiles what is stored, so it accepts them."""
    table = _role_table(expectedOutputTokens=12.0)
    provider = _provider(breaker=None, apiKeySecretRef=None)
    for obj in (table, provider):
        assert not compile_one(obj).accepted
    apply(crds, namespace, table, provider)
    stored_table = get_json(crds, namespace, "roletable", "bad")["spec"]
    assert stored_table["roles"][0]["expectedOutputTokens"] == 12
    stored_provider = get_json(crds, namespace, "providerpolicy", "bad")["spec"]
    assert "apiKeySecretRef" not in stored_provider
    assert stored_provider["breaker"]["cooldownSeconds"] == 10
    stored = [{**table, "spec": stored_table}, {**provider, "spec": stored_provider}]
    result = compile_manifests([manifest_from_object(o, f"#{i}") for i, o in enumerate(stored)])
    assert result.all_accepted, result.rejected


def test_without_strict_validation_an_unknown_field_is_pruned_but_kept_by_kubectl(
    crds: ControlPlane, namespace: str
) -> None:
    """Why strict field validation matters: turned off, the structural schema prunes a
    pasted key from the spec, yet client-side apply keeps it in its annotation."""
    planted = "sk-or-v1-planted"
    obj = _provider(apiKey=planted)
    crds.kubectl("apply", "--validate=false", "-n", namespace, "-f", "-", input=json.dumps(obj))
    stored = get_json(crds, namespace, "providerpolicy", "bad")
    assert "apiKey" not in stored["spec"]
    annotation = stored["metadata"]["annotations"][
        "kubectl.kubernetes.io/last-applied-configuration"
    ]
    assert planted in annotation


def test_the_largest_tables_an_aggregator_needs_are_accepted_and_one_more_is_not(
    crds: ControlPlane, namespace: str
) -> None:
    """256 roles in one RoleTable and 512 machines on one model: within the CRDs' bounds and
    their CEL rules' cost budget on the real API server (a rule's cost grows with the list
    bounds, and the API server refuses a CRD or an object whose rules cost too much); and
    compile takes them too. One more of either is refused naming the field."""
    models = [f"vendor/model-{i:03d}" for i in range(4)]
    roles = [
        {"name": f"role-{i:03d}", "models": models, "patienceSeconds": 30,
         "visibility": "Watched", "ruling": "Order"}
        for i in range(256)
    ]  # fmt: skip
    table = {**_role_table(), "metadata": {"name": "large"}, "spec": {"roles": roles}}
    machines = [{"name": f"sub-{i:03d}", "ttftSeconds": 0.5, "tokensPerSecond": 50}
                for i in range(512)]  # fmt: skip
    policy = _provider(models=[{"name": models[0], "machines": machines}])
    policy["metadata"] = {"name": "large"}
    apply(crds, namespace, table, policy)
    config = compile_objects([table, policy])  # every resource accepted
    assert (len(config.roles), len(config.providers[0].models[0].machines)) == (256, 512)
    # The operator's status for it: one effective ruling per role.
    rulings = [
        {"role": r["name"], "declared": "Order", "effective": "Order", "reason": "declared",
         "declaredDelivery": "Auto", "delivery": "Live"}
        for r in roles
    ]  # fmt: skip
    patch_status(crds, namespace, "roletable/large", {"effectiveRulings": rulings})
    stored = get_json(crds, namespace, "roletable", "large")
    assert len(stored["status"]["effectiveRulings"]) == 256
    too_many_roles = _edit(table, lambda s: s["roles"].append({**roles[0], "name": "one-more"}))
    refused = apply(crds, namespace, too_many_roles, check=False)
    assert refused.returncode != 0
    assert "spec.roles" in refused.stderr
    assert "must have at most 256 items" in refused.stderr
    one_more = {"name": "sub-512"}
    too_many_machines = _edit(policy, lambda s: s["models"][0]["machines"].append(one_more))
    refused = apply(crds, namespace, too_many_machines, check=False)
    assert refused.returncode != 0
    assert "spec.models[0].machines" in refused.stderr
    assert "must have at most 512 items" in refused.stderr
