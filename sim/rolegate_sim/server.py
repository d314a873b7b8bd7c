"""The simulator as an aiohttp server: app factory, in-process start/stop, blocking serve.

`start()` is what tests and the demo use (free port, returns the URL); `serve()` is the
CLI's foreground mode.
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from aiohttp import web

from rolegate_sim import control
from rolegate_sim.chat import SIM_STATE, handle_chat
from rolegate_sim.scenario import Scenario, load_scenario
from rolegate_sim.state import SimState

__all__ = ["SIM_STATE", "RunningSim", "create_app", "serve", "start"]

# Generous: the benchmark sends large prompts; aiohttp's default is 1 MiB.
_MAX_REQUEST_BYTES = 64 * 1024 * 1024
# How long stop() lets in-flight requests finish before cancelling them. A simulator has
# nothing worth a graceful drain, and tests stop it with streams still parked in stalls.
_SHUTDOWN_GRACE_SECONDS = 0.1


def create_app(scenario: Scenario) -> web.Application:
    app = web.Application(client_max_size=_MAX_REQUEST_BYTES)
    app[SIM_STATE] = SimState(scenario)
    # `/api/v1` is OpenRouter's path; `/v1` what OpenAI-compatible clients default to.
    app.router.add_post("/v1/chat/completions", handle_chat)
    app.router.add_post("/api/v1/chat/completions", handle_chat)
    control.add_routes(app)
    app.on_shutdown.append(_mark_stopping)
    return app


async def _mark_stopping(app: web.Application) -> None:
    # Handlers cancelled from here on are cancelled by us, not by a departing client.
    app[SIM_STATE].stopping = True


@dataclass
class RunningSim:
    url: str  # base URL without `/v1`, e.g. http://127.0.0.1:43123
    port: int
    app: web.Application
    _runner: web.AppRunner = field(repr=False)

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def __aenter__(self) -> RunningSim:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


async def start(scenario: Scenario, host: str = "127.0.0.1", port: int = 0) -> RunningSim:
    """Start serving `scenario` on host:port (0 picks a free port) in the running loop."""
    app = create_app(scenario)
    runner = web.AppRunner(
        app,
        # Cancel the handler when the client disconnects: that is how a dropped stream
        # gets recorded as `client_disconnected` and stops generating.
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=_SHUTDOWN_GRACE_SECONDS,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_port = int(runner.addresses[0][1])
    except BaseException:
        await runner.cleanup()
        raise
    url_host = f"[{host}]" if ":" in host else host
    return RunningSim(
        url=f"http://{url_host}:{bound_port}", port=bound_port, app=app, _runner=runner
    )


def serve(scenario_path: Path, host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM. Raises ScenarioError if the file is invalid."""
    scenario = load_scenario(scenario_path)
    asyncio.run(_serve_until_signalled(scenario, host, port))


async def _serve_until_signalled(scenario: Scenario, host: str, port: int) -> None:
    sim = await start(scenario, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        print(f"rolegate sim listening on {sim.url}", flush=True)
        await stop.wait()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await sim.stop()
