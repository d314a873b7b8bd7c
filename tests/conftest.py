"""Fixtures that start real servers on free loopback ports: the simulated provider and the proxy."""

from __future__ import annotations

import contextlib
import logging
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from rolegate_cli.controlplane import REPO_ROOT, ControlPlane, installed_binaries, scratch_dir
from rolegate_policy.crds import RESOURCES
from rolegate_proxy.edge.server import RunningProxy
from rolegate_proxy.edge.server import start as start_proxy
from rolegate_proxy.edge.settings import ProxySettings
from rolegate_sim.scenario import parse_scenario
from rolegate_sim.server import RunningSim
from rolegate_sim.server import start as start_sim

from .support import ProxyFactory, SimFactory, compile_objects
from .waiting import wait_for

CRD_DIR = REPO_ROOT / "deploy" / "crds"


@pytest.fixture(autouse=True)
def no_server_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """A handler that raises becomes a logged 500 a client might not notice: fail on it."""
    caplog.set_level(logging.WARNING, logger="aiohttp")
    yield
    errors = [r for r in caplog.get_records("call") if r.name.startswith("aiohttp")]
    assert not errors, [r.getMessage() for r in errors]
    # An arm whose end was never made (the request gave its queue place back for it).
    lost = [r for r in caplog.get_records("call") if "without its end recorded" in r.getMessage()]
    assert not lost, [r.getMessage() for r in lost]


@pytest.fixture
async def sim_server() -> AsyncIterator[SimFactory]:
    running: list[RunningSim] = []

    async def make(scenario: dict[str, Any]) -> RunningSim:
        sim = await start_sim(parse_scenario(scenario), "127.0.0.1", 0)
        running.append(sim)
        return sim

    yield make
    for sim in running:
        await sim.stop()


@pytest.fixture
async def proxy_server() -> AsyncIterator[ProxyFactory]:
    running: list[RunningProxy] = []

    async def make(objects: list[dict[str, Any]], **settings: Any) -> RunningProxy:
        # Exploration (a machine other than the best leading 2 % of decisions) is off
        # unless a test asks for it: most tests assert which machine leads.
        settings.setdefault("explore_share", 0.0)
        # Jitter, backoff and the ranking's dither from a seeded stream: a failing test
        # fails the same way on every run.
        settings.setdefault("random_seed", 0)
        # Tests read /metrics where they send their requests (`--metrics-on-api-port`);
        # the tests of where /metrics is served say so (test_metrics_port.py).
        settings.setdefault("metrics_on_api_port", True)
        config = compile_objects(objects)
        proxy = await start_proxy(ProxySettings(host="127.0.0.1", port=0, **settings), config)
        running.append(proxy)
        return proxy

    yield make
    for proxy in running:
        await proxy.stop()
        # Every arm ended, whatever ended it (an answer, a fault, the client, the shutdown),
        # gave its place in its machine's queue back: a leak would make it look busy.
        assert proxy.state.dispatcher.load.out() == 0, "an arm never gave its ticket back"


# The real control plane for Kubernetes tests: etcd + kube-apiserver, one per run, shared
# by tests/k8s and tests/operator. Never skipped: when the binaries cannot be built, the
# fixture errors with the build's output, so a run that claims to test Kubernetes either
# does or fails loudly.


@contextlib.contextmanager
def fresh_control_plane() -> Iterator[ControlPlane]:
    """etcd and kube-apiserver in a scratch directory, stopped and removed afterwards."""
    root = scratch_dir()
    plane = ControlPlane(bin_dir=installed_binaries(), root=root)
    try:
        yield plane.start()
    finally:
        plane.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def control_plane() -> Iterator[ControlPlane]:
    with fresh_control_plane() as plane:
        yield plane


@pytest.fixture
def namespace(control_plane: ControlPlane) -> str:
    """A fresh namespace per test (deleted namespaces stay Terminating here: no GC)."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    control_plane.kubectl("create", "namespace", name)
    return name


@pytest.fixture(scope="session")
def crds(control_plane: ControlPlane) -> ControlPlane:
    """The control plane with the rolegate CRDs of `deploy/crds/` applied and established
    (once per run, as a user would: `kubectl apply -f deploy/crds/`)."""
    control_plane.kubectl("apply", "-f", str(CRD_DIR))
    control_plane.kubectl(
        "wait", "--for=condition=established", "--timeout=60s",
        *(f"crd/{resource.crd_name}" for resource in RESOURCES),
    )  # fmt: skip
    # Established is not yet published: the OpenAPI document `kubectl explain` reads
    # follows a moment later.
    for resource in RESOURCES:

        def explained(singular: str = resource.singular) -> bool:
            return control_plane.kubectl("explain", singular, check=False).returncode == 0

        wait_for(explained, f"{resource.kind} in the OpenAPI document", within=30, every=0.2)
    return control_plane
