"""What each of the sixteen faults a new user meets comes to (issue 13): the fault, what the
client got, the attempts the upstream saw, and the time, through the real proxy, simulator
and `openai` client. Run once with the default settings and once with a baseline budget
(at most 2 retries, 30 s patience and stream-idle limit); the outage row runs at full
length (about 100 s), one request every 4 s.

Run: `.venv/bin/python bench/faults.py [--quick]` (`--quick`: the outage at a tenth).
The cases are `tests/fault_cases.py`, which the test suite asserts on.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_report import publish, where_it_ran

from tests.fault_cases import BASELINE, CASES, DEFAULTS, OUTAGE, Budget, run, run_outage

HEADER = f"{'fault':<44} {'outcome':<34} {'time':>7}  attempts (p1 primary, f1 fallback)"


async def table(budget: Budget, scale: float) -> list[str]:
    rows = [budget.name, "", HEADER, "-" * len(HEADER)]
    for case in CASES:
        outcome = await run(case, budget)
        rows.append(
            f"{case.name:<44} {outcome.verdict(case):<34} {outcome.seconds:>6.2f}s  "
            + ", ".join(outcome.attempts)
        )
    outage = await run_outage(budget, scale=scale)
    served = "every request answered" if outage.answered else "SOME REQUESTS FAILED"
    back = outage.back_after
    again = f"primary back {back:.1f} s after recovering" if back is not None else "NEVER BACK"
    before = sum(1 for at, _ in outage.served if at < outage.recovered_at)
    rows.append(
        f"{OUTAGE[:44]:<44} {served:<34} {100 * scale:>6.0f}s  "
        f"{before} requests by f1 during the outage; {again}"
    )
    return rows


async def main(scale: float, out: Path) -> int:
    rows: list[str] = []
    for budget in (DEFAULTS, BASELINE):
        rows += await table(budget, scale)
        rows.append("")
    wrong = [row for row in rows if "WRONG" in row or "FAILED" in row or "NEVER" in row]
    rows.append(f"cases not handled: {len(wrong)}")
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
