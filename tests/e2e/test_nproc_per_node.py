"""Several processes per node: 2 nodes x 2 processes (gloo, CPU), a node SIGKILLed (world 4 -> 2)
and a node joining (2 -> 4), and still every sample of every epoch reaches the final model
exactly once (the counting model-def's weights are the proof, as in test_exactly_once.py).

Each node has its own node-local snapshot directory, as pods do: the survivors' rescue is
written there by the node's local rank 0 only, and a joining node has none.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kfp_elastic.etcd.client import connect
from kfp_elastic.worker.progress import Progress
from tests.helpers import AgentGroup, committed_step, counting_worker_args, new_run_id, wait_for

EPOCHS = 3
SAMPLES = 480
NPROC = 2
STEP_TIME = "0.2"  # 90 steps >= 18 s: the world of 2 still trains when the joining node is up


def start(group: AgentGroup, etcd, run_id: str, workdir: Path, name: str):
    return group.start(
        backend="elastic-etcd",
        endpoint=etcd.endpoint,
        run_id=run_id,
        nnodes="1:2",
        nproc_per_node=NPROC,
        script="-m",
        script_args=[
            "kfp_elastic.worker",
            *counting_worker_args(
                EPOCHS,
                workdir,
                STEP_TIME,
                *("--local-snapshot-dir", str(workdir / f"local-{name}")),
                *("--etcd", etcd.endpoint, "--device", "cpu"),
            ),
        ],
        rdzv_conf={"last_call_timeout": 1},
        name=name,
        env={"COUNTING_SAMPLES": str(SAMPLES)},
    )


def committed_world(progress: Progress) -> tuple[int, int]:
    """(committed step, world size it was trained with); (-1, 0) while etcd does not answer."""
    try:
        record, _ = progress.committed_record()
    except Exception:  # noqa: BLE001 - polled while workers restart
        return -1, 0
    return (record.step, record.world_size) if record else (0, 0)


def test_two_processes_per_node_through_kill_and_join(tmp_path: Path, etcd) -> None:
    run_id = new_run_id("nproc")
    client = connect(etcd.client_settings())
    progress = Progress(client, f"/kfp-elastic/{run_id}")
    try:
        with AgentGroup(tmp_path) as group:
            nodes = [start(group, etcd, run_id, tmp_path, f"node{i}") for i in range(2)]
            step = wait_for(
                lambda: (s := committed_world(progress))[0] >= 6 and s[1] == 4 and s[0],
                90,
                what="2 nodes x 2 processes training",
            )
            nodes[1].sigkill_tree()
            wait_for(
                lambda: (s := committed_world(progress))[0] > step and s[1] == 2,
                60,
                what="the surviving node's 2 processes training (world 2)",
            )
            nodes.append(start(group, etcd, run_id, tmp_path, "node2"))
            step = committed_step(progress)
            wait_for(
                lambda: (s := committed_world(progress))[0] > step and s[1] == 4,
                60,
                what="the joined node's processes training (world 4)",
            )
            codes = [node.wait(120) for node in (nodes[0], nodes[2])]
            assert codes == [0, 0], group.logs(80)
            logs = nodes[0].log_text()
        counts = torch.load(tmp_path / "model.pt")["counts"]
        assert torch.equal(counts, torch.full((SAMPLES,), float(EPOCHS), dtype=torch.float64))
        record, _ = progress.committed_record()
        assert record.complete and record.epoch == EPOCHS
        for epoch in range(EPOCHS):
            assert progress.queue_counts(epoch)["done"] == len(progress.manifest().shards)
        # Both of the surviving node's processes ran in the world of 2 (one per local rank).
        assert "world=2" in logs and "local_rank=1" in logs, logs[-4000:]
    finally:
        client.close()
