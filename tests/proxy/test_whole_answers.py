"""What a whole non-streamed answer teaches (SPEC B7; issue 31, finding 3): its pace, in a
belief of its own, never per-token gaps; the gap and pace beliefs' spread is bounded with
their mean kept; the pace travels in the pod's memory as the gaps do. Pure, plus the wire
format's round trip, and a pure-core run of the bench's question: the rate test's false
acts over 1,000 healthy streams after 1,000 non-streamed answers."""

from __future__ import annotations

import math
import random

import orjson
import pytest

from rolegate_proxy.core.arm_end import Answered, ArmEnd, Cause, sighting
from rolegate_proxy.core.beliefs import (
    REFERENCE_SHAPE,
    Completed,
    GapStats,
    Ledger,
    LedgerSettings,
    LogNormal,
    MachineEvidence,
    MachineKey,
    Sighting,
)
from rolegate_proxy.core.choice import Alternative
from rolegate_proxy.core.fleet import PodMemory
from rolegate_proxy.core.watch import Watch
from rolegate_proxy.wire.pod_memory import MemoryFormatError, decode, encode

from ..support import published_sheet
from .test_watch_bounds import role

AGG, MODEL = "agg", "vendor/model"
A, B = MachineKey(AGG, MODEL, "a"), MachineKey(AGG, MODEL, "b")
# Both published at a slow first token and 60 tok/s; the whole answers below come far
# faster than that shape, as a cached or instant upstream's do.
SHEET = (("a", 0.5, 60.0), ("b", 0.6, 60.0))


def ledger() -> Ledger:
    book = Ledger()
    book.load_sheet(published_sheet(AGG, MODEL, SHEET, continues=True))
    return book


def whole_answer(at: float, seconds: float, tokens: int) -> Sighting:
    return Sighting(*A, at, completed=Completed(seconds, tokens))


def test_whole_answers_never_reach_the_gap_or_ttft_belief() -> None:
    book = ledger()
    before = book.belief_of(A, 0.0)
    assert before is not None
    for i in range(1000):
        book.file(whole_answer(i * 0.01, 0.002, 90))  # 90 tokens in 2 ms: "22 us gaps"
    after = book.belief_of(A, 10.0)
    assert after is not None
    assert after.gap is not None
    assert after.gap.weight == 0.0
    assert after.expected_rate == pytest.approx(60.0)
    assert after.expected_ttft == pytest.approx(0.5)
    assert after.sightings == 1000


def test_the_pace_is_read_against_the_published_shape() -> None:
    book = ledger()
    # 31 tokens in 1.5 s against the sheet's 0.5 s + 31 / 60 s = 1.017 s.
    book.file(whole_answer(0.0, 1.5, 31))
    belief = book.belief_of(A, 0.0)
    assert belief is not None
    assert belief.shape == (0.5, 1 / 60.0)
    assert belief.completion is not None
    assert belief.completion.median() == pytest.approx(1.5 / (0.5 + 31 / 60.0))


def test_a_machine_answering_100x_slower_than_published_is_believed_slow() -> None:
    """Issue 31's first finding seen through whole answers: published at 400 tok/s, really
    writing at 4. Three answers of 100 tokens and routing expects it tens of times slower."""
    book = Ledger()
    book.load_sheet(published_sheet(AGG, MODEL, [("a", 0.5, 400.0)]))
    published = book.belief_of(A, 0.0)
    assert published is not None
    for at in (0.0, 30.0, 60.0):
        book.file(whole_answer(at, 0.5 + 100 / 4.0, 100))
    slow = book.belief_of(A, 60.0)
    assert slow is not None
    assert slow.expected_seconds(100) > 10 * published.expected_seconds(100)  # type: ignore[operator]
    assert slow.expected_rate == pytest.approx(400.0)  # and no gap was made up


def test_fast_whole_answers_lower_the_expected_time_not_the_gaps() -> None:
    book = ledger()
    before = book.belief_of(A, 0.0)
    assert before is not None
    for i in range(5):
        book.file(whole_answer(float(i), 0.002, 3))
    after = book.belief_of(A, 5.0)
    assert after is not None
    assert after.expected_seconds(3) < before.expected_seconds(3)  # type: ignore[operator]
    assert after.gap == book.belief_of(B, 5.0).gap  # type: ignore[union-attr]  # as b's


