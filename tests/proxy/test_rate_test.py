"""The watch on one arm (SPEC B5-B7): the mid-stream rate test, the late first token, the one
predicate, and what every arm teaches. Pure: the clock is an argument and synthetic gap
streams come from a seeded `random.Random`. Includes seed 003's three cases."""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rolegate_policy.config import (
    CompiledRole,
)
from rolegate_policy.enums import (
    Ruling,
    Visibility,
)
from rolegate_proxy.core.arm_end import ArmEnd, Cause, sighting
from rolegate_proxy.core.beliefs import GapStats, Ledger, MachineKey, Sighting
from rolegate_proxy.core.choice import Alternative
from rolegate_proxy.core.watch import (
    Act,
    ActReason,
    Clock,
    Watch,
    WatchSettings,
)

from ..support import published_sheet

AGG, MODEL = "openrouter", "qwen/qwen3-coder"
TOKENS = 600


def role(patience: float = 300.0, tokens: int = TOKENS) -> CompiledRole:
    return CompiledRole(
        name="agent",
        source="test",
        models=(MODEL,),
        patience_seconds=patience,
        visibility=Visibility.WATCHED,
        ruling=Ruling.ORDER,
        effective_ruling=Ruling.ORDER,
        ruling_reason="test",
        expected_output_tokens=tokens,
    )


def ledger(*machines: tuple[str, float, float], continues: bool = True) -> Ledger:
    config = published_sheet(AGG, MODEL, machines, continues=continues)
    book = Ledger()
    book.load_sheet(config)
    return book


def key(machine: str) -> MachineKey:
    return MachineKey(AGG, MODEL, machine)


def watch(
    book: Ledger,
    serving: str,
    others: Iterable[str],
    *,
    now: float = 0.0,
    patience: float = 300.0,
    continues: bool = True,
    streams_to_client: bool = True,
    watch_settings: WatchSettings | None = None,
) -> Watch:
    frontier = []
    for name in others:
        belief = book.belief(AGG, MODEL, name, now)
        assert belief is not None
        frontier.append(Alternative(key(name), belief, continues))
    return Watch(
        role(patience),
        sent_at=now,
        serving=key(serving),
        belief=book.belief(AGG, MODEL, serving, now),
        frontier=frontier,
        streams_to_client=streams_to_client,
        settings=watch_settings,
    )


def gaps(
    rng: random.Random,
    rate: float,
    n: int,
    *,
    token_sd: float = 0.35,
    stream_sd: float = 0.0,
    pauses: float = 0.05,
    pause: float = 6.0,
) -> list[float]:
    """Realistic per-token gaps at a mean `rate`: log-normal jitter, a stream-level rate
    drawn around `rate`, and occasional pauses (a token `pause` times late)."""
    level = rate * math.exp(rng.gauss(0.0, stream_sd))
    scale = 1.0 + pauses * (pause - 1.0)  # keeps the mean rate at `level`
    out = []
    for _ in range(n):
        gap = math.exp(rng.gauss(0.0, token_sd) - token_sd**2 / 2) / (level * scale)
        out.append(gap * pause if rng.random() < pauses else gap)
    return out


def play(w: Watch, ttft: float, stream: Sequence[float]) -> tuple[Act | None, int, float]:
    """Feed a first token after `ttft`, then one token per gap; stop at the first rate act.
    Returns the act, the gaps it took and the seconds of tokens it took."""
    now = w.sent_at + ttft
    w.observe(now, 1)
    first = now
    for count, gap in enumerate(stream, start=1):
        now += gap
        act = w.observe(now, 1)
        if act is not None and act.reason is ActReason.RATE:
            return act, count, now - first
    return None, len(stream), now - first


# Seed 003: the machine believed at ~60 tok/s, and two on the same model at 90-120.
SEED = (("deepinfra", 1.0, 60.0), ("fireworks", 0.8, 90.0), ("groq", 0.6, 120.0))


# --- seed 003 case 1: the 219-second stream ---------------------------------------------------


