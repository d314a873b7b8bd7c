"""The kopf wiring: thin handlers that feed the store, and the settings kopf runs with.

Everything here only connects kopf to plain modules: `store` (what is watched),
`controller` (the debounced compile loop), `reports_loop` (what the proxy pods report),
`leader` (one writer among replicas), `reconcile` / `conditions` / `tripped` / `fleet`
(pure logic), `kube` (the writes) and `lifecycle` (signals and stopping). Handlers are
registered on this module's own `REGISTRY` with explicit ids; `run_operator` runs kopf
in-process with it beside the elector and the metrics endpoint (`rolegate operator`).

Watching uses `@kopf.on.event` only: kopf then keeps no progress or diff-base
annotations and adds no finalizers on users' resources. The storages and the finalizer
name are set to our own domain anyway, so a future handler cannot write `kopf.zalando.org`
annotations by default.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import kopf
from kubernetes import client

from rolegate_operator.controller import Controller, Options, utc_now
from rolegate_operator.kube import Kube, connection_info, describe_error
from rolegate_operator.leader import ElectionOptions, Elector, Leadership, always_leading
from rolegate_operator.lifecycle import RELEASE_SECONDS, STOP_SECONDS, Outcome, run_beside_signals
from rolegate_operator.metrics import OperatorMetrics
from rolegate_operator.recorder import EventRecorder
from rolegate_operator.reports_loop import ReportsLoop
from rolegate_operator.store import GROUP, KINDS, VERSION, Store

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
# The longest pause between two attempts of a failed API request (kopf's watches included).
WATCH_RETRY_CAP: Final = 5.0

log = logging.getLogger("rolegate.operator")


@dataclass
class Runtime:
    """What the handlers share, carried in kopf's memo."""

    options: Options
    configuration: client.Configuration
    kube: Kube
    controller: Controller
    reports: ReportsLoop
    leadership: Leadership
    # Set to stop kopf (on SIGTERM, or when a loop of ours died). An asyncio flag: kopf
    # waits for a threading.Event in an executor thread that then blocks the
    # interpreter's exit when the flag is never set.
    stop_flag: asyncio.Event = field(default_factory=asyncio.Event)
    # Set on SIGINT/SIGTERM: the stop is asked for, not kopf stopping on its own.
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    reports_task: asyncio.Task[None] | None = None
    crash: BaseException | None = None


def runtime_of(memo: Mapping[str, Any]) -> Runtime:
    runtime = memo.get(RUNTIME_KEY)
    if not isinstance(runtime, Runtime):
        raise kopf.PermanentError("rolegate operator started without its runtime in the memo")
    return runtime


class RetryForever:
    """kopf's retry delays for a failed API request: never exhausted, growing to a cap.

    kopf's default (1, 1, 2, 3, 5, 8, 13, 21: about 54 s) runs out during a routine API
    server restart (its warm-up 503s last longer), and a watcher that exhausts it dies for
    good. Unsized on purpose: kopf then counts attempts without a total. Iterated afresh
    for every request."""

    def __init__(self, first: float = 0.5, cap: float = WATCH_RETRY_CAP) -> None:
        self._first = first
        self._cap = cap

    def __iter__(self) -> Iterator[float]:
        delay = self._first
        while True:
            yield delay
            delay = min(delay * 2, self._cap)


def configure(settings: kopf.OperatorSettings) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{GROUP}/kopf-finalizer"
    # kopf posts Events only for its own warnings and errors; ours come from `kube`.
    settings.posting.level = logging.WARNING
    settings.networking.error_backoffs = RetryForever()
    settings.watching.server_timeout = WATCH_SERVER_TIMEOUT
    settings.watching.client_timeout = WATCH_CLIENT_TIMEOUT
    settings.watching.connect_timeout = WATCH_CONNECT_TIMEOUT
    if hasattr(settings.watching, "inactivity_timeout"):  # kopf >= 1.44
        settings.watching.inactivity_timeout = WATCH_INACTIVITY_TIMEOUT
    # No cluster-wide CRD and namespace watching: the CRDs must exist at start (the
    # command checks), and the namespaces are named, so least-privilege RBAC suffices.
    settings.scanning.disabled = True
    # Replicas are coordinated by our Lease (leader.py), not by kopf's peering.
    settings.peering.standalone = True
    # kopf logs every handled watch event at INFO; ours say what was done with them.
    if log.getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)


@kopf.on.login(id="rolegate-login", registry=REGISTRY)
def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    return connection_info(runtime_of(memo).configuration)


