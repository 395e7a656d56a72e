"""A sharded (FSDP2) job resized by SIGKILL, a join and SIGTERM keeps exactly-once data: its
shards move between the ranks' host memory at every world change."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from kfp_elastic.components.common import reap_local_processes
from kfp_elastic.etcd.client import connect
from kfp_elastic.master.state import MasterState
from kfp_elastic.worker.progress import Progress
from tests.conftest import SecureEtcd
from tests.helpers import (
    REPO_ROOT,
    AgentGroup,
    committed_step,
    counting_worker_args,
    master_command,
    new_run_id,
    restored_worlds,
    wait_for,
)

EPOCHS = 3
SAMPLES = 480
MODEL_DEF = "kfp_elastic.testing.model_defs.counting_sharded"


def worker_args(etcd, workdir: Path) -> list[str]:
    args = counting_worker_args(EPOCHS, workdir, "0.05", "--etcd", etcd.endpoint)
    args[args.index("kfp_elastic.testing.model_defs.counting")] = MODEL_DEF
    return [
        "kfp_elastic.worker",
        *args,
        "--memory-snapshot-dir",
        str(workdir / "shm"),
        "--disk-snapshot-every",
        "4",
    ]


def committed_world(progress: Progress) -> int:
    record, _ = progress.committed_record()
    return record.world_size if record else 0


def start(group: AgentGroup, etcd, run_id: str, workdir: Path, name: str):
    return group.start(
        backend="elastic-etcd",
        endpoint=etcd.endpoint,
        run_id=run_id,
        nnodes="2:3",
        script="-m",
        script_args=worker_args(etcd, workdir),
        rdzv_conf={"last_call_timeout": 1},
        name=name,
        env={"COUNTING_SAMPLES": str(SAMPLES), "KFP_ELASTIC_WORKER_NAME": name},
    )


def test_sharded_exactly_once_through_kill_join_and_sigterm(tmp_path: Path, private_etcd) -> None:
    etcd = private_etcd
    run_id = new_run_id("sharded")
    client = connect(etcd.client_settings())
    progress = Progress(client, f"/kfp-elastic/{run_id}")
    try:
        with AgentGroup(tmp_path) as group:
            nodes = [start(group, etcd, run_id, tmp_path, f"node{i}") for i in range(3)]
            wait_for(lambda: committed_step(progress) >= 6, 90, what="training under way")
            nodes[1].sigkill_tree()
            step = committed_step(progress)
            wait_for(lambda: committed_step(progress) >= step + 6, 90, what="after the kill")
            nodes.append(start(group, etcd, run_id, tmp_path, "node3"))
            wait_for(lambda: committed_world(progress) == 3, 90, what="the join")
            step = committed_step(progress)
            wait_for(lambda: committed_step(progress) >= step + 6, 90, what="after the join")
            nodes[2].sigterm()
            wait_for(lambda: committed_world(progress) == 2, 90, what="after SIGTERM")
            step = committed_step(progress)
            wait_for(lambda: committed_step(progress) >= step + 3, 90, what="after SIGTERM")
            survivors = [nodes[0], nodes[3]]
            codes = [node.wait(180) for node in survivors]
            # Every agent's lines in time order (their time stamps sort): rank 0 moves between
            # nodes as the worlds change.
            lines = [line for agent in group.agents for line in agent.log_text().splitlines()]
            logs = "\n".join(sorted(lines))
            assert codes == [0, 0], group.logs(400)
        counts = torch.load(tmp_path / "model.pt")["counts"]
        assert torch.equal(counts, torch.full((SAMPLES,), float(EPOCHS), dtype=torch.float64))
        record, _ = progress.committed_record()
        assert record.complete and record.epoch == EPOCHS
        # Every world after the first restored from memory: no disk fallback.
        sources = re.findall(r"restored rank=\d+ world=\d+ step=\d+ .*? from=(\w+)", logs)
        assert sources and "disk" not in sources, sources
        # Worlds of 3, then 2 (the kill), 3 (the join), 2 (SIGTERM): each restored from memory.
        worlds = restored_worlds(logs)
        assert worlds[:4] == [3, 2, 3, 2], worlds
    finally:
        client.close()


@pytest.mark.timeout(300)
def test_own_fsdp_script_through_the_master_on_tls_etcd_with_two_processes_per_node(
    tmp_path: Path, secure_etcd: SecureEtcd, run_id: str
) -> None:
    """The user's own FSDP2 script (the script API, ``tests/scripts/ddp_counting.py --fsdp``)
    under ``kfp-elastic master``, TLS + auth etcd, 2 workers x 2 processes: a preemption
    (SIGTERM to one worker's agent) loses no step, the next world reshards from memory, every
    sample counts once per epoch, and the run's host-memory shards are gone when the job ends."""
    etcd = secure_etcd.settings
    memory = tmp_path / "shm"
    command = master_command(
        [
            *("-m", "tests.scripts.ddp_counting", "--fsdp"),
            *("--samples", str(SAMPLES), "--step-time", "0.05"),
        ],
        run_id=run_id,
        etcd=etcd.endpoint_text,
        etcd_cacert=str(etcd.cacert),
        etcd_cert=str(etcd.cert),
        etcd_key=str(etcd.key),
        etcd_user=str(etcd.user),
        etcd_password_file=str(etcd.password_file),
        min_workers=1,
        max_workers=2,
        nproc_per_worker=2,
        max_wait=60,
        rdzv_conf="last_call_timeout=30",
        workdir=tmp_path / "work",
        dataset_length=SAMPLES,
        shard_size=20,
        epochs=2,
        batch_size=4,
        snapshot_every=3,
        snapshot_dir=tmp_path / "snap",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KFP_ELASTIC_ETCD_")}
    env.update(PYTHONPATH=str(REPO_ROOT), KFP_ELASTIC_MEMORY_SNAPSHOT_DIR=str(memory))
    client = connect(etcd)
    progress = Progress(client, etcd.run_prefix(run_id))
    state = MasterState(client, etcd.run_prefix(run_id))
    log_path = tmp_path / "master.log"
    with open(log_path, "wb") as log:
        master = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(lambda: committed_world(progress) == 4, 120, 0.2, "2 workers x 2 processes")
        wait_for(lambda: committed_step(progress) >= 6, 120, 0.2, "training under way")
        agent = next(r["pid"] for r in state.workers().values() if r.get("pid"))
        os.kill(agent, signal.SIGTERM)  # a preemption notice to one worker
        assert master.wait(240) == 0, log_path.read_text()[-4000:]
        counts = torch.load(tmp_path / "snap" / "model.pt", weights_only=True)["counts"]
        assert torch.equal(counts, torch.full((SAMPLES,), 2.0, dtype=torch.float64))
        logs = "\n".join(
            p.read_text(errors="replace") for p in sorted((tmp_path / "work").rglob("*.log"))
        )
        stops = [int(s) for s in re.findall(r"stopping on SIGTERM rank=\d+ step=(\d+)", logs)]
        restores = [int(s) for s in re.findall(r"restored rank=0 world=\d+ step=(\d+)", logs)]
        assert stops and set(stops) <= set(restores), (stops, restores)  # 0 steps lost
        assert "from=memory" in logs and "on-disk snapshot" not in logs
        assert not (memory / run_id).exists()  # the master removed every node's shards
    finally:
        if master.poll() is None:
            master.kill()
        master.wait(10)
        reap_local_processes(run_id)
        client.close()
