"""From store snapshots to configuration, statuses and the last-known-good memory."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rolegate_operator.reconcile import AcceptedVersion, ReconcileResult, reconcile
from rolegate_operator.store import ResourceKey, Store
from rolegate_policy.compile import compile_manifests
from rolegate_policy.manifests import manifest_from_object
from rolegate_policy.status import ConditionStatus

from .builders import as_stored, key_of, provider, role, role_table, store_with

ROUTER = as_stored(provider("router", models={"qwen/qwen3-coder": ["fastco"], "m2": ["slowco"]}))
AGENT_TABLE = as_stored(role_table("roles", role("agent"), role("reflex", models=["m2"])))


def compiled_directly(*objects: dict[str, Any]) -> str:
    """The hash `compile_manifests` gives for exactly these objects."""
    manifests = [
        manifest_from_object(obj, f"{obj['metadata']['namespace']}/{obj['metadata']['name']}")
        for obj in objects
    ]
    return compile_manifests(manifests).config.hash


def run(
    store: Store, memory: Mapping[ResourceKey, AcceptedVersion] | None = None
) -> ReconcileResult:
    return reconcile(store.snapshot(), memory or {})


def edit(obj: dict[str, Any], generation: int, **spec: Any) -> dict[str, Any]:
    edited = as_stored(
        {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "metadata": dict(obj["metadata"])},
        uid=obj["metadata"]["uid"],
        generation=generation,
    )
    edited["spec"] = {**obj["spec"], **spec}
    return edited


def test_valid_resources_compile_exactly_as_compile_does() -> None:
    result = run(store_with(ROUTER, AGENT_TABLE))
    assert result.config.hash == compiled_directly(ROUTER, AGENT_TABLE)
    assert [role.name for role in result.config.roles] == ["agent", "reflex"]
    assert all(outcome.accepted for outcome in result.outcomes.values())
    assert set(result.accepted) == {key_of(ROUTER), key_of(AGENT_TABLE)}
    table = result.outcomes[key_of(AGENT_TABLE)]
    assert table.served_generation == 1
    assert table.status.observed_generation == 1
    assert table.status.accepted.observed_generation == 1
    assert table.status.accepted.reason == "Accepted"
    assert table.status.extra["roleCount"] == 2


def test_effective_rulings_say_what_auto_resolved_to() -> None:
    table = as_stored(
        role_table(
            "roles",
            role("agent"),  # Watched
            role("reflex", visibility="Unwatched", patienceSeconds=4, ruling="Auto"),
            role("batch", visibility="Unwatched", patienceSeconds=60, ruling="Only"),
        )
    )
    result = run(store_with(ROUTER, table))
    rulings = result.outcomes[key_of(table)].status.extra["effectiveRulings"]
    assert [(r["role"], r["declared"], r["effective"]) for r in rulings] == [
        ("agent", "Auto", "Order"),
        ("reflex", "Auto", "Only"),
        ("batch", "Only", "Only"),
    ]
    assert "under the 10s threshold" in rulings[1]["reason"]


def test_provider_policy_status_has_no_role_fields() -> None:
    result = run(store_with(ROUTER))
    assert result.outcomes[key_of(ROUTER)].status.extra == {}


def test_an_invalid_edit_keeps_the_last_accepted_generation_serving() -> None:
    store = store_with(ROUTER, AGENT_TABLE)
    good = run(store)
    broken = edit(AGENT_TABLE, 2, roles=[role("agent", patienceSeconds=0)])
    store.observe("MODIFIED", broken)
    result = run(store, good.accepted)

    # The configuration is the one generation 1 compiled to.
    assert result.config.hash == good.config.hash
    outcome = result.outcomes[key_of(AGENT_TABLE)]
    assert outcome.served_generation == 1
    condition = outcome.status.accepted
    assert condition.status is ConditionStatus.FALSE
    assert condition.reason == "InvalidSpec"
    assert "spec.roles[0].patienceSeconds: must be greater than 0" in condition.message
    assert "Generation 1, the last accepted, is still served" in condition.message
    # The status describes the generation it evaluated.
    assert outcome.status.observed_generation == 2
    assert condition.observed_generation == 2
    assert outcome.status.extra == {"roleCount": 1, "effectiveRulings": []}
    # The memory still holds generation 1, and the other resource is unaffected.
    assert result.accepted[key_of(AGENT_TABLE)].generation == 1
    assert result.outcomes[key_of(ROUTER)].accepted

    fixed = edit(AGENT_TABLE, 3, roles=[role("agent", patienceSeconds=9)])
    store.observe("MODIFIED", fixed)
    recovered = run(store, result.accepted)
    assert recovered.outcomes[key_of(AGENT_TABLE)].accepted
    assert recovered.outcomes[key_of(AGENT_TABLE)].served_generation == 3
    assert recovered.accepted[key_of(AGENT_TABLE)].generation == 3
    assert recovered.config.hash == compiled_directly(ROUTER, fixed)


def test_a_resource_never_accepted_is_left_out_and_says_so() -> None:
    broken = as_stored(role_table("roles", role("agent", patienceSeconds=0)))
    result = run(store_with(ROUTER, broken))
    outcome = result.outcomes[key_of(broken)]
    assert outcome.served_generation is None
    assert outcome.status.accepted.message.endswith("Nothing of this resource is served.")
    assert result.config.roles == ()
    assert key_of(broken) not in result.accepted


def test_an_edit_that_references_an_unserved_model_keeps_the_old_roles() -> None:
    """Relational rejections caused by the resource's own edit fall back too."""
    store = store_with(ROUTER, AGENT_TABLE)
    good = run(store)
    typo = edit(AGENT_TABLE, 2, roles=[role("agent", models=["qwen/qwen3-codr"])])
    store.observe("MODIFIED", typo)
    result = run(store, good.accepted)
    assert result.config.hash == good.config.hash
    condition = result.outcomes[key_of(AGENT_TABLE)].status.accepted
    assert condition.reason == "NoServedModel"
    assert condition.message.startswith("spec.roles[0].models: role agent: none of its models")
    assert "Generation 1, the last accepted, is still served" in condition.message


