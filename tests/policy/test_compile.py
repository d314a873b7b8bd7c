"""compile_manifests: per-resource verdicts, global names, served models, Auto, determinism."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import pytest

from rolegate_policy.compile import compile_directory, compile_manifests
from rolegate_policy.config import (
    ProxyConfig,
)
from rolegate_policy.enums import (
    Ruling,
    Visibility,
)
from rolegate_policy.manifests import Manifest, ManifestError, manifest_from_object
from rolegate_policy.report import format_report, format_rulings, render_json
from rolegate_policy.rulings import resolve_ruling
from rolegate_policy.verdicts import AcceptedReason, CompileResult, ResourceVerdict

from .builders import EXAMPLES, GOLDEN, provider, role, role_table


def compile_objects(*objects: dict[str, Any]) -> CompileResult:
    return compile_manifests(
        [manifest_from_object(obj, f"obj#{index}") for index, obj in enumerate(objects)]
    )


def verdict(result: CompileResult, name: str) -> ResourceVerdict:
    (found,) = [v for v in result.verdicts if v.name == name]
    return found


# Auto ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("declared", "visibility", "patience", "effective", "reason"),
    [
        (
            Ruling.AUTO,
            Visibility.UNWATCHED,
            4,
            Ruling.ONLY,
            "Auto: Unwatched and patience 4s is under the 10s threshold, so a busy pool "
            "becomes a refusal (Only)",
        ),
        (
            Ruling.AUTO,
            Visibility.UNWATCHED,
            10,
            Ruling.ORDER,
            "Auto: Unwatched but patience 10s is not under the 10s threshold, so a slow "
            "answer beats no answer (Order)",
        ),
        (
            Ruling.AUTO,
            Visibility.WATCHED,
            1,
            Ruling.ORDER,
            "Auto: Watched, so a person reads the stream and a slow answer beats no answer (Order)",
        ),
        (Ruling.ORDER, Visibility.UNWATCHED, 1, Ruling.ORDER, "declared"),
        (Ruling.ONLY, Visibility.WATCHED, 600, Ruling.ONLY, "declared"),
    ],
)
def test_resolve_ruling(
    declared: Ruling, visibility: Visibility, patience: float, effective: Ruling, reason: str
) -> None:
    assert resolve_ruling(declared, visibility, patience, 10) == (effective, reason)


def test_auto_threshold_is_the_tables_own() -> None:
    result = compile_objects(
        provider(),
        role_table(
            "t",
            role("a", patienceSeconds=12, visibility="Unwatched"),
            autoOnlyBelowSeconds=15,
        ),
    )
    (compiled,) = result.config.roles
    assert compiled.ruling is Ruling.AUTO
    assert compiled.effective_ruling is Ruling.ONLY
    assert "under the 15s threshold" in compiled.ruling_reason
    (ruling,) = verdict(result, "t").effective_rulings
    assert (ruling.role, ruling.declared, ruling.effective) == ("a", Ruling.AUTO, Ruling.ONLY)
    assert ruling.reason == compiled.ruling_reason


# Per-resource acceptance ---------------------------------------------------------------


def test_invalid_provider_is_left_out_and_the_rest_compile() -> None:
    broken = provider("broken", models={"m": ["a"]})
    broken["spec"]["models"][0]["machines"][0]["tokensPerSecond"] = 0
    result = compile_objects(
        provider("good", models={"qwen/qwen3-coder": ["a"]}),
        broken,
        role_table("t", role("agent", models=["qwen/qwen3-coder", "m"])),
    )
    assert [p.name for p in result.config.providers] == ["good"]
    bad = verdict(result, "broken")
    assert (bad.accepted, bad.reason) == (False, AcceptedReason.INVALID_SPEC)
    assert bad.message == "spec.models[0].machines[0].tokensPerSecond: must be greater than 0"
    table = verdict(result, "t")
    assert table.accepted
    assert table.warnings == (
        "spec.roles[0].models[1]: m is not served by any accepted ProviderPolicy; role agent "
        "skips it until one does",
    )
    # Unserved models are left out, so every compiled model has a provider.
    assert result.config.roles[0].models == ("qwen/qwen3-coder",)


def test_role_with_no_served_model_rejects_its_table() -> None:
    result = compile_objects(
        provider(models={"a": ["x"]}),
        role_table("t", role("ok", models=["a"]), role("lost", models=["b", "c"])),
    )
    table = verdict(result, "t")
    assert (table.accepted, table.reason) == (False, AcceptedReason.NO_SERVED_MODEL)
    (error,) = table.errors
    assert error.field == "spec.roles[1].models"
    assert "role lost: none of its models (b, c)" in error.message
    assert "add a ProviderPolicy serving one of them" in error.message
    assert result.config.roles == ()
    # Effective rulings still tell the reviewer what Auto meant.
    assert [r.role for r in table.effective_rulings] == ["ok", "lost"]


def test_openai_dialect_machine_defaults_to_the_provider_name() -> None:
    result = compile_objects(
        provider("vllm", dialect="OpenAI", models={"m": [], "n": ["gpu-0"]}),
    )
    compiled = result.config.provider("vllm")
    assert compiled is not None
    assert [(m.name, [x.name for x in m.machines]) for m in compiled.models] == [
        ("m", ["vllm"]),
        ("n", ["gpu-0"]),
    ]


def test_compiled_provider_carries_settings_and_secret_ref() -> None:
    result = compile_objects(
        provider(
            "p",
            namespace="ns",
            endpoint="https://h.example/api/v1/",
            apiKeySecretRef={"name": "s", "key": "k"},
            breaker={"cooldownSeconds": 5, "transportScope": "Model", "rateWindow": 50},
            degradedOutput={"detectEmpty": False},
            timeouts={"idleSeconds": 15},
        )
    )
    compiled = result.config.providers[0]
    assert compiled.source == "ns/p"
    assert compiled.endpoint == "https://h.example/api/v1"
    assert compiled.api_key_secret_ref is not None
    assert (compiled.api_key_secret_ref.name, compiled.api_key_secret_ref.key) == ("s", "k")
    assert compiled.breaker.cooldown_seconds == 5
    assert compiled.breaker.rate_window == 50
    assert compiled.breaker.transport_scope.value == "Model"
    assert compiled.degraded_output.detect_empty is False
    assert compiled.degraded_output.detect_mangled is True
    assert compiled.timeouts.idle_seconds == 15


def test_role_models_keep_their_order_while_sets_are_sorted() -> None:
    result = compile_objects(
        provider("zz", models={"z": ["b", "a"], "a": ["c"]}),
        provider("aa", models={"m": ["x"]}),
        role_table("t", role("second", models=["z", "m", "a"]), role("first", models=["m"])),
    )
    config = result.config
    assert [p.name for p in config.providers] == ["aa", "zz"]
    assert [r.name for r in config.roles] == ["first", "second"]
    assert config.role("second") is not None
    assert config.role("second").models == ("z", "m", "a")  # type: ignore[union-attr]
    zz = config.provider("zz")
    assert zz is not None
    assert [m.name for m in zz.models] == ["a", "z"]
    assert [m.name for m in zz.models[1].machines] == ["a", "b"]


def test_patience_warning_only_when_every_machine_publishes_figures() -> None:
    slow = provider(models={"m": ["a", "b"]})
    for machine in slow["spec"]["models"][0]["machines"]:
        machine.update(ttftSeconds=1, tokensPerSecond=10)
    table = role_table("t", role("r", models=["m"], patienceSeconds=5, expectedOutputTokens=100))
    warned = verdict(compile_objects(slow, table), "t")
    assert warned.accepted
    (warning,) = warned.warnings
    assert warning.startswith("spec.roles[0].patienceSeconds: by their published figures")
    assert "about 11.0s for 100 tokens" in warning

    del slow["spec"]["models"][0]["machines"][1]["tokensPerSecond"]
    assert verdict(compile_objects(slow, table), "t").warnings == ()


def test_a_roles_exploration_share_is_compiled_and_absent_stays_absent() -> None:
    """Absent is not 0: it leaves the share to the proxy's --explore-share."""
    table = role_table(
        "t", role("own", models=["m"], explorationShare=0.1), role("default", models=["m"])
    )
    config = compile_objects(provider(models={"m": ["a"]}), table).config
    own, default = config.role("own"), config.role("default")
    assert own is not None
    assert default is not None
    assert own.exploration_share == 0.1
    assert default.exploration_share is None


