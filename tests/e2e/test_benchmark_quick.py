"""One benchmark suite end to end as a user starts it: ``python -m benchmarks runtime --quick
--parts micro`` (the fastest suite: in-process snapshot costs against an embedded etcd). Its
JSON lands under a new temporary directory, named by suite, date and commit, which it also
holds; nothing is written into ``benchmarks/results``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks.harness import RESULTS, git_commit
from tests.helpers import run_benchmark


def committed_results() -> set[Path]:
    return {p for p in RESULTS.rglob("*") if p.is_file()}


@pytest.mark.timeout(300)
def test_quick_runtime_micro_writes_its_result_to_a_temporary_directory(tmp_path: Path) -> None:
    before = committed_results()
    # TMPDIR (tmp_path): where the quick run's directory is made
    code, output = run_benchmark(["runtime", "--quick", "--parts", "micro"], tmp_path)
    assert code == 0, output

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
