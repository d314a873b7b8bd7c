"""What each of the sixteen faults a new user meets comes to (issues 13 and 31), through the
real proxy, simulator and `openai` client, as a user meets them: ONE long-lived simulator
and proxy for the whole sequence (each case's faults switched on at runtime through the
simulator's control API), non-streamed health checks between the rows, machines that write
at a realistic pace (0.2 s to the first token, 100 tokens a second ±20 %, as published),
and every case through a Watched role and an Unwatched one (delivered buffered).

Each row is judged on what the client got, the attempts per machine, resends of an
identical body to a machine that refused it for what the request is (a 4xx other than 408
and 429), the caller's time and the `model` that served (the last content chunk's) with
the usage it reports; the expectation of each case is in `tests/fault_cases.py` (`Expect`)
and is printed beside it. A row is WRONG when any judgement fails. Run once with the
default settings and once with a baseline budget (at most 2 retries, 30 s patience and
stream-idle limit), each on its own long-lived rig; the primary's breaker cools down in
1-2 s there so that a case's trip has ended before the next case. The outage row runs on
a fresh rig (its window starts with the simulator) at full length (about 100 s), one request
every 4 s, with the default breaker schedule.

Run: `.venv/bin/python bench/faults.py [--quick]` (`--quick`: the outage at a tenth).
The cases are `tests/fault_cases.py`, which `tests/proxy/test_every_fault.py` asserts on.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_report import publish, where_it_ran

from tests.fault_cases import (
    BASELINE,
    DEFAULTS,
    OUTAGE,
    Budget,
    Case,
    Row,
    run_outage,
    run_sequence,
)

HEADER = (
    f"{'fault':<41} {'role':<9} {'time':>6} {'served by':<18} {'re':>2}  "
    f"{'expected':<38} verdict; attempts"
)


def expected(case: Case) -> str:
    """`p1<=2 f1<=1 <=3.5s fallback`: the case's `Expect`, short."""
    expect = case.expect
    assert expect is not None
    if case.error_status is not None:
        served = f"error {case.error_status}"
    else:
        served = "|".join(sorted(m.removeprefix("vendor/") for m in expect.served))
    return (
        f"{case.primary_machine}<={expect.primary} f1<={expect.fallback} "
        f"<={expect.seconds:g}s {served}"
    )


def line(row: Row) -> str:
    served = (row.outcome.last_model or "-").removeprefix("vendor/")
    return (
        f"{row.case.name[:41]:<41} {row.visibility:<9} {row.outcome.seconds:>5.2f}s "
        f"{served:<18} {row.outcome.resends:>2}  {expected(row.case):<38} "
        f"{row.verdict}; {', '.join(row.outcome.attempts)}"
    )


async def table(budget: Budget, scale: float) -> tuple[list[str], int]:
    """The budget's rows, and how many are wrong (the outage row's failures included)."""
    rows = [budget.name, "", HEADER, "-" * len(HEADER)]
    sequence = await run_sequence(budget)
    rows += [line(row) for row in sequence]
    checks = sum(row.checks for row in sequence)
    failed = sum(row.checks_failed for row in sequence)
    outage = await run_outage(budget, scale=scale)
    served = "every request answered" if outage.answered else "SOME REQUESTS FAILED"
    back = outage.back_after
    again = f"primary back {back:.1f} s after recovering" if back is not None else "NEVER BACK"
    before = sum(1 for at, _ in outage.served if at < outage.recovered_at)
    rows.append(
        f"{OUTAGE[:41]:<41} {'Watched':<9} {100 * scale:>5.0f}s {served}: "
        f"{before} requests by f1 during the outage; {again} (fresh rig, instant machines)"
    )
    wrong = sum(1 for row in sequence if row.failed)
    outage_wrong = not outage.answered or back is None
    rows += [
        "",
        f"rows WRONG: {wrong} of {len(sequence)}; health checks between rows (non-streamed): "
        f"{checks}, {'all answered whole' if not failed else f'{failed} NOT ANSWERED WHOLE'}",
    ]
    return rows, wrong + outage_wrong + (failed > 0)


async def main(scale: float, out: Path) -> int:
    rows = [
        "re: requests the upstream saw that repeat an earlier one to the same machine byte for "
        "byte; expected: at most so many attempts at the primary (p1, p2) and at the fallback "
        "(f1), the caller's time at most, the models that may finish the answer",
        "",
    ]
    wrong = 0
    for budget in (DEFAULTS, BASELINE):
        budget_rows, budget_wrong = await table(budget, scale)
        rows += [*budget_rows, ""]
        wrong += budget_wrong
    rows.append(f"rows not handled, both budgets: {wrong}")
    rows.append(where_it_ran())
    publish(rows, out)
    return 1 if wrong else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the outage row at a tenth")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "faults.txt"
    )
    args = parser.parse_args()
    sys.exit(asyncio.run(main(0.1 if args.quick else 1.0, args.out)))