@kopf.on.startup(id="rolegate-startup", registry=REGISTRY)
async def startup(memo: kopf.Memo, **_: Any) -> None:
    runtime = runtime_of(memo)
    runtime.task = asyncio.create_task(runtime.controller.run(), name="rolegate compile loop")
    runtime.task.add_done_callback(lambda task: _loop_ended(runtime, task))
    runtime.reports_task = asyncio.create_task(runtime.reports.run(), name="rolegate reports")
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
    for task in (runtime.task, runtime.reports_task):
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
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
    GROUP, VERSION, KINDS["AccessGrant"].plural, id="rolegate-accessgrant", registry=REGISTRY
)
async def on_access_grant(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    runtime_of(memo).controller.observe(type, body)


@kopf.on.event(
    GROUP, VERSION, KINDS["ProviderPolicy"].plural, id="rolegate-providerpolicy", registry=REGISTRY
)
async def on_provider_policy(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    runtime = runtime_of(memo)
    runtime.controller.observe(type, body)
    runtime.reports.observe()  # the proxies' reports change only the status


def _loop_ended(runtime: Runtime, task: asyncio.Task[None]) -> None:
    if task.cancelled():
        return
    runtime.crash = task.exception() or RuntimeError("the compile loop returned")
    log.critical("compile loop ended, stopping error=%r", runtime.crash)
    runtime.stop_flag.set()


class LoopCrashed(RuntimeError):
    """The compile loop died; the operator stopped."""


class KopfStopped(RuntimeError):
    """kopf stopped without being asked to (a watcher gave up): the process must exit so
    the pod restarts, rather than stay up without watching."""


class CannotStart(RuntimeError):
    """The API server cannot be reached, refuses us, or does not serve the CRDs."""


@dataclass(frozen=True)
class Endpoints:
    """What the operator serves besides its work."""

    liveness: str | None = None  # kopf's probe, e.g. http://0.0.0.0:8080/healthz
    metrics_port: int | None = None
    metrics_host: str = "0.0.0.0"


def run_operator(
    options: Options,
    configuration: client.Configuration,
    *,
    endpoints: Endpoints = Endpoints(),
    election: ElectionOptions | None = None,
) -> None:
    """Run the operator until SIGINT/SIGTERM. Raises `CannotStart` when a first listing
    fails or the API server does not serve RoleTable or ProviderPolicy, `LoopCrashed` when
    the compile loop died, and `KopfStopped` when kopf stopped on its own.

    Returns (or raises) within `STOP_SECONDS` of a signal; work still running then (an API
    call in a worker thread waiting out its timeout) is abandoned: the caller exits the
    process with `exit_now`, since nothing is lost that the next start does not redo."""
    # The client's own retries of a refused connection say nothing our warnings do not,
    # and during an outage they would be most of the log.
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
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
    leadership = Leadership() if election is not None else always_leading()
    metrics = OperatorMetrics()
    store = Store()
    # One recorder for both loops: Events are aggregated and rate-limited across them.
    events = EventRecorder(kube)
    controller = Controller(
        options, store, kube, events=events, leadership=leadership, metrics=metrics
    )
    reports = ReportsLoop(
        store,
        kube,
        events=events,
        now=utc_now,
        ttl_seconds=options.report_ttl_seconds,
        leadership=leadership,
        metrics=metrics,
        compiled=lambda: controller.last_result,
    )
    # Programmed follows the compiled hash as well as the pods' reports.
    controller.after_pass.append(reports.observe)
    leadership.on_gain += [controller.resync, reports.resync]
    leadership.on_change.append(metrics.set_leader)
    metrics.set_leader(leadership.leading)
    metrics.watch(options.namespaces)
    runtime = Runtime(
        options=options,
        configuration=configuration,
        kube=kube,
        controller=controller,
        reports=reports,
        leadership=leadership,
    )
    elector = Elector(election, kube, leadership) if election is not None else None
    try:
        outcome = run_beside_signals(
            runtime.stopping, _supervise(runtime, endpoints, elector, metrics)
        )
    finally:
        kube.close()
    if outcome is Outcome.KOPF_STOPPED:
        raise KopfStopped("kopf stopped on its own; exiting so the pod restarts")
    if runtime.crash is not None:
        raise LoopCrashed(f"the compile loop crashed: {runtime.crash!r}") from runtime.crash


async def _supervise(
    runtime: Runtime, endpoints: Endpoints, elector: Elector | None, metrics: OperatorMetrics
) -> Outcome:
    """Run kopf beside the elector and the metrics endpoint; end at a signal, a crash of
    ours, or kopf ending by itself, and be gone within `STOP_SECONDS` in every case."""
    loop = asyncio.get_running_loop()
    metrics_runner = None
    if endpoints.metrics_port is not None:
        try:
            metrics_runner = await metrics.serve(endpoints.metrics_host, endpoints.metrics_port)
        except OSError as error:  # the port is taken, or not ours to bind
            raise CannotStart(
                f"cannot serve metrics on port {endpoints.metrics_port}: {error.strerror}"
            ) from error
    elector_task = (
        asyncio.create_task(elector.run(), name="rolegate leader election") if elector else None
    )
    settings = kopf.OperatorSettings()
    configure(settings)
    options = runtime.options
    kopf_task = asyncio.create_task(
        kopf.operator(
            registry=REGISTRY,
            settings=settings,
            standalone=True,
            clusterwide=not options.namespaces,
            namespaces=list(options.namespaces),
            memo=kopf.Memo({RUNTIME_KEY: runtime}),
            liveness_endpoint=endpoints.liveness,
            stop_flag=runtime.stop_flag,
        ),
        name="kopf",
    )
    stop_asked = asyncio.create_task(runtime.stopping.wait())
    crashed = asyncio.create_task(runtime.stop_flag.wait())
    await asyncio.wait({kopf_task, stop_asked, crashed}, return_when=asyncio.FIRST_COMPLETED)
    if runtime.stopping.is_set():
        outcome = Outcome.ASKED
    elif runtime.crash is not None:
        outcome = Outcome.CRASHED
    else:
        outcome = Outcome.KOPF_STOPPED
        log.critical("kopf stopped on its own; exiting so the pod restarts")
    deadline = loop.time() + STOP_SECONDS
    # The Lease first: a standby takes over at its next attempt instead of a lease later.
    if elector is not None and elector_task is not None:
        elector_task.cancel()
        was_leading = runtime.leadership.leading
        runtime.leadership.set(False)  # no write starts from here on
        if was_leading:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.to_thread(elector.release_lease), RELEASE_SECONDS)
    runtime.stop_flag.set()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(asyncio.shield(kopf_task), max(0.0, deadline - loop.time()))
    for task in (kopf_task, stop_asked, crashed, runtime.task, runtime.reports_task):
        if task is not None and not task.done():
            task.cancel()
    if metrics_runner is not None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(metrics_runner.cleanup(), max(0.05, deadline - loop.time()))
    log.info("operator stopped reason=%s", outcome.value)
    return outcome