# Names are global ----------------------------------------------------------------------


def test_duplicate_provider_names_first_in_namespace_order_wins() -> None:
    later = provider("shared", namespace="team-b", models={"b": ["x"]})
    first = provider("shared", namespace="team-a", models={"a": ["x"]})
    for order in ([later, first], [first, later]):
        result = compile_objects(*order)
        assert result.config.providers[0].source == "team-a/shared"
        lost = next(v for v in result.verdicts if v.namespace == "team-b")
        assert lost.reason is AcceptedReason.DUPLICATE_NAME
        assert "team-a/shared" in lost.message


def test_an_invalid_resource_claims_no_name() -> None:
    invalid = provider("shared", namespace="team-a", endpoint="ftp://x")
    valid = provider("shared", namespace="team-b")
    result = compile_objects(invalid, valid)
    assert result.config.providers[0].source == "team-b/shared"
    assert [v.reason for v in result.verdicts] == [
        AcceptedReason.INVALID_SPEC,
        AcceptedReason.ACCEPTED,
    ]


def test_duplicate_role_across_tables_rejects_the_later_table_whole() -> None:
    result = compile_objects(
        provider(),
        role_table("b-table", role("unique"), role("agent")),
        role_table("a-table", role("agent", patienceSeconds=5)),
    )
    assert [(r.name, r.source) for r in result.config.roles] == [("agent", "llm/a-table")]
    lost = verdict(result, "b-table")
    assert lost.reason is AcceptedReason.DUPLICATE_NAME
    assert [e.field for e in lost.errors] == ["spec.roles[1].name"]
    assert "RoleTable llm/a-table" in lost.errors[0].message


