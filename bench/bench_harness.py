"""What `peers.py` and `machines.py` share: gateways as real processes whose CPU and memory
are read from /proc, workloads (cells) against the simulator's scenario models, one
aiohttp load generator, alternating rounds, and the tables.

A *target* is something that answers chat completions: the simulator itself (direct) or a
proxy in front of it. A *cell* is one workload (non-streamed, a 20-chunk stream, ...). Every
round runs every cell against every target in turn (direct, then each proxy, then the next
cell), so all targets see the same machine noise; every figure comes from one run.

CPU time is utime+stime (and the reaped children's cutime+cstime) from /proc/<pid>/stat,
summed over the target's whole process tree, read just before and just after the measured
requests of a block. The kernel reports it in clock ticks (10 ms), so a block's reading is
good to ±10 ms: the cells are sized so that a round costs far more than that.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import aiohttp
from overhead import pct, wait_ready

T = TypeVar("T")
_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")
# A stream's first content token, as every target spells it (the simulator's reply
# starts with the word `w0`, and the JSON string that carries it begins with a quote).
_FIRST_TOKEN = b'"w0 '
_REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=300)


def reply(tokens: int) -> str:
    """A reply the simulator splits into exactly `tokens` tokens (a word and its space)."""
    return "".join(f"w{i} " for i in range(tokens))


# --- processes ---------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (which may hold spaces and
    parentheses, hence the split at the last `)`): [0] is the state, [1] the parent."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return text[text.rfind(")") + 2 :].split()


def process_tree(root: int) -> list[int]:
    """`root` and every live descendant: gateways may fork workers or helpers."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds used so far by the tree: each live process's utime+stime, plus the
    cutime+cstime of the children it has reaped (a child that exits mid-round keeps
    counting, through its parent)."""
    ticks = 0
    for pid in process_tree(root):
        fields = _stat_fields(pid)
        if fields is not None:
            ticks += sum(int(value) for value in fields[11:15])
    return ticks / _TICKS_PER_SECOND


def tree_peak_rss_mib(root: int) -> float:
    """VmHWM (the resident set's high-water mark) summed over the tree's live processes."""
    kib = 0
    for pid in process_tree(root):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    kib += int(line.split()[1])
    return kib / 1024


@dataclass
class Proc:
    """A process this benchmark started, its output in `log`."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.popen.pid)

    def peak_rss_mib(self) -> float:
        return tree_peak_rss_mib(self.popen.pid)

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            raise SystemExit(
                f"{self.name} exited with {self.popen.returncode}; its output: {self.log}"
            )

    async def ready(self, url: str, within: float) -> None:
        """Wait for `url` to answer 200, failing at once if the process dies first."""
        waiting = asyncio.create_task(wait_ready(url, within))
        try:
            while not waiting.done():
                self.check_alive()
                await asyncio.wait({waiting}, timeout=0.2)
            await waiting
        finally:
            waiting.cancel()

    def stop(self) -> None:
        """SIGTERM to its whole process group (it was started as a group leader), then
        SIGKILL to what is left after 15 s."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=15)
        # Whatever the group leader left behind (workers, helpers), and the leader itself.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()


class Processes:
    """Starts processes (each its own process group, its output in `<logs>/<name>.log`)
    and stops every one of them on the way out, however the way out is taken: an error,
    Ctrl-C or a SIGTERM to this process."""

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: list[Proc] = []
        self.interrupted = False
        # What signal.signal returned for each: a handler, SIG_DFL or SIG_IGN.
        self._previous: dict[int, Any] = {}

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] = {},
        cwd: Path | None = None,
    ) -> Proc:
        log = self.logs / f"{name}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(
                list(argv),
                env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                # Its own group: Ctrl-C in the terminal reaches only this process, which
                # then stops the group (its workers included) in order.
                start_new_session=True,
            )
        proc = Proc(name, popen, log)
        self.started.append(proc)
        return proc

    def _interrupt(self, signum: int, frame: FrameType | None) -> None:
        # The exception may land in an event-loop callback that swallows it; the processes
        # told to stop here make every request after it fail, so the run ends either way.
        self.interrupted = True
        for proc in self.started:
            if proc.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.popen.pid, signal.SIGTERM)
        raise KeyboardInterrupt

    def __enter__(self) -> Processes:
        for signum in self._SIGNALS:
            self._previous[signum] = signal.signal(signum, self._interrupt)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            for proc in reversed(self.started):
                proc.stop()
        finally:
            for signum, previous in self._previous.items():
                signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        if self.interrupted:
            # In place of whatever the interruption surfaced as (a broken response, often).
            raise SystemExit(f"interrupted: every process it started is stopped ({self.logs})")


# --- workloads and targets ---------------------------------------------------------------


def rolegate_command() -> str:
    """The `rolegate` CLI of the environment running the benchmark (this checkout's .venv)."""
    return str(Path(sys.executable).parent / "rolegate")


def sim_model(
    name: str, tokens: int, machines: Sequence[str], tokens_per_second: float = 0
) -> dict[str, object]:
    """A scenario model whose machines answer `reply(tokens)`: instant (every due event
    leaves in one write, up to 32 KiB) unless paced at `tokens_per_second`."""
    return {
        "name": name,
        "reply": reply(tokens),
        "machines": [
            {"name": machine, "ttftSeconds": 0, "tokensPerSecond": tokens_per_second}
            for machine in machines
        ],
    }


def write_scenario(path: Path, models: Sequence[Mapping[str, object]]) -> None:
    # A short record list: the simulator keeps one per request for its control API.
    path.write_text(json.dumps({"seed": 1, "recordLimit": 1000, "models": list(models)}))


def roles_and_grant(roles: Mapping[str, Sequence[str]]) -> list[dict[str, object]]:
    """A RoleTable with a role per entry (name: its models), patient and Watched, the
    machines in Order; and an AccessGrant opening them to callers without a credential,
    as the load generator calls."""
    table: dict[str, object] = {
        "apiVersion": "rolegate.dev/v1alpha1",
        "kind": "RoleTable",
        "metadata": {"name": "bench"},
        "spec": {
            "roles": [
                {
                    "name": name,
                    "models": list(models),
                    "patienceSeconds": 60,
                    "visibility": "Watched",
                    "ruling": "Order",
                }
                for name, models in roles.items()
            ]
        },
    }
    grant: dict[str, object] = {
        "apiVersion": "rolegate.dev/v1alpha1",
        "kind": "AccessGrant",
        "metadata": {"name": "bench"},
        "spec": {"subjects": [{"anonymous": True}], "roles": list(roles)},
    }
    return [table, grant]


def write_manifests(folder: Path, manifests: Sequence[Mapping[str, object]]) -> None:
    """The manifests as one YAML file for `rolegate proxy --manifests` (JSON is YAML)."""
    folder.mkdir(parents=True)
    (folder / "bench.yaml").write_text("\n---\n".join(json.dumps(m) for m in manifests) + "\n")


@dataclass(frozen=True)
class Cell:
    """One workload: `tokens` content chunks from scenario model `model`, streamed or
    not, `requests` per round at `concurrency`."""

    name: str
    model: str
    tokens: int
    stream: bool
    concurrency: int
    requests: int


@dataclass(frozen=True)
class Target:
    """Where requests go and whose processes pay for them. `body` gives the request body
    for a cell (each target names the model its own way)."""

    name: str
    url: str
    proc: Proc
    body: Callable[[Cell], bytes]
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def request_headers(self) -> dict[str, str]:
        return {"Content-Type": "application/json", **self.headers}


def openai_body(model: str, stream: bool, provider: Mapping[str, object] | None) -> bytes:
    """The request every target gets: one short user message; `provider` is the
    aggregator routing field the simulator reads (what rolegate adds on its own)."""
    payload: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": "benchmark prompt"}],
        "stream": stream,
    }
    if provider is not None:
        payload["provider"] = dict(provider)
    return json.dumps(payload).encode()


@dataclass
class Measured:
    """What one (target, cell) pair collected over all rounds."""

    latencies_ms: list[float] = field(default_factory=list)
    first_token_ms: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    upstream_cpu_s: float = 0.0
    requests: int = 0
    wall_s: float = 0.0
    note: str | None = None

    def cpu_ms_per_request(self) -> float:
        return self.cpu_s * 1000 / self.requests if self.requests else float("nan")

    def upstream_cpu_ms_per_request(self) -> float:
        return self.upstream_cpu_s * 1000 / self.requests if self.requests else float("nan")

    def p50(self) -> float:
        return statistics.median(self.latencies_ms) if self.latencies_ms else float("nan")

    def p99(self) -> float:
        return pct(self.latencies_ms, 0.99) if self.latencies_ms else float("nan")

    def first_p50(self) -> float:
        return statistics.median(self.first_token_ms) if self.first_token_ms else float("nan")

    def per_second(self) -> float:
        return self.requests / self.wall_s if self.wall_s else float("nan")


Results = dict[tuple[str, str], Measured]


async def _one(
    session: aiohttp.ClientSession, target: Target, body: bytes, cell: Cell
) -> tuple[float, float | None]:
    """One request, read to its last byte: (milliseconds to the last byte, to the first
    content token of a stream)."""
    started = time.perf_counter()
    first: float | None = None
    async with session.post(target.url, data=body, headers=target.request_headers) as response:
        if response.status != 200:
            text = (await response.text())[:300]
            raise SystemExit(f"{target.name} answered {response.status} for {cell.name}: {text}")
        if cell.stream:
            async for chunk in response.content.iter_any():
                if first is None and _FIRST_TOKEN in chunk:
                    first = time.perf_counter()
        else:
            await response.read()
    done = time.perf_counter()
    return (done - started) * 1000, None if first is None else (first - started) * 1000


def _contents(raw: bytes, stream: bool) -> list[str]:
    """The content pieces of an answer: one per content event of a stream, the message
    of a non-streamed answer."""
    if not stream:
        return [json.loads(raw)["choices"][0]["message"]["content"]]
    pieces = []
    for line in raw.decode().splitlines():
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        for choice in json.loads(line[5:]).get("choices") or ():
            content = (choice.get("delta") or {}).get("content")
            if content:
                pieces.append(content)
    return pieces


async def _check(session: aiohttp.ClientSession, target: Target, cell: Cell) -> str | None:
    """Fails unless the target returns the whole reply; says so when a stream arrives in
    another number of content events than the upstream sent (re-chunked or buffered)."""
    body, headers = target.body(cell), target.request_headers
    async with session.post(target.url, data=body, headers=headers) as r:
        raw = await r.read()
        if r.status != 200:
            raise SystemExit(f"{target.name} answered {r.status} for {cell.name}: {raw[:300]!r}")
    pieces = _contents(raw, cell.stream)
    if "".join(pieces) != reply(cell.tokens):
        raise SystemExit(f"{target.name} did not return the whole reply for {cell.name}")
    if cell.stream and len(pieces) != cell.tokens:
        return f"{cell.tokens} chunks arrived as {len(pieces)} content events"
    return None


async def _block(
    target: Target, cell: Cell, upstream: Proc, out: Measured, *, check: bool = False
) -> None:
    """One block: open the connections (a request per connection, not measured), then
    `cell.requests` requests at `cell.concurrency`, CPU read just before and after."""
    connector = aiohttp.TCPConnector(limit=cell.concurrency)
    body = target.body(cell)
    async with aiohttp.ClientSession(connector=connector, timeout=_REQUEST_TIMEOUT) as session:
        if check:
            out.note = await _check(session, target, cell)
        await asyncio.gather(*(_one(session, target, body, cell) for _ in range(cell.concurrency)))
        queue = iter(range(cell.requests))
        latencies: list[float] = []
        firsts: list[float] = []

        async def worker() -> None:
            for _ in queue:
                total, first = await _one(session, target, body, cell)
                latencies.append(total)
                if first is not None:
                    firsts.append(first)

        cpu, upstream_cpu = target.proc.cpu_seconds(), upstream.cpu_seconds()
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(cell.concurrency)))
        out.wall_s += time.perf_counter() - started
        out.cpu_s += target.proc.cpu_seconds() - cpu
        out.upstream_cpu_s += upstream.cpu_seconds() - upstream_cpu
    out.requests += cell.requests
    out.latencies_ms.extend(latencies)
    out.first_token_ms.extend(firsts)
    target.proc.check_alive()


