"""The kopf wiring: thin handlers that feed the store, and the settings kopf runs with.

Everything here only connects kopf to plain modules: `store` (what is watched),
`controller` (the debounced compile loop), `reconcile` / `conditions` (pure logic) and
`kube` (the writes). Handlers are registered on this module's own `REGISTRY` with
explicit ids; `run_operator` runs kopf in-process with it (`rolegate operator`).

Watching uses `@kopf.on.event` only: kopf then keeps no progress or diff-base
annotations and adds no finalizers on users' resources. The storages and the finalizer
name are set to our own domain anyway, so a future handler cannot write `kopf.zalando.org`
annotations by default.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf
from kubernetes import client

from rolegate_operator.controller import Controller, Options, utc_now
from rolegate_operator.kube import Kube, connection_info, describe_error
from rolegate_operator.recorder import EventRecorder
from rolegate_operator.store import GROUP, KINDS, VERSION, Store
from rolegate_operator.tripped_loop import TrippedLoop

REGISTRY = kopf.OperatorRegistry()
RUNTIME_KEY = "rolegate"

# Watch streams: the API server ends each after `server_timeout`; the client gives up
# a little later; a stream with no event and no bookmark for `inactivity_timeout` is
# presumed dead (streams that go silent behind load balancers, nolar/kopf#585).
# An integer: kopf passes it to the API server as `timeoutSeconds`, which must parse as one.
WATCH_SERVER_TIMEOUT = 60
WATCH_CLIENT_TIMEOUT = 90.0
WATCH_CONNECT_TIMEOUT = 10.0
WATCH_INACTIVITY_TIMEOUT = 75.0

log = logging.getLogger("rolegate.operator")


@dataclass
class Runtime:
    """What the handlers share, carried in kopf's memo."""

    options: Options
    configuration: client.Configuration
    kube: Kube
    controller: Controller
    tripped: TrippedLoop
    # Set when the compile loop dies: kopf stops and `run_operator` raises. An asyncio
    # flag: kopf waits for a threading.Event in an executor thread that then blocks the
    # interpreter's exit when the flag is never set.
    stop_flag: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    tripped_task: asyncio.Task[None] | None = None
    crash: BaseException | None = None


def runtime_of(memo: Mapping[str, Any]) -> Runtime:
    runtime = memo.get(RUNTIME_KEY)
    if not isinstance(runtime, Runtime):
        raise kopf.PermanentError("rolegate operator started without its runtime in the memo")
    return runtime


def configure(settings: kopf.OperatorSettings) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{GROUP}/kopf-finalizer"
    # kopf posts Events only for its own warnings and errors; ours come from `kube`.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = WATCH_SERVER_TIMEOUT
    settings.watching.client_timeout = WATCH_CLIENT_TIMEOUT
    settings.watching.connect_timeout = WATCH_CONNECT_TIMEOUT
    if hasattr(settings.watching, "inactivity_timeout"):  # kopf >= 1.44
        settings.watching.inactivity_timeout = WATCH_INACTIVITY_TIMEOUT
    # No cluster-wide CRD and namespace watching: the CRDs must exist at start (the
    # command checks), and the namespaces are named, so least-privilege RBAC suffices.
    settings.scanning.disabled = True
    # kopf logs every handled watch event at INFO; ours say what was done with them.
    if log.getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)


@kopf.on.login(id="rolegate-login", registry=REGISTRY)
def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    return connection_info(runtime_of(memo).configuration)


@kopf.on.startup(id="rolegate-startup", registry=REGISTRY)
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    configure(settings)
    runtime = runtime_of(memo)
    runtime.task = asyncio.create_task(runtime.controller.run(), name="rolegate compile loop")
    runtime.task.add_done_callback(lambda task: _loop_ended(runtime, task))
    runtime.tripped_task = asyncio.create_task(runtime.tripped.run(), name="rolegate tripped")
    options = runtime.options
    log.info(
        "operator started namespaces=%s configmap=%s/%s",
        ",".join(options.namespaces) or "*",
        options.configmap_namespace,
        options.configmap_name,
    )


@kopf.on.cleanup(id="rolegate-cleanup", registry=REGISTRY)
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    runtime = runtime_of(memo)
    for task in (runtime.task, runtime.tripped_task):
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    runtime.kube.close()
    # Release kopf's waiter on the stop flag, or kopf waits 5 s for it as a hung task.
    runtime.stop_flag.set()


@kopf.on.probe(id="rolegate-config-hash", registry=REGISTRY)
def probe_config_hash(memo: kopf.Memo, **_: Any) -> str | None:
    """Shown on the liveness endpoint: the hash of the configuration last compiled."""
    result = runtime_of(memo).controller.last_result
    return result.config.hash if result is not None else None


@kopf.on.event(
    GROUP, VERSION, KINDS["RoleTable"].plural, id="rolegate-roletable", registry=REGISTRY
)
async def on_role_table(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    runtime_of(memo).controller.observe(type, body)


@kopf.on.event(
    GROUP, VERSION, KINDS["ProviderPolicy"].plural, id="rolegate-providerpolicy", registry=REGISTRY
)
async def on_provider_policy(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    runtime = runtime_of(memo)
    runtime.controller.observe(type, body)
    runtime.tripped.observe()  # the proxies' reports change only the status


def _loop_ended(runtime: Runtime, task: asyncio.Task[None]) -> None:
    if task.cancelled():
        return
    runtime.crash = task.exception() or RuntimeError("the compile loop returned")
    log.critical("compile loop ended, stopping error=%r", runtime.crash)
    runtime.stop_flag.set()


class LoopCrashed(RuntimeError):
    """The compile loop died; the operator stopped."""


class CannotStart(RuntimeError):
    """The API server cannot be reached, refuses us, or does not serve the CRDs."""


def run_operator(
    options: Options,
    configuration: client.Configuration,
    *,
    liveness_endpoint: str | None = None,
) -> None:
    """Run the operator until SIGINT/SIGTERM. Raises `CannotStart` when a first listing
    fails or the API server does not serve RoleTable or ProviderPolicy, and
    `LoopCrashed` when the compile loop died."""
    kube = Kube(configuration)
    namespace = options.namespaces[0] if options.namespaces else None
    try:
        missing = [kind for kind in KINDS if kube.list_uids(kind, namespace) is None]
    except Exception as error:
        kube.close()
        raise CannotStart(
            f"cannot list {GROUP} resources at {configuration.host}: {describe_error(error)}"
        ) from error
    if missing:
        kube.close()
        raise CannotStart(
            f"the API server does not serve {', '.join(missing)} ({GROUP}/{VERSION}); "
            "install the CRDs first: kubectl apply -f deploy/crds/"
        )
    store = Store()
    # One recorder for both loops: Events are aggregated and rate-limited across them.
    events = EventRecorder(kube)
    runtime = Runtime(
        options=options,
        configuration=configuration,
        kube=kube,
        controller=Controller(options, store, kube, events=events),
        tripped=TrippedLoop(
            store, kube, events=events, now=utc_now, ttl_seconds=options.report_ttl_seconds
        ),
    )
    kopf.run(
        registry=REGISTRY,
        standalone=True,
        clusterwide=not options.namespaces,
        namespaces=list(options.namespaces),
        memo=kopf.Memo({RUNTIME_KEY: runtime}),
        liveness_endpoint=liveness_endpoint,
        stop_flag=runtime.stop_flag,
    )
    if runtime.crash is not None:
        raise LoopCrashed(f"the compile loop crashed: {runtime.crash!r}") from runtime.crash
