"""Seeded chaos at one training job on the test cluster.

The compiled ``elastic-train`` task runs as the master pod with the production settings
(``training_run.TrainingRun``) on three one-worker nodes; the chaos executor fires a seeded plan
(``chaos.plan_chaos``: preempt a worker, SIGKILL a worker pod, delete the master pod and run
the task again as a KFP retry, restart etcd, remove a node, add one), each event once the job
committed progress since the previous one. The job must complete with every sample of every
epoch counted exactly once, nothing left behind, and the final accuracy within 1 point of an
undisturbed run. ``python -m benchmarks chaos`` runs the same with 20+ events.

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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kfp_elastic.testing.cluster.chaos import ChaosExecutor, plan_chaos
from kfp_elastic.testing.cluster.training_run import TrainingRun, undisturbed_accuracy
from tests.helpers import REPO_ROOT

SEED, EVENTS = 0, 5  # seed 0: remove a node, delete the master, kill, preempt, add a node
NODE = {"cpu": "1", "memory": "8Gi"}  # one worker per node: a node's loss is one worker's
PARAMS = {
    # 240 samples, a 4-class classifier
    "model_def": "kfp_elastic.testing.model_defs.counted_blobs",
    "num_shards": 12,
    "min_workers": 1,
    "max_workers": 3,
    # 60 steps at a base world of 3 (15 s of training): 5 events need ~10 of them (each fires
    # after the job moved on), the rest lets the job finish while the reference trains.
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
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))  # pods import tests.model_defs
    began = time.monotonic()
    nodes = {f"node-{i}": NODE for i in range(1, 4)}
    with TrainingRun(tmp_path / "job", PARAMS, nodes=nodes) as run:
        run.start()
        plan = plan_chaos(SEED, EVENTS, nodes=len(nodes), min_nodes=PARAMS["min_workers"])
        outcomes = ChaosExecutor(run, NODE).apply(plan)
        assert [o.index for o in outcomes] == list(range(EVENTS))
        # The reference trains while the job finishes (it has no step time: a few seconds).
        with ThreadPoolExecutor(1) as pool:
            reference = pool.submit(
                undisturbed_accuracy, tmp_path / "undisturbed", run, run.base_world_size()
            )
            assert run.wait_done(180) == "Succeeded", run.log_tail()
            calm = reference.result()

        run.check_exactly_once()
        disturbed = run.accuracy()
        assert abs(disturbed - calm) <= 0.01, f"undisturbed {calm:.4f}, after chaos {disturbed:.4f}"
        assert calm > 0.5, f"the reference did not learn: {calm:.4f}"  # 4 classes: 0.25 by chance

        # The master deleted its workers at the end (the exit handler's pod is left to
        # test_cluster_job: it adds ~8 s here); nothing may run any more.
        assert run.workers() == {}
        run.wait_no_leftovers()
    assert not run.cluster.leftover_processes()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("event=chaos ")]
    assert len(lines) == EVENTS, lines
    print(
        f"chaos seed={SEED}: {[(o.kind.value, o.target, o.recovery_s) for o in outcomes]}; "
        f"accuracy {disturbed:.4f} vs undisturbed {calm:.4f}; {time.monotonic() - began:.1f} s"
    )
