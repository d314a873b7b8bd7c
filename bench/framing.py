"""Framing cost per MB of SSE, for events of 1 KB to 50 MB (issue 30, SPEC E8): linear in
bytes means the cost per MB is the same whatever the events' size.

Each stream is fed to `EventFramer` in 64 KiB reads (what aiohttp hands out from a busy
socket) and every event is taken out, its data read as nothing more than its bytes, so
the figure is the framing alone. Each size runs over at least 16 MB of stream; the best of
three runs is kept.

    .venv/bin/python bench/framing.py [--against f4d9991]

`--against REV` frames the same streams with the framer of another revision (from git)
beside today's, up to the sizes it can finish: the framer before issue 30 rescanned its
whole buffer on every read, so its cost per MB grows with the event's size.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from bench_report import publish, where_it_ran

from rolegate_proxy.wire import sse

READ = 64 * 1024
MB = 1024 * 1024
SIZES = [1024, 16 * 1024, 256 * 1024, MB, 4 * MB, 16 * MB, 50 * MB]
LEAST_STREAM = 16 * MB
RUNS = 3
# The other revision's framer is timed up to this event size (beyond, it takes minutes).
AGAINST_UP_TO = 4 * MB


def stream_of(event_size: int) -> tuple[bytes, int]:
    """Events of `event_size` bytes each (their `data: ` line and blank line included),
    at least LEAST_STREAM in all, and how many."""
    payload = event_size - len(b"data: \n\n")
    event = b"data: " + b"x" * payload + b"\n\n"
    count = max(1, -(-LEAST_STREAM // event_size))
    return event * count, count


def _as_is(data: bytes) -> bytes:
    return data


def _never() -> None:
    raise AssertionError("no event here is malformed")


def frame(make: Callable[[], object], stream: bytes) -> tuple[float, int]:
    """Seconds to frame `stream` read by read, and the events it found."""
    framer = make()
    found = 0
    started = time.perf_counter()
    for at in range(0, len(stream), READ):
        if framer.feed(stream[at : at + READ]):  # type: ignore[attr-defined]
            for _ in framer.events(_as_is, _never):  # type: ignore[attr-defined]
                found += 1
    return time.perf_counter() - started, found


def best(make: Callable[[], object], stream: bytes, count: int) -> float:
    times = []
    for _ in range(RUNS):
        seconds, found = frame(make, stream)
        assert found == count, (found, count)
        times.append(seconds)
    return min(times)


def framer_of(revision: str) -> ModuleType:
    source = subprocess.run(
        ["git", "show", f"{revision}:proxy/rolegate_proxy/wire/sse.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "sse_then.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("sse_then", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _size(n: int) -> str:
    return f"{n // MB} MB" if n >= MB else f"{n // 1024} KB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="REV", help="also frame with this revision's framer")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "framing.txt"
    )
    args = parser.parse_args()
    then = framer_of(args.against) if args.against else None

    def today() -> object:
        return sse.EventFramer(max_event_bytes=64 * MB)

    header = f"{'event':>8} {'events':>7} {'stream MB':>9} {'ms/MB':>8} {'vs 1 KB':>8}"
    if then is not None:
        header += f" {args.against + ' ms/MB':>16} {'vs 1 KB':>8}"
    rows = [
        "EventFramer: framing cost per MB of stream, fed in 64 KiB reads "
        f"(best of {RUNS}; each size over at least {LEAST_STREAM // MB} MB)",
        "",
        header,
        "-" * len(header),
    ]
    first: float | None = None
    first_then: float | None = None
    for size in SIZES:
        stream, count = stream_of(size)
        megabytes = len(stream) / MB
        per_mb = best(today, stream, count) / megabytes * 1000
        first = first or per_mb
        row = (
            f"{_size(size):>8} {count:>7} {megabytes:>9.0f} {per_mb:>8.3f} {per_mb / first:>7.2f}x"
        )
        if then is not None:
            if size <= AGAINST_UP_TO:
                then_per_mb = best(then.EventFramer, stream, count) / megabytes * 1000
                first_then = first_then or then_per_mb
                row += f" {then_per_mb:>16.3f} {then_per_mb / first_then:>7.2f}x"
            else:
                row += f" {'(not run)':>16}"
        rows.append(row)
    rows += ["", where_it_ran()]
    publish(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