def test_a_machine_known_only_from_whole_answers_gets_stand_in_priors_streams_outweigh() -> None:
    book = Ledger()
    book.file(whole_answer(0.0, 9.0, 100))  # three times the reference shape (3 s)
    known = book.belief_of(A, 0.0)
    assert known is not None
    assert known.shape == REFERENCE_SHAPE
    assert known.expected_gap == pytest.approx(3 * REFERENCE_SHAPE.gap, rel=0.2)
    assert known.gap is not None
    assert known.gap.weight == 0.0
    stream = GapStats.of([0.01] * 200)
    book.file(Sighting(*A, 1.0, ttft=0.2, gaps=stream))
    streamed = book.belief_of(A, 1.0)
    assert streamed is not None
    assert streamed.expected_gap == pytest.approx(0.01, rel=0.15)


def test_a_bounded_belief_keeps_its_mean() -> None:
    wide = LogNormal(math.log(0.001), 10.0, 6.0, 30.0, 10.0)
    assert wide.log_var > 6
    held = wide.bounded(1.0)
    assert held.log_var == pytest.approx(1.0)
    assert held.mean() == pytest.approx(wide.mean())
    assert (held.kappa, held.a, held.weight) == (wide.kappa, wide.a, wide.weight)
    assert LogNormal(0.0, 10.0, 6.0, 0.1).bounded(1.0) == LogNormal(0.0, 10.0, 6.0, 0.1)


def test_the_ledgers_gap_spread_is_bounded_whatever_was_mixed_into_it() -> None:
    """The issue's polluted evidence, as an old state file may still hold it: 22 us gaps
    mixed with 15 ms ones. Its log-variance reached 6.49; it is held at `max_log_var`."""
    book = ledger()
    for i in range(40):
        gap = 22e-6 if i % 2 else 0.015
        book.file(Sighting(*A, float(i), ttft=0.2, gaps=GapStats.of([gap] * 50)))
    belief = book.belief_of(A, 40.0)
    assert belief is not None
    assert belief.gap is not None
    assert belief.gap.log_var == pytest.approx(LedgerSettings().max_log_var)


def test_the_pace_travels_in_the_pods_memory_and_a_restart() -> None:
    book = ledger()
    for i in range(4):
        book.file(whole_answer(float(i), 0.2, 20))
    book.file(Sighting(AGG, MODEL, "only-answers", 4.0, completed=Completed(2.0, 50)))
    evidence = book.evidence(4.0)
    paces = {item.key.machine: item.completion for item in evidence}
    assert paces["a"] is not None
    assert paces["only-answers"] is not None
    memory = decode(encode(PodMemory("pod-1", 1000.0, tuple(evidence))), now=1000.0)
    read = {item.key: item.completion for item in memory.machines}
    for item in evidence:
        assert item.completion is not None
        kept = read[item.key]
        assert kept is not None
        assert (kept.n, kept.s1, kept.s2) == pytest.approx(
            (item.completion.n, item.completion.s1, item.completion.s2), rel=1e-5
        )

    restarted = ledger()
    restarted.restore(memory.machines, 0.0, 4.0)
    peer = ledger()
    peer.hear(((item, 1.0) for item in memory.machines), 4.0)
    for reader in (restarted, peer):
        again = reader.belief_of(A, 4.0)
        original = book.belief_of(A, 4.0)
        assert again is not None
        assert original is not None
        assert again.expected_pace == pytest.approx(original.expected_pace, rel=0.05)
        assert again.expected_rate == pytest.approx(60.0)
        stranger = reader.belief_of(MachineKey(AGG, MODEL, "only-answers"), 4.0)
        assert stranger is not None
        assert stranger.expected_seconds(50) is not None


