"""`serve()`: the blocking foreground server behind `rolegate sim`, in a real subprocess."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from rolegate_sim.scenario import ScenarioError
from rolegate_sim.server import serve

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "scenario.yaml"
SERVE = "import sys; from pathlib import Path; from rolegate_sim.server import serve; " + (
    "serve(Path(sys.argv[1]), '127.0.0.1', 0)"
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_prints_one_line_serves_and_stops_on_a_signal(sig: signal.Signals) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", SERVE, str(EXAMPLE)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("rolegate sim listening on http://127.0.0.1:")
        url = line.rsplit(" ", 1)[1].strip()
        with urllib.request.urlopen(f"{url}/healthz", timeout=5) as response:
            assert response.status == 200
        process.send_signal(sig)
        stdout, stderr = process.communicate(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stderr
    assert stdout == ""  # exactly one line in all
    assert stderr == ""


def test_serve_raises_scenario_error_for_a_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("models: []\n")
    with pytest.raises(ScenarioError, match=r"bad\.yaml"):
        serve(path, "127.0.0.1", 0)


def test_the_simulator_imports_nothing_of_rolegate_itself() -> None:
    check = (
        "import sys, rolegate_sim.server, rolegate_sim.scenario; "
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('rolegate_proxy', 'rolegate_policy', 'rolegate_operator', 'rolegate_cli')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", check], check=True, timeout=30)
