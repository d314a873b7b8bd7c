"""Compare runs of `overhead.py` before and after a change: the median of the runs per cell.

Run `overhead.py` on both trees in alternation on one machine (see bench/README.md), each
with its own `--out`, then:

    .venv/bin/python bench/overhead_compare.py --before b1.txt b2.txt ... --after a1.txt ... \
        --label "368af69 -> working tree" --out bench/results/overhead-issue6.txt

The cells compared are the added time at the median (proxied minus direct, same run) at
concurrency 1 and 64. Each figure is the median over the runs given; the range is the
lowest and highest run. The change is after over before, in percent.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from bench_report import publish, where_it_ran

# (mode, concurrency, metric) as overhead.py prints them.
CELLS = [
    ("complete", 1, "total"),
    ("stream", 1, "ttft"),
    ("complete", 64, "total"),
    ("stream", 64, "ttft"),
    ("stream", 64, "last"),
]
LIMIT_PCT = 10.0


def added_p50(path: Path) -> dict[tuple[str, int, str], float]:
    """The `added p50` column (ms) of one overhead.py result, per cell."""
    found: dict[tuple[str, int, str], float] = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) < 6 or parts[0] not in ("complete", "stream"):
            continue
        found[(parts[0], int(parts[1]), parts[2])] = float(parts[5].removesuffix("ms"))
    missing = [cell for cell in CELLS if cell not in found]
    if missing:
        raise SystemExit(f"{path}: no figures for {missing}")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, nargs="+", required=True)
    parser.add_argument("--after", type=Path, nargs="+", required=True)
    parser.add_argument("--label", default="before -> after")
    parser.add_argument("--note", action="append", default=[], help="a line to add (repeatable)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    before = [added_p50(path) for path in args.before]
    after = [added_p50(path) for path in args.after]
    header = (
        f"{'cell (added p50)':<22} {'before':>9} {'after':>9} {'change':>8}   "
        f"{'before range':>17} {'after range':>17}"
    )
    rows = [f"proxy overhead, {args.label}", *args.note, "", header, "-" * len(header)]
    over = []
    for cell in CELLS:
        b = [run[cell] for run in before]
        a = [run[cell] for run in after]
        mb, ma = statistics.median(b), statistics.median(a)
        change = (ma / mb - 1) * 100
        if change > LIMIT_PCT:
            over.append(f"{cell[0]} c={cell[1]} {cell[2]}")
        name = f"{cell[0]} c={cell[1]} {cell[2]}"
        rows.append(
            f"{name:<22} {mb:>7.3f}ms {ma:>7.3f}ms {change:>+7.1f}%   "
            f"{f'{min(b):.3f}-{max(b):.3f}ms':>17} {f'{min(a):.3f}-{max(a):.3f}ms':>17}"
        )
    rows.append("")
    rows.append(
        f"limit: no cell more than {LIMIT_PCT:g} % worse at the median: "
        + ("met" if not over else "NOT met (" + ", ".join(over) + ")")
    )
    rows.append(
        f"runs: {len(before)} before, {len(after)} after (medians over runs); " + where_it_ran()
    )
    publish(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