async def measure(
    targets: Sequence[Target],
    cells: Sequence[Cell],
    rounds: int,
    upstream: Proc,
    progress: Callable[[str], None] = lambda line: None,
) -> Results:
    """Every cell against every target, `rounds` times, alternating targets within each
    cell. A warm-up round (checked, not counted) comes first: connection pools, caches
    and lazy imports are paid for before anything is measured."""
    results: Results = {(t.name, c.name): Measured() for t in targets for c in cells}
    for cell in cells:
        for target in targets:
            warm = Measured()
            await _block(target, cell, upstream, warm, check=True)
            results[target.name, cell.name].note = warm.note
    progress("warmed up")
    for number in range(1, rounds + 1):
        started = time.monotonic()
        for cell in cells:
            for target in targets:
                await _block(target, cell, upstream, results[target.name, cell.name])
        progress(f"round {number}/{rounds} took {time.monotonic() - started:.0f}s")
    return results


# --- tables ------------------------------------------------------------------------------


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A titled table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([first, *rest]).rstrip()

    rule = "-" * len(line(header))
    return [title, line(header), rule, *(line(row) for row in rows), ""]


def ratio(a: float, b: float) -> str:
    """a ÷ b, or '-' where either is missing (or b is not positive)."""
    if a != a or b != b or b <= 0:
        return "-"
    return f"{a / b:.2f}"


def number(value: float, digits: int = 3, signed: bool = False) -> str:
    if value != value:
        return "-"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run the load generator on uvloop where installed (as the proxy runs): a lighter
    client leaves more of the two CPUs to the processes measured, the same for all."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
