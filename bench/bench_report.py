"""What every benchmark ends with: the machine it ran on, and the report printed and kept."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path


def where_it_ran() -> str:
    """The python, the CPU count and the time: the figures mean nothing without them."""
    return (
        f"python {sys.version.split()[0]}; {os.cpu_count()} CPUs; "
        f"{datetime.now(UTC).strftime('%Y-%m-%d %H:%M:%S UTC')}"
    )


def publish(rows: Sequence[str], out: Path) -> None:
    """Print the report and write it to `out` (bench/results/<name>.txt by default)."""
    report = "\n".join(rows)
    print(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report + "\n")
