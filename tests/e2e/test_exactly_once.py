"""Every sample of every epoch reaches the final model exactly once, whatever happens.

The counting model-def's weights count how often each sample contributed to an optimizer step
the final model descends from, so the final model itself is the proof.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kfp_elastic.etcd.client import connect
from kfp_elastic.worker.progress import Progress
from tests.helpers import AgentGroup, committed_step, counting_worker_args, new_run_id, wait_for

EPOCHS = 3
SAMPLES = 480


def worker_args(etcd, workdir: Path) -> list[str]:
    return [
        "kfp_elastic.worker",
        *counting_worker_args(EPOCHS, workdir, "0.05", "--etcd", etcd.endpoint),
    ]


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
        env={"COUNTING_SAMPLES": str(SAMPLES)},
    )


def test_exactly_once_through_kill_sigterm_join_and_etcd_restart(
    tmp_path: Path, private_etcd
) -> None:
    etcd = private_etcd
    run_id = new_run_id("once")
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
            step = committed_step(progress)
            wait_for(lambda: committed_step(progress) >= step + 9, 90, what="after the join")
            nodes[2].sigterm()
            step = committed_step(progress)
            wait_for(lambda: committed_step(progress) >= step + 6, 90, what="after SIGTERM")
            etcd.restart()
            survivors = [nodes[0], nodes[3]]
            codes = [node.wait(180) for node in survivors]
            assert codes == [0, 0], group.logs(80)
        counts = torch.load(tmp_path / "model.pt")["counts"]
        assert torch.equal(counts, torch.full((SAMPLES,), float(EPOCHS), dtype=torch.float64))
        record, _ = progress.committed_record()
        assert record.complete and record.epoch == EPOCHS
        for epoch in range(EPOCHS):
            assert progress.queue_counts(epoch) == {
                "todo": 0,
                "doing": 0,
                "done": len(progress.manifest().shards),
            }
    finally:
        client.close()
