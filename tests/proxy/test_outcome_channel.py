"""The outcome channel and its JSON-lines exporter as plain objects (SPEC C7): a bounded ring
buffer that evicts the oldest record and counts it, a wake-up per emission, a record with
every typed field the spec names, and an exporter whose own queue is bounded the same way.
No servers: the exporter's writer task runs on the test's loop against `tmp_path`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from rolegate_proxy.core.decisions import Decision
from rolegate_proxy.core.outcomes import (
    Arm,
    ArmAct,
    ArmResult,
    Outcome,
    OutcomeChannel,
    OutcomeKind,
    Skip,
)
from rolegate_proxy.core.trace_ids import TraceIds
from rolegate_proxy.edge.outcome_export import OutcomeExporter

from ..waiting import eventually


def _outcome(request_id: str, kind: OutcomeKind = OutcomeKind.ANSWERED) -> Outcome:
    return Outcome(
        request_id=request_id,
        role="agent",
        outcome=kind,
        status=200,
        stream=True,
        started_at=1_760_000_000.0,
        latency_seconds=0.25,
    )


def _full_outcome() -> Outcome:
    """A record with every field set, arms and skips included."""
    return Outcome(
        request_id="req-full",
        role="agent",
        outcome=OutcomeKind.ANSWERED,
        status=200,
        stream=True,
        started_at=1_760_000_000.5,
        latency_seconds=1.75,
        ttft_seconds=0.4,
        ruling="Auto",
        patience_seconds=30.0,
        provider="agg",
        model="vendor/model-a",
        machine="fastco",
        finish_reason="stop",
        verdict="ok",
        tokens_in=12,
        tokens_out=34,
        tokens_estimated=True,
        cost_usd=0.0021,
        arms=(
            Arm(
                "agg",
                "vendor/model-a",
                "slowco",
                ArmResult.MOVED,
                status=200,
                seconds=0.9,
                ttft_seconds=0.3,
                act=ArmAct.CONTINUED,
                detail="moved after 5 tokens",
                cause="moved",
                started_after=0.05,
                span_id=0x00F067AA0BA902B7,
            ),
            Arm("agg", "vendor/model-a", "fastco", ArmResult.OK, 200, 0.8, 0.1, ArmAct.KEPT),
            Arm("agg", "vendor/model-a", "lateco", ArmResult.CANCELLED, None, 0.2),
        ),
        skipped=(
            Skip("agg", "vendor/model-a", "brokenco", "breaker open: 3 resets"),
            Skip("other", "vendor/model-b", None, "the role's patience ran out"),
        ),
        config_hash="abc123",
        error_code=None,
        trace=TraceIds(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x53995C3F42CD8AD8, sampled=True),
    )


# --- the channel ----------------------------------------------------------------------------


def test_drain_returns_every_record_oldest_first_and_empties_the_buffer() -> None:
    channel = OutcomeChannel(capacity=10)
    for i in range(5):
        channel.emit(_outcome(f"r{i}"))
    assert len(channel) == 5
    assert [o.request_id for o in channel.drain()] == ["r0", "r1", "r2", "r3", "r4"]
    assert len(channel) == 0
    assert channel.drain() == []
    assert (channel.emitted, channel.dropped) == (5, 0)
    channel.emit(_outcome("r5"))
    assert [o.request_id for o in channel.drain()] == ["r5"]
    assert (channel.emitted, channel.dropped) == (6, 0)


def test_a_full_buffer_evicts_the_oldest_and_counts_each_eviction() -> None:
    channel = OutcomeChannel(capacity=3)
    dropped_after_each = []
    for i in range(8):
        channel.emit(_outcome(f"r{i}"))
        dropped_after_each.append(channel.dropped)
        assert len(channel) == min(i + 1, 3)
    # Nothing is dropped until the buffer is full, then exactly one record per emission.
    assert dropped_after_each == [0, 0, 0, 1, 2, 3, 4, 5]
    delivered = channel.drain()
    assert [o.request_id for o in delivered] == ["r5", "r6", "r7"]  # the newest survive
    assert channel.emitted == 8
    assert channel.emitted == len(delivered) + channel.dropped


def test_draining_makes_room_again() -> None:
    channel = OutcomeChannel(capacity=2)
    delivered: list[Outcome] = []
    for i in range(6):
        channel.emit(_outcome(f"r{i}"))
        if i % 2 == 1:
            delivered += channel.drain()  # a drainer that keeps up: nothing is lost
    assert [o.request_id for o in delivered] == [f"r{i}" for i in range(6)]
    assert (channel.emitted, channel.dropped) == (6, 0)


def test_a_capacity_of_one_keeps_only_the_newest() -> None:
    channel = OutcomeChannel(capacity=1)
    for i in range(4):
        channel.emit(_outcome(f"r{i}"))
    assert [o.request_id for o in channel.drain()] == ["r3"]
    assert (channel.emitted, channel.dropped, channel.capacity) == (4, 3, 1)


@pytest.mark.parametrize("capacity", [0, -1, -10_000])
def test_a_capacity_below_one_is_refused_with_a_clear_message(capacity: int) -> None:
    with pytest.raises(ValueError, match=rf"at least one record, not {capacity}$"):
        OutcomeChannel(capacity)


def test_wake_is_called_once_per_emission() -> None:
    channel = OutcomeChannel(capacity=2)
    channel.emit(_outcome("before"))  # no drainer attached yet: emission still works
    calls: list[int] = []
    channel.wake = lambda: calls.append(len(channel))
    for i in range(5):
        channel.emit(_outcome(f"r{i}"))
        assert len(calls) == i + 1
    # Called after the record is in the buffer (the drainer finds it there), evictions too.
    assert calls == [2, 2, 2, 2, 2]
    channel.wake = None
    channel.emit(_outcome("after"))
    assert len(calls) == 5
    assert (channel.emitted, channel.dropped) == (7, 5)


# --- the record -----------------------------------------------------------------------------


def test_as_json_is_plain_json_with_enum_values() -> None:
    outcome = _full_outcome()
    data = outcome.as_json()
    # Plain JSON types only: no enum instances (json.dumps would accept a StrEnum silently).
    text = json.dumps(data, allow_nan=False)
    assert json.loads(text) == data
    assert type(data["outcome"]) is str
    assert data["outcome"] == "answered"
    assert [type(a["result"]) for a in data["arms"]] == [str, str, str]
    assert [a["result"] for a in data["arms"]] == ["moved", "ok", "cancelled"]
    assert [type(a["act"]) for a in data["arms"]] == [str, str, type(None)]
    assert [a["act"] for a in data["arms"]] == ["continued", "kept", None]


def test_as_json_carries_every_field_spec_c7_names() -> None:
    data = _full_outcome().as_json()
    # SPEC C7: role, model, provider, machine, arms (with machines and acts), latency, TTFT,
    # tokens, cost, outcome, finish reason, verdict, skip reasons.
    assert data["role"] == "agent"
    assert data["model"] == "vendor/model-a"
    assert data["provider"] == "agg"
    assert data["machine"] == "fastco"
    assert [(a["machine"], a["act"]) for a in data["arms"]] == [
        ("slowco", "continued"),
        ("fastco", "kept"),
        ("lateco", None),
    ]
    assert data["arms"][0] == {
        "provider": "agg",
        "model": "vendor/model-a",
        "machine": "slowco",
        "result": "moved",
        "status": 200,
        "seconds": 0.9,
        "ttft_seconds": 0.3,
        "act": "continued",
        "detail": "moved after 5 tokens",
        "cause": "moved",
        "started_after": 0.05,
        "span_id": "00f067aa0ba902b7",
    }
    assert data["latency_seconds"] == 1.75
    assert data["ttft_seconds"] == 0.4
    assert (data["tokens_in"], data["tokens_out"], data["tokens_estimated"]) == (12, 34, True)
    assert data["cost_usd"] == 0.0021
    assert data["outcome"] == "answered"
    assert data["finish_reason"] == "stop"
    assert data["verdict"] == "ok"
    assert data["skipped"] == [
        {
            "provider": "agg",
            "model": "vendor/model-a",
            "machine": "brokenco",
            "reason": "breaker open: 3 resets",
        },
        {
            "provider": "other",
            "model": "vendor/model-b",
            "machine": None,
            "reason": "the role's patience ran out",
        },
    ]
    # The request's span, to find its trace by: ids only (the caller's tracestate stays out).
    assert data["trace"] == {
        "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736",
        "span_id": "53995c3f42cd8ad8",
        "sampled": True,
    }


def test_as_json_leaves_no_field_out() -> None:
    """A field added to the record (or an arm, or a skip) but not to its JSON fails here."""
    data = _full_outcome().as_json()
    assert set(data) == {f.name for f in dataclasses.fields(Outcome)}
    assert set(data["arms"][0]) == {f.name for f in dataclasses.fields(Arm)}
    assert set(data["skipped"][0]) == {f.name for f in dataclasses.fields(Skip)}


def test_every_outcome_kind_serialises_to_its_value() -> None:
    for kind in OutcomeKind:
        data = _outcome("r", kind).as_json()
        assert data["outcome"] == kind.value
        assert json.loads(json.dumps(data))["outcome"] == kind.value
    assert {k.value for k in OutcomeKind} == {
        "answered",
        "incomplete",
        "failed",
        "rejected",
        "cancelled",
    }


# --- the exporter ---------------------------------------------------------------------------


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


async def _until(predicate: Callable[[], object]) -> None:
    """Until the exporter (a background task of this loop) has got as far as `predicate`."""

    async def holds() -> bool:
        return bool(predicate())

    await eventually(holds, what="the exporter's progress", every=0.005)


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert task.cancelled()


async def _export_one(target: Path, request_id: str) -> None:
    exporter = OutcomeExporter(str(target))
    task = asyncio.create_task(exporter.run())
    exporter([_outcome(request_id)])
    await _until(lambda: exporter.written == 1)
    await _stop(task)


async def test_the_exporter_writes_one_line_per_record(tmp_path: Path) -> None:
    target = tmp_path / "nested" / "outcomes.jsonl"  # the directory is created
    exporter = OutcomeExporter(str(target))
    task = asyncio.create_task(exporter.run())
    try:
        first = [_outcome("r0"), _full_outcome()]
        exporter(first)
        await _until(lambda: exporter.written == 2)
        assert _lines(target) == [o.as_json() for o in first]
        exporter([_outcome("r2", OutcomeKind.FAILED)])
        await _until(lambda: exporter.written == 3)
        assert [line["request_id"] for line in _lines(target)] == ["r0", "req-full", "r2"]
        # Queued, then cancelled before the writer woke: the cancellation writes the rest.
        exporter([_outcome("r3"), _outcome("r4")])
    finally:
        await _stop(task)
    lines = target.read_bytes().splitlines(keepends=True)
    assert all(line.endswith(b"\n") for line in lines)
    assert [json.loads(line)["request_id"] for line in lines] == [
        "r0",
        "req-full",
        "r2",
        "r3",
        "r4",
    ]
    assert (exporter.written, exporter.dropped) == (5, 0)


async def test_the_exporter_appends_to_an_existing_file(tmp_path: Path) -> None:
    target = tmp_path / "outcomes.jsonl"
    for run in range(2):
        await _export_one(target, f"run{run}")
    assert [line["request_id"] for line in _lines(target)] == ["run0", "run1"]


async def test_a_writer_that_falls_behind_drops_and_counts_the_oldest_lines(
    tmp_path: Path,
) -> None:
    target = tmp_path / "outcomes.jsonl"
    exporter = OutcomeExporter(str(target), queue=3)
    # The writer has not run yet: everything queues, and the queue holds three lines.
    exporter([_outcome(f"r{i}") for i in range(5)])
    assert exporter.dropped == 2
    exporter([_outcome("r5")])
    assert exporter.dropped == 3
    task = asyncio.create_task(exporter.run())
    await _until(lambda: exporter.written == 3)
    await _stop(task)
    assert [line["request_id"] for line in _lines(target)] == ["r3", "r4", "r5"]
    assert (exporter.written, exporter.dropped) == (3, 3)
    # Six records offered: each was either written or counted as dropped.
    assert exporter.written + exporter.dropped == 6


async def test_a_cancelled_exporter_closes_its_file(tmp_path: Path) -> None:
    target = tmp_path / "outcomes.jsonl"
    exporter = OutcomeExporter(str(target))
    task = asyncio.create_task(exporter.run())
    await _until(target.exists)
    await _stop(task)
    # Nothing was offered: an empty file, and no unclosed-file warning (filterwarnings=error).
    assert target.read_bytes() == b""
    assert (exporter.written, exporter.dropped) == (0, 0)


async def test_a_batch_being_written_when_the_exporter_stops_is_not_lost(tmp_path: Path) -> None:
    # One worker thread, held busy: the exporter's write is queued behind it, which is the
    # moment a shutdown can land on (the write of the last batch not yet done).
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=1))
    target = tmp_path / "outcomes.jsonl"
    exporter = OutcomeExporter(str(target))
    task = asyncio.create_task(exporter.run())
    await _until(target.exists)
    gate = threading.Event()
    busy = loop.run_in_executor(None, gate.wait)
    try:
        exporter([_outcome("last-batch")])
        for _ in range(5):
            await asyncio.sleep(0)  # the writer wakes and hands its write to the pool
        task.cancel()  # the shutdown lands while the write waits for a thread
        for _ in range(5):
            await asyncio.sleep(0)  # the exporter takes the cancellation in its next steps
    finally:
        gate.set()
        await busy
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert task.cancelled()
    # The write in flight finished before the exporter closed its file.
    assert (exporter.written, exporter.dropped) == (1, 0)
    assert [line["request_id"] for line in _lines(target)] == ["last-batch"]


def test_a_finished_decision_carries_every_field_into_its_outcome() -> None:
    decision = Decision(
        request_id="req-1", role="agent", ruling="Order", started_at=100.0, stream=True,
        patience_seconds=30.0, grant="team/g",
    )  # fmt: skip
    decision.started_wall = 1_760_000_000.0
    decision.arm(Arm("agg", "vendor/model", "m1", ArmResult.OK, 200, 1.25, 0.25))
    decision.skip("agg", "vendor/model", "m2", "slow")
    decision.served_provider, decision.served_model, decision.served_machine = (
        "agg", "vendor/model", "m1",
    )  # fmt: skip
    decision.finish_reason, decision.verdict = "stop", "ok"
    decision.tokens_in, decision.tokens_out, decision.tokens_estimated = 7, 11, True
    decision.cost_usd, decision.first_content_at, decision.error_code = 0.5, 100.25, "late"
    outcome = decision.finish(
        outcome=OutcomeKind.ANSWERED, status=200, now=101.5, config_hash="abc"
    )
    assert dataclasses.asdict(outcome) == {
        "request_id": "req-1",
        "role": "agent",
        "outcome": OutcomeKind.ANSWERED,
        "status": 200,
        "stream": True,
        "started_at": 1_760_000_000.0,
        "latency_seconds": 1.5,
        "ttft_seconds": 0.25,
        "ruling": "Order",
        "patience_seconds": 30.0,
        "grant": "team/g",
        "provider": "agg",
        "model": "vendor/model",
        "machine": "m1",
        "finish_reason": "stop",
        "verdict": "ok",
        "tokens_in": 7,
        "tokens_out": 11,
        "tokens_estimated": True,
        "cost_usd": 0.5,
        "arms": (dataclasses.asdict(decision.arms[0]),),
        "skipped": (dataclasses.asdict(decision.skips[0]),),
        "config_hash": "abc",
        "error_code": "late",
        "trace": None,
    }
    # The dispatcher's own word wins over "answered"; the caller's error code over its own.
    decision.outcome = OutcomeKind.INCOMPLETE
    later = decision.finish(
        outcome=OutcomeKind.ANSWERED, status=200, now=102.0, config_hash="abc", error_code="x"
    )
    assert (later.outcome, later.error_code) == (OutcomeKind.INCOMPLETE, "x")
