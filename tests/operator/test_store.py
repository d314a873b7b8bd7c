"""The in-memory view fed by watch events: what counts as a change, deletes, our writes."""

from __future__ import annotations

import copy

from rolegate_operator.store import ResourceKey, Store

from .builders import as_stored, key_of, provider, role, role_table

TABLE = as_stored(role_table("roles", role("agent")))


def test_listing_and_added_events_fill_the_store() -> None:
    store = Store()
    assert store.observe(None, TABLE) is True  # from kopf's initial listing
    assert store.observe("ADDED", as_stored(provider("router"))) is True
    stored = store.get(ResourceKey("RoleTable", "llm", "roles"))
    assert stored is not None
    assert (stored.uid, stored.generation) == ("uid-RoleTable-roles", 1)
    assert stored.spec == TABLE["spec"]
    assert len(store) == 2


def test_a_resend_of_the_same_object_is_no_change() -> None:
    store = Store()
    store.observe(None, TABLE)
    assert store.observe("MODIFIED", as_stored(role_table("roles", role("agent")))) is False


def test_metadata_and_foreign_status_changes_are_not_changes() -> None:
    store = Store()
    store.observe(None, TABLE)
    labelled = copy.deepcopy(TABLE)
    labelled["metadata"]["labels"] = {"team": "a"}
    labelled["metadata"]["resourceVersion"] = "2"
    assert store.observe("MODIFIED", labelled) is False
    # A proxy pod's report on a ProviderPolicy is not ours to react to.
    policy = as_stored(provider("router"))
    store.observe(None, policy)
    reported = as_stored(provider("router"), status={"reports": [{"pod": "proxy-0"}]})
    assert store.observe("MODIFIED", reported) is False
    # ...but it is stored, so the snapshot is current.
    stored = store.get(key_of(policy))
    assert stored is not None
    assert stored.status == {"reports": [{"pod": "proxy-0"}]}


def test_spec_generation_and_owned_status_changes_are_changes() -> None:
    store = Store()
    store.observe(None, TABLE)
    edited = as_stored(role_table("roles", role("agent", patienceSeconds=5)), generation=2)
    assert store.observe("MODIFIED", edited) is True
    someone_wiped_our_status = as_stored(
        role_table("roles", role("agent", patienceSeconds=5)),
        generation=2,
        status={"observedGeneration": 1},
    )
    assert store.observe("MODIFIED", someone_wiped_our_status) is True


def test_deleted_removes_and_a_stale_delete_is_ignored() -> None:
    store = Store()
    store.observe(None, TABLE)
    recreated = as_stored(role_table("roles", role("agent")), uid="new-uid")
    assert store.observe("ADDED", recreated) is True  # same name, new object
    assert store.observe("DELETED", TABLE) is False  # the old object's late delete
    assert len(store) == 1
    assert store.observe("DELETED", recreated) is True
    assert len(store) == 0


def test_snapshot_does_not_change_with_later_events() -> None:
    store = Store()
    store.observe(None, TABLE)
    snapshot = store.snapshot()
    store.observe("DELETED", TABLE)
    assert list(snapshot) == [key_of(TABLE)]
    # The stored spec is a copy: mutating the event body afterwards changes nothing.
    body = as_stored(provider("router"))
    store.observe(None, body)
    body["spec"]["endpoint"] = "https://elsewhere.example/v1"
    stored = store.get(key_of(body))
    assert stored is not None
    assert stored.spec["endpoint"] == "https://router.example/v1"


def test_our_own_write_updates_the_status_of_the_same_object_only() -> None:
    store = Store()
    store.observe(None, TABLE)
    written = as_stored(role_table("roles", role("agent")), status={"roleCount": 1})
    store.record_write(written)
    stored = store.get(key_of(TABLE))
    assert stored is not None
    assert stored.status == {"roleCount": 1}
    # A write answer for an object we no longer hold (deleted, re-created) is dropped.
    store.record_write(as_stored(role_table("gone", role("agent"))))
    store.record_write(as_stored(role_table("roles", role("agent")), uid="other", status={}))
    assert store.get(ResourceKey("RoleTable", "llm", "gone")) is None
    stored = store.get(key_of(TABLE))
    assert stored is not None
    assert stored.status == {"roleCount": 1}


def test_other_kinds_and_broken_bodies_are_ignored() -> None:
    store = Store()
    assert store.observe(None, {"kind": "ConfigMap", "metadata": {"name": "x"}}) is False
    assert store.observe(None, {"kind": "RoleTable", "metadata": "nonsense"}) is False
    assert store.observe(None, {"kind": "RoleTable", "metadata": {"name": "x"}}) is False
    assert len(store) == 0


def test_seen_uids_cover_objects_deleted_before_the_barrier_checked() -> None:
    store = Store()
    store.observe(None, TABLE)
    store.observe("DELETED", TABLE)
    assert store.has_seen("uid-RoleTable-roles")
    assert not store.has_seen("never")
    store.stop_tracking_uids()
    assert not store.has_seen("uid-RoleTable-roles")


def test_as_object_is_what_compile_reads() -> None:
    store = Store()
    store.observe(None, TABLE)
    stored = store.get(key_of(TABLE))
    assert stored is not None
    assert stored.as_object() == {
        "apiVersion": "rolegate.dev/v1alpha1",
        "kind": "RoleTable",
        "metadata": {
            "name": "roles",
            "namespace": "llm",
            "generation": 1,
            "uid": "uid-RoleTable-roles",
        },
        "spec": TABLE["spec"],
    }
