"""``python -m benchmarks scheduling exp1 --quick`` (elastic) and ``admission --quick``
(whole-job eviction): several KFP runs of the training task on one test cluster, submitted at
given times; the result holds what the simulator and the docs read, and the figure is written.

What is asserted holds whatever the machine's speed: every job ends with all its steps, an
elastic job starts on the free slots and grows to its size, an evicted job runs again after the
job that evicted it and still does every step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.scheduling import admission, exp1
from tests.helpers import REPO_ROOT


@pytest.fixture(autouse=True)
def _pods_import_this_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))


def test_exp1_quick_elastic(tmp_path: Path) -> None:
    # The elastic half (the gang half starts twice the pods for a baseline: the full run has it)
    out = tmp_path / "exp1.json"
    assert exp1.main(["--quick", "--policies", "elastic", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    for key in ("slots", "job_type", "global_batch", "steps", "second_submit_s"):
        assert key in result
    assert set(result["policies"]) == {"elastic"}
    policy = result["policies"]["elastic"]
    assert {"makespan_s", "utilization", "utilization_both_running"} <= set(policy)
    for job in policy["jobs"]:
        assert {"submit_s", "first_step_s", "end_s", "pending_s", "jct_s"} <= set(job)
        assert job["steps_done"] - job["steps_lost"] == result["steps"], job["name"]
    first, second = policy["jobs"]
    # the second job trains on the free slots while the first runs, then grows to its size
    assert second["first_step_s"] < first["step_log"][-1][0]
    assert second["worlds"][0][1] == result["slots"] - result["workers"]
    assert second["worlds"][-1][1] == result["workers"]
    costs = result["measured_costs"]
    assert set(costs["step_s_by_world"]) == {"elastic"}
    assert set(costs["elastic"]["pod_start_s"]) == {"job-1", "job-2"}


def test_admission_quick(tmp_path: Path) -> None:
    out = tmp_path / "admission.json"
    assert admission.main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert set(result["policies"]) == {"evict"}
    for policy in result["policies"].values():
        for job in policy["jobs"]:
            assert job["steps_done"] - job["steps_lost"] == result["steps"], job["name"]
    a, b = result["policies"]["evict"]["jobs"]
    # B's arrival evicted A whole; A ran again once B was done and finished every step
    assert len(a["evictions_s"]) == 1 and len(a["resubmissions_s"]) == 1
    assert a["resubmissions_s"][0] >= b["end_s"]
    assert a["end_s"] > b["end_s"]
    assert set(result["goals"]["evict"]) >= {"b_first_step_pass", "a_no_step_lost_pass"}
    # B's own start, read from its master's timeline and its master pod's processes
    starts = result["policies"]["evict"]["starts"]
    assert starts["model_def_check_passed"] is True
    assert starts["pods_after_master_s"] is not None and starts["first_pod_launched_s"] > 0
    assert result["alone"] is None  # --quick skips B's run alone