def test_seed_case_1_a_machine_believed_at_60_writing_at_7_is_moved_within_a_second() -> None:
    book = ledger(*SEED)
    rng = random.Random(11)
    for rate in (6.0, 6.8, 7.9):
        w = watch(book, "deepinfra", ["fireworks", "groq"])
        act, count, seconds = play(w, 1.0, gaps(rng, rate, 1500))
        assert act is not None
        assert act.reason is ActReason.RATE
        assert act.alternative is not None
        assert act.alternative.key == key("groq")  # a second, distinct machine
        assert act.movable
        assert count == WatchSettings().min_gaps  # 8 gaps: the minimum the test allows
        assert seconds < 2.5
        assert not w.keeping_up
        reading = w.reading(act.at)
        assert (reading.clock, reading.reason) == (Clock.RATE, ActReason.RATE)
        assert "rate: log LR" in act.detail


def test_seed_case_1_the_move_saves_most_of_the_219_seconds() -> None:
    # A 600-token answer at 6.8 tok/s takes ~89 s on the slow machine alone. Moved after
    # the test's 8 gaps to the 120 tok/s machine it takes ~8 s, within 2x of that
    # machine's own ~5.6 s.
    book = ledger(*SEED)
    w = watch(book, "deepinfra", ["fireworks", "groq"])
    act, count, seconds = play(w, 1.0, gaps(random.Random(3), 6.8, TOKENS))
    assert act is not None
    assert act.alternative is not None
    alone = 1.0 + TOKENS / 6.8
    fast_alone = act.alternative.expected_seconds(TOKENS)
    moved = 1.0 + seconds + act.alternative.expected_seconds(TOKENS - count - 1)
    assert alone > 85.0
    assert moved < 2 * fast_alone
    assert moved < alone / 8


def test_seed_case_1_even_a_machine_believed_slow_is_moved_when_the_frontier_is_fast() -> None:
    # The seed's own bug: after the morning's slow streams the machine is believed at
    # ~7 tok/s, so it is never surprising to itself. Against the frontier it still is.
    book = ledger(*SEED)
    for at, rate in ((0.0, 9.8), (220.0, 5.9), (1130.0, 6.1), (1550.0, 7.9), (1945.0, 6.8)):
        book.note(
            Sighting(AGG, MODEL, "deepinfra", at, ttft=1.0, gaps=GapStats.of([1 / rate] * 500))
        )
    believed = book.belief(AGG, MODEL, "deepinfra", 1945.0)
    assert believed is not None
    assert believed.expected_rate < 10.0  # type: ignore[operator]
    w = watch(book, "deepinfra", ["fireworks", "groq"], now=1945.0)
    act, count, _ = play(w, 1.0, gaps(random.Random(5), 6.8, 600))
    assert act is not None
    assert act.reason is ActReason.RATE
    assert count <= 10


def test_issue_case_1_two_tok_s_against_two_at_90() -> None:
    book = ledger(("slow", 1.0, 90.0), ("fast1", 0.5, 90.0), ("fast2", 0.5, 90.0))
    w = watch(book, "slow", ["fast1", "fast2"])
    act, count, seconds = play(w, 1.0, gaps(random.Random(1), 2.0, 600))
    assert act is not None
    assert act.reason is ActReason.RATE
    assert act.alternative is not None
    assert act.alternative.key.machine in {"fast1", "fast2"}
    assert count == 8
    assert seconds < 8.0


# --- case 1b: collapse mid-stream, and no false act --------------------------------------------


def test_a_fast_machine_that_collapses_mid_stream_is_moved_soon_after() -> None:
    book = ledger(("fireworks", 0.8, 90.0), ("groq", 0.6, 120.0), ("together", 0.7, 100.0))
    rng = random.Random(8)
    w = watch(book, "fireworks", ["groq", "together"])
    healthy = gaps(rng, 90.0, 250)
    act, count, _ = play(w, 0.8, [*healthy, *gaps(rng, 5.0, 300)])
    assert act is not None
    assert act.reason is ActReason.RATE
    # The healthy stretch banked no credit: the collapse is caught within a few tokens.
    assert 250 < count <= 250 + 8


