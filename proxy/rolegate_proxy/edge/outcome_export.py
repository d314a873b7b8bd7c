"""The JSON-lines exporter of the outcome channel (off by default; `--outcome-export`).

One line per outcome record, to a file (appended) or to stdout (`-`). The consumer side
only serialises and queues lines in memory; a background task writes them in a worker
thread, so neither the request path nor the event loop ever waits on the disk. When the
writer falls behind its bounded queue, the oldest lines are dropped and counted
(`rolegate_outcome_export_dropped_total`), like the channel itself.

The records hold routing metadata only (see outcomes.py): an export never carries a
prompt, a completion or a credential.
"""

from __future__ import annotations

import asyncio
import sys
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Final

import orjson

from ..core.outcomes import Outcome

DEFAULT_QUEUE: Final = 50_000
STDOUT: Final = "-"


class OutcomeExporter:
    def __init__(self, target: str, *, queue: int = DEFAULT_QUEUE) -> None:
        self.target = target
        self._lines: deque[bytes] = deque(maxlen=queue)
        self._ready = asyncio.Event()
        self.written = 0
        self.dropped = 0

    def __call__(self, batch: Sequence[Outcome]) -> None:
        """The consumer: serialise and queue; never writes."""
        for outcome in batch:
            if len(self._lines) == self._lines.maxlen:
                self.dropped += 1
            self._lines.append(orjson.dumps(outcome.as_json()) + b"\n")
        self._ready.set()

    async def run(self) -> None:
        """Write queued lines until cancelled; then finish the write in flight and write
        what is left, so a shutdown loses nothing that reached the exporter."""
        stream = await asyncio.to_thread(self._open)
        writing: asyncio.Future[None] | None = None
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                while self._lines:
                    count = len(self._lines)
                    chunk = b"".join(self._lines)
                    self._lines.clear()
                    # Shielded: a cancellation stops the waiting, never the write.
                    writing = asyncio.ensure_future(asyncio.to_thread(_write, stream, chunk))
                    await asyncio.shield(writing)
                    writing = None
                    self.written += count
        finally:
            if writing is not None:
                await writing
                self.written += count
            if self._lines:
                count = len(self._lines)
                await asyncio.to_thread(_write, stream, b"".join(self._lines))
                self._lines.clear()
                self.written += count
            if stream is not sys.stdout.buffer:
                stream.close()

    def _open(self) -> IO[bytes]:
        if self.target == STDOUT:
            return sys.stdout.buffer
        path = Path(self.target)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.open("ab")


def _write(stream: IO[bytes], chunk: bytes) -> None:
    stream.write(chunk)
    stream.flush()
