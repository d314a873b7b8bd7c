"""`rolegate_breaker_open`, the series the chart's RolegateBreakerOpen alert watches for
minutes on end: the keys excluded now, each series present for as long as its key stays
excluded, even to a scrape that renders while the breaker clock refreshes the gauge (a
scrape renders in a worker thread; the clock runs on the loop)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rolegate_policy.status import BreakerPhase
from rolegate_proxy.core.exclusions import BreakerKey, BreakerView, Cause
from rolegate_proxy.flow.metrics import ProxyMetrics

Labels = tuple[str, str, str, str, str]


def view(key: BreakerKey, state: BreakerPhase, cause: Cause = Cause.BREAKER) -> BreakerView:
    return BreakerView(
        key=key, cause=cause, state=state, reason=None, since=None, until=None, trips=1,
        trigger=None, detail="",
    )  # fmt: skip


def excluded(metrics: ProxyMetrics) -> set[Labels]:
    """The label sets of `rolegate_breaker_open` on the page a scrape renders."""
    page = metrics.scrape()().decode()
    found: set[Labels] = set()
    for family in text_string_to_metric_families(page):
        if family.name == "rolegate_breaker_open":
            for sample in family.samples:
                labels = sample.labels
                assert sample.value == 1
                found.add(
                    (labels["provider"], labels["model"], labels["machine"], labels["cause"],
                     labels["state"])
                )  # fmt: skip
    return found


def test_the_series_follow_the_keys_excluded_now() -> None:
    metrics = ProxyMetrics()
    router, coder = BreakerKey("router"), BreakerKey("agg", "coder", "m1")
    metrics.observe_breakers([view(router, BreakerPhase.OPEN), view(coder, BreakerPhase.OPEN)])
    assert excluded(metrics) == {
        ("router", "", "", "Breaker", "Open"),
        ("agg", "coder", "m1", "Breaker", "Open"),
    }
    # The router probes (HalfOpen), the machine closes, a quota excludes the router too.
    metrics.observe_breakers(
        [
            view(router, BreakerPhase.HALF_OPEN),
            view(router, BreakerPhase.OPEN, Cause.QUOTA),
            view(coder, BreakerPhase.CLOSED),
        ]
    )
    assert excluded(metrics) == {
        ("router", "", "", "Breaker", "HalfOpen"),
        ("router", "", "", "Quota", "Open"),
    }
    metrics.observe_breakers([])
    assert excluded(metrics) == set()


@pytest.fixture
def eager_thread_switching() -> Iterator[None]:
    """Switch threads as often as the interpreter can, so the scraping thread lands inside
    every window of the loop's work that it can land in (instead of one in thousands)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


@pytest.mark.usefixtures("eager_thread_switching")
def test_a_scrape_during_a_refresh_still_sees_a_key_that_stays_excluded() -> None:
    """Cleared and set again on every tick, the series was missing from about a third of
    the pages rendered meanwhile; each miss ends the series for Prometheus."""
    metrics = ProxyMetrics()
    still_open = [view(BreakerKey("router"), BreakerPhase.OPEN)]
    metrics.observe_breakers(still_open)
    render = metrics.scrape()
    done = threading.Event()
    pages: list[bool] = []

    def scrape() -> None:
        while not done.is_set():
            pages.append(b"rolegate_breaker_open{" in render())

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        while len(pages) < 500:
            metrics.observe_breakers(still_open)
    finally:
        done.set()
        scraper.join()
    assert pages.count(False) == 0, f"{pages.count(False)} of {len(pages)} pages missed it"