def test_slow_as_believed_with_no_faster_alternative_is_never_moved() -> None:
    book = ledger(("slowpoke", 2.0, 6.0), ("alsoslow", 2.0, 5.0))
    for seed in range(50):
        w = watch(book, "slowpoke", ["alsoslow"])
        act, _, _ = play(w, 2.0, gaps(random.Random(seed), 6.0, 300))
        assert act is None
        assert w.keeping_up


def test_with_no_alternative_at_all_nothing_is_tested() -> None:
    book = ledger(("only", 1.0, 60.0))
    w = watch(book, "only", [])
    act, _, _ = play(w, 1.0, gaps(random.Random(0), 2.0, 100))
    assert act is None
    assert w.llr == 0.0


def test_false_move_rate_over_1000_healthy_streams_with_realistic_jitter() -> None:
    # Machines writing as believed: per-token log-normal jitter (sd 0.35), 5% of tokens
    # paused 6x, the stream's own rate drawn with sd 0.2 on the log scale (the night's
    # 40-105 tok/s spread around 62). Goal: under 1%; measured: 0 in 1,000.
    book = ledger(*SEED)
    moved = 0
    for seed in range(1000):
        w = watch(book, "deepinfra", ["fireworks", "groq"])
        act, _, _ = play(w, 1.0, gaps(random.Random(seed), 60.0, 300, stream_sd=0.2))
        moved += act is not None
    assert moved / 1000 <= 0.01
    assert moved == 0


def test_a_wide_belief_with_noisy_gaps_is_moved_at_most_alpha_of_the_time() -> None:
    # Very noisy gaps (sd 0.9 per token, 10% of tokens paused 6x, stream rate sd 0.2) from
    # a machine whose belief learned that noise from a few earlier streams. Measured: 0 of
    # 1,000 moved (4 before the test's variance was bounded by log(rho) / 2: a wider one
    # sets the hypotheses' medians below the healthy gaps, so noise read as "behind").
    book = ledger(*SEED)
    rng = random.Random(99)
    for at in range(4):
        noisy = gaps(rng, 60.0, 300, token_sd=0.9, pauses=0.1)
        book.note(Sighting(AGG, MODEL, "deepinfra", float(at), ttft=1.0, gaps=GapStats.of(noisy)))
    belief = book.belief(AGG, MODEL, "deepinfra", 4.0)
    assert belief is not None
    assert belief.gap is not None
    assert belief.gap.log_sd > 0.8
    moved = 0
    for seed in range(1000):
        w = watch(book, "deepinfra", ["fireworks", "groq"], now=4.0)
        noisy = gaps(random.Random(seed), 60.0, 300, token_sd=0.9, pauses=0.1, stream_sd=0.2)
        act, _, _ = play(w, 1.0, noisy)
        moved += act is not None
    assert moved <= 1000 * WatchSettings().false_move
    assert moved == 0


def test_a_wide_belief_is_not_decisive_and_a_narrow_one_is_not_ignored() -> None:
    narrow, wide = ledger(*SEED), ledger(*SEED)
    for at in range(5):
        steady = GapStats.of([1 / 60.0] * 300)
        narrow.note(Sighting(AGG, MODEL, "deepinfra", float(at), ttft=1.0, gaps=steady))
        scattered = GapStats.of(gaps(random.Random(at), 60.0, 300, token_sd=0.9))
        wide.note(Sighting(AGG, MODEL, "deepinfra", float(at), ttft=1.0, gaps=scattered))
    w_narrow = watch(narrow, "deepinfra", ["fireworks", "groq"], now=5.0)
    w_wide = watch(wide, "deepinfra", ["fireworks", "groq"], now=5.0)
    for w in (w_narrow, w_wide):
        # Somewhat slow: 29 tok/s against 60 believed. (The wide belief's variance is held
        # at the test's bound, log(rho) / 2; at 27 tok/s even that is at the clip.)
        play(w, 1.0, [1 / 29.0] * 3)
    assert w_narrow.llr > w_wide.llr > 0.0
    assert w_narrow.llr == pytest.approx(3 * WatchSettings().clip)  # each gap at the clip


