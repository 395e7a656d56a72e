"""The sharded digits example (FSDP2, AdamW) trained while the world goes 3 → 2 (SIGKILL) →
3 (a join) → 2 (SIGTERM) matches a fixed-size sharded run with the same global batch, within
the DDP convergence test's tolerance (tests/e2e/test_convergence.py)."""

from __future__ import annotations

from pathlib import Path

from kfp_elastic.etcd.client import connect
from kfp_elastic.worker.evaluate import evaluate
from kfp_elastic.worker.progress import Progress
from tests.helpers import AgentGroup, new_run_id, restored_worlds, wait_for

MODEL_DEF = "kfp_elastic.worker.examples.digits_sharded"
ACCURACY_TOLERANCE = 0.005  # the DDP convergence test's


def train(tmp: Path, etcd, disturb: bool) -> tuple[float, float, str]:
    run_id = new_run_id("sharded-digits")
    args = [
        "kfp_elastic.worker",
        "--model-def",
        MODEL_DEF,
        "--epochs",
        "8",
        "--batch-size",
        "16",
        "--policy",
        "fixed-global-batch",
        "--base-world-size",
        "3",
        "--snapshot-every",
        "5",
        "--snapshot-dir",
        str(tmp / "snap"),
        "--memory-snapshot-dir",
        str(tmp / "shm"),
        "--etcd",
        etcd.endpoint,
        "--output",
        str(tmp / "model.pt"),
        "--step-time",
        "0.04",
    ]
    client = connect(etcd.client_settings())
    progress = Progress(client, f"/kfp-elastic/{run_id}")

    def record() -> tuple[int, int]:
        committed, _ = progress.committed_record()
        return (committed.step, committed.world_size) if committed else (0, 0)

    try:
        with AgentGroup(tmp) as group:

            def start(name: str):
                return group.start(
                    backend="elastic-etcd",
                    endpoint=etcd.endpoint,
                    run_id=run_id,
                    nnodes="2:3",
                    script="-m",
                    script_args=args,
                    name=name,
                    rdzv_conf={"last_call_timeout": 1},
                    env={"KFP_ELASTIC_WORKER_NAME": name},
                )

            nodes = [start(f"node{i}") for i in range(3)]
            survivors = nodes
            if disturb:
                wait_for(lambda: record()[0] >= 30, 120, what="first world")
                nodes[2].sigkill_tree()
                wait_for(lambda: record()[1] == 2, 120, what="world of 2")
                reached = record()[0]
                wait_for(lambda: record()[0] >= reached + 5, 120, what="world of 2 trains")
                nodes.append(start("node3"))
                wait_for(lambda: record()[1] == 3, 120, what="the join")
                reached = record()[0]
                wait_for(lambda: record()[0] >= reached + 5, 120, what="world of 3 trains")
                nodes[1].sigterm()
                wait_for(lambda: record()[1] == 2, 120, what="world of 2 after SIGTERM")
                survivors = [nodes[0], nodes[3]]
            codes = [n.wait(300) for n in survivors]
            # Every agent's lines in time order (their time stamps sort): rank 0 moves between
            # nodes as the worlds change.
            lines = [line for agent in group.agents for line in agent.log_text().splitlines()]
            logs = "\n".join(sorted(lines))
            assert codes == [0] * len(survivors), group.logs(400)
    finally:
        client.close()
    result = evaluate(MODEL_DEF, tmp / "model.pt")
    return result.accuracy, result.loss, logs


def test_resized_sharded_run_converges_like_a_fixed_size_one(tmp_path: Path, etcd) -> None:
    calm, calm_loss, _ = train(tmp_path / "calm", etcd, disturb=False)
    disturbed, disturbed_loss, logs = train(tmp_path / "disturbed", etcd, disturb=True)
    assert calm > 0.9, f"fixed-size accuracy {calm:.3f}"
    assert abs(disturbed - calm) <= ACCURACY_TOLERANCE, (
        f"fixed-size {calm:.4f} vs resized {disturbed:.4f} (loss {calm_loss:.4f} vs "
        f"{disturbed_loss:.4f})"
    )
    assert abs(disturbed_loss - calm_loss) <= 0.05 * calm_loss, (calm_loss, disturbed_loss)
    worlds = restored_worlds(logs)
    assert worlds[:4] == [3, 2, 3, 2], worlds
    assert "on-disk snapshot" not in logs  # every resize resharded from memory
