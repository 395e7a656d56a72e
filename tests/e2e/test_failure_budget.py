"""One failure budget per job: a failure that moves is not restarted in place forever.

Without the budget, torchrun restarted such a worker in place (``--max-restarts=100``), each
start failing at another step, so no agent saw "the same failure again"; the master never saw a
worker end, and the job ended "succeeded" once the failure had moved past the last step.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from kfp_elastic.components.common import run_pids
from kfp_elastic.contract.failure_budget import SOURCE_AGENT, CountedFailure, read_failures
from kfp_elastic.etcd.client import connect
from tests.helpers import REPO_ROOT, master_command
from tests.model_defs import nan_moves, raises_moving


def _kill_run(run_id: str) -> None:
    for _ in range(3):
        for pid in run_pids(run_id):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _run_master(
    tmp_path: Path, etcd: Any, run_id: str, model_def: str, **flags: str
) -> tuple[int, str, str, tuple[CountedFailure, ...]]:
    """Run a 2-worker job of a few steps to its end: (exit code, result line, output, the
    failures counted in etcd)."""
    command = master_command(
        ["--model-def", model_def, "--epochs", "1", "--batch-size", "64"],
        run_id=run_id,
        etcd=etcd.endpoint,
        min_workers="2",
        max_workers="2",
        max_wait="120",
        workdir=str(tmp_path / "work"),
        **flags,
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "KFP_ELASTIC_RUN_ID": run_id}
    try:
        result = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=240, cwd=REPO_ROOT
        )
        left = run_pids(run_id)  # the master stopped its workers before it returned
    finally:
        _kill_run(run_id)
    output = result.stdout + result.stderr
    assert not left, f"workers left running: {sorted(left)}\n{output[-3000:]}"
    client = connect(etcd.client_settings())
    try:
        counted = read_failures(client, etcd.client_settings().run_prefix(run_id))
    finally:
        client.close()
    lines = [x for x in result.stdout.splitlines() if x.startswith("result=")]
    return result.returncode, lines[-1] if lines else "", output, counted


def test_a_nan_that_moves_fails_the_job_at_its_first_occurrence(
    tmp_path: Path, etcd: Any, run_id: str
) -> None:
    code, line, output, counted = _run_master(tmp_path, etcd, run_id, "tests.model_defs.nan_moves")
    assert code == 1, output[-3000:]
    assert line.startswith(f"result=failed run={run_id} message="), output[-3000:]
    found = re.search(r"NonFiniteLoss: non-finite loss \(nan\) at step (\d+) on rank (\d+)", line)
    assert found, line
    step, rank = int(found[1]), int(found[2])
    assert rank == nan_moves.NAN_RANK
    assert "the job fails at its first occurrence (1 worker failure counted)" in line
    # Counted once, by the agent of the failing rank, in the round it first happened: never
    # restarted in place.
    (failure,) = counted
    assert failure.fatal and failure.source == SOURCE_AGENT and failure.rank == rank
    assert failure.round is not None and nan_moves.nan_step(failure.round) == step


def test_an_error_that_moves_fails_the_job_once_the_budget_is_spent(
    tmp_path: Path, etcd: Any, run_id: str
) -> None:
    code, line, output, counted = _run_master(
        tmp_path, etcd, run_id, "tests.model_defs.raises_moving", max_failures="2"
    )
    assert code == 1, output[-3000:]
    assert line.startswith(f"result=failed run={run_id} message="), output[-3000:]
    # Tolerated twice (restarted in place), the third counted failure ends the job.
    assert "3 worker failures exceed --max-failures=2; last: " in line, line
    assert f"RuntimeError: {raises_moving.ERROR}" in line and "raises_moving.py" in line
    assert f"rank {raises_moving.FAILING_RANK}" in line
    assert len(counted) == 3, counted
    steps = {re.findall(rf"{raises_moving.ERROR} (\d+)", f.error)[0] for f in counted}
    assert len(steps) == 3  # it moved: no two starts failed the same way