def test_one_slow_token_never_decides() -> None:
    book = ledger(*SEED)
    w = watch(book, "deepinfra", ["fireworks", "groq"])
    play(w, 1.0, [1 / 60.0] * 20 + [5.0])  # a five-second pause after 20 healthy tokens
    assert w.keeping_up
    assert w.llr <= WatchSettings().lower + WatchSettings().clip


def test_after_content_only_an_alternative_that_continues_can_take_over() -> None:
    book = ledger(*SEED)
    cannot = watch(book, "deepinfra", ["fireworks", "groq"], continues=False)
    act, _, _ = play(cannot, 1.0, [1 / 5.0] * 20)
    assert act is not None
    assert not act.movable  # B6: keep the slow stream, let the ledger learn
    assert "cannot take over: keep" in act.detail
    buffered = watch(
        book, "deepinfra", ["fireworks", "groq"], continues=False, streams_to_client=False
    )
    act, _, _ = play(buffered, 1.0, [1 / 5.0] * 20)
    assert act is not None
    assert act.movable  # nothing reached the client: a race is still possible


def test_the_best_continuing_alternative_is_preferred_once_content_flowed() -> None:
    book = ledger(*SEED)
    fireworks = book.belief(AGG, MODEL, "fireworks", 0.0)
    groq = book.belief(AGG, MODEL, "groq", 0.0)
    assert fireworks is not None
    assert groq is not None
    w = Watch(
        role(),
        sent_at=0.0,
        serving=key("deepinfra"),
        belief=book.belief(AGG, MODEL, "deepinfra", 0.0),
        frontier=[
            Alternative(key("groq"), groq, False),
            Alternative(key("fireworks"), fireworks, True),
        ],
    )
    act, _, _ = play(w, 1.0, [1 / 5.0] * 20)
    assert act is not None
    assert act.alternative is not None
    assert act.alternative.key == key("fireworks")
    assert act.movable


# --- the late first token (ttft) --------------------------------------------------------------


def tick_until(w: Watch, end: float, step: float = 0.25) -> Act | None:
    now = w.sent_at
    while now < end:
        now += step
        act = w.observe(now)
        if act is not None:
            return act
    return None


def test_a_late_first_token_starts_a_race_with_the_alternative() -> None:
    book = ledger(*SEED)
    w = watch(book, "deepinfra", ["fireworks", "groq"])
    assert w.observe(1.0) is None
    reading = w.reading(1.0)
    assert (reading.clock, reading.reason, reading.keeping_up) == (
        Clock.FIRST_TOKEN,
        ActReason.TTFT,
        True,
    )
    act = tick_until(w, 60.0)
    assert act is not None
    assert act.reason is ActReason.TTFT
    assert act.alternative is not None
    assert act.alternative.key == key("groq")
    assert act.movable  # nothing delivered yet: a race
    ttft = book.belief(AGG, MODEL, "deepinfra", 0.0)
    assert ttft is not None
    assert ttft.ttft is not None
    assert act.waited == pytest.approx(ttft.ttft.upper(2.0), abs=0.25)
    assert 2.0 < act.waited < 8.0
    assert tick_until(w, 120.0) is None  # one act per reason


def test_a_narrow_belief_does_not_promise_an_overdue_first_token_any_moment() -> None:
    """Twenty first tokens at 0.2 s make a narrow belief; on it, a token not come after a
    second is expected within milliseconds, so waiting always looked better than an
    alternative 0.8 s away (the fault sequence's silent primary raced only at 2.7 s). Past
    the late point an arm is expected to take at least as long again as it is overdue."""
    book = ledger(("steady", 0.2, 100.0), ("other", 0.2, 100.0))
    for i in range(20):
        book.note(Sighting(AGG, MODEL, "steady", float(i), ttft=0.2))
    w = watch(book, "steady", ["other"], now=20.0, patience=300.0)
    act = tick_until(w, 30.0, step=0.05)
    assert act is not None
    assert act.reason is ActReason.TTFT
    assert act.waited < 1.0


