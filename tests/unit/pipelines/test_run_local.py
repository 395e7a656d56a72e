"""``kfp-elastic run-local``'s terminal: task and progress lines, and at the end why a run failed
and where its logs are; kfp.local's JSON only in the log (or with ``--verbose``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kfp_elastic.pipelines.run_local import failure_reason, print_outputs, terminal_line
from tests.helpers import REPO_ROOT

KFP_OUTPUT = """\
01:07:59.369 - INFO - Executing task \x1b[96m'shard-dataset'\x1b[0m
01:07:59.370 - INFO - Streamed logs:
    [KFP Executor 2026-11-26 01:07:59,742 INFO]: Got executor_input:
    {
        "inputs": {
            "parameterValues": {
    ValueError: an earlier, handled error
    kfp_elastic.worker.model_def.ModelDefError: --model-def nosuch.module: module not found
01:08:02.169 - ERROR - Task \x1b[96m'shard-dataset'\x1b[0m finished with status FAILURE
01:08:02.171 - INFO - Executing task \x1b[96m'stop-workers'\x1b[0m
    stop_workers: pipeline FAILED (Task exit-handler-1 failed.), run kfp-5
    RuntimeError: not the first failure
01:08:02.503 - INFO - Task \x1b[96m'stop-workers'\x1b[0m finished with status \x1b[91mFAILURE\x1b[0m
"""


def test_only_task_and_progress_lines_reach_the_terminal() -> None:
    shown = [line for line in KFP_OUTPUT.splitlines() if terminal_line(line)]
    assert len(shown) == 5
    assert not [line for line in shown if "executor_input" in line or "{" in line]
    assert terminal_line("    [   12.3s] worker-1 lost: preempted")
    assert terminal_line("    elastic_train: run kfp-5, 1..2 workers, launcher local")


def test_the_reason_is_the_first_failed_tasks_last_error() -> None:
    assert failure_reason(KFP_OUTPUT.splitlines()) == (
        "task shard-dataset: ModelDefError: --model-def nosuch.module: module not found"
    )
    assert failure_reason(["01:00:00.000 - INFO - Executing task 'x'"]) is None


def test_the_banner_names_the_reason_the_log_and_an_existing_run_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "elastic-training-2026"
    (run / "elastic-train" / "job" / "workers").mkdir(parents=True)
    print_outputs(False, run, tmp_path / "run.log", "task x: RuntimeError: boom", tmp_path)
    out = capsys.readouterr().out
    assert "reason:        task x: RuntimeError: boom" in out
    assert f"full log:      {tmp_path / 'run.log'}" in out
    assert f"outputs under {run}" in out and "worker logs:" in out
    assert "no run directory" not in out
    print_outputs(False, None, tmp_path / "run.log", None, tmp_path)
    assert f"no run directory under {tmp_path}" in capsys.readouterr().out


def test_a_failing_run_ends_with_its_reason_and_no_json(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kfp_elastic",
            "run-local",
            "--pipeline-root",
            str(tmp_path),
            "--model-def",
            "no_such.model_def",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert result.returncode == 1
    out = result.stdout
    assert "parameterValues" not in out and "Traceback" not in out
    banner = out.rstrip().splitlines()[-5:-1]  # then a closing rule
    assert banner[0] == "pipeline elastic-training: FAILED"
    assert banner[1].startswith(
        "  reason:        task shard-dataset: ModelDefError: --model-def no_such.model_def"
    )
    log = Path(banner[2].split("full log:", 1)[1].strip())
    assert "parameterValues" in log.read_text()  # everything is in the log
    assert banner[3].startswith(f"outputs under {tmp_path}/elastic-training-")