def test_same_resource_twice_is_a_duplicate_of_itself_ordered_by_source() -> None:
    one = manifest_from_object(provider("p"), "b.yaml")
    two = manifest_from_object(provider("p"), "a.yaml")
    result = compile_manifests([one, two])
    assert [(v.source, v.reason) for v in result.verdicts] == [
        ("a.yaml", AcceptedReason.ACCEPTED),
        ("b.yaml", AcceptedReason.DUPLICATE_NAME),
    ]
    assert "llm/p (a.yaml)" in result.verdicts[1].message


# Envelopes -----------------------------------------------------------------------------


def test_other_groups_are_ignored_and_unknown_rolegate_kinds_rejected() -> None:
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}}
    future = {**provider("f"), "apiVersion": "rolegate.dev/v2"}
    typo = {**provider("t"), "kind": "ProviderPolicies"}
    result = compile_objects(secret, future, typo, provider())
    assert [(i.kind, i.name) for i in result.ignored] == [("Secret", "s")]
    assert verdict(result, "f").reason is AcceptedReason.INVALID_MANIFEST
    assert verdict(result, "f").errors[0].field == "apiVersion"
    assert verdict(result, "t").errors[0].field == "kind"
    assert verdict(result, "router").accepted


def test_generation_is_carried_into_the_verdict() -> None:
    obj = provider()
    obj["metadata"]["generation"] = 42
    assert compile_objects(obj).verdicts[0].generation == 42


def test_manifest_from_object_requires_an_envelope() -> None:
    with pytest.raises(ManifestError) as caught:
        manifest_from_object({"kind": "RoleTable", "metadata": {}}, "ns/x")
    assert [e.field for e in caught.value.errors] == ["apiVersion", "metadata.name"]


