"""The pod's memory in a local file (`--state-file`): restored at start, kept every
`--state-save-seconds` and once more at shutdown, so a restarted process routes from what
it had learned instead of from the published figures alone.

Writes are atomic (a temporary file `.<name>.<8 random>.tmp` in the same directory, flushed
to disk, then renamed over the old one): a crash mid-write leaves the previous memory,
never half of one, and the temporary file, which the next start removes. All file work
runs in a worker thread; the request path never waits on it. A file that is missing
starts the pod cold; one that is unreadable, corrupt, from another format or holding a
value no pod could have learned (wire/pod_memory.py, core/plausible.py) starts it cold
too, with a warning naming the file and the field that is wrong (never a value).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Final

from ..core.fleet import PodMemory, remember, restore
from ..wire.pod_memory import MemoryFormatError, decode, encode
from .state import ProxyState
from .status_reporter import pod_name

log = logging.getLogger("rolegate.proxy.memory")


# What `write_memory` names its temporary file, after the memory's own name.
TEMPORARY_SUFFIX: Final = ".tmp"


def read_memory(path: Path, now: float | None = None) -> PodMemory | None:
    """The memory kept at `path`, read at `now` (the wall clock when None); None when there
    is none or it is refused (with a warning)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        log.warning("state file unreadable path=%s error=%s", path, error.strerror)
        return None
    try:
        return decode(data, now)
    except MemoryFormatError as error:
        log.warning("state file ignored path=%s reason=%s", path, error)
        return None


def write_memory(path: Path, memory: PodMemory) -> None:
    """Atomically replace `path` with `memory`."""
    data = encode(memory)
    handle, temporary = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.", suffix=TEMPORARY_SUFFIX
    )
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


def remove_leftovers(path: Path) -> int:
    """Remove the temporary files a write of `path` left behind when the process was killed
    between creating and renaming one; how many. Only names `write_memory` makes (mkstemp's
    eight characters after `.<name>.`, with or without the suffix older versions did not
    add), only regular files. Two processes must not share one state file anyway."""
    name, suffix = re.escape(path.name), re.escape(TEMPORARY_SUFFIX)
    own = re.compile(rf"\.{name}\.[a-z0-9_]{{8}}(?:{suffix})?")
    removed = 0
    try:
        with os.scandir(path.parent) as entries:
            leftovers = [
                entry.path
                for entry in entries
                if own.fullmatch(entry.name) and entry.is_file(follow_symlinks=False)
            ]
    except OSError:
        return 0  # no directory yet: nothing left behind, and the first write says why
    for leftover in leftovers:
        try:
            os.unlink(leftover)
        except FileNotFoundError:
            continue
        except OSError as error:
            log.warning(
                "state file leftover not removed path=%s error=%s", leftover, error.strerror
            )
            continue
        removed += 1
    return removed


class StateKeeper:
    """Restores the pod's memory from `path` and keeps it there."""

    def __init__(self, state: ProxyState, path: Path) -> None:
        self._state = state
        self._path = path

    async def restore(self) -> None:
        removed = await asyncio.to_thread(remove_leftovers, self._path)
        if removed:
            log.info("state file leftovers removed path=%s files=%d", self._path, removed)
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
