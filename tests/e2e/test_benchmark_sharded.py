"""``python -m benchmarks sharded --quick`` end to end, as a user starts it: three local nodes
train the 5 M-parameter sharded model on each snapshot path, one node is SIGKILLed, and the
report holds every number for both paths, each restore from where its path keeps the shards
(no time is asserted: only the report's structure)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_benchmark


@pytest.mark.timeout(300)
def test_quick_sharded_benchmark_reports_both_paths(tmp_path: Path) -> None:
    out = tmp_path / "sharded.json"
    code, output = run_benchmark(["sharded", "--quick", "--out", str(out)], tmp_path, 280)
    assert code == 0, output
    report = json.loads(out.read_text())
    assert (report["benchmark"], report["quick"], report["complete"]) == ("sharded", True, True)
    assert 4_000_000 <= report["model"]["parameters"] <= 6_000_000

    runs = {(r["path"], r["kind"]): r for r in report["runs"]}
    assert set(runs) == {(p, k) for p in ("memory", "disk") for k in ("kill", "every1")}
    assert all(r["error"] is None for r in runs.values()), output
    for path in ("memory", "disk"):
        kill = runs[path, "kill"]
        assert kill["restored_from"] == path  # both new ranks, from the path's own store
        assert kill["victim_rank"] == 1 and kill["victim"] != ""
        assert kill["recovery_s"] > 0 and kill["moved_bytes"] > 0
        assert kill["first_new_step"] == kill["restored_step"] + 1
        # How many snapshots the auto interval takes in a quick run depends on the load.
        assert kill["auto"]["snapshots"] >= 0 and kill["auto"]["blocking_share"] >= 0
        every1 = runs[path, "every1"]["every1"]
        assert every1["snapshots"] == report["settings"]["every1_steps"]
        assert all(b > 0 for b in every1["blocking_s"])
        for run in (kill, runs[path, "every1"]):
            memory = run["host_memory"]
            worlds = {(r["world"], r["rank"]) for r in memory["ranks"]}
            assert {(3, 0), (3, 1), (3, 2)} <= worlds
            assert all(r["vmhwm_bytes"] > 0 and r["node"] for r in memory["ranks"])
            # The memory path keeps slots in each node's directory; the disk path none.
            assert (memory["peak_node_dir_bytes"] > 0) == (path == "memory")
        assert {(2, 0), (2, 1)} <= {(r["world"], r["rank"]) for r in kill["host_memory"]["ranks"]}
    memory_kill, disk_kill = runs["memory", "kill"], runs["disk", "kill"]
    assert memory_kill["moved_bytes"] == memory_kill["received_bytes"] + memory_kill["sent_bytes"]
    assert disk_kill["dcp_dir"].startswith("dcp-")

    summary = report["summary"]
    for path in ("memory", "disk"):
        assert summary[path]["restored_from"] == path
        assert summary[path]["kill_to_first_step_s"] > 0
        assert summary[path]["restore_moved_bytes"] > 0
        assert summary[path]["peak_rank_host_bytes"] > 0
        assert summary[path]["blocking_share_every1"] > 0
    ratios = summary["memory_over_disk"]
    # A ratio is None where a quick run lacks one path's number (no auto snapshot under load).
    assert all(v is None or v >= 0 for v in ratios.values()), ratios
    assert ratios["kill_to_first_step_s"] > 0 and ratios["restore_moved_bytes"] > 0
    assert set(summary["goals"].values()) <= {"met", "MISSED"}
    assert "summary: sharded" in output and "memory/disk" in output
    # Nothing left: the work directory, the nodes' host-memory directories.
    assert not list(tmp_path.glob("sharded-bench-*"))
    assert report["memory_root"] and not Path(report["memory_root"]).exists()
