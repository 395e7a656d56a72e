"""``python -m benchmarks scheduling convergence --quick``: a gang and an elastic run train for
real, both curves are recorded and the figure is written next to the result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_benchmark


@pytest.mark.timeout(300)
def test_quick_convergence_records_both_curves_and_the_figure(tmp_path: Path) -> None:
    out = tmp_path / "convergence.json"
    code, output = run_benchmark(
        ["scheduling", "convergence", "--quick", "--out", str(out)], tmp_path
    )
    assert code == 0, output[-4000:]

    report = json.loads(out.read_text())
    epochs = report["settings"]["epochs"]
    for name in ("gang", "elastic"):
        run = report["runs"][name]
        assert [p["epoch"] for p in run["curve"]] == list(range(1, epochs + 1)), run
        assert 0.1 < run["final_accuracy"] <= 1.0
        assert run["commits"] and run["commits"][-1]["epoch"] == epochs
    assert report["runs"]["gang"]["worlds"] == [report["settings"]["world"]]
    assert report["runs"]["elastic"]["worlds"][0] == report["settings"]["world"] // 2
    assert report["summary"]["verdict"] in ("PASS", "FAIL")
    assert out.with_suffix(".png").stat().st_size > 0
    assert "final held-out accuracy: gang" in output
