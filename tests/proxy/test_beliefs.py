"""The ledger (SPEC B1, B2, B7): log-normal beliefs per machine with a conjugate update and
forgetting, seeded by the sheet, taught by every arm. Pure: the clock is an argument.
Includes seed 003's measured series and its late-first-token case in the pure core."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rolegate_policy.config import (
    ProxyConfig,
)
from rolegate_proxy.core.beliefs import (
    BELIEF_COALESCE_SECONDS,
    BELIEF_REFRESH_SECONDS,
    GapStats,
    Ledger,
    LedgerSettings,
    LogNormal,
    MachineKey,
    Sighting,
    Source,
    truncated_mean,
)

from ..support import published_sheet

AGG, MODEL = "openrouter", "qwen/qwen3-coder"
HOUR = 3600.0


def sheet(*machines: tuple[str, float | None, float | None]) -> ProxyConfig:
    return published_sheet(AGG, MODEL, machines)


def ledger(*machines: tuple[str, float | None, float | None], **knobs: float) -> Ledger:
    book = Ledger(LedgerSettings(**knobs))  # type: ignore[arg-type]
    book.load_sheet(sheet(*machines))
    return book


def stream(rate: float, tokens: int, *, jitter: float = 0.0, seed: int = 0) -> GapStats:
    rng = random.Random(seed)
    return GapStats.of(
        (1.0 / rate) * math.exp(rng.gauss(0.0, jitter) - jitter * jitter / 2) for _ in range(tokens)
    )


def seen(
    machine: str, at: float, *, ttft: float | None = None, rate: float | None = None, **kw: object
) -> Sighting:
    gaps = stream(rate, 200) if rate is not None else GapStats()
    return Sighting(AGG, MODEL, machine, at, ttft=ttft, gaps=gaps, **kw)  # type: ignore[arg-type]


# --- the sheet prior --------------------------------------------------------------------------


def test_a_machine_with_no_prior_and_no_sighting_has_no_belief() -> None:
    book = ledger(("deepinfra", 0.8, 90.0), ("bare", None, None))
    assert book.belief(AGG, MODEL, "bare", 0.0) is None
    assert book.belief(AGG, MODEL, "never-heard-of", 0.0) is None
    assert book.machines(AGG, MODEL) == ("deepinfra",)


def test_the_sheet_prior_is_mean_matched_to_the_published_figures() -> None:
    belief = ledger(("deepinfra", 0.8, 90.0)).belief(AGG, MODEL, "deepinfra", 0.0)
    assert belief is not None
    assert belief.source is Source.SHEET
    assert belief.expected_ttft == pytest.approx(0.8)
    assert belief.expected_rate == pytest.approx(90.0)
    assert belief.expected_seconds(600) == pytest.approx(0.8 + 600 / 90.0)
    assert belief.sightings == 0


def test_a_sheet_with_a_ttft_but_no_rate_gives_half_a_belief() -> None:
    belief = ledger(("halfknown", 2.0, None)).belief(AGG, MODEL, "halfknown", 0.0)
    assert belief is not None
    assert belief.expected_ttft == pytest.approx(2.0)
    assert belief.gap is None
    assert belief.expected_seconds(100) is None


def test_a_published_zero_ttft_or_rate_is_read_sanely() -> None:
    book = ledger(("instant", 0.0, 0.0))
    belief = book.belief(AGG, MODEL, "instant", 0.0)
    assert belief is not None
    assert belief.expected_ttft == pytest.approx(1e-3)
    assert belief.gap is None  # 0 tok/s means "not published", not "infinitely slow"


# --- learning ---------------------------------------------------------------------------------


def test_a_sighting_moves_the_belief_toward_what_was_seen_and_narrows_it() -> None:
    book = ledger(("deepinfra", 1.0, 60.0))
    before = book.belief(AGG, MODEL, "deepinfra", 0.0)
    after = book.note(seen("deepinfra", 10.0, ttft=3.0, rate=20.0))
    assert before is not None
    assert after is not None
    assert before.ttft is not None
    assert after.ttft is not None
    assert before.gap is not None
    assert after.gap is not None
    assert 1.0 < after.ttft.median() < 3.0
    assert 20.0 < after.expected_rate < 60.0  # type: ignore[operator]
    assert after.gap.kappa > before.gap.kappa
    assert after.sightings == 1
    assert after.last_seen == 10.0


def test_a_late_first_token_moves_the_ttft_belief_toward_the_observed_value() -> None:
    # Seed 003 case 2: first tokens after 260-428 s from a machine the sheet says answers
    # in 8. One sighting, on any arm, must move the belief toward lateness.
    book = ledger(("slowstart", 8.0, 50.0))
    before = book.belief(AGG, MODEL, "slowstart", 0.0)
    assert before is not None
    assert before.expected_ttft == pytest.approx(8.0)
    after = book.note(seen("slowstart", 5.0, ttft=260.0, cut=True))
    assert after is not None
    assert after.ttft is not None
    assert 8.0 < after.ttft.median() < 260.0
    assert after.expected_ttft > 8.0 * 2  # type: ignore[operator]
    for late in (370.0, 375.0, 428.0):
        book.note(seen("slowstart", 6.0, ttft=late, cut=True))
    settled = book.belief(AGG, MODEL, "slowstart", 6.0)
    assert settled is not None
    assert settled.ttft is not None
    assert settled.ttft.median() > 50.0
    assert settled.expected_ttft > 100.0  # type: ignore[operator]


def test_a_censored_wait_moves_the_ttft_belief_up_and_never_down() -> None:
    # An arm abandoned (race lost, client gone) after 30 s with no first token: TTFT >= 30.
    book = ledger(("slowstart", 8.0, 50.0))
    before = book.belief(AGG, MODEL, "slowstart", 0.0)
    after = book.note(Sighting(AGG, MODEL, "slowstart", 1.0, waited=30.0, cut=True))
    assert before is not None
    assert after is not None
    assert before.ttft is not None
    assert after.ttft is not None
    assert after.ttft.median() > before.ttft.median()
    assert after.expected_ttft > before.expected_ttft  # type: ignore[operator]
    # A wait shorter than the belief's median says almost nothing, and is not filed.
    short = book.note(Sighting(AGG, MODEL, "slowstart", 2.0, waited=0.5, cut=True))
    assert short is not None
    assert short.ttft is not None
    assert short.ttft.m == pytest.approx(after.ttft.m, abs=1e-3)


def test_a_censored_wait_teaches_a_machine_we_had_no_ttft_for() -> None:
    book = ledger()
    after = book.note(Sighting(AGG, MODEL, "mystery", 1.0, waited=12.0, cut=True))
    assert after is not None
    assert after.source is Source.LEARNED
    assert after.ttft is not None
    assert after.ttft.median() == pytest.approx(12.0, rel=1e-6)  # a lower bound, kept as one


def test_an_arm_that_measured_nothing_teaches_nothing() -> None:
    book = ledger(("deepinfra", 1.0, 60.0))
    book.note(Sighting(AGG, MODEL, "deepinfra", 1.0))
    belief = book.belief(AGG, MODEL, "deepinfra", 1.0)
    assert belief is not None
    assert belief.sightings == 0
    assert book.note(Sighting(AGG, MODEL, "ghost", 1.0)) is None
    assert len(book) == 0


def test_a_sighting_has_an_exact_ttft_or_a_censored_wait_not_both() -> None:
    with pytest.raises(ValueError, match="not both"):
        Sighting(AGG, MODEL, "x", 0.0, ttft=1.0, waited=2.0)


def test_one_stream_counts_for_at_most_stream_weight_observations() -> None:
    book = ledger(("deepinfra", 1.0, 60.0), stream_weight=8.0)
    after = book.note(
        Sighting(AGG, MODEL, "deepinfra", 0.0, ttft=1.0, gaps=stream(60.0, 5000, jitter=0.3))
    )
    assert after is not None
    assert after.gap is not None
    assert after.gap.weight == pytest.approx(8.0)


# --- what routing reads: the cached belief ----------------------------------------------------


def test_routing_sees_a_filed_sighting_once_the_coalescing_window_has_passed() -> None:
    book = ledger(("deepinfra", 0.8, 90.0))
    key = MachineKey(AGG, MODEL, "deepinfra")
    read = book.current(key, 10.0)
    book.file(seen("deepinfra", 10.0, ttft=6.0))
    # Within the window the belief computed at 10.0 is served, sighting or not...
    inside = 10.0 + BELIEF_COALESCE_SECONDS / 2
    assert book.current(key, inside) is read
    # ...after it the sighting counts, and the exact read always counted it.
    after = book.current(key, 10.0 + BELIEF_COALESCE_SECONDS)
    assert after is not None
    assert read is not None
    assert after.expected_ttft is not None
    assert read.expected_ttft is not None
    assert after.expected_ttft > read.expected_ttft
    exact = book.belief(AGG, MODEL, "deepinfra", inside)
    assert exact is not None
    assert exact.expected_ttft == pytest.approx(after.expected_ttft, rel=1e-3)


def test_a_belief_nothing_was_filed_for_is_served_until_it_is_a_second_old() -> None:
    book = ledger(("deepinfra", 0.8, 90.0))
    key = MachineKey(AGG, MODEL, "deepinfra")
    read = book.current(key, 10.0)
    assert book.current(key, 10.0 + BELIEF_REFRESH_SECONDS / 2) is read
    assert book.current(key, 10.0 + BELIEF_REFRESH_SECONDS) is not read


def test_a_machine_nothing_was_believed_about_is_known_from_its_first_sighting() -> None:
    book = ledger(("deepinfra", 0.8, 90.0))
    key = MachineKey(AGG, MODEL, "newcomer")
    assert book.current(key, 10.0) is None
    book.file(seen("newcomer", 10.0, ttft=0.4))
    learned = book.current(key, 10.0 + BELIEF_COALESCE_SECONDS / 10)
    assert learned is not None
    assert learned.source is Source.LEARNED


# --- forgetting: seed 003's measured series ---------------------------------------------------

# 2026-09-11: the machine's rate over the night, then the morning (seconds since midnight).
NIGHT = [(1 * HOUR + 4 * 60 + i * 9.0, 40.0 + (i * 37) % 66) for i in range(45)]  # 40-105 tok/s
MORNING = [
    (9 * HOUR + 33 * 60 + 33, 9.8),
    (9 * HOUR + 37 * 60 + 16, 5.9),
    (9 * HOUR + 52 * 60 + 49, 6.1),
    (9 * HOUR + 59 * 60 + 46, 7.9),
    (10 * HOUR + 6 * 60 + 18, 6.8),
]


def test_an_old_night_does_not_outvote_a_fresh_collapse() -> None:
    book = ledger(("deepinfra", 1.0, 60.0))
    for at, rate in NIGHT:
        book.note(Sighting(AGG, MODEL, "deepinfra", at, ttft=1.0, gaps=stream(rate, 400)))
    night = book.belief(AGG, MODEL, "deepinfra", NIGHT[-1][0])
    assert night is not None
    assert 50.0 < night.expected_rate < 80.0  # type: ignore[operator]
    first_at, first_rate = MORNING[0]
    book.note(Sighting(AGG, MODEL, "deepinfra", first_at, ttft=1.0, gaps=stream(first_rate, 1900)))
    fresh = book.belief(AGG, MODEL, "deepinfra", first_at)
    assert fresh is not None
    assert fresh.expected_rate < 20.0  # type: ignore[operator]
    for at, rate in MORNING[1:]:
        book.note(Sighting(AGG, MODEL, "deepinfra", at, ttft=1.0, gaps=stream(rate, 1500)))
    morning = book.belief(AGG, MODEL, "deepinfra", MORNING[-1][0])
    assert morning is not None
    assert 5.0 < morning.expected_rate < 10.0  # type: ignore[operator]


def test_without_forgetting_the_night_would_outvote_the_collapse() -> None:
    # The reason for the half-life: the same series with (practically) no forgetting and no
    # cap leaves the first slow stream a small correction to 45 fast ones.
    book = ledger(("deepinfra", 1.0, 60.0), half_life_seconds=1e12, max_weight=1e9)
    for at, rate in NIGHT:
        book.note(Sighting(AGG, MODEL, "deepinfra", at, ttft=1.0, gaps=stream(rate, 400)))
    first_at, first_rate = MORNING[0]
    book.note(Sighting(AGG, MODEL, "deepinfra", first_at, ttft=1.0, gaps=stream(first_rate, 1900)))
    belief = book.belief(AGG, MODEL, "deepinfra", first_at)
    assert belief is not None
    assert belief.expected_rate > 50.0  # type: ignore[operator]


def test_after_a_long_silence_the_belief_drifts_back_to_the_sheet() -> None:
    book = ledger(("deepinfra", 1.0, 60.0))
    book.note(Sighting(AGG, MODEL, "deepinfra", 0.0, ttft=9.0, gaps=stream(6.0, 400)))
    soon = book.belief(AGG, MODEL, "deepinfra", 60.0)
    later = book.belief(AGG, MODEL, "deepinfra", 24 * HOUR)
    assert soon is not None
    assert later is not None
    assert soon.expected_rate < 20.0  # type: ignore[operator]
    assert later.expected_rate == pytest.approx(60.0, rel=1e-3)
    assert later.expected_ttft == pytest.approx(1.0, rel=1e-3)


# --- likelihoods and uncertainty --------------------------------------------------------------


def test_the_gap_likelihood_peaks_near_the_believed_gap() -> None:
    belief = ledger(("deepinfra", 1.0, 60.0)).belief(AGG, MODEL, "deepinfra", 0.0)
    assert belief is not None
    at_belief = belief.gap_log_pdf(1 / 60.0)
    assert at_belief is not None
    assert at_belief > belief.gap_log_pdf(1 / 6.0)  # type: ignore[operator]
    assert at_belief > belief.gap_log_pdf(1 / 600.0)  # type: ignore[operator]
    assert belief.ttft_log_pdf(1.0) > belief.ttft_log_pdf(30.0)  # type: ignore[operator]


def test_a_wide_belief_is_less_sure_of_the_usual_and_less_surprised_by_the_unusual() -> None:
    narrow = LogNormal(m=math.log(1 / 60), kappa=40.0, a=21.0, b=20 * 0.05)
    wide = LogNormal(m=math.log(1 / 60), kappa=1.0, a=1.5, b=0.5 * 0.8)
    assert narrow.log_pdf(1 / 60) > wide.log_pdf(1 / 60)
    assert narrow.log_pdf(1 / 6) < wide.log_pdf(1 / 6)
    assert narrow.log_var < wide.log_var
    # ... and its expectation is higher: an unsure belief promises less.
    assert narrow.mean() < wide.mean()


def test_the_predictive_narrows_as_sightings_accumulate() -> None:
    book = ledger(("deepinfra", 1.0, 60.0))
    spreads = []
    for i in range(6):
        book.note(
            Sighting(AGG, MODEL, "deepinfra", float(i), ttft=1.0, gaps=stream(60.0, 50, jitter=0.2))
        )
        belief = book.belief(AGG, MODEL, "deepinfra", float(i))
        assert belief is not None
        assert belief.gap is not None
        spreads.append(belief.gap.log_var)
    assert spreads == sorted(spreads, reverse=True)


def test_the_residual_wait_of_a_late_arm_grows_with_the_wait() -> None:
    ttft = LogNormal(m=math.log(2.0), kappa=3.0, a=2.5, b=1.5 * 0.36)
    assert ttft.residual(0.0) == pytest.approx(ttft.mean())
    residuals = [ttft.residual(w) for w in (5.0, 20.0, 100.0, 1e4, 1e9)]
    assert all(r > 0 for r in residuals)
    assert residuals == sorted(residuals)


def test_truncated_mean_is_above_both_the_floor_and_the_mean() -> None:
    assert truncated_mean(0.0, 1.0, -5.0) == pytest.approx(0.0, abs=1e-5)
    assert truncated_mean(0.0, 1.0, 1.0) > 1.0
    assert truncated_mean(0.0, 1.0, 50.0) == pytest.approx(50.0, rel=1e-3)


# --- unknown machines, reloads, memory ---------------------------------------------------------


def test_a_machine_known_only_from_an_answer_gets_a_learned_belief() -> None:
    # Seed 003 case 3: the aggregator served DekaLLM, which has no row on the sheet.
    book = ledger(("deepinfra", 0.5, 120.0))
    assert book.belief(AGG, MODEL, "dekallm", 0.0) is None
    book.note(Sighting(AGG, MODEL, "dekallm", 1.0, ttft=4.0, gaps=stream(15.0, 300)))
    belief = book.belief(AGG, MODEL, "dekallm", 1.0)
    assert belief is not None
    assert belief.source is Source.LEARNED
    assert belief.expected_ttft == pytest.approx(4.0, rel=0.5)
    assert belief.expected_rate == pytest.approx(15.0, rel=0.3)
    assert book.machines(AGG, MODEL) == ("deepinfra", "dekallm")
    assert MachineKey(AGG, MODEL, "dekallm") in set(book.keys())
    assert [b.key.machine for b in book.beliefs(1.0)] == ["deepinfra", "dekallm"]


def test_a_reload_keeps_what_was_learned() -> None:
    book = ledger(("deepinfra", 1.0, 60.0), ("gone", 1.0, 60.0))
    book.note(Sighting(AGG, MODEL, "deepinfra", 0.0, ttft=1.0, gaps=stream(10.0, 200)))
    book.note(Sighting(AGG, MODEL, "gone", 0.0, ttft=1.0, gaps=stream(30.0, 200)))
    book.load_sheet(sheet(("deepinfra", 1.0, 60.0)))
    kept = book.belief(AGG, MODEL, "deepinfra", 0.0)
    orphan = book.belief(AGG, MODEL, "gone", 0.0)
    assert kept is not None
    assert orphan is not None
    assert kept.expected_rate < 20.0  # type: ignore[operator]
    assert orphan.source is Source.LEARNED
    assert orphan.expected_rate == pytest.approx(30.0, rel=0.2)


def test_a_dropped_sheet_row_with_nothing_learned_is_forgotten() -> None:
    book = ledger(("deepinfra", 1.0, 60.0), ("gone", 1.0, 60.0))
    book.load_sheet(sheet(("deepinfra", 1.0, 60.0)))
    assert book.machines(AGG, MODEL) == ("deepinfra",)
    assert book.belief(AGG, MODEL, "gone", 0.0) is None


def test_memory_is_bounded() -> None:
    book = ledger(("deepinfra", 1.0, 60.0), max_keys=16)
    for i in range(200):
        book.note(Sighting(AGG, MODEL, f"m{i}", float(i), ttft=1.0, gaps=stream(50.0, 10)))
    assert len(book) == 16
    assert len(book.machines(AGG, MODEL)) == 17  # the 16 latest and the sheet's row
    assert book.belief(AGG, MODEL, "m0", 200.0) is None
    assert book.belief(AGG, MODEL, "m199", 200.0) is not None


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="half_life"):
        LedgerSettings(half_life_seconds=0)
    with pytest.raises(ValueError, match="max_weight"):
        LedgerSettings(stream_weight=10, max_weight=5)


def test_gap_stats_are_sufficient_statistics() -> None:
    stats = GapStats().add(1, 0.1).add(3, 0.3)  # four gaps of 0.1 s
    assert stats.count == 4
    assert stats.mean_log == pytest.approx(math.log(0.1))
    assert stats.var_log == pytest.approx(0.0, abs=1e-12)
    assert stats.median_rate == pytest.approx(10.0)
    assert stats.add(0, 5.0) is stats
    assert GapStats().mean_log is None
    assert GapStats().var_log is None


# --- properties -------------------------------------------------------------------------------

rates = st.floats(min_value=0.5, max_value=500.0)
ttfts = st.floats(min_value=0.01, max_value=300.0)


@settings(max_examples=60, deadline=None)
@given(ttft=ttfts, rate=rates, slower=st.floats(min_value=1.01, max_value=50.0), tokens=rates)
def test_expected_time_is_monotone_in_the_gap(
    ttft: float, rate: float, slower: float, tokens: float
) -> None:
    fast, slow = ledger(("m", ttft, rate)), ledger(("m", ttft, rate))
    fast.note(Sighting(AGG, MODEL, "m", 1.0, ttft=ttft, gaps=stream(rate, 50, jitter=0.3)))
    slow.note(Sighting(AGG, MODEL, "m", 1.0, ttft=ttft, gaps=stream(rate / slower, 50, jitter=0.3)))
    a, b = fast.belief(AGG, MODEL, "m", 1.0), slow.belief(AGG, MODEL, "m", 1.0)
    assert a is not None
    assert b is not None
    n = int(tokens)
    assert b.expected_seconds(n) >= a.expected_seconds(n)  # type: ignore[operator]
    assert b.expected_gap > a.expected_gap  # type: ignore[operator]


@settings(max_examples=60, deadline=None)
@given(published=ttfts, observed=ttfts, censored=st.booleans())
def test_a_first_token_moves_the_belief_toward_it_never_past_it(
    published: float, observed: float, censored: bool
) -> None:
    book = ledger(("m", published, 50.0))
    before = book.belief(AGG, MODEL, "m", 0.0)
    sighting = (
        Sighting(AGG, MODEL, "m", 1.0, waited=observed, cut=True)
        if censored
        else Sighting(AGG, MODEL, "m", 1.0, ttft=observed)
    )
    after = book.note(sighting)
    assert before is not None
    assert after is not None
    assert before.ttft is not None
    assert after.ttft is not None
    old, new, y = before.ttft.m, after.ttft.m, math.log(observed)
    if censored:
        assert new >= old - 1e-9  # a wait only ever says "at least this late"
    else:
        assert min(old, y) - 1e-9 <= new <= max(old, y) + 1e-9
