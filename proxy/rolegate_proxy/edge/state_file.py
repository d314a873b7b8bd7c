"""The pod's memory in a local file (`--state-file`): restored at start, kept every
`--state-save-seconds` and once more at shutdown, so a restarted process routes from what
it had learned instead of from the published figures alone.

Writes are atomic (a temporary file in the same directory, flushed to disk, then renamed
over the old one): a crash mid-write leaves the previous memory, never half of one. All
file work runs in a worker thread; the request path never waits on it. A file that is
missing starts the pod cold; one that is unreadable, corrupt or from another format
starts it cold too, with a warning naming the file and what is wrong (never its content).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
from pathlib import Path

from ..core.fleet import PodMemory, remember, restore
from ..wire.pod_memory import MemoryFormatError, decode, encode
from .state import ProxyState
from .status_reporter import pod_name

log = logging.getLogger("rolegate.proxy.memory")


def read_memory(path: Path) -> PodMemory | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        log.warning("state file unreadable path=%s error=%s", path, error.strerror)
        return None
    try:
        return decode(data)
    except MemoryFormatError as error:
        log.warning("state file ignored path=%s reason=%s", path, error)
        return None


def write_memory(path: Path, memory: PodMemory) -> None:
    """Atomically replace `path` with `memory`."""
    data = encode(memory)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


class StateKeeper:
    """Restores the pod's memory from `path` and keeps it there."""

    def __init__(self, state: ProxyState, path: Path) -> None:
        self._state = state
        self._path = path

    async def restore(self) -> None:
        memory = await asyncio.to_thread(read_memory, self._path)
        if memory is None:
            return
        dispatcher = self._state.dispatcher
        now, wall_now = dispatcher.now(), time.time()
        learners = (dispatcher.ledger, dispatcher.scores)
        if restore(memory, *learners, now, wall_now, breakers=dispatcher.breakers):
            log.info(
                "memory restored path=%s machines=%d scores=%d signatures=%d age_s=%.0f",
                self._path,
                len(memory.machines),
                len(memory.scores),
                len(memory.faults),
                max(0.0, wall_now - memory.written_at),
            )

    async def save(self) -> None:
        dispatcher = self._state.dispatcher
        # Taken on the loop (the ledger is the loop's), written in a worker thread.
        memory = remember(
            pod_name(),
            dispatcher.ledger,
            dispatcher.scores,
            dispatcher.now(),
            time.time(),
            breakers=dispatcher.breakers,
        )
        try:
            await asyncio.to_thread(write_memory, self._path, memory)
        except OSError as error:
            log.warning("state file not written path=%s error=%s", self._path, error.strerror)

    async def keep(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            await self.save()