def test_a_table_is_judged_against_a_broken_policys_last_good_version() -> None:
    """Both change at once: the policy breaks itself (InvalidSpec), the table is edited
    validly. The table must not be rolled back because of the policy."""
    store = store_with(ROUTER, AGENT_TABLE)
    good = run(store)
    store.observe("MODIFIED", edit(ROUTER, 2, endpoint="https://router.example:0/v1"))
    edited_table = edit(AGENT_TABLE, 2, roles=[role("agent", patienceSeconds=12)])
    store.observe("MODIFIED", edited_table)
    result = run(store, good.accepted)

    router = result.outcomes[key_of(ROUTER)]
    assert router.status.accepted.reason == "InvalidSpec"
    assert "spec.endpoint: must have no port or a port from 1 to 65535" in (
        router.status.accepted.message
    )
    assert router.served_generation == 1
    table = result.outcomes[key_of(AGENT_TABLE)]
    assert table.accepted
    assert table.served_generation == 2
    assert result.config.hash == compiled_directly(ROUTER, edited_table)


def test_when_the_last_good_version_is_rejected_too_nothing_is_served() -> None:
    store = store_with(ROUTER, AGENT_TABLE)
    good = run(store)
    store.observe("DELETED", ROUTER)
    store.observe("MODIFIED", edit(AGENT_TABLE, 2, roles=[role("agent", patienceSeconds=0)]))
    result = run(store, good.accepted)
    outcome = result.outcomes[key_of(AGENT_TABLE)]
    assert outcome.served_generation is None
    assert outcome.status.accepted.reason == "InvalidSpec"
    assert "Its last accepted generation 1 is rejected too (NoServedModel:" in (
        outcome.status.accepted.message
    )
    assert result.config.roles == ()
    # Still remembered: a ProviderPolicy serving it may come back.
    assert result.accepted[key_of(AGENT_TABLE)].generation == 1


def test_an_unchanged_resource_rejected_because_of_others_is_not_rolled_back() -> None:
    store = store_with(ROUTER, AGENT_TABLE)
    good = run(store)
    store.observe("DELETED", ROUTER)  # deleting is deliberate: its models go
    result = run(store, good.accepted)
    outcome = result.outcomes[key_of(AGENT_TABLE)]
    assert outcome.status.accepted.reason == "NoServedModel"
    assert outcome.served_generation is None
    assert result.config.providers == ()
    assert key_of(ROUTER) not in result.accepted  # deleted resources are forgotten


def test_a_recreated_resource_does_not_inherit_the_old_ones_memory() -> None:
    store = store_with(ROUTER, AGENT_TABLE)
    good = run(store)
    store.observe("DELETED", AGENT_TABLE)
    reborn = as_stored(
        role_table("roles", role("agent", patienceSeconds=0)), uid="uid-2", generation=2
    )
    store.observe("ADDED", reborn)
    result = run(store, good.accepted)
    outcome = result.outcomes[key_of(reborn)]
    assert outcome.served_generation is None
    assert result.config.roles == ()
    assert key_of(reborn) not in result.accepted


def test_the_fallback_still_claims_its_names() -> None:
    """While generation 1 of a table is served, its role names are taken."""
    store = store_with(ROUTER, AGENT_TABLE)
    good = run(store)
    store.observe("MODIFIED", edit(AGENT_TABLE, 2, roles=[role("agent", patienceSeconds=0)]))
    # Generation 2 dropped `reflex`, but generation 1 (served) still defines it.
    other = as_stored(role_table("zzz", role("reflex", models=["m2"])))
    store.observe("ADDED", other)
    result = run(store, good.accepted)
    assert result.outcomes[key_of(other)].status.accepted.reason == "DuplicateName"
    reflex = result.config.role("reflex")
    assert reflex is not None
    assert reflex.source == "llm/roles"


def test_snapshot_order_does_not_matter() -> None:
    forward = run(store_with(ROUTER, AGENT_TABLE))
    backward = run(store_with(AGENT_TABLE, ROUTER))
    assert forward.config.to_canonical_json() == backward.config.to_canonical_json()
