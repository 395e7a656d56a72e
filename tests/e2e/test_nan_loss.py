"""A NaN loss is no success: the job fails with an error naming the step and the rank
(``--nan-policy fail``, the default), or skips that step and finishes (``skip``)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from tests.helpers import REPO_ROOT, run_master_job
from tests.model_defs.nan_at_step import NAN_RANK, NAN_STEP

NAN_DEF = "tests.model_defs.nan_at_step"


def _run_master(tmp_path: Path, etcd: Any, run_id: str, *options: str) -> tuple[int, str, str]:
    code, line, output, _ = run_master_job(tmp_path, etcd, run_id, NAN_DEF, *options)
    return code, line, output


def test_a_nan_loss_fails_the_job_naming_the_step_and_rank(
    tmp_path: Path, etcd: Any, run_id: str
) -> None:
    code, line, output = _run_master(tmp_path, etcd, run_id)
    assert code == 1, output[-3000:]
    assert line.startswith(f"result=failed run={run_id} message="), output[-3000:]
    assert f"NonFiniteLoss: non-finite loss (nan) at step {NAN_STEP} on rank {NAN_RANK}" in line


def test_with_the_skip_policy_every_rank_skips_that_step_and_the_job_finishes(
    tmp_path: Path, etcd: Any, run_id: str
) -> None:
    code, line, output = _run_master(tmp_path, etcd, run_id, "--nan-policy", "skip")
    assert code == 0, output[-3000:]
    assert line.startswith(f"result=succeeded run={run_id}"), output[-3000:]
    logs = "".join(p.read_text() for p in (tmp_path / "work" / "workers").glob("*.log"))
    # Only rank NAN_RANK's loss was NaN; the other rank skips the same step with it.
    for rank in (0, 1):
        assert f"skipped step={NAN_STEP} rank={rank}: non-finite gradients" in logs


def _torchrun_script(tmp_path: Path, etcd: Any, run_id: str, policy: str) -> Any:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KFP_ELASTIC_")}
    env.update(
        KFP_ELASTIC_SNAPSHOT_DIR=str(tmp_path / "snap"),
        KFP_ELASTIC_BATCH_SIZE="4",
        KFP_ELASTIC_NAN_POLICY=policy,
        PYTHONPATH=str(REPO_ROOT),
    )
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2"),
        "--rdzv-backend=elastic-etcd",
        f"--rdzv-endpoint={etcd.endpoint}",
        f"--rdzv-id={run_id}",
        "--rdzv-conf=last_call_timeout=1",
        str(REPO_ROOT / "tests" / "scripts" / "nan_loss_script.py"),
    ]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)


def test_the_script_api_applies_the_same_nan_policy(tmp_path: Path, etcd: Any) -> None:
    failed = _torchrun_script(tmp_path / "fail", etcd, f"{uuid.uuid4().hex[:10]}-f", "fail")
    assert failed.returncode != 0
    assert "NonFiniteLoss: non-finite loss (nan) at step 3 on rank 1" in failed.stderr
    skipped = _torchrun_script(tmp_path / "skip", etcd, f"{uuid.uuid4().hex[:10]}-s", "skip")
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    assert "rank 0 finished steps=6" in skipped.stdout
    assert "non-finite loss step=3 rank=1" in skipped.stderr
