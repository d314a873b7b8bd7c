"""The rate test's variance is bounded (SPEC B5, B7; issue 31, finding 3): however wide the
serving machine's gap belief, a stream writing at its believed rate never tests as behind
an alternative that is no faster. Pure: beliefs built to order, a seeded RNG for jitter."""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from rolegate_policy.config import CompiledRole
from rolegate_policy.enums import Ruling, Visibility
from rolegate_proxy.core.beliefs import LogNormal, MachineBelief, MachineKey, Source
from rolegate_proxy.core.choice import Alternative
from rolegate_proxy.core.watch import ActReason, Watch, WatchSettings

AGG, MODEL = "agg", "vendor/model"
SERVING, OTHER = MachineKey(AGG, MODEL, "a"), MachineKey(AGG, MODEL, "b")


def role(tokens: int = 512) -> CompiledRole:
    return CompiledRole(
        name="agent",
        source="test",
        models=(MODEL,),
        patience_seconds=600.0,
        visibility=Visibility.WATCHED,
        ruling=Ruling.ORDER,
        effective_ruling=Ruling.ORDER,
        ruling_reason="test",
        expected_output_tokens=tokens,
    )


def log_normal(mean: float, log_var: float, kappa: float = 40.0) -> LogNormal:
    """A belief whose predictive has exactly this mean and log-variance."""
    a = 1.0 + kappa / 2.0
    b = log_var * (a - 1.0) * kappa / (kappa + 1.0)
    return LogNormal(math.log(mean) - log_var / 2.0, kappa, a, b, kappa)


def belief(key: MachineKey, ttft: float, rate: float, gap_log_var: float) -> MachineBelief:
    return MachineBelief(
        key, Source.SHEET, log_normal(ttft, 0.1), log_normal(1.0 / rate, gap_log_var)
    )


def watch(serving: MachineBelief, alternative: MachineBelief) -> Watch:
    frontier = [Alternative(OTHER, alternative, continues_partial=True)]
    return Watch(role(), sent_at=0.0, serving=SERVING, belief=serving, frontier=frontier)


def stream(w: Watch, gaps: list[float], per_event: int = 1) -> float:
    """A first token at 0.2 s, then `per_event` tokens per gap; the time of the last."""
    now = 0.2
    assert w.observe(now, 1) is None
    for gap in gaps:
        now += gap * per_event
        act = w.observe(now, per_event)
        assert act is None or act.reason is not ActReason.RATE, act.detail
    return now


def test_the_bound_is_half_log_rho_and_the_floor_still_holds_below_it() -> None:
    assert WatchSettings().max_log_var == math.log(2.0) / 2
    assert WatchSettings(tolerance=3.0).max_log_var == math.log(3.0) / 2
    # A belief narrower than the floor is read at the floor; one wider than the bound at
    # the bound (the issue's 6.49 included).
    for log_var, assumed in ((0.001, 0.2**2), (0.3, 0.3), (6.49, math.log(2.0) / 2)):
        w = watch(belief(SERVING, 0.2, 61.0, log_var), belief(OTHER, 0.2, 61.0, 0.1))
        assert math.isclose(w._log_var, assumed)


def test_the_issues_case_a_61_tok_s_stream_on_a_belief_of_log_variance_6_49() -> None:
    """Measured in the issue: past a log-variance of about 1.39 healthy gaps count as behind;
    at 6.49 a 61 tok/s stream was moved after 11-13 tokens."""
    serving = belief(SERVING, 0.2, 61.0, 6.49)
    w = watch(serving, belief(OTHER, 0.2, 61.0, 0.1))
    stream(w, [1 / 61.0] * 500)
    assert w.keeping_up
    assert w.llr == WatchSettings().lower  # the ratio sat at its floor throughout


