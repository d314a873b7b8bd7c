"""Builders for test manifests and helpers that talk to the real servers under test."""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx

from rolegate_policy.compile import compile_manifests
from rolegate_policy.config import (
    CompiledMachine,
    CompiledModel,
    CompiledProvider,
    ProxyConfig,
)
from rolegate_policy.enums import (
    Dialect,
)
from rolegate_policy.manifests import manifest_from_object
from rolegate_proxy.core.outcomes import Outcome
from rolegate_proxy.edge.server import RunningProxy
from rolegate_sim.server import RunningSim

from .waiting import eventually

SimFactory = Callable[[dict[str, Any]], Awaitable[RunningSim]]
ProxyFactory = Callable[..., Awaitable[RunningProxy]]


def interruptible() -> None:
    """`preexec_fn` for a child process a test sends Ctrl-C (SIGINT): the signal as a
    terminal delivers it. A runner that started the suite in the background (a CI job,
    `make test &`) leaves SIGINT ignored, and a program that starts with it ignored is
    right never to catch it (bash cannot even trap it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def provider_policy(
    name: str,
    endpoint: str,
    models: dict[str, list[str]],
    *,
    dialect: str = "Aggregator",
    **spec: Any,
) -> dict[str, Any]:
    return {
        "apiVersion": "rolegate.dev/v1alpha1",
        "kind": "ProviderPolicy",
        "metadata": {"name": name, "namespace": "test"},
        "spec": {
            "endpoint": endpoint,
            "dialect": dialect,
            "models": [
                {"name": model, "machines": [{"name": m} for m in machines]}
                for model, machines in models.items()
            ],
            **spec,
        },
    }


def machine_policy(
    url: str, model: str, machines: list[dict[str, Any]], name: str = "agg"
) -> dict[str, Any]:
    """An aggregator ProviderPolicy serving one model, with machines written out in full
    (published figures, continuesPartialMessage)."""
    return models_policy(name, url, {model: machines})


def models_policy(
    name: str, url: str, models: dict[str, list[dict[str, Any]]], **spec: Any
) -> dict[str, Any]:
    """An aggregator ProviderPolicy serving each model on its machines written out in full,
    with any other `spec` fields (a breaker, timeouts)."""
    return {
        "apiVersion": "rolegate.dev/v1alpha1",
        "kind": "ProviderPolicy",
        "metadata": {"name": name, "namespace": "test"},
        "spec": {
            "endpoint": f"{url}/v1",
            "dialect": "Aggregator",
            "models": [{"name": m, "machines": machines} for m, machines in models.items()],
            **spec,
        },
    }


async def one_machine_sim(
    sim_server: SimFactory, model: str, *, reply: str, tokens_per_second: float
) -> RunningSim:
    """A simulator with one machine, `m1`, of `model`: no time to the first token, then
    `tokens_per_second`."""
    machine = {"name": "m1", "ttftSeconds": 0, "tokensPerSecond": tokens_per_second}
    return await sim_server(
        {"seed": 1, "models": [{"name": model, "reply": reply, "machines": [machine]}]}
    )


async def state_belief(proxy_url: str, machine: str) -> dict[str, Any]:
    """One machine's belief, as the proxy's public state endpoint shows it."""
    async with httpx.AsyncClient() as client:
        state = (await client.get(f"{proxy_url}/v1/rolegate/state")).json()
    (belief,) = [b for b in state["beliefs"] if b["machine"] == machine]
    return dict(belief)


def published_sheet(
    provider: str,
    model: str,
    machines: Sequence[tuple[str, float | None, float | None]],
    *,
    continues: bool = False,
) -> ProxyConfig:
    """A compiled configuration with one aggregator model whose machines publish
    (name, TTFT seconds, tokens per second): the ledger's sheet prior, for pure-core tests."""
    return ProxyConfig(
        providers=(
            CompiledProvider(
                name=provider,
                source="test",
                endpoint="http://upstream.invalid/v1",
                dialect=Dialect.AGGREGATOR,
                models=(
                    CompiledModel(
                        name=model,
                        machines=tuple(
                            CompiledMachine(
                                name=name,
                                ttft_seconds=ttft,
                                tokens_per_second=rate,
                                continues_partial_message=continues,
                            )
                            for name, ttft, rate in machines
                        ),
                    ),
                ),
            ),
        )
    )