def test_a_late_first_token_with_nothing_better_waits_for_the_patience() -> None:
    book = ledger(*SEED)
    alone = watch(book, "deepinfra", [], patience=30.0)
    assert alone.next_check(0.0) == 30.0
    act = tick_until(alone, 60.0)
    assert act is not None
    assert act.reason is ActReason.TTFT
    assert act.alternative is None
    assert act.at == pytest.approx(30.0)
    assert "nothing better to move to" in act.detail


def test_no_race_when_the_alternative_is_worse_than_waiting() -> None:
    book = ledger(("quick", 0.3, 100.0), ("sluggish", 20.0, 10.0))
    w = watch(book, "quick", ["sluggish"], patience=300.0)
    act = tick_until(w, 10.0)
    assert act is None
    assert w.reading(10.0).alternative is None


def test_a_first_token_past_what_patience_allows_acts_even_if_not_late_by_its_belief() -> None:
    # A machine with a long published TTFT in a role whose patience leaves no room for it.
    book = ledger(("laggard", 20.0, 100.0), ("quick", 0.3, 100.0))
    w = watch(book, "laggard", ["quick"], patience=15.0)
    act = tick_until(w, 30.0)
    assert act is not None
    assert act.reason is ActReason.TTFT
    assert act.waited < 15.0


def test_an_unknown_serving_machine_is_late_at_twice_the_alternatives_ttft() -> None:
    book = ledger(*SEED)
    groq = book.belief(AGG, MODEL, "groq", 0.0)
    assert groq is not None
    w = Watch(role(), sent_at=0.0, frontier=[Alternative(key("groq"), groq, True)])
    act = tick_until(w, 10.0, step=0.05)
    assert act is not None
    assert act.reason is ActReason.TTFT
    assert act.waited == pytest.approx(2 * 0.6, abs=0.1)


# --- the one predicate, the deadline, next_check ----------------------------------------------


def test_a_stream_keeping_up_runs_on_the_patience_clock_and_acts_at_the_deadline() -> None:
    book = ledger(*SEED)
    w = watch(book, "deepinfra", ["fireworks", "groq"], patience=5.0)
    w.observe(1.0, 1)
    reading = w.reading(1.0)
    assert (reading.clock, reading.reason, reading.ceiling) == (
        Clock.PATIENCE,
        ActReason.DEADLINE,
        5.0,
    )
    # The first look comes before the deadline: the moment a silence would decide.
    silent_until = w.next_check(1.0)
    assert silent_until is not None
    assert 1.0 < silent_until < 5.0
    now, act = 1.0, None
    while act is None and now < 10.0:
        now += 1 / 60.0
        act = w.observe(now, 1)
    assert act is not None
    assert act.reason is ActReason.DEADLINE
    assert act.at == pytest.approx(5.0, abs=0.02)
    assert w.next_check(now) is None


# --- silence is evidence ------------------------------------------------------------------


def _producing(w: Watch, tokens: int, rate: float, start: float = 1.0) -> float:
    """`tokens` tokens at `rate`, from `start`; the time of the last."""
    now = start
    for _ in range(tokens):
        assert w.observe(now, 1) is None
        now += 1 / rate
    return now - 1 / rate


def test_a_machine_believed_at_60_that_goes_silent_is_acted_on_within_3_seconds() -> None:
    book = ledger(*SEED)
    w = watch(book, "deepinfra", ["fireworks", "groq"])
    last = _producing(w, 20, 60.0)
    due = w.next_check(last)
    assert due is not None
    assert due - last < 3.0
    # Nothing before the check it asked for...
    assert w.observe((last + due) / 2) is None
    # ...and at it, a rate act that can move the request.
    act = w.observe(due)
    assert act is not None
    assert act.reason is ActReason.RATE
    assert act.movable
    assert "silent for" in act.detail
    assert act.at - last < 3.0
    # The ratio it names is the one that decided: the silence's share counted in.
    ratio, bound = map(float, re.findall(r"log LR (\S+) >= (\S+)", act.detail)[0])
    assert ratio >= bound


