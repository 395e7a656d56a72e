"""``python -m benchmarks scheduling convergence --quick``: a gang and an elastic run train for
real, both curves are recorded and the figure is written next to the result."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT


@pytest.mark.timeout(300)
def test_quick_convergence_records_both_curves_and_the_figure(tmp_path: Path) -> None:
    out = tmp_path / "convergence.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks", "scheduling", "convergence", "--quick"]
        + ["--out", str(out)],
        cwd=REPO_ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything it left behind
    assert proc.returncode == 0, output[-4000:]

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
