"""The invariant end to end with the master: worker SIGKILL, master SIGKILL + restart, a
preemption (SIGTERM) and an etcd restart; every sample reaches the final model once per epoch."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import torch

from kfp_elastic.etcd.client import connect
from kfp_elastic.job_env import RUN_ID_ENV
from kfp_elastic.master.state import MasterState
from kfp_elastic.master.timeline import EventKind, read_timeline
from kfp_elastic.processes import pids_with_env, signal_quietly
from kfp_elastic.worker.progress import Progress
from tests.helpers import (
    REPO_ROOT,
    committed_step,
    counting_worker_args,
    master_command,
    sigkill_process_tree,
    wait_for,
)

EPOCHS, SAMPLES = 3, 480


def test_every_sample_once_through_master_and_etcd_restarts(
    tmp_path: Path, private_etcd, run_id: str
) -> None:
    etcd = private_etcd
    command = master_command(
        [
            "-m",
            "kfp_elastic.worker",
            *counting_worker_args(EPOCHS, tmp_path),
        ],
        run_id=run_id,
        etcd=etcd.endpoint,
        min_workers="2",
        max_workers="3",
        leader_ttl="2",
        max_wait="120",
        rdzv_conf="last_call_timeout=1",
        workdir=str(tmp_path / "work"),
        dataset_length=str(SAMPLES),
        shard_size="40",
        epochs=str(EPOCHS),
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "COUNTING_SAMPLES": str(SAMPLES),
        "KFP_ELASTIC_RUN_ID": run_id,
    }
    client = connect(etcd.client_settings())
    progress = Progress(client, f"/kfp-elastic/{run_id}")
    state = MasterState(client, f"/kfp-elastic/{run_id}")
    masters: list[subprocess.Popen] = []

    def start_master(index: int) -> subprocess.Popen:
        log = open(tmp_path / f"master{index}.log", "wb")  # noqa: SIM115 - closed below
        master = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        masters.append(master)
        return master

    def progressed(by: int, what: str) -> None:
        start = committed_step(progress)
        try:
            wait_for(lambda: committed_step(progress) >= start + by, 120, 0.2, what)
        except TimeoutError as error:  # say where it stood: the masters' and workers' logs
            raise TimeoutError(f"{error} (committed step {start})\n{_logs(tmp_path)}") from error

    def a_worker_pid() -> int:
        workers = wait_for(
            lambda: [
                r["pid"] for r in state.workers().values() if r.get("pid") and _alive(r["pid"])
            ],
            60,
            0.2,
            "a worker",
        )
        return workers[0]

    try:
        start_master(0)
        progressed(6, "training under way")
        sigkill_process_tree(a_worker_pid())  # a node dies
        progressed(6, "training after the worker kill")
        masters[0].send_signal(signal.SIGKILL)  # the master dies
        masters[0].wait(10)
        second = start_master(1)
        progressed(6, "training after the master restart")
        os.kill(a_worker_pid(), signal.SIGTERM)  # a preemption notice
        progressed(6, "training after the preemption")
        etcd.restart()
        assert second.wait(240) == 0, (tmp_path / "master1.log").read_text()[-4000:]
        counts = torch.load(tmp_path / "model.pt")["counts"]
        assert torch.equal(counts, torch.full((SAMPLES,), float(EPOCHS), dtype=torch.float64))
        for epoch in range(EPOCHS):
            assert progress.queue_counts(epoch) == {"todo": 0, "doing": 0, "done": 12}
        kinds = [event.kind for event in read_timeline(client, f"/kfp-elastic/{run_id}")]
        assert EventKind.MASTER_RECOVERED in kinds and EventKind.WORKER_LOST in kinds
        assert kinds[-1] is EventKind.JOB_DONE
    finally:
        for master in masters:
            with contextlib.suppress(ProcessLookupError):
                master.kill()
            master.wait(10)
        _kill_run(run_id)
        client.close()


def _logs(root: Path, tail: int = 3000) -> str:
    """The end of every log under ``root`` (the masters', the workers' in the work dir)."""
    parts = []
    for log in sorted(root.rglob("*.log")):
        parts.append(f"==== {log.relative_to(root)}\n{log.read_text(errors='replace')[-tail:]}")
    return "\n".join(parts)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def _kill_run(run_id: str) -> None:
    for _ in range(3):
        for pid in pids_with_env(RUN_ID_ENV, run_id):
            signal_quietly(pid, signal.SIGKILL)
        time.sleep(0.1)