def test_a_silence_shorter_than_decisive_is_not_banked() -> None:
    book = ledger(*SEED)
    w = watch(book, "deepinfra", ["fireworks", "groq"])
    last = _producing(w, 20, 60.0)
    due = w.next_check(last)
    assert due is not None
    before = w.llr
    assert w.observe(last + (due - last) * 0.9) is None
    assert w.llr == before
    # The stream resumes at its believed rate: it keeps being served.
    assert _producing(w, 20, 60.0, start=last + (due - last) * 0.95) > due
    assert w.keeping_up


def test_with_nothing_to_move_to_a_silence_decides_nothing() -> None:
    book = ledger(*SEED)
    w = watch(book, "deepinfra", [])
    last = _producing(w, 20, 60.0)
    assert w.observe(last + 30.0) is None
    assert w.keeping_up


def test_the_deadline_act_names_an_alternative_only_if_it_would_finish_sooner() -> None:
    book = ledger(*SEED)
    w = watch(book, "groq", ["fireworks", "deepinfra"], patience=2.0)
    # Keeping up at its believed 120 tok/s until the patience is spent.
    _producing(w, 167, 120.0, start=0.6)
    act = w.observe(2.0)
    assert act is not None
    assert act.reason is ActReason.DEADLINE
    assert act.alternative is None


@settings(max_examples=60, deadline=None)
@given(
    events=st.lists(st.tuples(st.floats(0.001, 2.0), st.integers(0, 3)), min_size=1, max_size=80),
    patience=st.floats(1.0, 60.0),
)
def test_one_predicate_the_clock_and_the_reason_always_agree(
    events: list[tuple[float, int]], patience: float
) -> None:
    book = ledger(*SEED)
    w = watch(book, "deepinfra", ["fireworks", "groq"], patience=patience)
    pairs = {
        Clock.FIRST_TOKEN: ActReason.TTFT,
        Clock.RATE: ActReason.RATE,
        Clock.PATIENCE: ActReason.DEADLINE,
    }
    now = 0.0
    for step, tokens in events:
        now += step
        before = w.reading(now)
        act = w.observe(now, tokens)
        reading = w.reading(now)
        assert pairs[reading.clock] is reading.reason
        assert reading.keeping_up is not (reading.clock is Clock.RATE) or w.first_at is None
        if act is not None:
            # The act carries the reason of the clock its ceiling ran on.
            assert act.reason in {before.reason, reading.reason}
            assert act.reason is reading.reason or tokens > 0
    reasons = [a.reason for a in w.acts]
    assert len(reasons) == len(set(reasons))


def test_identify_names_the_machine_when_the_aggregator_does() -> None:
    book = ledger(*SEED)
    groq = book.belief(AGG, MODEL, "groq", 0.0)
    assert groq is not None
    w = Watch(role(), sent_at=0.0, frontier=[Alternative(key("groq"), groq, True)])
    assert sighting(_end(w, 5.0, Cause.ANSWERED), None) is None  # no machine named yet
    w.observe(1.0, 1)
    w.identify(key("deepinfra"), book.belief(AGG, MODEL, "deepinfra", 1.0))
    act, _, _ = play_more(w, 1.0, [1 / 6.0] * 12)
    assert act is not None
    assert act.reason is ActReason.RATE


def play_more(w: Watch, start: float, stream: Sequence[float]) -> tuple[Act | None, int, float]:
    now = start
    for count, gap in enumerate(stream, start=1):
        now += gap
        act = w.observe(now, 1)
        if act is not None:
            return act, count, now - start
    return None, len(stream), now - start


