"""How the operator process stops: on a signal within a second in every state, and at once
(non-zero) when what it runs ends by itself.

kopf installs SIGINT/SIGTERM handlers of its own when it runs in the main thread, and then
stops in its own time (it waits up to 10 s for its tasks). So the operator's loop runs in
a thread of its own, where kopf leaves signals alone, and the main thread takes the
signals and keeps time: it asks the loop to stop, and the process leaves `STOP_SECONDS`
later at the latest, even if the loop is stuck. Threads blocked in API calls (each bounded
by its own timeout, up to 30 s) never hold a stop up: `exit_now` leaves without them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from collections.abc import Coroutine
from enum import StrEnum
from typing import Any, Final, NoReturn

log = logging.getLogger("rolegate.operator")

# SIGTERM to exit, in every state (docs/operator.md promises a second).
STOP_SECONDS: Final = 0.8
# Of those, at most this long to hand the Lease over.
RELEASE_SECONDS: Final = 0.4


class Outcome(StrEnum):
    ASKED = "asked"  # SIGINT/SIGTERM
    CRASHED = "crashed"  # a loop of ours died
    KOPF_STOPPED = "kopf-stopped"


def run_beside_signals(stopping: asyncio.Event, main: Coroutine[Any, Any, Outcome]) -> Outcome:
    """Run `main` on an event loop in a thread of its own while this (the main) thread
    takes the signals: a signal sets `stopping` on the loop, and this returns
    `STOP_SECONDS` later at the latest, even if the loop is stuck (see the module
    docstring)."""
    asked = threading.Event()
    loops: list[asyncio.AbstractEventLoop] = []
    results: list[Outcome] = []
    errors: list[BaseException] = []

    def serve() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        loops.append(loop)
        if asked.is_set():
            stopping.set()
        try:
            results.append(loop.run_until_complete(main))
        except BaseException as error:  # handed to the main thread below
            errors.append(error)

    def on_signal(number: int, _frame: object) -> None:
        log.info("signal received signal=%s", signal.Signals(number).name)
        asked.set()
        for loop in loops:
            loop.call_soon_threadsafe(stopping.set)

    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, on_signal)
    thread = threading.Thread(target=serve, name="rolegate-operator", daemon=True)
    thread.start()
    while thread.is_alive():
        if asked.wait(0.1):
            thread.join(STOP_SECONDS + 0.1)
            break
    if errors:
        raise errors[0]
    return results[0] if results else Outcome.ASKED


def exit_now(code: int) -> NoReturn:
    """Leave the process at once: worker threads blocked in API calls (each bounded by its
    own timeout, up to 30 s) must not hold a stopping operator up."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
