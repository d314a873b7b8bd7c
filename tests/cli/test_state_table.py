"""The demo's state table: every machine with its scores, who judged it, its belief and
its breaker, read from the shape `/v1/rolegate/state` serves."""

from __future__ import annotations

from typing import Any

from rolegate_cli.state_table import render_state


def _score(machine: str, score: float, n: int, semantic: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "provider": "router",
        "model": "m",
        "machine": machine,
        "operational": {"score": score, "n": n, "confidence": min(1.0, n / 50)},
        "semantic": semantic,
        "evaluators": {"judge": 3} if semantic else {},
    }


def test_every_machine_is_a_row_with_its_scores_belief_and_breaker() -> None:
    state = {
        "config_hash": "sha256:" + "0" * 64,
        "scores": [
            _score("cold", 0.5, 0, None),
            _score("judged", 0.8, 60, {"score": 0.7, "n": 3}),
        ],
        "beliefs": [
            {"provider": "router", "model": "m", "machine": "judged",
             "expected_ttft_seconds": 0.25, "expected_tokens_per_second": 90.0},
        ],
        "breakers": [
            {"provider": "router", "model": "m", "machine": "cold", "state": "Open",
             "reason": "EmptyResponses", "cause": "Breaker"},
        ],
        "outcomes": {"emitted": 7, "dropped": 1},
    }  # fmt: skip
    lines = render_state(state).splitlines()
    header, rule, cold, judged, footer = lines
    assert header.split() == [
        "machine", "operational", "n", "conf", "semantic", "judged", "by", "ttft", "s",
        "tok/s", "breaker",
    ]  # fmt: skip
    assert set(rule) == {"-"}
    assert cold.split() == ["router/m", "@", "cold", "0.500", "0", "0.00", "-", "-", "-", "-",
                            "Open", "(EmptyResponses)"]  # fmt: skip
    assert judged.split() == ["router/m", "@", "judged", "0.800", "60", "1.00", "0.700", "(n",
                              "3)", "judge", "x3", "0.25", "90", "closed"]  # fmt: skip
    assert footer == "outcomes emitted 7, dropped 1; config sha256:000000000000"
    assert all(line == line.rstrip() for line in lines)
