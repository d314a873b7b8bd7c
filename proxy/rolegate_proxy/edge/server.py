"""Running the proxy: in-process (tests, demo, bench) or as the `rolegate proxy` command."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
from dataclasses import dataclass

from aiohttp import web

from rolegate_policy.config import (
    ProxyConfig,
)

from .app import create_app, create_metrics_app
from .configmap_source import ConfigMapSource
from .connections import ConnectionLimits, ProxyRunner
from .settings import ProxySettings
from .state import STATE, ProxyState

# Where the proxy listens: always shown (`rolegate` sets this logger to INFO), in the
# chosen log format.
started = logging.getLogger("rolegate.proxy.started")


class CannotListen(Exception):
    """A port the proxy was told to listen on cannot be bound (taken, or not ours)."""


@dataclass
class Listener:
    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass
class RunningProxy:
    api: Listener
    # The `--metrics-port` listener (/metrics and health); None without that flag.
    metrics: Listener | None = None

    @property
    def host(self) -> str:
        return self.api.host

    @property
    def port(self) -> int:
        return self.api.port

    @property
    def url(self) -> str:
        return self.api.url

    @property
    def metrics_url(self) -> str:
        """Where /metrics is served: the metrics listener, else the API's (which serves it
        only with `metrics_on_api_port`)."""
        return (self.metrics or self.api).url

    @property
    def state(self) -> ProxyState:
        return self.api.runner.app[STATE]

    async def stop(self) -> None:
        # The API first (its open streams get the grace period); the metrics listener last,
        # so the probes and a final scrape still answer while the streams drain.
        await self.api.runner.cleanup()
        if self.metrics is not None:
            await self.metrics.runner.cleanup()


async def start(
    settings: ProxySettings, config: ProxyConfig, source: ConfigMapSource | None = None
) -> RunningProxy:
    """Listen on the API port, and on the metrics port when one is set; `CannotListen`
    names the flag whose port cannot be bound (nothing is left running then)."""
    app = create_app(settings, config, source)
    runner = guarded_runner(app, settings)
    await runner.setup()
    try:
        api = await _listen(runner, settings.host, settings.port, "--port")
    except CannotListen:
        await runner.cleanup()
        raise
    if settings.metrics_port is None:
        return RunningProxy(api=api)
    metrics_runner = guarded_runner(create_metrics_app(app), settings)
    await metrics_runner.setup()
    host = settings.metrics_host or settings.host
    try:
        metrics = await _listen(metrics_runner, host, settings.metrics_port, "--metrics-port")
    except CannotListen:
        await metrics_runner.cleanup()
        await runner.cleanup()
        raise
    return RunningProxy(api=api, metrics=metrics)


def guarded_runner(app: web.Application, settings: ProxySettings) -> ProxyRunner:
    """The runner of every listener, the API's and the metrics port's alike: a listener
    without these limits is one a slow client can hold open forever.

    handler_cancellation: a client that disconnects cancels its handler at once, which
    closes the upstream connection, so the provider stops generating for nobody. The runner
    answers what the HTTP parser refuses in the OpenAI error shape, and holds the
    connections to their limits (edge/connections.py), each listener counting its own
    (a flood on one never refuses the other's probes or scrapes); keepalive_timeout is the
    idle one."""
    return ProxyRunner(
        app,
        limits=ConnectionLimits(
            header_seconds=settings.header_timeout_seconds,
            body_seconds=settings.body_timeout_seconds,
            max_connections=settings.max_connections,
        ),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=settings.shutdown_grace_seconds,
        keepalive_timeout=settings.idle_timeout_seconds,
    )


async def _listen(runner: web.AppRunner, host: str, port: int, flag: str) -> Listener:
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except OSError as error:  # the port is taken, or not ours to bind
        # asyncio words the error around the address; the address is said already.
        reason = os.strerror(error.errno) if error.errno else str(error)
        raise CannotListen(f"cannot listen on {host}:{port} ({flag}): {reason}") from error
    # With port 0 the OS picks a free one; the runner knows which.
    return Listener(runner=runner, host=host, port=int(runner.addresses[0][1]))


# Young objects a collection waits for (CPython's default is 700).
GC_YOUNG_THRESHOLD = 10_000


def settle_garbage_collector() -> None:
    """Tune the cycle collector for a long-running server, once it has started.

    What startup made (modules, the configuration, the app) lives as long as the process:
    frozen, it is never traversed again. Young objects are collected every 10,000
    allocations instead of 700: a request's objects are freed by reference counting as it
    ends, so a collection mostly walks the requests in flight, and walking them 14 times
    less often takes a few percent off every request's CPU (bench/overhead.py). Garbage
    in reference cycles waits at most that many allocations longer: kilobytes."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def serve(
    settings: ProxySettings, config: ProxyConfig, source: ConfigMapSource | None = None
) -> None:
    """Run until SIGINT or SIGTERM; open streams get the grace period to finish. A port
    that cannot be bound raises `CannotListen`."""

    async def main() -> None:
        running = await start(settings, config, source)
        settle_garbage_collector()
        origin = source.describe if source else f"{len(config.roles)} roles, config {config.hash}"
        if running.metrics:
            metrics = f", metrics on {running.metrics.url}"
        elif settings.metrics_on_api_port:
            metrics = ", metrics on the API port"
        else:
            metrics = ", no /metrics (--metrics-port PORT serves it)"
        started.info("rolegate proxy listening on %s (%s)%s", running.url, origin, metrics)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            # Not every event loop can take signal handlers (Windows' cannot): there, the
            # default KeyboardInterrupt still stops the process.
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await running.stop()

    # uvloop's event loop trims the proxy's own share of each request (bench/overhead.py);
    # the standard loop remains the fallback where uvloop is not installed.
    try:
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())
