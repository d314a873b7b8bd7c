"""The compile loop's passes against a recording fake of the API writes: what is written,
what is not, and which Events are posted. No kopf, no server, no sleeping."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from rolegate_operator.conditions import EventNote
from rolegate_operator.controller import Controller, Options, PassFailed, debounce_deadline
from rolegate_operator.kube import ConfigMapWrite
from rolegate_operator.store import ResourceKey, Store
from rolegate_policy.config import (
    ProxyConfig,
)

from .builders import as_stored, key_of, provider, role, role_table

ROUTER = as_stored(provider("router"))
TABLE = as_stored(role_table("roles", role("agent")))


@dataclass
class FakeKube:
    """Stores statuses and the ConfigMap like the API server would, and records calls."""

    objects: dict[ResourceKey, dict[str, Any]] = field(default_factory=dict)
    configmap: str | None = None
    status_writes: list[ResourceKey] = field(default_factory=list)
    configmap_writes: int = 0
    events: list[tuple[ResourceKey, EventNote]] = field(default_factory=list)
    fail_status_for: set[ResourceKey] = field(default_factory=set)

    def list_uids(self, kind: str, namespace: str | None) -> set[str] | None:
        return {obj["metadata"]["uid"] for key, obj in self.objects.items() if key.kind == kind}

    def apply_status(self, key: ResourceKey, status: Mapping[str, Any]) -> dict[str, Any] | None:
        if key in self.fail_status_for:
            raise ConnectionError("API server unreachable")
        obj = self.objects.get(key)
        if obj is None:
            return None
        self.status_writes.append(key)
        kept = [c for c in obj.get("status", {}).get("conditions", []) if c["type"] != "Accepted"]
        obj["status"] = {
            **obj.get("status", {}),
            **copy.deepcopy(dict(status)),
            "conditions": [*status["conditions"], *kept],
        }
        return copy.deepcopy(obj)

    def record(self, key: ResourceKey, uid: str, note: EventNote, now: datetime) -> int:
        """The Events the loop asks for (the recorder's own behaviour: test_events.py)."""
        self.events.append((key, note))
        return 1

    def sync_configmap(
        self, namespace: str, name: str, proxy_config: ProxyConfig
    ) -> ConfigMapWrite:
        payload = proxy_config.to_canonical_json()
        if self.configmap == payload:
            return ConfigMapWrite.UNCHANGED
        created = self.configmap is None
        self.configmap = payload
        self.configmap_writes += 1
        return ConfigMapWrite.CREATED if created else ConfigMapWrite.UPDATED


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        self.now += timedelta(seconds=1)
        return self.now


def setup(*objects: dict[str, Any]) -> tuple[Controller, FakeKube]:
    kube = FakeKube(objects={key_of(obj): copy.deepcopy(obj) for obj in objects})
    controller = Controller(
        Options(namespaces=("llm",), configmap_namespace="llm"),
        Store(),
        kube,
        events=kube,
        now=Clock(),
    )
    for obj in objects:
        controller.observe(None, obj)
    return controller, kube


def deliver(controller: Controller, kube: FakeKube) -> None:
    """What the watch does after our writes: send the objects as now stored."""
    for obj in kube.objects.values():
        controller.observe("MODIFIED", copy.deepcopy(obj))


def change(controller: Controller, kube: FakeKube, obj: dict[str, Any]) -> None:
    """A user edit: the server stores it (keeping status), the watch delivers it."""
    stored = kube.objects[key_of(obj)]
    stored["spec"] = copy.deepcopy(obj["spec"])
    stored["metadata"]["generation"] = obj["metadata"]["generation"]
    controller.observe("MODIFIED", copy.deepcopy(stored))


def accepted_of(kube: FakeKube, obj: dict[str, Any]) -> dict[str, Any]:
    conditions = kube.objects[key_of(obj)]["status"]["conditions"]
    found: dict[str, Any] = next(c for c in conditions if c["type"] == "Accepted")
    return found


def test_debounce_waits_for_quiet_but_not_forever() -> None:
    assert debounce_deadline(first=0.0, last=0.0, quiet=0.3, longest=2.0) == 0.3
    assert debounce_deadline(first=0.0, last=1.0, quiet=0.3, longest=2.0) == 1.3
    assert debounce_deadline(first=0.0, last=1.9, quiet=0.3, longest=2.0) == 2.0


async def test_a_first_pass_writes_the_configmap_and_every_status() -> None:
    controller, kube = setup(ROUTER, TABLE)
    result = await controller.run_pass()
    assert kube.configmap == result.config.to_canonical_json()
    assert sorted(kube.status_writes) == sorted([key_of(ROUTER), key_of(TABLE)])
    assert accepted_of(kube, TABLE)["status"] == "True"
    # New resources accepted: each one's first generation is compiled and served.
    message = f"Generation 1 compiled; served in configuration {result.config.hash}."
    assert sorted(kube.events) == sorted(
        (key_of(obj), EventNote("Normal", "Compiled", message)) for obj in (ROUTER, TABLE)
    )


async def test_a_pass_with_nothing_new_writes_nothing() -> None:
    controller, kube = setup(ROUTER, TABLE)
    await controller.run_pass()
    deliver(controller, kube)
    before = (len(kube.status_writes), kube.configmap_writes, len(kube.events))
    await controller.run_pass()
    await controller.run_pass(verify_configmap=True)
    assert (len(kube.status_writes), kube.configmap_writes, len(kube.events)) == before


async def test_our_write_counts_even_before_the_watch_delivers_it() -> None:
    controller, kube = setup(ROUTER, TABLE)
    await controller.run_pass()
    writes = len(kube.status_writes)
    await controller.run_pass()  # no deliver(): the store took the write's answer
    assert len(kube.status_writes) == writes


async def test_a_rejection_warns_once_and_only_the_changed_resource_is_written() -> None:
    controller, kube = setup(ROUTER, TABLE)
    await controller.run_pass()
    deliver(controller, kube)
    kube.status_writes.clear()
    kube.events.clear()
    first_config = kube.configmap

    change(
        controller,
        kube,
        as_stored(role_table("roles", role("agent", models=["nope"])), generation=2),
    )
    await controller.run_pass()
    assert kube.status_writes == [key_of(TABLE)]
    assert kube.configmap == first_config  # last known good
    condition = accepted_of(kube, TABLE)
    assert (condition["status"], condition["reason"], condition["observedGeneration"]) == (
        "False",
        "NoServedModel",
        2,
    )
    assert [(key, note.type, note.reason) for key, note in kube.events] == [
        (key_of(TABLE), "Warning", "NoServedModel")
    ]

    # Recompiles caused by another resource change nothing here and post nothing.
    deliver(controller, kube)
    change(
        controller,
        kube,
        as_stored(provider("router", timeouts={"connectSeconds": 3}), generation=2),
    )
    second = await controller.run_pass()
    assert kube.status_writes == [key_of(TABLE), key_of(ROUTER)]
    # The edited policy's new generation is news; the still-rejected table posts nothing.
    assert kube.events[1:] == [
        (
            key_of(ROUTER),
            EventNote(
                "Normal",
                "Compiled",
                f"Generation 2 compiled; served in configuration {second.config.hash}.",
            ),
        )
    ]

    deliver(controller, kube)
    change(controller, kube, as_stored(role_table("roles", role("agent")), generation=3))
    await controller.run_pass()
    assert accepted_of(kube, TABLE)["status"] == "True"
    assert [(note.type, note.reason) for _, note in kube.events] == [
        ("Warning", "NoServedModel"),
        ("Normal", "Compiled"),
        ("Normal", "Accepted"),  # the recovery: its own event, not a Compiled one as well
    ]


async def test_a_failed_status_write_fails_the_pass_after_trying_the_others() -> None:
    controller, kube = setup(ROUTER, TABLE)
    kube.fail_status_for.add(key_of(ROUTER))
    with pytest.raises(PassFailed, match="1 status write"):
        await controller.run_pass()
    assert kube.status_writes == [key_of(TABLE)]
    kube.fail_status_for.clear()
    await controller.run_pass()
    assert kube.status_writes == [key_of(TABLE), key_of(ROUTER)]


async def test_a_resource_gone_before_its_write_is_skipped() -> None:
    controller, kube = setup(ROUTER, TABLE)
    del kube.objects[key_of(TABLE)]  # deleted on the server; the watch has not said so yet
    await controller.run_pass()
    assert kube.status_writes == [key_of(ROUTER)]
