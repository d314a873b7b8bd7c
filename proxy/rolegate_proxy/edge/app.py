"""The proxy's app factory: routes, shared state on the app, background work in cleanup contexts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import hdrs, web
from prometheus_client import CONTENT_TYPE_LATEST

from rolegate_policy.config import (
    ProxyConfig,
)

from ..flow.upstream import ReuseTellingConnector, Upstreams
from ..wire.errors import ProxyError
from . import explain
from .callers import KubeReviewer, cached_access
from .calls import Call
from .configmap_source import ConfigMapSource
from .credentials import KeyStore
from .error_shape import MAX_BODY_BYTES
from .fleet_memory import RESTORE_SECONDS, FleetMemory
from .settings import ProxySettings
from .state import STATE, ProxyState
from .state_file import StateKeeper
from .status_reporter import WITHDRAW_SECONDS, BreakerReporter

log = logging.getLogger("rolegate.proxy")

BREAKER_TICK_SECONDS = 1.0


def create_app(
    settings: ProxySettings, config: ProxyConfig, source: ConfigMapSource | None = None
) -> web.Application:
    """`config` is served at once; with a `source`, later configurations replace it."""
    keys = KeyStore(secrets_dir=settings.secrets_dir)
    keys.refresh(config)
    state = ProxyState(settings=settings, config=config, keys=keys, source=source)
    if config.hash:
        state.metrics.config_hash.labels(config.hash).set(1)
    # aiohttp enforces the limit on bodies without Content-Length; the connection handler
    # (error_shape.OpenAIErrorHandler) answers it in OpenAI shape, as the routing's errors.
    app = web.Application(client_max_size=settings.max_body_bytes)
    app[MAX_BODY_BYTES] = settings.max_body_bytes
    app[STATE] = state
    app.cleanup_ctx.append(_upstream_session)
    app.cleanup_ctx.append(_key_refresher)
    app.cleanup_ctx.append(_breaker_clock)
    if settings.state_file is not None:
        # Before the outcome drain: cleanups run in reverse, so the last write comes after
        # the last outcomes were handed over.
        app.cleanup_ctx.append(_state_file)
    app.cleanup_ctx.append(_outcome_drain)
    if state.spans is not None:
        # After the outcome drain: cleanups run in reverse, so the spans of the last
        # outcomes are queued before the export thread's last batch.
        app.cleanup_ctx.append(_span_export)
    app.on_shutdown.append(_shutting_down)
    if source is not None:
        app.cleanup_ctx.append(_config_watch)
        # In a cluster (the configuration comes from the API server), each pod reports on
        # the ProviderPolicies' status (the hash it serves, its keys, its breakers) and
        # shares its memory with the other pods.
        app.cleanup_ctx.append(_cluster_writes)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    # /metrics names roles, grants and providers: not for whoever reaches the API port,
    # unless asked for (the metrics port is the place for it).
    add_operational_routes(app, metrics=settings.metrics_on_api_port)
    app.router.add_get("/v1/rolegate/decisions", explain.decisions)
    app.router.add_get("/v1/rolegate/state", explain.state)
    app.router.add_post("/v1/feedback", explain.feedback)
    return app


def create_metrics_app(api: web.Application) -> web.Application:
    """The metrics listener's app (`--metrics-port`): /metrics, /healthz and /readyz on the
    API app's state. No background work of its own: that belongs to the API app. Its
    listener has the API's connection limits and error shapes (edge/server.py), and the
    same body limit (its routes read no body; one sent anyway is dropped)."""
    app = web.Application(client_max_size=api[MAX_BODY_BYTES])
    app[MAX_BODY_BYTES] = api[MAX_BODY_BYTES]
    app[STATE] = api[STATE]
    add_operational_routes(app, metrics=True)
    return app


def add_operational_routes(app: web.Application, *, metrics: bool) -> None:
    """The one place the operational endpoints are routed: health on every listener, and
    /metrics on the metrics port, and on the API port only with `metrics_on_api_port`."""
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    if metrics:
        app.router.add_get("/metrics", metrics_page)


async def _shutting_down(app: web.Application) -> None:
    # Runs before the server cancels the handlers still open after the grace period: the
    # arms those cancellations end are the shutdown's, not their clients'.
    app[STATE].dispatcher.shutting_down = True


async def _upstream_session(app: web.Application) -> AsyncIterator[None]:
    """One pooled client session for every upstream, and one that never reuses a
    connection, for the single retry of a pooled connection the upstream had closed."""
    state = app[STATE]
    # No cookie jar: one pool serves every caller, so a cookie an upstream set on one
    # caller's answer must never ride along on the next request, which may be another's.
    pooled = aiohttp.ClientSession(
        connector=ReuseTellingConnector(limit=0, ttl_dns_cache=300),
        auto_decompress=True,
        cookie_jar=aiohttp.DummyCookieJar(),
    )
    fresh = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=True),
        auto_decompress=True,
        cookie_jar=aiohttp.DummyCookieJar(),
    )
    state.dispatcher.upstreams = Upstreams(
        pooled, fresh, state.keys, bounds=state.settings.answer_bounds,
        load=state.dispatcher.load,
    )  # fmt: skip
    yield
    state.dispatcher.upstreams = None
    await pooled.close()
    await fresh.close()


async def _key_refresher(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]

    async def refresh_forever() -> None:
        while True:
            await asyncio.sleep(state.settings.key_refresh_seconds)
            # File reads happen in a worker thread, never on the request path.
            await state.refresh_keys()

    task = asyncio.create_task(refresh_forever(), name="rolegate-key-refresh")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _state_file(app: web.Application) -> AsyncIterator[None]:
    """The pod's memory restored before the first request, kept while it serves, and
    written once more after the last."""
    state = app[STATE]
    assert state.settings.state_file is not None
    keeper = StateKeeper(state, state.settings.state_file)
    await keeper.restore()
    task = asyncio.create_task(
        keeper.keep(state.settings.state_save_seconds), name="rolegate-state-file"
    )
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await keeper.save()


async def _outcome_drain(app: web.Application) -> AsyncIterator[None]:
    """The outcome channel's background side: the first emission after a drain schedules
    the next one (on the loop's next turn, or after `outcome_batch_seconds`), which hands
    the batch to the consumers. A callback, not a task: no coroutine to resume per
    request. The request path only appends."""
    state = app[STATE]
    loop = asyncio.get_running_loop()
    batch_seconds = state.settings.outcome_batch_seconds
    pending: list[asyncio.Handle] = []

    def drain() -> None:
        pending.clear()
        state.consume()

    def wake() -> None:
        if pending:
            return
        if batch_seconds > 0:
            pending.append(loop.call_later(batch_seconds, drain))
        else:
            pending.append(loop.call_soon(drain))

    state.outcomes.wake = wake
    export = None
    if state.exporter is not None:
        export = asyncio.create_task(state.exporter.run(), name="rolegate-outcome-export")
    yield
    # Shutdown: what is still buffered reaches the consumers (and the export) once more.
    state.outcomes.wake = None
    for handle in pending:
        handle.cancel()
    drain()
    if export is not None:
        export.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await export


async def _span_export(app: web.Application) -> AsyncIterator[None]:
    """The span export thread (edge/span_export.py): started with the app; at shutdown it
    exports what is queued (within the export timeout) and shuts the exporter down."""
    spans = app[STATE].spans
    assert spans is not None
    spans.start()
    yield
    await asyncio.to_thread(spans.stop, spans.settings.export_timeout_seconds)


async def _breaker_clock(app: web.Application) -> AsyncIterator[None]:
    """Time alone moves breakers (open to half-open, exclusions expiring): poll it."""
    state = app[STATE]
    dispatcher = state.dispatcher

    async def tick() -> None:
        while True:
            await asyncio.sleep(BREAKER_TICK_SECONDS)
            for transition in dispatcher.breakers.poll(dispatcher.now()):
                dispatcher.on_transition(transition)
            state.metrics.observe_breakers(dispatcher.breakers.snapshot(dispatcher.now()))

    task = asyncio.create_task(tick(), name="rolegate-breaker-clock")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _cluster_writes(app: web.Application) -> AsyncIterator[None]:
    """What the pod writes to the API server: its report on each ProviderPolicy's status,
    and its ProxyMemory (edge/fleet_memory.py), its own restored before the first request
    (within RESTORE_SECONDS) while the other pods' are heard. At shutdown, both farewells
    (the reports withdrawn, the memory written once more) run together, within
    WITHDRAW_SECONDS in all."""
    state = app[STATE]
    assert state.source is not None
    dispatcher = state.dispatcher
    reporter = BreakerReporter(
        snapshot=lambda: dispatcher.breakers.snapshot(dispatcher.now()),
        config=lambda: state.config,
        monotonic=dispatcher.now,
        kubeconfig=state.source.kubeconfig,
        heartbeat_seconds=state.settings.status_heartbeat_seconds,
        quirks=dispatcher.recorder.quirks_of,
        key_resolution=state.keys.resolution,
    )
    memory = FleetMemory(
        dispatcher,
        namespace=state.source.namespace,
        kubeconfig=state.source.kubeconfig,
        publish_seconds=state.settings.memory_publish_seconds,
    )
    dispatcher.listeners.append(reporter.mark_dirty)
    dispatcher.listeners.append(memory.mark_urgent)
    state.report_listeners.append(reporter.mark_dirty)
    async with aiohttp.ClientSession() as session:
        await memory.restore_own(session, within=RESTORE_SECONDS)
        reports = asyncio.create_task(reporter.run(session), name="rolegate-status-reports")
        sharing = asyncio.create_task(memory.run(session), name="rolegate-fleet-memory")
        yield
        # Shutdown (after the grace period for open streams): the report in flight
        # finishes, not cut off, so it cannot land after the withdrawal; then the pod
        # withdraws its reports and writes its memory a last time, both at once.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WITHDRAW_SECONDS
        reporter.stop()
        sharing.cancel()
        await asyncio.wait({reports}, timeout=WITHDRAW_SECONDS / 2)
        reports.cancel()
        await asyncio.gather(reports, sharing, return_exceptions=True)
        await asyncio.gather(
            reporter.withdraw(session, within=deadline - loop.time()),
            memory.farewell(session, within=deadline - loop.time()),
        )


async def _config_watch(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    source = state.source
    assert source is not None
    source.on_config = state.swap_config
    source.on_api_state = lambda up: state.metrics.kube_api_up.set(1 if up else 0)
    source.on_rejected = lambda _reason: state.metrics.config_rejected.inc()
    # Its own session: API-server TLS and long-lived watches stay out of the upstream pool.
    async with aiohttp.ClientSession() as session:
        # ServiceAccount tokens are verified by this API server, with the same credentials.
        state.access.use(KubeReviewer(session, cached_access(source.kubeconfig)))
        task = asyncio.create_task(source.run(session), name="rolegate-config-watch")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await Call(request.app[STATE], request).serve()


async def list_models(request: web.Request) -> web.Response:
    """The roles the caller may use (never the others: which roles exist is not an
    unknown caller's business)."""
    state = request.app[STATE]
    config = state.config
    try:
        subject = await state.access.identify(request.headers.get(hdrs.AUTHORIZATION))
        state.access.may_use_some_role(subject)
    except ProxyError as error:
        return error.response()
    granted = set(state.access.roles_of(subject, config))
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": role.name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "rolegate",
                    "rolegate": {
                        "models": list(role.models),
                        "patience_seconds": role.patience_seconds,
                        "visibility": role.visibility.value,
                        "ruling": role.effective_ruling.value,
                    },
                }
                for role in config.roles
                if role.name in granted
            ],
        }
    )


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    config = state.config
    ready = bool(config.roles)
    waiting = "waiting for a configuration" if not config.hash else "no roles configured"
    return web.json_response(
        {
            "status": "ready" if ready else waiting,
            "config_hash": config.hash,
            "config_source": state.source.describe if state.source else "manifests",
            "roles": len(config.roles),
            "providers": len(config.providers),
        },
        status=200 if ready else 503,
    )


async def metrics_page(request: web.Request) -> web.Response:
    # Snapshot on the loop, render in a worker thread: a large page must not hold the loop.
    render = request.app[STATE].metrics.scrape()
    body = await asyncio.to_thread(render)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
