"""One training job on the test cluster, as a KFP run with the production settings would go.

The compiled pipeline's ``elastic-train`` task and its exit handler run as pods (command and
args as compiled, executor input as the KFP launcher builds it; ``testing/cluster/kfp_task.py``)
with the production overlay's ConfigMap and etcd with mutual TLS through a mounted Secret. The
master (the ``elastic-train`` pod) creates worker pods that run ``torchrun
--rdzv-backend=elastic-etcd``. Then: capacity for 2 of 3 workers → it trains with 2, the third
Pending; a serving pod preempts one worker (SIGTERM, no step lost); the serving pod goes and a node
comes → the world grows to 3; the master's pod is deleted and created again (a KFP retry) → the
new master adopts the running workers; the job completes with every sample of every epoch counted
once, writes model, metrics and report; the exit handler's pod finds nothing left to delete.
The master pod runs the compiled command under stand-ins of Argo's emissary and KFP's launcher
(``testing/cluster/kfp_launcher.py``), so its deletion goes as on the KFP backend.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from kfp_elastic.master.timeline import EventKind, MasterRecovered, MasterSteppedDown, WorkerLost
from kfp_elastic.testing.cluster.training_run import TrainingRun
from tests.helpers import REPO_ROOT, wait_for

# Long enough (8 epochs of 15 steps of >= 0.4 s) that the retried master, which takes 10-15 s
# to start on a loaded 2-core machine, finds the workers still training; each phase below moves
# on at the first commit of the new world so that training time is not spent waiting.
EPOCHS, SHARDS = 8, 12
PARAMS = {
    "model_def": "kfp_elastic.testing.model_defs.counting",  # 240 samples
    "num_shards": SHARDS,
    "min_workers": 1,
    "max_workers": 3,
    "epochs": EPOCHS,
    "batch_size": 8,
    "snapshot_every": 3,
    "step_time": 0.4,
    "worker_cpu": "1",
    "max_wait_s": 120.0,
}


def test_training_task_as_master_pod_through_preemption_growth_and_a_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pods get the host's PYTHONPATH: the counting model definition lives under tests/.
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    with TrainingRun(tmp_path, PARAMS, nodes={"node-1": {"cpu": "2", "memory": "8Gi"}}) as run:
        run.start()

        # 1. capacity for 2 of 3 workers: trains with 2, the third waits Pending
        run.wait_committed(3, world=2, what="training with 2 workers")
        assert sorted(run.workers().values()) == ["Pending", "Running", "Running"], run.log_tail()

        # 2. a serving pod (priority 0 > the workers' -3 and -5) preempts one worker gracefully:
        # the opportunistic one (-5, the lowest priority on the node); its replacement is
        # opportunistic too and waits Pending without preempting anyone
        serving = run.preempt_worker(sorted(run.running_workers())[0])
        run.wait_committed(run.step() + 1, world=1, timeout=60, what="training with 1 worker")

        # 3. the serving pod goes and a node comes: the Pending workers run, the world is 3
        run.release(serving)
        run.cluster.add_node("node-2", cpu="1", memory="8Gi")
        run.wait_committed(run.step() + 1, world=3, what="training with 3 workers")
        running = set(run.running_workers())
        assert len(running) == 3

        # 4. the master's pod is deleted (its node drained, the task retried): a new pod of
        # the same task (same executor input, as a KFP retry) adopts the running workers
        step_at_retry = run.step()
        retry = run.delete_master()
        assert set(run.running_workers()) == running  # the deletion took no worker with it
        wait_for(
            lambda: any(isinstance(e, MasterRecovered) for e in run.timeline()),
            60,
            0.3,
            "the new master recovered",
        )
        adopted = run.workers()
        assert {n for n, p in adopted.items() if p == "Running"} == running, (
            f"master deleted at step {step_at_retry}, recovered at {run.step()} of "
            f"{EPOCHS * run.samples // 16}",
            adopted,
            running,
            run.log_tail(),
        )
        before = run.step()
        print(f"master deleted at step {step_at_retry}, the retry adopted at step {before}")
        run.wait_committed(before + 1, world=3, timeout=60, what="training under the retry")
        assert run.wait_finished(retry, 180) == "Succeeded", run.log_tail()

        # the job: complete, exactly once, nothing lost to the preemption
        run.check_exactly_once()
        events = run.timeline()
        recovered = [e for e in events if isinstance(e, MasterRecovered)]
        assert len(recovered) == 1 and running <= set(recovered[0].workers)
        # The deleted master learned of its deletion (SIGTERM through the emissary stand-in's
        # process-group signal, or its pod's deletionTimestamp) and had until the emissary
        # noticed its launcher's end (0-1 s) to hand over: when it did, the record is its own and
        # comes before the retry's recovery; otherwise its lease expired (docs/master.md).
        stepped = [e for e in events if isinstance(e, MasterSteppedDown)]
        assert len(stepped) <= 1 and all(e.master != recovered[0].master for e in stepped)
        assert all(events.index(e) < events.index(recovered[0]) for e in stepped)
        print("the deleted master stepped down" if stepped else "the deleted master was killed")
        after_retry = events[events.index(recovered[0]) :]
        assert not [e for e in after_retry if e.kind is EventKind.WORKER_LAUNCHED]
        lost = [e for e in events if isinstance(e, WorkerLost)]
        assert [e.cause for e in lost] == ["preempted"], lost
        # The preemption cost no step: the world stopped at the step it had just committed
        # (SIGTERM -> agreed stop -> snapshot), and the smaller world went on from there.
        stopped_at = _commit_before_shrink(events)
        assert f"step={stopped_at} (snapshot committed)" in run.log(lost[0].name)
        assert events[-1].kind is EventKind.JOB_DONE
        metrics = run.metrics()
        assert metrics["max_world_size"] == 3 and metrics["disruptions"] == 1, metrics
        assert run.train is not None
        assert "<html" in run.train.output("report").read_text().lower()

        # cleanup: the master deleted its workers; the exit handler finds none left, and
        # deletes the run's etcd keys (kept for KFP retries until the pipeline ended)
        assert run.workers() == {}
        handler_log = run.exit_handler()
        assert "deleted 0 worker pods" in handler_log
        assert re.search(r"deleted [1-9]\d* etcd keys", handler_log), handler_log
        assert run.timeline() == []
        run.wait_no_leftovers()
    assert not run.cluster.leftover_processes()


def _timeline_text(events: list[Any]) -> str:
    """The timeline in short, one event a line (for failure messages)."""
    start = events[0].t if events else 0.0
    keep = ("round", "step", "world_size", "rescued", "name", "cause", "workers")
    return "\n".join(
        f"{e.t - start:7.2f} {e.kind.value} "
        + " ".join(f"{k}={getattr(e, k)}" for k in keep if hasattr(e, k))
        for e in events
    )


def _commit_before_shrink(events: list[Any]) -> int:
    """The step of the last commit before the first round that formed a smaller world."""
    world, step = 0, -1
    for event in events:
        if event.kind is EventKind.COMMITTED:
            step = event.step
        elif event.kind is EventKind.ROUND_FORMED:
            if world and event.world_size < world:
                return step
            world = event.world_size
    raise AssertionError(f"no smaller world formed:\n{_timeline_text(events)}")
