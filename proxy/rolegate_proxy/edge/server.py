"""Running the proxy: in-process (tests, demo, bench) or as the `rolegate proxy` command."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import sys
from dataclasses import dataclass

from aiohttp import web

from rolegate_policy.config import (
    ProxyConfig,
)

from .app import create_app
from .configmap_source import ConfigMapSource
from .connections import ConnectionLimits, ProxyRunner
from .settings import ProxySettings
from .state import STATE, ProxyState


@dataclass
class RunningProxy:
    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def state(self) -> ProxyState:
        return self.runner.app[STATE]

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start(
    settings: ProxySettings, config: ProxyConfig, source: ConfigMapSource | None = None
) -> RunningProxy:
    app = create_app(settings, config, source)
    # handler_cancellation: a client that disconnects cancels its handler at once, which
    # closes the upstream connection, so the provider stops generating for nobody. The
    # runner answers what the HTTP parser refuses in the OpenAI error shape, and holds the
    # connections to their limits (edge/connections.py); keepalive_timeout is the idle one.
    runner = ProxyRunner(
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
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port, reuse_address=True)
    await site.start()
    # With port 0 the OS picks a free one; the runner knows which.
    port = int(runner.addresses[0][1])
    return RunningProxy(runner=runner, host=settings.host, port=port)


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
    """Run until SIGINT or SIGTERM; open streams get the grace period to finish."""

    async def main() -> None:
        running = await start(settings, config, source)
        settle_garbage_collector()
        origin = source.describe if source else f"{len(config.roles)} roles, config {config.hash}"
        print(
            f"rolegate proxy listening on {running.url} ({origin})",
            file=sys.stderr,
            flush=True,
        )
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
