"""What one routing decision costs over 50 machines (SPEC B1-B4, C4, C5).

Per request, `Dispatcher.handle` orders the role's candidates (`Chooser.order_candidates`)
and `_admit` chooses among a candidate's machines (`Chooser.choose`): every machine's
belief is read from the ledger, checked against the breakers' exclusions and the role's
patience, and the admitted ones are ranked by score, cost and expected time. A streamed
request also plans the whole role once more (`Chooser.plan`) for the mid-stream rate
test's frontier. This measures those calls in-process over one aggregator serving one
model on 50 machines that publish TTFT, tokens per second and prices, in a warm state: a
ledger with sightings for half the machines, a scoreboard with observations for most,
evaluator judgments for some, breakers that saw traffic with two machines out (a tripped
breaker and a rate limit), and an affinity pin. Each call is timed on its own
(`time.perf_counter_ns`); median and p95 over the calls.

Run: `.venv/bin/python bench/routing_decision.py [--calls 2000] [--profile]`.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench_report import publish, where_it_ran

from rolegate_policy.config import (
    CompiledMachine,
    CompiledModel,
    CompiledProvider,
    CompiledRole,
    ProxyConfig,
    with_hash,
)
from rolegate_policy.enums import (
    Dialect,
    Ruling,
    Visibility,
)
from rolegate_policy.model import (
    BreakerSpec,
    DegradedOutputSpec,
)
from rolegate_proxy.core.beliefs import GapStats, Ledger, MachineKey, Sighting
from rolegate_proxy.core.breaker import Attempted, Breakers, TransportFault
from rolegate_proxy.core.chooser import Chooser, Fate
from rolegate_proxy.core.decisions import Decision
from rolegate_proxy.core.routing import plan_candidates
from rolegate_proxy.core.score import ObservationKind, Scoreboard, ScoreScale
from rolegate_proxy.core.verdicts import OK

PROVIDER, MODEL = "openrouter", "qwen/qwen3-coder"
MACHINES = 50
NOW = 5000.0
PROMPT_TOKENS = 1800
GOAL_US = 100.0


def world() -> tuple[ProxyConfig, CompiledRole, Breakers, Chooser]:
    """The configuration, the role and the warm routing state (see the module docstring)."""
    rng = random.Random(7)
    machines = tuple(
        CompiledMachine(
            name=f"machine-{i:02d}",
            ttft_seconds=round(rng.uniform(0.15, 2.5), 2),
            # A few slow ones: 600 tokens at under ~21 tok/s is past a 30 s patience.
            tokens_per_second=round(rng.uniform(12.0, 220.0), 1),
            price_input_per_mtok=round(rng.uniform(0.05, 1.2), 3),
            price_output_per_mtok=round(rng.uniform(0.2, 4.0), 3),
            continues_partial_message=i % 3 != 0,
        )
        for i in range(MACHINES)
    )
    agent = CompiledRole(
        name="agent",
        source="bench",
        models=(MODEL,),
        patience_seconds=30.0,
        visibility=Visibility.WATCHED,
        ruling=Ruling.ORDER,
        effective_ruling=Ruling.ORDER,
        ruling_reason="bench",
        expected_output_tokens=600,
    )
    config = with_hash(
        ProxyConfig(
            roles=(agent,),
            providers=(
                CompiledProvider(
                    name=PROVIDER,
                    source="bench",
                    endpoint="http://upstream.invalid/v1",
                    dialect=Dialect.AGGREGATOR,
                    models=(CompiledModel(name=MODEL, machines=machines),),
                ),
            ),
        )
    )

    ledger = Ledger()
    ledger.load_sheet(config)
    # Sightings for half the machines, spread over the last hour and a half.
    for i, machine in enumerate(machines[::2]):
        assert machine.ttft_seconds is not None
        assert machine.tokens_per_second is not None
        for j in range(12):
            drift = rng.uniform(0.7, 1.5)
            gap = drift / machine.tokens_per_second
            ledger.note(
                Sighting(
                    PROVIDER,
                    MODEL,
                    machine.name,
                    NOW - 5400 + 400 * j + i,
                    ttft=machine.ttft_seconds * rng.uniform(0.8, 1.6),
                    gaps=GapStats.of(gap * rng.uniform(0.6, 1.4) for _ in range(200)),
                )
            )

    # Observations for most machines (45 of 50), some with a long record, some short.
    scores = Scoreboard()
    kinds = [ObservationKind.OK] * 17 + [ObservationKind.LATE, ObservationKind.SERVER_ERROR,
                                         ObservationKind.TIMEOUT]  # fmt: skip
    for i, machine in enumerate(machines[:45]):
        key = MachineKey(PROVIDER, MODEL, machine.name)
        for j in range(5 + (i * 7) % 70):
            kind = rng.choice(kinds)
            scores.observe(key, kind, NOW - 100 + j, elapsed=45.0, patience=30.0)
        if i % 5 == 0:
            scores.judge(key, rng.uniform(2.5, 5.0), scale=ScoreScale(1.0, 5.0),
                         evaluator="judge", now=NOW)  # fmt: skip

    # Breakers that saw traffic on most machines; one tripped (two 503s), one rate-limited.
    provider = config.providers[0]
    breakers = Breakers(
        lambda _p: provider.breaker if _p == PROVIDER else BreakerSpec(),
        random.Random(3),
        degraded_for=lambda _p: provider.degraded_output if _p == PROVIDER
        else DegradedOutputSpec(),
    )  # fmt: skip
    for i, machine in enumerate(machines[:40]):
        at = NOW - 200 + i
        breakers.record(Attempted.answered(PROVIDER, MODEL, OK, machine=machine.name), at)
    breakers.record(Attempted.http_error(PROVIDER, MODEL, 503, machine="machine-04"), NOW - 3)
    breakers.record(Attempted.http_error(PROVIDER, MODEL, 503, machine="machine-04"), NOW - 2)
    breakers.record(Attempted.transport_failure(PROVIDER, MODEL, TransportFault.TIMEOUT,
                                              machine="machine-17"), NOW - 2)  # fmt: skip
    breakers.record(
        Attempted.http_error(PROVIDER, MODEL, 429, machine="machine-09", retry_after=30.0), NOW - 1
    )

    chooser = Chooser(ledger, scores=scores, draw=random.Random(1).random)
    return config, agent, breakers, chooser


def check(config: ProxyConfig, role: CompiledRole, breakers: Breakers, chooser: Chooser) -> str:
    """One decision, looked at: the bench must route over the state it claims to."""
    (candidate,) = plan_candidates(role, config)
    choice = chooser.choose(role, candidate, breakers.exclusion, NOW, prompt_tokens=PROMPT_TOKENS)
    fates = {fate: sum(f.fate is fate for f in choice.fates) for fate in Fate}
    excluded = {f.machine for f in choice.fates if f.fate is Fate.EXCLUDED}
    if len(choice.fates) != MACHINES or not {"machine-04", "machine-09"} <= excluded:
        raise SystemExit(f"unexpected state: {len(choice.fates)} machines, excluded {excluded}")
    if not choice.sendable or fates[Fate.PATIENCE] == 0:
        raise SystemExit(f"unexpected state: {fates}")
    frontier = len(chooser.plan(role, [candidate], breakers.exclusion, NOW).frontier())
    return (
        f"{MACHINES} machines: {fates[Fate.ADMITTED]} admitted, {fates[Fate.EXCLUDED]} excluded "
        f"(breaker, rate limit), {fates[Fate.PATIENCE]} refused for patience; "
        f"frontier {frontier} machines"
    )


def cases(
    config: ProxyConfig, role: CompiledRole, breakers: Breakers, chooser: Chooser
) -> list[tuple[str, Callable[[], object]]]:
    exclusion = breakers.exclusion
    candidates = plan_candidates(role, config)
    (candidate,) = candidates
    # The machine that answered last for the role: the affinity pin, as after any answer.
    first = chooser.choose(role, candidate, exclusion, NOW, prompt_tokens=PROMPT_TOKENS)
    pin = MachineKey(PROVIDER, MODEL, first.admitted[0])

    def decision() -> object:
        # What handle + _admit ask of the chooser for a request's first attempt.
        chooser.answered(role.name, pin)
        (ordered,) = chooser.order_candidates(
            role, candidates, exclusion, NOW, prompt_tokens=PROMPT_TOKENS
        )
        return chooser.choose(role, ordered, exclusion, NOW, prompt_tokens=PROMPT_TOKENS)

    def admit_path() -> object:
        # The same, with the rest of handle/_admit around it: the candidate list, a skip
        # in the request's Decision for every refused machine, the breakers' admission.
        chooser.answered(role.name, pin)
        record = Decision("req", role.name, role.effective_ruling.value, NOW)
        (ordered,) = chooser.order_candidates(
            role, plan_candidates(role, config), exclusion, NOW, prompt_tokens=PROMPT_TOKENS
        )
        choice = chooser.choose(role, ordered, exclusion, NOW, avoid=[],
                                prompt_tokens=PROMPT_TOKENS)  # fmt: skip
        for fate in (f for f in choice.fates if not f.admitted):
            record.skip(PROVIDER, MODEL, fate.machine, f"{fate.reason}: {fate.detail}")
        return breakers.admit(PROVIDER, MODEL, None, NOW)

    def choose() -> object:
        chooser.answered(role.name, pin)
        return chooser.choose(role, candidate, exclusion, NOW, prompt_tokens=PROMPT_TOKENS)

    def plan() -> object:
        chooser.answered(role.name, pin)
        return chooser.plan(role, plan_candidates(role, config), exclusion, NOW)

    def frontier() -> object:
        chooser.answered(role.name, pin)
        return chooser.plan(role, plan_candidates(role, config), exclusion, NOW).frontier()

    return [
        ("order_candidates + choose (the decision)", decision),
        ("  + plan_candidates, skips, breakers.admit", admit_path),
        ("choose alone", choose),
        ("plan (mid-stream, streamed requests)", plan),
        ("plan + frontier()", frontier),
    ]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(
    named: list[tuple[str, Callable[[], object]]], calls: int
) -> list[tuple[str, float, float]]:
    results = []
    clock = time.perf_counter_ns
    for name, run in named:
        for _ in range(100):  # warm-up
            run()
        took: list[float] = []
        for _ in range(calls):
            start = clock()
            run()
            took.append((clock() - start) / 1000.0)
        results.append((name, statistics.median(took), pct(took, 0.95)))
    return results


def profile(run: Callable[[], object], calls: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        run()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.strip_dirs().sort_stats("cumulative").print_stats(30)
    # Only the table: the header names the temporary profile, not a finding.
    text = out.getvalue()
    return text[text.index("   ncalls") :].rstrip() if "   ncalls" in text else text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per case")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print a cProfile of the decision (always when it misses the goal)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "routing_decision.txt"
    )
    args = parser.parse_args()

    config, role, breakers, chooser = world()
    state = check(config, role, breakers, chooser)
    named = cases(config, role, breakers, chooser)
    results = measure(named, args.calls)
    width = max(len(name) for name, _, _ in results)
    header = f"{'per call':<{width}} {'p50 µs':>8} {'p95 µs':>8}"
    rows = [header, "-" * len(header)]
    rows += [f"{name:<{width}} {p50:>8.1f} {p95:>8.1f}" for name, p50, p95 in results]
    decision = results[0][1]
    met = decision < GOAL_US
    rows.append("")
    rows.append(state)
    rows.append(
        f"goal: one full routing decision over {MACHINES} machines under {GOAL_US:g} µs at "
        f"the median: {'met' if met else 'NOT met'} ({decision:.1f} µs)"
    )
    rows.append(f"calls={args.calls} per case; " + where_it_ran())
    if args.profile or not met:
        profiled = min(args.calls, 500)
        rows.append("")
        rows.append(
            f"cProfile of {profiled} decisions, by cumulative time (the profiler's own "
            "overhead inflates every figure; read the shares):"
        )
        rows.append(profile(named[0][1], profiled))
    publish(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
