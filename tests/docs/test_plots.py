"""The docs' pictures (benchmarks/plots.py, `make plots`): each is drawn from a committed
benchmark result, says the machine and the date of its run, and is in docs/plots where the
pages embed it."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.plots import PLOTS, draw
from benchmarks.record import label, machine

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def test_every_plot_is_drawn_from_the_committed_results(tmp_path: Path) -> None:
    assert draw(RESULTS, tmp_path) == list(PLOTS)
    for name in PLOTS:
        assert (tmp_path / f"{name}.png").stat().st_size > 20_000, name
        committed = ROOT / "docs" / "plots" / f"{name}.png"
        assert committed.stat().st_size > 20_000, f"{committed} is not drawn: make plots"


def test_each_result_says_its_command_machine_and_date() -> None:
    for path in sorted(RESULTS.glob("*.json")):
        record = json.loads(path.read_text())
        assert set(record) == {"command", "date", "machine", "result"}, path
        shown = label(record)
        assert record["date"] in shown and f"{record['machine']['cores']} vCPU" in shown


def test_the_machine_is_described_from_this_host() -> None:
    here = machine()
    assert here["cores"] >= 1 and here["memory_gib"] >= 1
    amx = "amx_tile" in Path("/proc/cpuinfo").read_text()
    assert ("amx_tile" in here["vector"]) == amx
