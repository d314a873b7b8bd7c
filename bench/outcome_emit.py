"""What one outcome emission costs on the request path (SPEC C6, C7).

`chat_completions` ends every request, in its `finally`, with `Decision.finish(...)` (the
request's `Outcome` record) and `OutcomeChannel.emit(outcome)` (an append to a bounded ring
buffer, two counters and the drainer's `wake`). Both run on the event loop before the
response is done, so their cost is paid by every request. This measures them in-process,
without the network: a realistic record (2 arms, 3 skips), a channel of the app's default
capacity whose `wake` is an `asyncio.Event().set` bound method as in `app.py`, and each
figure as the per-call time of a batch of calls (`time.perf_counter_ns`), median and p95
over the samples. The garbage collector stays on, as in the proxy.

Run: `.venv/bin/python bench/outcome_emit.py [--samples 200] [--batch 1000]`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench_report import publish, where_it_ran

from rolegate_proxy.core.decisions import Decision
from rolegate_proxy.core.outcomes import (
    DEFAULT_CAPACITY,
    Arm,
    ArmAct,
    ArmResult,
    Outcome,
    OutcomeChannel,
    OutcomeKind,
)

PROVIDER, MODEL = "openrouter", "qwen/qwen3-coder"
CONFIG_HASH = "sha256:" + "0123456789abcdef" * 4
GOAL_US = 5.0  # "a few microseconds at most in CPython"

# One batch of `n` calls; returns the nanoseconds the whole batch took.
Batch = Callable[[int], int]


def decision() -> Decision:
    """A streamed request that failed over once: two arms (a 503, then the answer, which
    the rate test kept), three skipped machines (a breaker, patience, a rate limit)."""
    d = Decision(
        request_id="req-9f8e7d6c5b4a39281706",
        role="agent",
        ruling="Order",
        started_at=1000.0,
        stream=True,
        patience_seconds=60.0,
    )
    d.skip(PROVIDER, MODEL, "deepinfra", "UpstreamErrors: breaker open for 30 s (503 x2)")
    d.skip(
        PROVIDER,
        MODEL,
        "crawler",
        "patience: expected 122.0 s (TTFT 2.0 s + 600 tokens at 5.0 tok/s) exceeds the "
        "role's patience of 60 s",
    )
    d.skip(PROVIDER, MODEL, "together", "RateLimited: 429 for 30 s (Retry-After)")
    d.arm(Arm(PROVIDER, MODEL, "fireworks", ArmResult.SERVER_ERROR, 503, 0.412, None, None,
              "503 Service Unavailable"))  # fmt: skip
    d.arm(Arm(PROVIDER, MODEL, "groq", ArmResult.OK, 200, 3.871, 0.298, ArmAct.KEPT))
    d.served_provider, d.served_model, d.served_machine = PROVIDER, MODEL, "groq"
    d.finish_reason, d.verdict = "stop", "ok"
    d.tokens_in, d.tokens_out, d.cost_usd = 1834, 611, 0.00071
    d.first_content_at = 1000.72
    return d


def finish(d: Decision) -> Outcome:
    return d.finish(outcome=OutcomeKind.ANSWERED, status=200, now=1004.31, config_hash=CONFIG_HASH)


def channel(wake: Callable[[], None] | None, *, full: bool, record: Outcome) -> OutcomeChannel:
    c = OutcomeChannel(DEFAULT_CAPACITY)
    if full:
        for _ in range(DEFAULT_CAPACITY):
            c.emit(record)
    c.wake = wake
    return c


def cases(event: asyncio.Event) -> list[tuple[str, Batch, Callable[[], None]]]:
    """(name, one batch, what runs between batches, untimed)."""
    d = decision()
    record = finish(d)
    if (len(record.arms), len(record.skipped)) != (2, 3):
        raise SystemExit("the record should have 2 arms and 3 skips")

    def nothing() -> None:
        pass

    def empty(n: int) -> int:
        start = time.perf_counter_ns()
        for _ in range(n):
            pass
        return time.perf_counter_ns() - start

    def emitting(c: OutcomeChannel) -> Batch:
        emit = c.emit

        def batch(n: int) -> int:
            start = time.perf_counter_ns()
            for _ in range(n):
                emit(record)
            return time.perf_counter_ns() - start

        return batch

    def flipping(c: OutcomeChannel) -> Batch:
        # The event is clear before every emission, so `set` flips it each time (the first
        # emission of a loop turn, after the drainer cleared it). The clear is timed too.
        emit, clear = c.emit, event.clear

        def batch(n: int) -> int:
            start = time.perf_counter_ns()
            for _ in range(n):
                clear()
                emit(record)
            return time.perf_counter_ns() - start

        return batch

    def finishing(n: int) -> int:
        start = time.perf_counter_ns()
        for _ in range(n):
            d.finish(outcome=OutcomeKind.ANSWERED, status=200, now=1004.31,
                     config_hash=CONFIG_HASH)  # fmt: skip
        return time.perf_counter_ns() - start

    def both(c: OutcomeChannel) -> Batch:
        emit = c.emit

        def batch(n: int) -> int:
            start = time.perf_counter_ns()
            for _ in range(n):
                emit(d.finish(outcome=OutcomeKind.ANSWERED, status=200, now=1004.31,
                              config_hash=CONFIG_HASH))  # fmt: skip
            return time.perf_counter_ns() - start

        return batch

    def drained(c: OutcomeChannel) -> Callable[[], None]:
        # With room: the drainer empties the buffer between batches, as it does between
        # loop turns, so no batch ever reaches the capacity.
        def reset() -> None:
            c.drain()

        return reset

    room_none = channel(None, full=False, record=record)
    room = channel(event.set, full=False, record=record)
    room_flip = channel(event.set, full=False, record=record)
    full = channel(event.set, full=True, record=record)
    room_both = channel(event.set, full=False, record=record)
    full_both = channel(event.set, full=True, record=record)
    return [
        ("empty loop (the batch's own overhead)", empty, nothing),
        ("emit, wake=None", emitting(room_none), drained(room_none)),
        ("emit, wake=Event.set (event already set)", emitting(room), drained(room)),
        ("emit, wake flips the event (+ clear)", flipping(room_flip), drained(room_flip)),
        ("emit, full buffer (evicts), wake=Event.set", emitting(full), nothing),
        ("Decision.finish (2 arms, 3 skips)", finishing, nothing),
        ("finish + emit, room in buffer", both(room_both), drained(room_both)),
        ("finish + emit, full buffer (evicts)", both(full_both), nothing),
    ]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(samples: int, batch: int) -> list[tuple[str, float, float]]:
    # An Event made inside a running loop, as the app's drainer makes it; nobody waits on
    # it here, so `set` never schedules a wake-up (the drainer's own turn is not measured).
    event = asyncio.Event()
    event.set()
    results = []
    for name, run, between in cases(event):
        for _ in range(20):  # warm-up
            run(batch)
            between()
        per_call: list[float] = []
        for _ in range(samples):
            per_call.append(run(batch) / batch / 1000.0)  # µs per call
            between()
        results.append((name, statistics.median(per_call), pct(per_call, 0.95)))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--batch", type=int, default=1000, help="calls per sample")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "outcome_emit.txt"
    )
    args = parser.parse_args()

    results = asyncio.run(measure(args.samples, args.batch))
    width = max(len(name) for name, _, _ in results)
    header = f"{'per call':<{width}} {'p50 µs':>8} {'p95 µs':>8}"
    rows = [header, "-" * len(header)]
    rows += [f"{name:<{width}} {p50:>8.3f} {p95:>8.3f}" for name, p50, p95 in results]
    by_name = {name: p50 for name, p50, _ in results}
    worst = max(
        by_name["finish + emit, room in buffer"], by_name["finish + emit, full buffer (evicts)"]
    )
    rows.append("")
    rows.append(
        f"goal: finish + emit a few µs at most (taken as < {GOAL_US:g} µs): "
        f"{'met' if worst < GOAL_US else 'NOT met'} ({worst:.3f} µs at the median, worst case)"
    )
    rows.append(
        f"samples={args.samples} x {args.batch} calls; buffer capacity {DEFAULT_CAPACITY}; "
        + where_it_ran()
    )
    publish(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