def role_table(*roles: dict[str, Any], name: str = "roles") -> dict[str, Any]:
    return {
        "apiVersion": "rolegate.dev/v1alpha1",
        "kind": "RoleTable",
        "metadata": {"name": name, "namespace": "test"},
        "spec": {"roles": list(roles)},
    }


def role(
    name: str,
    models: list[str],
    *,
    patience: float = 30,
    visibility: str = "Watched",
    ruling: str = "Auto",
) -> dict[str, Any]:
    return {
        "name": name,
        "models": models,
        "patienceSeconds": patience,
        "visibility": visibility,
        "ruling": ruling,
    }


async def sim_records(sim_url: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient() as client:
        response = await client.get(f"{sim_url}/_sim/requests")
        response.raise_for_status()
        records: list[dict[str, Any]] = response.json()
        return records


async def wait_for_sim_record(
    sim_url: str, done: Callable[[dict[str, Any]], bool], within: float = 10.0
) -> dict[str, Any]:
    """The simulator's latest request record, once it satisfies `done`."""

    async def latest_done() -> dict[str, Any] | None:
        records = await sim_records(sim_url)
        return records[-1] if records and done(records[-1]) else None

    return await eventually(latest_done, what="a simulator record as expected", within=within)


async def outcomes(proxy: RunningProxy, count: int, within: float = 10.0) -> list[Outcome]:
    """The proxy's recent outcomes once at least `count` have reached its decision log (the
    outcome channel hands them over on the loop's next turn, after the response)."""

    async def enough() -> list[Outcome] | None:
        found = proxy.state.decisions.recent()
        return found if len(found) >= count else None

    return await eventually(enough, what=f"{count} outcomes in the decision log", within=within)


def access_grant(
    name: str, subjects: list[dict[str, Any]], roles: list[str], **spec: Any
) -> dict[str, Any]:
    """An AccessGrant in namespace `test`; `spec` adds `limits`, `admin`."""
    return {
        "apiVersion": "rolegate.dev/v1alpha1",
        "kind": "AccessGrant",
        "metadata": {"name": name, "namespace": "test"},
        "spec": {"subjects": subjects, "roles": roles, **spec},
    }


def proxy_memory(
    pod: str, memory: str, written_at: str = "2026-01-01T00:00:00Z", /, **spec: Any
) -> dict[str, Any]:
    """A ProxyMemory object as a proxy pod writes it (`memory`: the pod-memory JSON);
    `spec` overrides any field of its spec by its API name."""
    return {
        "apiVersion": "rolegate.dev/v1alpha1",
        "kind": "ProxyMemory",
        "metadata": {
            "name": f"memory-{pod}",
            "labels": {"app.kubernetes.io/component": "proxy-memory"},
        },
        "spec": {"pod": pod, "writtenAt": written_at, "machines": 1, "memory": memory, **spec},
    }


def open_access() -> dict[str, Any]:
    """What a local setup declares to let anyone call every role and read the explanations:
    an AccessGrant with an explicit anonymous subject and `admin: true` (without one, a
    caller with no credential is refused)."""
    return access_grant("open", [{"anonymous": True}], ["*"], admin=True)


def compile_objects(objects: list[dict[str, Any]]) -> ProxyConfig:
    """The configuration of `objects`; with `open_access()` added when they declare no
    AccessGrant (the tests of access declare their own)."""
    if not any(obj.get("kind") == "AccessGrant" for obj in objects):
        objects = [*objects, open_access()]
    manifests = [manifest_from_object(obj, f"test#{i}") for i, obj in enumerate(objects)]
    result = compile_manifests(manifests)
    rejected = [v for v in result.verdicts if not v.accepted]
    assert not rejected, f"test manifests rejected: {rejected}"
    return result.config


def kubectl_table(output: str) -> list[dict[str, str]]:
    """`kubectl get` output as one mapping per row, column header -> cell. Read by the
    headers' offsets: an empty cell collapses the spacing, so splitting on spaces would
    shift every cell after it."""
    header, *rows = output.rstrip("\n").splitlines()
    names = header.split()
    starts: list[int] = []
    at = 0
    for name in names:
        at = header.index(name, at)
        starts.append(at)
        at += len(name)
    ends: list[int | None] = [*starts[1:], None]
    return [
        {name: row[start:end].strip() for name, start, end in zip(names, starts, ends, strict=True)}
        for row in rows
    ]
