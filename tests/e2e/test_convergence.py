"""The digits example trained while the world goes 3 → 2 → 3 matches an undisturbed run."""

from __future__ import annotations

from pathlib import Path

from kfp_elastic.etcd.client import connect
from kfp_elastic.worker.evaluate import evaluate
from kfp_elastic.worker.progress import Progress
from tests.helpers import AgentGroup, new_run_id, wait_for

MODEL_DEF = "kfp_elastic.worker.examples.digits"


def train(tmp: Path, etcd, disturb: bool) -> float:
    run_id = new_run_id("digits")
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
        "--etcd",
        etcd.endpoint,
        "--output",
        str(tmp / "model.pt"),
        "--step-time",
        "0.04",
    ]
    client = connect(etcd.client_settings())
    progress = Progress(client, f"/kfp-elastic/{run_id}")

    def step() -> int:
        record, _ = progress.committed_record()
        return record.step if record else 0

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
                )

            nodes = [start(f"node{i}") for i in range(3)]
            if disturb:
                wait_for(lambda: step() >= 40, 120, what="first world")
                nodes[2].sigkill_tree()
                reached = step()
                # The newcomer starts as soon as the world of 2 trains: its own start (python,
                # torch, zygote) takes seconds and the remaining steps must outlast it.
                wait_for(lambda: step() >= reached + 5, 120, what="world of 2")
                nodes[2] = start("node3")
            codes = [n.wait(240) for n in nodes]
            assert codes == [0, 0, 0], group.logs(60)
    finally:
        client.close()
    return evaluate(MODEL_DEF, tmp / "model.pt").accuracy


def test_elastic_run_converges_like_a_static_one(tmp_path: Path, etcd) -> None:
    calm = train(tmp_path / "calm", etcd, disturb=False)
    disturbed = train(tmp_path / "disturbed", etcd, disturb=True)
    assert calm > 0.9, f"undisturbed accuracy {calm:.3f}"
    assert abs(disturbed - calm) <= 0.005, f"calm {calm:.4f} vs disturbed {disturbed:.4f}"
