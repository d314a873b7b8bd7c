"""A pod's memory on the wire: what goes out comes back, its size at 1,000 machines, and
what comes in from outside is refused whole when it is not a memory."""

from __future__ import annotations

import math

import orjson
import pytest

from rolegate_proxy.core.beliefs import Evidence, GapStats, MachineEvidence, MachineKey, Sighting
from rolegate_proxy.core.breaker import FaultMarks
from rolegate_proxy.core.exclusions import BreakerKey
from rolegate_proxy.core.fleet import PodMemory
from rolegate_proxy.core.score import ScoreEvidence
from rolegate_proxy.wire.pod_memory import MAX_MACHINES, MemoryFormatError, decode, encode

from .test_beliefs import AGG, MODEL, ledger, seen


def learned(machines: int) -> PodMemory:
    """A memory of `machines` machines with aggregator-like names and real evidence."""
    items = tuple(
        MachineEvidence(
            MachineKey("openrouter", f"vendor/model-{i % 16:02d}", f"sub-provider-{i:04d}"),
            # Plausible (a first token in about 0.6 s, a gap of about 46 ms), to 7 digits.
            Evidence(12.34567891, -5.6789012, 3.3),
            Evidence(8.0, -24.617283, 76.123456),
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


# Plausibility (SPEC E8): a value no pod could have learned refuses the memory whole -------

NOW = 1_764_763_200.0
# log(5 s): a slow but plausible first token, 40 observations, a little spread.
SLOW = math.log(5.0)
GOOD_TTFT = [40, 40 * SLOW, 40 * (SLOW * SLOW + 0.01)]
GOOD_GAP = [8, 8 * math.log(0.005), 8 * math.log(0.005) ** 2]
LIAR = math.log(0.000175)  # a "first token" in 175 microseconds


def memory_with(
    key: tuple[str, str, str] = ("agg", "m", "m1"),
    *,
    now: float = NOW,
    ahead: float = -10.0,
    **changes: object,
) -> bytes:
    """A plausible memory of one machine (first token in 5 s), written `ahead` seconds
    after `now` (by default ten before), with `changes` made to its fields."""
    row: dict[str, object] = {
        "sightings": 40, "ttft": GOOD_TTFT, "gap": GOOD_GAP, "score": [40, 0.5, 30.0]
    }  # fmt: skip
    document: dict[str, object] = {"format": 1, "pod": "p", "writtenAt": now + ahead}
    for field, value in changes.items():
        (row if field in row else document)[field] = value
    document["machines"] = [[*key, row["sightings"], row["ttft"], row["gap"], row["score"]]]
    return orjson.dumps(document)


def test_a_plausible_memory_is_taken() -> None:
    (machine,) = decode(memory_with(), now=NOW).machines
    assert machine.ttft is not None
    assert math.exp(machine.ttft.mean_log) == pytest.approx(5.0)


IMPLAUSIBLE = [
    ("ttft log-sum overflows a belief", {"ttft": [1, 1e5, 1e10]}, "machines[0]: ttft", "1e5"),
    ("gap log-sum overflows a belief", {"gap": [1, 1e5, 1e10]}, "machines[0]: gap", "1e5"),
    ("a liar's 0.175 ms first token", {"ttft": [40, 40 * LIAR, 40 * LIAR * LIAR]},
     "machines[0]: ttft", "0.000175"),
    ("a first token after a day", {"ttft": [1, math.log(86_400), math.log(86_400) ** 2]},
     "machines[0]: ttft", "86400"),
    ("a gap of a nanosecond", {"gap": [4, 4 * math.log(1e-9), 4 * math.log(1e-9) ** 2]},
     "machines[0]: gap", "1e-09"),
    ("n a billion", {"ttft": [1e9, 1e9 * SLOW, 1e9 * SLOW * SLOW]}, "machines[0]: ttft",
     "1000000000"),
    ("n above the ledger's cap", {"gap": [41, 41 * -5.3, 41 * 28.1]}, "machines[0]: gap", "41"),
    ("s2 below what s1 and n allow", {"ttft": [40, 40 * SLOW, 1.0]}, "machines[0]: ttft",
     "1.0"),
    ("s2 wider than any range", {"ttft": [2, 0.0, 2 * 400.0]}, "machines[0]: ttft", "800"),
    ("a score weight above its count", {"score": [4, 0.5, 30.0]}, "machines[0]: score", "30"),
    ("a score weight below one", {"score": [40, 0.5, 0.01]}, "machines[0]: score", "0.01"),
    ("sightings past any count", {"sightings": 10**15}, "machines[0]: sightings",
     "1000000000000000"),
    ("written an hour in the future", {"ahead": 3600.0}, "writtenAt", "3600"),
    ("a fault mark 40 days old", {"faults": [["agg", "m", "m1", "empty_response", [40 * 86_400]]]},
     "faults[0]", "3456000"),
]  # fmt: skip


IMPLAUSIBLE_CASES = [
    pytest.param(changes, field, value, id=name) for name, changes, field, value in IMPLAUSIBLE
]


@pytest.mark.parametrize(("changes", "field", "value"), IMPLAUSIBLE_CASES)
def test_an_implausible_value_refuses_the_memory_naming_the_field_never_the_value(
    changes: dict[str, object], field: str, value: str
) -> None:
    with pytest.raises(MemoryFormatError) as refused:
        decode(memory_with(**changes), now=NOW)  # type: ignore[arg-type]
    message = str(refused.value)
    assert message.startswith(field), message
    for planted in (value, "100000", "1e+05"):
        assert planted not in message, message


def test_a_memory_written_within_the_clock_skew_is_taken() -> None:
    assert decode(memory_with(ahead=30.0), now=NOW).written_at == NOW + 30


def test_what_an_honest_ledger_learns_at_the_extremes_its_peers_accept() -> None:
    """The bounds a reader applies are the ones the ledger files within: a first token in a
    microsecond, one after a day, a wait of a month, a gap of a nanosecond or of hours are
    each held in range, so the memory that shares them is never refused."""
    book = ledger(("fast", 2.0, 50.0))
    extremes = [
        seen("fast", 1.0, ttft=1e-6),
        seen("fast", 2.0, ttft=86_400.0),
        seen("fast", 3.0, waited=2_592_000.0),
        Sighting(AGG, MODEL, "fast", 4.0, ttft=1e-9, gaps=GapStats().add(1000, 1e-6)),
        Sighting(AGG, MODEL, "fast", 5.0, ttft=0.5, gaps=GapStats().add(2, 20_000.0)),
        Sighting(AGG, MODEL, "bare", 6.0, waited=1e7, gaps=GapStats(3.0, 3 * 50.0, 3 * 2500.0)),
    ]
    for sighting in extremes:
        book.file(sighting)
    memory = PodMemory("p", NOW, tuple(book.evidence(6.0)))
    back = decode(encode(memory), now=NOW)
    assert {item.key.machine for item in back.machines} == {"fast", "bare"}
    for item in book.beliefs(6.0):
        assert item.expected_ttft is not None
        assert 1e-3 <= item.expected_ttft <= 1e9


def test_a_fault_mark_older_than_any_novelty_window_is_not_written() -> None:
    key = BreakerKey("p", "m")
    marks = (FaultMarks(key, "empty_response", (50 * 86_400.0, 10.0)),
             FaultMarks(key, "mangled", (60 * 86_400.0,)))  # fmt: skip
    back = decode(encode(PodMemory("p", NOW, faults=marks)), now=NOW)
    assert back.faults == (FaultMarks(key, "empty_response", (10.0,)),)


def test_requests_in_flight_travel_and_a_hostile_count_refuses_the_memory() -> None:
    key = MachineKey(AGG, MODEL, "deepinfra")
    back = decode(encode(PodMemory("p", 1.0, in_flight=((key, 3),))), now=10.0)
    assert back.in_flight == ((key, 3),)
    # An older memory has none.
    assert decode(encode(PodMemory("p", 1.0)), now=10.0).in_flight == ()
    for count in (0, -1, 10**9, 2.5, True, "3"):
        row = orjson.dumps(
            {"format": 1, "pod": "p", "writtenAt": 1.0, "machines": [],
             "inFlight": [[AGG, MODEL, "deepinfra", count]]}
        )  # fmt: skip
        with pytest.raises(MemoryFormatError, match=r"inFlight\[0\]: count"):
            decode(row, now=10.0)
