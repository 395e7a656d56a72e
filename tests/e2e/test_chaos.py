"""Seeded chaos at one training job on the test cluster.

The compiled ``elastic-train`` task runs as the master pod with the production settings
(``training_run.TrainingRun``) on three one-worker nodes; ``chaos.run_chaos`` fires a seeded
plan (``chaos.plan_chaos``: preempt a worker, SIGKILL a worker pod, delete the master pod and
run the task again as a KFP retry, restart etcd, remove a node, add one) spread over the run's
committed steps, waiting after each for what it does to the rendezvous round, and checks the
run: every event recovered, the job completed, every sample of every epoch counted exactly
once, nothing left behind, and the final accuracy within 1 point of an undisturbed run.
``python -m benchmarks chaos`` runs the same with 20 events, on any seeds.

The undisturbed reference is the same model definition trained by a static local torchrun job
(one process, no disruption) on the job's own shard manifest, seed and global batch
(``training_run.undisturbed_accuracy``). With ``fixed-global-batch`` every step takes the same
samples whatever the world size, so an undisturbed run at world 1 is the same training as one
at the job's size; the run costs a few seconds (no step time), so it is measured here rather
than assumed.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from kfp_elastic.testing.cluster.chaos import run_chaos
from kfp_elastic.testing.cluster.training_run import TrainingRun
from tests.helpers import REPO_ROOT

SEED, EVENTS = 0, 5  # seed 0: remove a node, delete the master, kill, preempt, add a node
NODE = {"cpu": "1", "memory": "8Gi"}  # one worker per node: a node's loss is one worker's
PARAMS = {
    # 240 samples, a 4-class classifier
    "model_def": "kfp_elastic.testing.model_defs.counted_blobs",
    "num_shards": 12,
    "min_workers": 1,
    "max_workers": 3,
    # 60 steps at a base world of 3 (15 s of training): the 5 events are spread over the
    # first 54 of them, the rest lets the job finish while the reference trains.
    "epochs": 6,
    "batch_size": 8,
    "snapshot_every": 2,
    "step_time": 0.25,
    "worker_cpu": "1",
    "max_wait_s": 120.0,
    "max_failures": 20,  # SIGKILLed workers count as failures; they are the point here
}


def test_a_job_survives_seeded_chaos_exactly_once_and_as_accurate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kfp_elastic.testing.cluster.chaos")
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))  # pods import kfp_elastic from this checkout
    began = time.monotonic()
    nodes = {f"node-{i}": NODE for i in range(1, 4)}
    with TrainingRun(tmp_path / "job", PARAMS, nodes=nodes) as run:
        result = run_chaos(run, SEED, EVENTS, NODE, tmp_path / "undisturbed", done_timeout_s=180)
        assert result.ok, "\n".join(
            [*(f"{c.name}: {c.detail}" for c in result.failed()), run.log_tail()]
        )
        # Spread over the run, not all at its start; and the run ended as the checks say.
        steps = [event.at_step for event in result.plan]
        assert len(steps) == EVENTS and steps[-1] > result.total_steps // 2, steps
        assert [o.index for o in result.outcomes] == list(range(EVENTS))
        assert {c.name for c in result.checks} == {
            "events",
            "completion",
            "exactly_once",
            "accuracy",
            "leftovers",
        }
        assert result.undisturbed_accuracy is not None and result.undisturbed_accuracy > 0.5, (
            f"the reference did not learn: {result.undisturbed_accuracy}"  # 4 classes: 0.25
        )
        # The master deleted its workers at the end (the exit handler's pod is left to
        # test_cluster_job: it adds ~8 s here).
        assert run.workers() == {}
    assert not run.cluster.leftover_processes()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("event=chaos ")]
    assert len(lines) == EVENTS, lines
    events = [
        (o.kind.value, o.target, o.at_step, o.new_world, o.recovery_s) for o in result.outcomes
    ]
    print(
        f"chaos seed={SEED}: {events}"
        f"; accuracy {result.accuracy:.4f} vs undisturbed {result.undisturbed_accuracy:.4f}; "
        f"{time.monotonic() - began:.1f} s"
    )