def test_a_burst_of_tokens_in_one_event_is_one_observation_of_their_mean_gap() -> None:
    book = ledger(*SEED)
    w = watch(book, "deepinfra", ["fireworks", "groq"])
    w.observe(1.0, 1)
    now = 1.0
    for _ in range(40):  # five tokens every 1/12 s: 60 tok/s, as believed
        now += 5 / 60.0
        assert w.observe(now, 5) is None
    assert w.keeping_up
    assert w.tokens == 201
    assert w.gaps.count == 200
    assert w.gaps.median_rate == pytest.approx(60.0)


def test_settings_and_thresholds() -> None:
    s = WatchSettings()
    assert s.upper == pytest.approx(math.log(0.95 / 0.01))
    assert s.lower == pytest.approx(math.log(0.05 / 0.99))
    assert s.upper == pytest.approx(4.55, abs=0.01)
    assert s.lower == pytest.approx(-2.99, abs=0.01)
    with pytest.raises(ValueError, match="error rates"):
        WatchSettings(false_move=0.0)
    with pytest.raises(ValueError, match="tolerance"):
        WatchSettings(tolerance=1.0)
    with pytest.raises(ValueError, match="below 1"):
        WatchSettings(false_move=0.6, missed_move=0.5)


# --- seed 003 case 2: every arm teaches -------------------------------------------------------


def test_seed_case_2_a_late_first_token_then_a_cut_teaches_the_serving_arm() -> None:
    # One arm, no race: the first token comes at 40 s from a machine the sheet says answers
    # in 1, then the stream is cut. The cut arm's sighting moves the TTFT belief.
    book = ledger(*SEED)
    before = book.belief(AGG, MODEL, "deepinfra", 0.0)
    w = watch(book, "deepinfra", [])
    w.observe(40.0, 1)
    w.observe(40.1, 1)
    w.observe(40.2, 1)
    taught = sighting(_end(w, 41.0, Cause.CUT), before)
    assert taught is not None
    assert taught.ttft == pytest.approx(40.0)
    assert taught.cut
    assert taught.gaps.count == 2
    after = book.note(taught)
    assert before is not None
    assert after is not None
    assert after.expected_ttft > 5 * before.expected_ttft  # type: ignore[operator]


def test_seed_case_2_the_losing_arm_of_a_race_teaches_too() -> None:
    book = ledger(*SEED)
    slow_arm = watch(book, "deepinfra", ["groq"])
    fast_arm = watch(book, "groq", ["deepinfra"], now=4.0)
    fast_arm.observe(4.5, 1)  # the race's winner produced content first
    for arm, cause in ((slow_arm, Cause.RACE_LOST), (fast_arm, Cause.ANSWERED)):
        taught = sighting(_end(arm, 9.0, cause), None)
        assert taught is not None
        book.note(taught)
    loser = book.belief(AGG, MODEL, "deepinfra", 9.0)
    assert loser is not None
    assert loser.expected_ttft > 1.5  # type: ignore[operator]  # waited 9 s: TTFT >= 9


def test_seed_case_2_an_arm_the_client_abandoned_teaches_its_wait() -> None:
    book = ledger(*SEED)
    w = watch(book, "deepinfra", [])
    taught = sighting(_end(w, 25.0, Cause.CLIENT_LEFT), None)
    assert taught is not None
    assert taught.waited == 25.0
    assert taught.ttft is None
    book.note(taught)
    belief = book.belief(AGG, MODEL, "deepinfra", 25.0)
    assert belief is not None
    assert belief.expected_ttft > 2.0  # type: ignore[operator]


def test_an_arm_that_errored_before_its_first_token_says_nothing_about_ttft() -> None:
    book = ledger(*SEED)
    w = watch(book, "deepinfra", [])
    assert sighting(_end(w, 0.2, Cause.HTTP_ERROR), None) is None


def _end(w: Watch, at: float, cause: Cause) -> ArmEnd:
    """The arm a watch measured, ended at `at` for `cause`."""
    machine = None if w.serving is None else w.serving.machine
    return ArmEnd(
        AGG, MODEL, machine, cause, started_at=w.sent_at, ended_at=at, streamed=True,
        first_at=w.first_at, gaps=w.gaps,
    )  # fmt: skip
