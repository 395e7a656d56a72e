"""One failure budget per job: a failure that moves is not restarted in place forever.

Without the budget, torchrun restarted such a worker in place (``--max-restarts=100``), each
start failing at another step, so no agent saw "the same failure again"; the master never saw a
worker end, and the job ended "succeeded" once the failure had moved past the last step.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from kfp_elastic.contract.failure_budget import SOURCE_AGENT, CountedFailure, read_failures
from kfp_elastic.etcd.client import connect
from tests.helpers import run_master_job
from tests.model_defs import nan_moves, raises_moving


def _run_master(
    tmp_path: Path, etcd: Any, run_id: str, model_def: str, **flags: str
) -> tuple[int, str, str, tuple[CountedFailure, ...]]:
    """Run a 2-worker job of a few steps to its end: (exit code, result line, output, the
    failures counted in etcd)."""
    code, line, output, left = run_master_job(tmp_path, etcd, run_id, model_def, **flags)
    assert not left, f"workers left running: {sorted(left)}\n{output[-3000:]}"
    client = connect(etcd.client_settings())
    try:
        counted = read_failures(client, etcd.client_settings().run_prefix(run_id))
    finally:
        client.close()
    return code, line, output, counted


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
