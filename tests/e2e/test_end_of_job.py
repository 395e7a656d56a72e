"""The end of a job: every node exits within seconds of the last epoch, with warm start on.

The scenario a new user runs first: the DDP tutorial's script (``tests/scripts/plain_ddp.py``,
nothing of kfp_elastic imported) under three ``torchrun --nnodes=2:3`` agents, the third node's
process tree SIGKILLed after a few epochs; the survivors resume from the script's own snapshot
and must end as soon as their last epoch is done. Also a plain two-node run, the built-in
runtime, and the master with a script that hangs after its last step.
``KFP_ELASTIC_STRESS_RUNS=20`` repeats each run (CI runs each once; the plain two-node run only
in stress runs).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from kfp_elastic.testing.nodes import AgentGroup, new_run_id
from tests.helpers import REPO_ROOT, counting_worker_args, master_command, wait_for

RUNS = int(os.environ.get("KFP_ELASTIC_STRESS_RUNS", "1"))
PLAIN_DDP = REPO_ROOT / "tests" / "scripts" / "plain_ddp.py"
# A run whose nodes have not all exited this long after the last epoch is hung (an end takes
# about a second; torch's own exit barrier alone would wait 300 s).
END_LIMIT_S = 60


def last_epoch_logged(text: str, epochs: int) -> bool:
    return f"Epoch {epochs - 1} |" in text


def wait_all_end(group: AgentGroup, agents, epochs: int, trained=None) -> list[int]:
    """Wait for the end of training (every agent logged its last epoch, or ``trained()``), then
    for every agent to exit."""
    wait_for(
        trained or (lambda: all(last_epoch_logged(a.log_text(), epochs) for a in agents)),
        240,
        0.2,
        "the last epoch",
    )
    last_epoch_seen = time.monotonic()
    try:
        codes = [agent.wait(END_LIMIT_S) for agent in agents]
    except subprocess.TimeoutExpired:
        pytest.fail(f"a node did not exit after the last epoch:\n{group.logs(60)}")
    # For stress runs (-s): how long the end took, the last epoch's log line to every exit.
    print(f"every node exited {time.monotonic() - last_epoch_seen:.1f}s after the last epoch")
    return codes


def start_nodes(group: AgentGroup, etcd, count: int, nnodes: str, **agent) -> list:
    """``count`` agents of one new run (``elastic-etcd``, warm start on)."""
    run_id = new_run_id("end")
    return [
        group.start(
            backend="elastic-etcd",
            endpoint=etcd.endpoint,
            run_id=run_id,
            nnodes=nnodes,
            name=f"node{i}",
            **agent,
        )
        for i in range(count)
    ]


@pytest.mark.parametrize("run", range(RUNS))
def test_the_tutorial_script_ends_after_a_node_is_lost(etcd, tmp_path: Path, run: int) -> None:
    epochs = 12
    with AgentGroup(tmp_path / "logs") as group:
        agents = start_nodes(
            group,
            etcd,
            3,
            "2:3",
            script=PLAIN_DDP,
            script_args=[str(epochs), "1", "--batch_size", "16", "--step_time", "0.02"],
            rdzv_conf={"last_call_timeout": 5},
            max_restarts=3,
            env={"KFP_ELASTIC_SNAPSHOT_DIR": str(tmp_path / "snap")},
        )
        wait_for(lambda: all("Epoch 2 |" in a.log_text() for a in agents), 120, 0.2, "three epochs")
        agents[2].sigkill_tree()
        codes = wait_all_end(group, agents[:2], epochs)
        assert codes == [0, 0], group.logs(60)


@pytest.mark.skipif(RUNS == 1, reason="stress runs only: the node-loss run ends the same way")
@pytest.mark.parametrize("run", range(RUNS))
def test_a_two_node_run_ends_after_its_last_epoch(etcd, tmp_path: Path, run: int) -> None:
    epochs = 3
    with AgentGroup(tmp_path / "logs") as group:
        agents = start_nodes(
            group,
            etcd,
            2,
            "2:2",
            script=PLAIN_DDP,
            script_args=[str(epochs), "1", "--batch_size", "16"],
            env={"KFP_ELASTIC_SNAPSHOT_DIR": str(tmp_path / "snap")},
        )
        assert wait_all_end(group, agents, epochs) == [0, 0], group.logs(60)


@pytest.mark.parametrize("run", range(RUNS))
def test_the_built_in_runtime_ends_after_its_last_step(etcd, tmp_path: Path, run: int) -> None:
    workdir = tmp_path / "work"
    with AgentGroup(tmp_path / "logs") as group:
        agents = start_nodes(
            group,
            etcd,
            2,
            "2:2",
            script="-m",
            script_args=[
                "kfp_elastic.worker",
                *counting_worker_args(2, workdir, "0.0", "--etcd", etcd.endpoint),
            ],
            env={"COUNTING_SAMPLES": "80"},
        )
        model = workdir / "model.pt"
        assert wait_all_end(group, agents, 2, trained=model.exists) == [0, 0], group.logs(60)


def test_the_master_ends_a_worker_that_hangs_after_the_job_completed(
    etcd, tmp_path: Path, run_id: str
) -> None:
    """The job's progress is complete, the script never returns: after ``--finish-grace`` the
    master ends the worker, reports success and names the worker that did not exit."""
    command = master_command(
        ["-m", "tests.scripts.ddp_counting", "--samples", "40", "--hang-at-end"],
        run_id=run_id,
        etcd=etcd.endpoint,
        min_workers=1,
        max_workers=1,
        workdir=tmp_path / "work",
        dataset_length=40,
        shard_size=10,
        epochs=1,
        batch_size=4,
        snapshot_dir=tmp_path / "snap",
        finish_grace=2,
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert re.search(r"did not exit within finish_grace_s=2s", output), output[-4000:]
