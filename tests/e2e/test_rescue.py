"""Rescue snapshots: a SIGKILLed node costs the survivors at most the step in flight.

The file-level rules are tested on a directory; the promise itself with real torchrun agents:
snapshots only at epoch ends (``--snapshot-every 1000``), the node of rank 0 (the one that
commits) SIGKILLed mid-epoch, and the next world resumes from the survivors' last finished step
instead of the epoch start — with every sample still counted exactly once.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kfp_elastic.etcd.client import connect
from kfp_elastic.worker.progress import Progress
from kfp_elastic.worker.rescue import Rescues, best_holder, rescue_name
from tests.helpers import AgentGroup, new_run_id, read_events, wait_for

EPOCHS = 2
SAMPLES = 480


def _state(step: int) -> dict:
    return {
        "model": {"w": torch.full((3,), float(step))},
        "optimizer": {"state": {}},
        "step": step,
        "epoch": 0,
        "position": 12 * step,
        "rng": torch.get_rng_state(),
    }


def test_newest_rescue_past_the_commit_wins_and_old_ones_go(tmp_path: Path) -> None:
    rescues = Rescues(tmp_path, "run-a")
    rescues.write(7, 1, _state(7))
    rescues.write(9, 1, _state(9))  # replaces rank 1's older rescue
    rescues.write(8, 2, _state(8))
    assert sorted(p.name for p in tmp_path.iterdir()) == [rescue_name(8, 2), rescue_name(9, 1)]
    step, state = rescues.newest_after(5)
    assert step == 9 and torch.equal(state["model"]["w"], torch.full((3,), 9.0))
    assert rescues.newest_after(9) is None  # not newer than what is committed
    rescues.discard_up_to(8)
    assert [p.name for p in tmp_path.iterdir()] == [rescue_name(9, 1)]


def test_rescue_of_another_run_or_corrupt_is_skipped(tmp_path: Path) -> None:
    Rescues(tmp_path, "other-run").write(20, 0, _state(20))
    mine = Rescues(tmp_path, "run-a")
    mine.write(10, 1, _state(10))
    mine.write(15, 2, _state(15))
    (tmp_path / rescue_name(15, 2)).write_bytes(b"KFPSNAP1 truncated")
    step, _ = mine.newest_after(0)
    assert step == 10


@pytest.mark.parametrize(
    ("steps", "committed", "holder"),
    [
        ([-1, -1, -1], 5, None),
        ([5, 4, -1], 5, None),
        ([-1, 9, 9], 5, 1),
        ([10, 11, 9], 5, 1),
    ],
)
def test_best_holder(steps: list[int], committed: int, holder: int | None) -> None:
    assert best_holder(steps, committed) == holder


def _rank0_agent(agents: list, world: int):
    pattern = f"restored rank=0 world={world} "
    return next(a for a in agents if pattern in a.log_text())


def test_sigkill_of_rank0_node_resumes_from_survivors_last_step(tmp_path: Path, etcd) -> None:
    run_id = new_run_id("rescue")
    client = connect(etcd.client_settings())
    progress = Progress(client, f"/kfp-elastic/{run_id}")
    steps_file = tmp_path / "steps.jsonl"  # one line per optimizer step (step post-hook)
    args = [
        "kfp_elastic.worker",
        "--model-def",
        "benchmarks.timed_model_def",
        "--epochs",
        str(EPOCHS),
        "--batch-size",
        "4",
        "--snapshot-every",
        "1000",
        "--snapshot-dir",
        str(tmp_path / "snap"),
        "--etcd",
        etcd.endpoint,
        "--output",
        str(tmp_path / "model.pt"),
        "--step-time",
        "0.05",
    ]
    try:
        with AgentGroup(tmp_path / "logs") as group:
            nodes = [
                group.start(
                    backend="elastic-etcd",
                    endpoint=etcd.endpoint,
                    run_id=run_id,
                    nnodes="2:3",
                    script="-m",
                    script_args=args,
                    rdzv_conf={"last_call_timeout": 1},
                    name=f"node{i}",
                    env={
                        "COUNTING_SAMPLES": str(SAMPLES),
                        "TIMED_MODEL_DEF": "kfp_elastic.testing.model_defs.counting",
                        "TIMED_STEPS_FILE": str(steps_file),
                    },
                )
                for i in range(3)
            ]
            wait_for(
                lambda: any(e["world"] == 3 and e["step"] >= 8 for e in read_events(steps_file)),
                120,
                what="step 8 of the 3-node world",
            )  # nothing committed before 40
            victim = _rank0_agent(nodes, 3)
            killed_at = victim.sigkill_tree()
            survivors = [n for n in nodes if n is not victim]
            assert [n.wait(180) for n in survivors] == [0, 0], group.logs(80)
            text = "".join(n.log_text() for n in survivors)
        rescued = [int(s) for s in re.findall(r"rescued rank=\d+ step=(\d+)", text)]
        restored = re.search(r"restored rank=0 world=2 step=(\d+) .*from=rescue of rank", text)
        assert rescued and restored, text[-4000:]
        reached = max(e["step"] for e in read_events(steps_file) if e["t"] < killed_at)
        # Survivors kept their last finished step: at most the one in flight is done again.
        assert int(restored.group(1)) == max(rescued) >= reached - 1 >= 7
        counts = torch.load(tmp_path / "model.pt")["counts"]
        assert torch.equal(counts, torch.full((SAMPLES,), float(EPOCHS), dtype=torch.float64))
        record, _ = progress.committed_record()
        assert record.complete and record.epoch == EPOCHS
        for epoch in range(EPOCHS):
            assert progress.queue_counts(epoch)["done"] == len(progress.manifest().shards)
        assert not list((tmp_path / "snap").glob("rescue-*")), "rescues outlived their commit"
    finally:
        client.close()