def test_an_earlier_pods_reader_still_reads_a_memory_with_paces() -> None:
    """A pod of an earlier version refuses a machine row that is not 7 long and ignores
    keys it does not know: the paces ride in a key of their own."""
    evidence = [MachineEvidence(A, None, None, 3, None)]
    plain = orjson.loads(encode(PodMemory("p", 1.0, tuple(evidence))))
    assert "completions" not in plain
    book = ledger()
    book.file(whole_answer(0.0, 0.2, 20))
    book.file(Sighting(*A, 0.0, ttft=0.2, gaps=GapStats.of([0.02] * 10)))
    document = orjson.loads(encode(PodMemory("p", 1.0, tuple(book.evidence(0.0)))))
    assert all(len(row) == 7 for row in document["machines"])
    assert [row[:3] for row in document["completions"]] == [["agg", MODEL, "a"]]
    # And a memory an earlier pod wrote (no paces) reads as no paces.
    del document["completions"]
    (item,) = decode(orjson.dumps(document), now=2.0).machines
    assert item.gap is not None
    assert item.completion is None


def test_an_implausible_pace_refuses_the_memory_naming_the_row() -> None:
    document = {"format": 1, "pod": "p", "writtenAt": 1.0, "machines": [],
                "completions": [["agg", MODEL, "a", [1.0, 40.0, 1600.0]]]}  # fmt: skip
    with pytest.raises(MemoryFormatError, match=r"completions\[0\]: pace"):
        decode(orjson.dumps(document), now=2.0)
    document["completions"] = [["agg", MODEL, "a"]]
    with pytest.raises(MemoryFormatError, match=r"completions\[0\] is not a list of 4"):
        decode(orjson.dumps(document), now=2.0)


# --- the bench's question, in the pure core ---------------------------------------------------


def answered(at: float, seconds: float, tokens: int) -> ArmEnd:
    return ArmEnd(
        provider=AGG, model=MODEL, machine="a", cause=Cause.ANSWERED, started_at=at - seconds,
        ended_at=at, streamed=False, answer=Answered("stop", 20, tokens),
    )  # fmt: skip


def healthy_gaps(rng: random.Random, rate: float, n: int) -> list[float]:
    """Gaps of a stream at `rate`: its own level within ~10 % of it, log-normal jitter
    (sd 0.35) and 5 % of tokens paused 6x, the mean rate kept."""
    level = rate * math.exp(rng.gauss(0.0, 0.1))
    scale = 1.0 + 0.05 * 5.0
    gaps = []
    for _ in range(n):
        gap = math.exp(rng.gauss(0.0, 0.35) - 0.35**2 / 2) / (level * scale)
        gaps.append(gap * 6.0 if rng.random() < 0.05 else gap)
    return gaps


def test_no_false_act_over_1000_healthy_streams_after_1000_whole_answers() -> None:
    """The rate test's false acts over 1,000 healthy streams at 60 tok/s after 1,000 short
    non-streamed answers from the same machine (and one more between every two streams),
    an alternative published no faster: goal 0, measured 0. (Before B7's rule, the
    answers taught ~1 ms gaps and every stream was acted on.)"""
    book = ledger()
    rng = random.Random(31)
    now = 0.0
    for _ in range(1000):
        now += 0.05
        book.file(sighting(answered(now, 2 / 60.0 * rng.uniform(0.5, 1.5), 3), None))  # type: ignore[arg-type]
    false_acts = 0
    for _ in range(1000):
        now += 0.05
        book.file(sighting(answered(now, 2 / 60.0, 3), None))  # type: ignore[arg-type]
        serving, other = book.belief_of(A, now), book.belief_of(B, now)
        assert serving is not None
        assert other is not None
        w = Watch(role(), sent_at=now, serving=A, belief=serving,
                  frontier=[Alternative(B, other, continues_partial=True)])  # fmt: skip
        gaps = healthy_gaps(rng, 60.0, 120)
        at = now + 0.1
        w.observe(at, 1)
        for gap in gaps:
            at += gap
            if w.observe(at, 1) is not None:
                false_acts += 1
                break
        book.file(Sighting(*A, at, ttft=0.1, gaps=GapStats.of(gaps)))
        now = at
    assert false_acts == 0
    believed = book.belief_of(A, now)
    assert believed is not None
    assert believed.expected_rate == pytest.approx(60.0, rel=0.15)
