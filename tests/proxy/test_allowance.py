"""A grant's limits as buckets, on a clock the tests move: what is admitted, when to retry,
and that the allowance is back in full after its window (the proxy end to end:
test_grants.py)."""

from __future__ import annotations

import pytest

from rolegate_policy.config import CompiledGrant
from rolegate_proxy.core.allowance import Allowances, LimitKind

CI = "ci/batch"


def grant(**limits: float) -> CompiledGrant:
    return CompiledGrant(name=CI, source="t", roles=("batch",), **limits)


def allowances(now: float = 0.0, **limits: float) -> Allowances:
    table = Allowances()
    table.configure([grant(**limits)], now)
    return table


def test_requests_a_minute_admit_a_burst_then_one_every_sixtieth_and_reset_after_the_window() -> (
    None
):
    table = allowances(requests_per_minute=3)
    assert [table.admit(CI, 0.0) for _ in range(3)] == [None, None, None]
    refused = table.admit(CI, 0.0)
    assert refused is not None
    assert (refused.kind, refused.figure) == (LimitKind.REQUESTS, 3)
    assert refused.retry_after == pytest.approx(20.0)  # one request back every 20 s
    assert refused.retry_after_header == "20"
    assert table.admit(CI, 19.9) is not None
    assert table.admit(CI, 20.0) is None
    # A whole window later the whole burst is back, and not more than it.
    assert [table.admit(CI, 80.0) for _ in range(3)] == [None, None, None]
    assert table.admit(CI, 80.0) is not None


def test_tokens_are_taken_when_the_answer_ends_and_an_overdraft_is_waited_out() -> None:
    table = allowances(tokens_per_minute=1000)
    assert table.admit(CI, 0.0) is None
    table.charge(CI, 1600, 0.0, 0.0)  # a long answer overdraws by 600
    refused = table.admit(CI, 0.0)
    assert refused is not None
    assert refused.kind is LimitKind.TOKENS
    assert refused.retry_after == pytest.approx(36.0, abs=1e-6)  # 600 tokens at 1000/min
    assert table.admit(CI, 36.0 + 1e-6) is None
    assert table.remaining(96.0)[CI][LimitKind.TOKENS] == pytest.approx(1.0)


def test_a_daily_budget_refills_a_24th_an_hour_and_the_longest_wait_is_the_one_told() -> None:
    table = allowances(requests_per_minute=1, cost_per_day_usd=24.0)
    assert table.admit(CI, 0.0) is None
    table.charge(CI, 0, 25.0, 0.0)  # 1 USD over
    refused = table.admit(CI, 0.0)
    assert refused is not None
    # Both limits refuse; the budget's hour, not the requests' minute, is when to come back.
    assert refused.kind is LimitKind.COST
    assert refused.retry_after == pytest.approx(3600.0)
    assert table.admit(CI, 3600.0 + 1e-3) is None


def test_a_configuration_change_never_hands_a_grant_a_fresh_allowance() -> None:
    table = allowances(requests_per_minute=2)
    assert table.admit(CI, 0.0) is None
    assert table.admit(CI, 0.0) is None
    table.configure([grant(requests_per_minute=2)], 1.0)
    assert table.admit(CI, 1.0) is not None
    # A larger limit adds its difference; a smaller one keeps what was used.
    table.configure([grant(requests_per_minute=4)], 1.0)
    assert table.admit(CI, 1.0) is None
    table.configure([grant(requests_per_minute=1)], 1.0)
    refused = table.admit(CI, 1.0)
    assert refused is not None
    # A grant without limits is not counted at all.
    table.configure([grant()], 1.0)
    assert table.admit(CI, 1.0) is None
    assert table.remaining(1.0) == {}
