"""One benchmark suite end to end as a user starts it: ``python -m benchmarks runtime --quick
--parts micro`` (the fastest suite: in-process snapshot costs against an embedded etcd). Its
JSON lands under a new temporary directory, named by suite, date and commit, which it also
holds; nothing is written into ``benchmarks/results``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness import RESULTS, git_commit
from tests.helpers import REPO_ROOT


def committed_results() -> set[Path]:
    return {p for p in RESULTS.rglob("*") if p.is_file()}


@pytest.mark.timeout(300)
def test_quick_runtime_micro_writes_its_result_to_a_temporary_directory(tmp_path: Path) -> None:
    before = committed_results()
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # where the quick run's directory is made
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks", "runtime", "--quick", "--parts", "micro"],
        cwd=REPO_ROOT,
        env=env,
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
    assert proc.returncode == 0, output

    written = list(tmp_path.glob("benchmarks-quick-*/runtime/*.json"))
    assert len(written) == 1, (output, sorted(tmp_path.rglob("*")))
    report = json.loads(written[0].read_text())
    commit, _ = git_commit()
    date = report["date"][:10]
    assert written[0].name == f"runtime-{date}-{commit}.json"
    assert report["commit"] == commit
    assert (report["benchmark"], report["quick"], report["complete"]) == ("runtime", True, True)
    assert report["environment"]["cpus"] == os.cpu_count()
    assert report["summary"]["sync_snapshot_ms"] > 0
    assert report["micro"]["state_bytes"] > 0
    assert (
        report["micro"]["step_with_snapshot_ms"] > 0 and "snapshot_blocking_ms" in report["summary"]
    )
    assert "summary: runtime" in output and f"wrote {written[0]}" in output
    assert committed_results() == before
    assert not list(tmp_path.glob("runtime-bench-*")), "the work directory was left behind"
