"""A sharded (FSDP2) job resized by SIGKILL, a join and SIGTERM keeps exactly-once data: its
shards move between the ranks' host memory at every world change."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from kfp_elastic.etcd.client import connect
from kfp_elastic.worker.progress import Progress
from tests.helpers import AgentGroup, committed_step, counting_worker_args, new_run_id, wait_for

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
            logs = group.logs(400)
            assert codes == [0, 0], logs
        counts = torch.load(tmp_path / "model.pt")["counts"]
        assert torch.equal(counts, torch.full((SAMPLES,), float(EPOCHS), dtype=torch.float64))
        record, _ = progress.committed_record()
        assert record.complete and record.epoch == EPOCHS
        # Every world after the first restored from memory: no disk fallback.
        sources = re.findall(r"restored rank=\d+ world=\d+ step=\d+ .*? from=(\w+)", logs)
        assert sources and "disk" not in sources, sources
        # Worlds of 3, then 2 (the kill), 3 (the join), 2 (SIGTERM): each restored from memory.
        worlds = [int(w) for w in re.findall(r"restored rank=0 world=(\d+) step=\d+ ", logs)]
        assert worlds[:4] == [3, 2, 3, 2], worlds
    finally:
        client.close()
