"""A pod's memory on the wire: what goes out comes back, its size at 1,000 machines, and
what comes in from outside is refused whole when it is not a memory."""

from __future__ import annotations

import math

import orjson
import pytest

from rolegate_proxy.core.beliefs import Evidence, MachineEvidence, MachineKey
from rolegate_proxy.core.fleet import PodMemory
from rolegate_proxy.core.score import ScoreEvidence
from rolegate_proxy.wire.pod_memory import MAX_MACHINES, MemoryFormatError, decode, encode

from .test_beliefs import ledger, seen


def learned(machines: int) -> PodMemory:
    """A memory of `machines` machines with aggregator-like names and real evidence."""
    items = tuple(
        MachineEvidence(
            MachineKey("openrouter", f"vendor/model-{i % 16:02d}", f"sub-provider-{i:04d}"),
            Evidence(12.34567891, -5.6789012 * 12, 3.3 * 12),
            Evidence(8.0, -24.617283 * 8, 76.123456 * 8),
            sightings=1000 + i,
        )
        for i in range(machines)
    )
    scores = tuple(
        (item.key, ScoreEvidence(60 + i, 0.97123456, 28.7654321)) for i, item in enumerate(items)
    )
    return PodMemory("rolegate-proxy-7d9f5c6b8-x2k4q", 1764763200.123, items, scores)


def test_a_memory_comes_back_as_it_went_to_six_significant_digits() -> None:
    memory = learned(3)
    back = decode(encode(memory))
    assert (back.pod, back.written_at) == (memory.pod, memory.written_at)
    assert [m.key for m in back.machines] == [m.key for m in memory.machines]
    for was, now in zip(memory.machines, back.machines, strict=True):
        assert now.sightings == was.sightings
        for a, b in ((was.ttft, now.ttft), (was.gap, now.gap)):
            assert a is not None
            assert b is not None
            assert (b.n, b.s1, b.s2) == pytest.approx((a.n, a.s1, a.s2), rel=1e-5)
    for (key, was_score), (back_key, score) in zip(memory.scores, back.scores, strict=True):
        assert back_key == key
        assert score.n == was_score.n
        assert (score.mean, score.weight) == pytest.approx(
            (was_score.mean, was_score.weight), rel=1e-5
        )


def test_a_machine_with_only_a_score_or_only_beliefs_keeps_just_that() -> None:
    key = MachineKey("p", "m", "x")
    memory = PodMemory("p", 1.0, (), ((key, ScoreEvidence(3, 0.5, 2.9)),))
    back = decode(encode(memory))
    assert back.machines == ()
    assert back.scores == memory.scores


def test_a_thousand_machines_fit_well_inside_an_etcd_object() -> None:
    size = len(encode(learned(1000)))
    print(f"1,000 machines: {size} bytes ({size / 1000:.0f} bytes a machine)")
    assert size < 200_000  # etcd's limit is 1.5 MiB
    assert len(encode(learned(MAX_MACHINES))) < 1_048_576


def test_a_ledger_s_memory_round_trips_through_the_wire() -> None:
    book = ledger(("fast", 2.0, 50.0))
    book.file(seen("fast", 10.0, ttft=1.5, rate=40.0))
    memory = PodMemory("p", 1.0, tuple(book.evidence(10.0)))
    assert decode(encode(memory)).machines[0].key == MachineKey(
        "openrouter", "qwen/qwen3-coder", "fast"
    )


def one_row(row: str) -> bytes:
    """A memory document of one machine row, written as JSON text."""
    return b'{"format": 1, "pod": "p", "writtenAt": 1, "machines": [' + row.encode() + b"]}"


@pytest.mark.parametrize(
    ("document", "complaint"),
    [
        (b"{", "not JSON"),
        (b"[]", "not a JSON object"),
        (b'{"format": 2, "pod": "p", "writtenAt": 1, "machines": []}', "format is not 1"),
        (b'{"format": 1, "pod": "p", "writtenAt": "x", "machines": []}', "writtenAt"),
        (b'{"format": 1, "pod": "", "writtenAt": 1, "machines": []}', "pod: a name"),
        (one_row('["a","b","c",1,null,null]'), "machines[0] is not a list of 7"),
        (one_row('["a","b","c",-1,null,null,null]'), "sightings"),
        (one_row('["a","b","c",1,[1,2],null,null]'), "ttft is not"),
        (one_row('["a","b","c",1,[0,2,3],null,null]'), "ttft is out of range"),
        (one_row('["a","b\\u0000","c",1,null,null,null]'), "unprintable"),
        (one_row('["a","b","c",1,null,null,[2,1.5,1]]'), "score is out of range"),
        (one_row('["a","b","c",1,null,null,[0,0.5,1]]'), "score is not"),
        (
            b'{"format": 1, "pod": "p", "writtenAt": 1, "machines": [], '
            b'"faults": [["p", null, "x", "empty_response", [1]]]}',
            "a machine without its model",
        ),
        (
            b'{"format": 1, "pod": "p", "writtenAt": 1, "machines": [], '
            b'"faults": [["p", "m", null, "empty_response", [-1]]]}',
            "an age is not",
        ),
        (
            b'{"format": 1, "pod": "p", "writtenAt": 1, "machines": [], '
            b'"faults": [["p", "m", null, "empty_response", []]]}',
            "ages is not a list",
        ),
        (
            b'{"format": 1, "pod": "p", "writtenAt": 1, "machines": [], '
            b'"trips": [["p", "m", null, "Sunspots"]]}',
            "the reason is not one rolegate knows",
        ),
        (
            b'{"format": 1, "pod": "p", "writtenAt": 1, "machines": [], '
            b'"trips": [["p", "m", null]]}',
            "trips[0] is not a list of 4",
        ),
        (
            b'{"format": 1, "pod": "p", "writtenAt": 1, "machines": [], '
            b'"rates": [["p", "m", null, "content", 3, 4]]}',
            "the counts are not a window's",
        ),
        (
            b'{"format": 1, "pod": "p", "writtenAt": 1, "machines": [], '
            b'"rates": [["p", "m", null, "weather", 3, 1]]}',
            "the family is not one rolegate knows",
        ),
    ],
)
def test_what_is_not_a_memory_is_refused_whole_naming_what_is_wrong(
    document: bytes, complaint: str
) -> None:
    with pytest.raises(MemoryFormatError, match=complaint.replace("[", r"\[")) as refused:
        decode(document)
    assert "sk-" not in str(refused.value)


def test_non_finite_numbers_and_too_many_machines_are_refused() -> None:
    nan = orjson.dumps({"format": 1, "pod": "p", "writtenAt": 1, "machines": []}).replace(
        b'"writtenAt":1', b'"writtenAt":NaN'
    )
    with pytest.raises(MemoryFormatError):
        decode(nan)
    row = ["a", "b", "c", 1, None, None, None]
    crowded = orjson.dumps(
        {"format": 1, "pod": "p", "writtenAt": 1, "machines": [row] * (MAX_MACHINES + 1)}
    )
    with pytest.raises(MemoryFormatError, match="at most"):
        decode(crowded)
    assert math.isfinite(decode(encode(learned(1))).written_at)