@settings(max_examples=300, deadline=None)
@given(
    log_var=st.floats(0.0, 12.0),
    rate=st.floats(2.0, 400.0),
    alternative_share=st.floats(0.05, 1.0),
    alternative_ttft=st.floats(0.0, 5.0),
    per_event=st.integers(1, 6),
)
def test_a_stream_at_its_believed_rate_never_drifts_toward_behind(
    log_var: float, rate: float, alternative_share: float, alternative_ttft: float,
    per_event: int,
) -> None:  # fmt: skip
    """The worst healthy stream: gaps exactly at the believed mean gap, no spread at all
    (any spread puts the median, and so the typical log gap, below the mean). With an
    alternative no faster, every step is toward keeping (`WatchSettings.max_log_var`)."""
    serving = belief(SERVING, 0.3, rate, log_var)
    alternative = belief(OTHER, alternative_ttft + 1e-3, rate * alternative_share, 0.1)
    w = watch(serving, alternative)
    believed_gap = serving.expected_gap
    assert believed_gap is not None
    stream(w, [believed_gap] * 200, per_event)
    assert w.keeping_up
    assert w.llr == WatchSettings().lower


def test_a_stream_within_rho_to_the_three_quarters_of_its_belief_keeps_up() -> None:
    """The bound leaves a margin: a stream up to 1.68x slower than its believed mean gap (at
    rho = 2) still drifts toward keeping up, at the widest variance the test assumes."""
    serving = belief(SERVING, 0.3, 60.0, 5.0)
    w = watch(serving, belief(OTHER, 0.3, 60.0, 0.1))
    stream(w, [1.6 / 60.0] * 400)
    assert w.keeping_up
    assert w.llr == WatchSettings().lower


def test_a_collapse_is_still_caught_on_a_wide_belief() -> None:
    """Bounding the variance makes each gap stronger evidence, never weaker: a machine
    believed (widely) at 60 tok/s that writes at 6 is moved within its first gaps."""
    serving = belief(SERVING, 0.3, 60.0, 6.49)
    w = watch(serving, belief(OTHER, 0.3, 60.0, 0.1))
    now = 0.2
    w.observe(now, 1)
    acted = None
    for count in range(1, 40):
        now += 1 / 6.0
        act = w.observe(now, 1)
        if act is not None:
            acted = count
            break
    assert acted == WatchSettings().min_gaps


def moved_levels(level_sd: float, streams: int = 1000) -> list[float]:
    """Jittered streams on the issue's polluted belief (61 tok/s, log-variance 6.49), an
    alternative as fast: each stream's own rate drawn about 61 with `level_sd` on the log
    scale, its tokens log-normal about it (sd 0.35). The rates of those moved."""
    serving = belief(SERVING, 0.3, 61.0, 6.49)
    alternative = belief(OTHER, 0.3, 61.0, 0.1)
    rng = random.Random(31)
    moved = []
    for _ in range(streams):
        w = watch(serving, alternative)
        level = 61.0 * math.exp(rng.gauss(0.0, level_sd))
        gaps = [math.exp(rng.gauss(0.0, 0.35) - 0.35**2 / 2) / level for _ in range(120)]
        now = 0.2
        w.observe(now, 1)
        for gap in gaps:
            now += gap
            if w.observe(now, 1) is not None:
                moved.append(level)
                break
    return moved


def test_healthy_jittered_streams_on_a_polluted_belief_are_not_moved() -> None:
    """None of 1,000 healthy streams is moved (each within 10 % of the believed rate, as a
    sd of 0.1 keeps them); before the bound, every one was."""
    assert moved_levels(0.1) == []


def test_only_streams_beyond_the_margin_are_moved() -> None:
    """With the spread of seed 003's night (sd 0.2: 40-105 tok/s about 62), the streams
    moved are those more than rho^(3/4) = 1.68x slower than believed. (Measured: 2 of 1,000,
    at 34 and 30 tok/s; a narrow belief moves the one at 30 too.)"""
    moved = moved_levels(0.2)
    assert len(moved) <= 1000 * WatchSettings().false_move
    assert all(level < 61.0 / 2**0.75 for level in moved)
