"""Compare runs of `peers.py --targets rolegate` before and after a change: every rolegate
cell, the median of the runs.

Run `peers.py --targets rolegate` on both trees in alternation on one machine, each run
with its own `--out` (this machine moves by more between sessions than a change does, so a
result file from another day is no baseline), then:

    .venv/bin/python bench/peers_compare.py --before b1.txt b2.txt ... --after a1.txt ... \
        --label "f4d9991 -> 29e0c1a" --out bench/results/peers-answer-events.txt

Each figure is the median over the runs given; the range is the lowest and highest run;
the change is after over before, in percent (for requests/s, a fall is the worse way).
The CPU figures come in steps of 0.2 ms (the kernel's tick over a block of requests), and
a p99 over a few dozen streams is nearly their maximum: read those ranges before a change.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

from bench_report import publish, where_it_ran

LIMIT_PCT = 10.0
# A table's title, cut where `peers.py` goes on to explain it (p50 and p99 kept apart).
_TITLE = re.compile(r"^(?P<title>[A-Z][^,:(]*(?:, p\d\d)?)")
_NUMBER = re.compile(r"^[-+]?\d+(?:\.\d+)?$")

Cell = tuple[str, str, str]  # (table, row, column)


def rolegate_cells(path: Path) -> dict[Cell, float]:
    """Every figure of a rolegate column (`rolegate`, `rolegate - up`) in one result."""
    found: dict[Cell, float] = {}
    title = ""
    columns: list[str] = []
    for line in path.read_text().splitlines():
        if not line.strip() or set(line.strip()) <= {"-"}:
            continue
        cells = re.split(r"\s{2,}", line.strip())
        if "rolegate" in cells or "rolegate - up" in cells:
            # A table whose rows name themselves has no title over that column.
            columns = ["", *cells] if line.startswith(" ") else cells
            continue
        heading = _TITLE.match(line)
        if heading and not _NUMBER.match(cells[-1].lstrip("+")):
            title, columns = heading["title"].strip(), []
            continue
        for column, value in zip(columns[1:], cells[1:], strict=False):
            if column.startswith("rolegate") and _NUMBER.match(value.lstrip("+")):
                found[(title, cells[0], column)] = float(value)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, nargs="+", required=True)
    parser.add_argument("--after", type=Path, nargs="+", required=True)
    parser.add_argument("--label", default="before -> after")
    parser.add_argument("--note", action="append", default=[], help="a line to add (repeatable)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    before = [rolegate_cells(path) for path in args.before]
    after = [rolegate_cells(path) for path in args.after]
    cells = [c for c in before[0] if all(c in run for run in before + after)]
    header = (
        f"{'table':<38} {'cell':<20} {'column':<14} {'before':>9} {'after':>9} {'change':>8}"
        f"   {'before range':>17} {'after range':>17}"
    )
    rows = [f"rolegate beside itself in peers.py, {args.label}", *args.note, "", header]
    rows.append("-" * len(header))
    over = []
    for cell in cells:
        b = [run[cell] for run in before]
        a = [run[cell] for run in after]
        mb, ma = statistics.median(b), statistics.median(a)
        change = (ma / mb - 1) * 100 if mb else 0.0
        worse = -change if cell[0].startswith("Requests/s") else change
        if worse > LIMIT_PCT:
            over.append(f"{cell[0]} / {cell[1]}")
        rows.append(
            f"{cell[0][:38]:<38} {cell[1][:20]:<20} {cell[2]:<14} {mb:>9.3f} {ma:>9.3f} "
            f"{change:>+7.1f}%   {f'{min(b):g}-{max(b):g}':>17} {f'{min(a):g}-{max(a):g}':>17}"
        )
    rows.append("")
    rows.append(
        f"limit: no cell more than {LIMIT_PCT:g} % worse at the median: "
        + ("met" if not over else "NOT met (" + "; ".join(over) + ")")
    )
    rows.append(
        f"runs: {len(before)} before, {len(after)} after (medians over runs); " + where_it_ran()
    )
    publish(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
