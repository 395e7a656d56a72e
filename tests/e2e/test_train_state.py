"""The training state users have survives a node loss: a job using every hook (LR schedule and step
decay, fp16 autocast + GradScaler, clipping, accumulation, momentum, dropout) on two torchrun
agents, one SIGKILLed mid-run and replaced, takes the same LR at every step and ends in the same
state, bit for bit, as the same job undisturbed (same world size, CPU: deterministic)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kfp_elastic.worker.snapshot import Snapshotter
from tests.helpers import Agent, AgentGroup, assert_same_state, new_run_id, read_events, wait_for
from tests.model_defs import full_state

EPOCHS = 4  # 96 samples, global batch 2 x 4 x 2 = 16: 24 steps
KILL_AFTER_STEP = 9


class Job:
    """One job of two agents (its files under ``tmp_path/name``)."""

    def __init__(self, group: AgentGroup, etcd, tmp_path: Path, name: str, step_time: float):
        self.group, self.etcd, self.name = group, etcd, name
        self.work = tmp_path / name
        self.run_id = new_run_id(name)
        self.steps_file = self.work / "steps.jsonl"
        self.args = [
            "kfp_elastic.worker",
            "--model-def",
            "benchmarks.timed_model_def",
            "--epochs",
            str(EPOCHS),
            "--batch-size",
            "4",
            "--snapshot-every",
            "4",
            "--snapshot-dir",
            str(self.work / "snap"),
            "--etcd",
            etcd.endpoint,
            "--output",
            str(self.work / "model.pt"),
            "--step-time",
            str(step_time),
        ]
        self.nodes = [self.start_node("node0"), self.start_node("node1")]

    def start_node(self, node: str) -> Agent:
        return self.group.start(
            backend="elastic-etcd",
            endpoint=self.etcd.endpoint,
            run_id=self.run_id,
            nnodes="2:2",
            script="-m",
            script_args=self.args,
            rdzv_conf={"last_call_timeout": 1},
            name=f"{self.name}-{node}",
            env={
                "TIMED_MODEL_DEF": "tests.model_defs.full_state",
                "TIMED_STEPS_FILE": str(self.steps_file),
            },
        )

    def replace_node1_after(self, step: int) -> None:
        """SIGKILL node1's whole tree once the job finished ``step``; a new node joins."""
        wait_for(
            lambda: any((e["step"] or 0) >= step for e in read_events(self.steps_file)),
            120,
            what=f"step {step} of {self.name}",
        )
        self.nodes[1].sigkill_tree()
        self.nodes = [self.nodes[0], self.start_node("node2")]

    def finish(self) -> str:
        """Wait for a successful end; the agents' logs."""
        assert [node.wait(180) for node in self.nodes] == [0, 0], self.group.logs(60)
        return "".join(node.log_text() for node in self.nodes)


def _lr_by_step(work: Path) -> dict[int, float]:
    """The LR of every step; a step done twice (redone after the restore) had the same LR."""
    lrs: dict[int, set[float]] = {}
    for event in read_events(work / "steps.jsonl"):
        lrs.setdefault(event["step"], set()).add(event["lr"])
    assert all(len(values) == 1 for values in lrs.values()), lrs
    return {step: values.pop() for step, values in lrs.items()}


def _final_snapshot(work: Path) -> dict:
    snapshots = Snapshotter(work / "snap")
    return snapshots.load(snapshots.available()[0])


def test_state_after_a_node_loss_matches_an_undisturbed_run(tmp_path: Path, etcd) -> None:
    with AgentGroup(tmp_path / "logs") as group:
        # Side by side: the machine's time goes to starting processes, not to these steps.
        calm = Job(group, etcd, tmp_path, "calm", step_time=0.0)
        hit = Job(group, etcd, tmp_path, "hit", step_time=0.15)
        hit.replace_node1_after(KILL_AFTER_STEP)
        calm.finish()
        logs = hit.finish()
    restored = re.search(r"restored rank=0 world=2 step=([1-9]\d*) .*from=(\S+)", logs)
    assert restored, logs[-4000:]  # the second world continued from a mid-run state

    expected = _lr_by_step(calm.work)
    assert len(expected) > 20 and len(set(expected.values())) > 10  # a schedule, really
    assert _lr_by_step(hit.work) == expected
    # LR_DECAY: x 0.5 from the step that starts half way through the third epoch (6 steps of 16
    # samples an epoch), in both runs, the disturbed one after its restore too; elsewhere after
    # the warm-up the cosine schedule moves the LR by a few percent a step. (The timed wrapper
    # numbers a step one past the runner's, which of the two is not this test's subject.)
    milestone = full_state.LR_DECAY["epochs"][0]
    decay_step = next(k for k in range(1, 99) if (k - 1) * 16 / full_state.SAMPLES >= milestone)
    ratios = {
        k: expected[k] / expected[k - 1]
        for k in expected
        if k - 1 in expected and k > full_state.WARMUP_STEPS + 2
    }
    drops = {k: ratio for k, ratio in ratios.items() if ratio < 0.9}
    assert len(drops) == 1 and set(drops) <= {decay_step, decay_step + 1}, (decay_step, ratios)
    assert list(drops.values())[0] == pytest.approx(0.5, rel=0.1), ratios
    calm_state, hit_state = _final_snapshot(calm.work), _final_snapshot(hit.work)
    assert set(calm_state) >= {"model", "optimizer", "scheduler", "scaler", "rng"}
    assert calm_state["scaler"]["scale"] < 65536.0  # fp16 overflowed at first: it backed off
    keys = ("model", "optimizer", "scheduler", "scaler", "rng", "step", "epoch", "position")
    assert_same_state({k: hit_state[k] for k in keys}, {k: calm_state[k] for k in keys})
    assert_same_state(torch.load(hit.work / "model.pt"), torch.load(calm.work / "model.pt"))