class _ReadOnlyBody(Mapping[str, Any]):
    """Stands in for kopf's Body: a mapping that is not a dict."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def __getitem__(self, key: str) -> Any:
        value = self._data[key]
        return _ReadOnlyBody(value) if isinstance(value, dict) else value

    def __iter__(self) -> Any:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


def test_manifest_from_object_accepts_any_mapping() -> None:
    manifest = manifest_from_object(_ReadOnlyBody(provider()), "llm/router")
    assert isinstance(manifest.spec, dict)
    assert isinstance(manifest.spec["models"][0], dict)
    assert compile_manifests([manifest]).verdicts[0].accepted


# Determinism ---------------------------------------------------------------------------


def _all_golden_manifests() -> list[Manifest]:
    from rolegate_policy.manifests import load_manifest_dir

    manifests: list[Manifest] = []
    for case in ("valid_mixed", "invalid_among_valid", "duplicates", "unserved_role"):
        manifests.extend(load_manifest_dir(GOLDEN / case / "input").manifests)
    return manifests


@pytest.mark.parametrize("seed", range(8))
def test_shuffled_input_gives_byte_identical_output(seed: int) -> None:
    manifests = _all_golden_manifests()
    baseline = compile_manifests(manifests)
    shuffled = list(manifests)
    random.Random(seed).shuffle(shuffled)
    again = compile_manifests(shuffled)
    assert again.config.hash == baseline.config.hash
    assert render_json(again) == render_json(baseline)
    assert format_report(again) == format_report(baseline)
    assert format_rulings(again) == format_rulings(baseline)


def test_hash_ignores_sources_of_files_but_not_content() -> None:
    # `rolegate compile DIR` names each manifest by its file, the operator by its
    # namespace/name: both must write the same hash, for every kind.
    grant = {
        "apiVersion": "rolegate.dev/v1alpha1",
        "kind": "AccessGrant",
        "metadata": {"name": "open", "namespace": "ns"},
        "spec": {"subjects": [{"anonymous": True}], "roles": ["*"]},
    }
    base = compile_objects(provider(), role_table("t", role()), grant)
    renamed = compile_manifests(
        [
            manifest_from_object(provider(), "x.yaml"),
            manifest_from_object(role_table("t", role()), "y.yaml"),
            manifest_from_object(grant, "z.yaml"),
        ]
    )
    assert renamed.all_accepted
    assert renamed.config.hash == base.config.hash
    changed = compile_objects(provider(), role_table("t", role(patienceSeconds=31)), grant)
    assert changed.config.hash != base.config.hash


def test_compiled_config_round_trips_through_its_canonical_json() -> None:
    result = compile_directory(EXAMPLES)
    assert result.all_accepted
    loaded = ProxyConfig.from_json(result.config.to_canonical_json())
    assert loaded == result.config


def test_compile_is_pure_and_repeatable() -> None:
    manifests = _all_golden_manifests()
    before = [m.spec for m in manifests]
    first, second = compile_manifests(manifests), compile_manifests(manifests)
    assert first == second
    assert [m.spec for m in manifests] == before


# The examples the demo uses ------------------------------------------------------------


def test_examples_compile_as_the_demo_expects() -> None:
    result = compile_directory(EXAMPLES)
    assert result.all_accepted
    assert all(not v.warnings for v in result.verdicts)
    config = result.config
    router = config.provider("sim-router")
    assert router is not None
    assert router.source == "rolegate/sim-router"
    assert router.dialect.value == "Aggregator"
    assert router.endpoint == "http://127.0.0.1:8089/v1"
    assert router.api_key_secret_ref is not None
    assert (router.api_key_secret_ref.name, router.api_key_secret_ref.key) == (
        "sim-router",
        "apiKey",
    )
    machines = {m.name: [x.name for x in m.machines] for m in router.models}
    assert machines == {
        "deepseek/deepseek-v3": ["fastco", "steadyco"],
        "qwen/qwen3-coder": ["fastco", "slowco", "steadyco"],
    }
    for model in router.models:
        for machine in model.machines:
            assert machine.ttft_seconds is not None
            assert machine.tokens_per_second is not None
            assert machine.price_input_per_mtok is not None
            assert machine.price_output_per_mtok is not None
    rulings = {r.name: (r.models, r.visibility.value, r.effective_ruling) for r in config.roles}
    assert rulings == {
        "reflex": (("qwen/qwen3-coder",), "Unwatched", Ruling.ONLY),
        "agent": (("qwen/qwen3-coder", "deepseek/deepseek-v3"), "Watched", Ruling.ORDER),
        "batch": (("deepseek/deepseek-v3",), "Unwatched", Ruling.ORDER),
    }
    reflex = config.role("reflex")
    assert reflex is not None
    assert reflex.patience_seconds == 4
    assert all(r.source == "rolegate/agents" for r in config.roles)
