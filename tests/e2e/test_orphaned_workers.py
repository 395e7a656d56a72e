"""No orphans: a run terminated without its exit handler leaves no worker pod behind.

On the test cluster, as a KFP run with the production settings: the master (the
``elastic-train`` task's pod) trains with two worker pods, then its processes are killed and its
pod deleted, and neither a KFP retry nor the exit handler (``stop_workers``) runs, as when a run
is terminated in the KFP UI. With ``orphan_timeout_s`` short, every worker pod ends on its own:
its agent logs ``no master for N s: stopping``, the workers commit a snapshot (no step lost) and
the container exits ``ORPHANED_EXIT_CODE``; no process is left. (A KFP retry that comes later
counts such workers as disruptions, not failures: ``tests/unit/rendezvous/test_orphan.py``; it
resumes from the committed snapshot as after any preemption: ``test_cluster_job.py``.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kfp_elastic.rendezvous.orphan import ORPHANED_EXIT_CODE
from kfp_elastic.testing.cluster.training_run import SNAPSHOT_CLAIM, TrainingRun
from tests.helpers import REPO_ROOT, wait_for

ORPHAN_TIMEOUT_S = 3.0
PARAMS = {
    "model_def": "kfp_elastic.testing.model_defs.counting",  # 240 samples: 15 steps an epoch
    "num_shards": 8,
    "min_workers": 2,
    "max_workers": 2,
    "epochs": 6,  # 90 steps of >= 0.3 s: the job is still training when the workers stop
    "batch_size": 8,
    "snapshot_every": 50,  # only the stop's own snapshot comes before the kill
    "step_time": 0.3,
    "worker_cpu": "1",
    "orphan_timeout_s": ORPHAN_TIMEOUT_S,
}
_STOPPED = re.compile(r"stopping on SIGTERM rank=\d+ step=(\d+) \(snapshot committed\)")


def test_workers_of_a_terminated_run_stop_on_their_own_after_a_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    with TrainingRun(tmp_path, PARAMS, nodes={"node-1": {"cpu": "2", "memory": "8Gi"}}) as run:
        run.start()
        run.wait_committed(1, world=2, what="training with 2 workers")
        workers = sorted(run.running_workers())
        assert len(workers) == 2

        # The run is terminated: the master dies without stepping down or cleaning up, its pod
        # goes, and no retry nor exit handler follows (no run.wait_until: it would retry).
        master = run.master
        assert run.kill_pod(master) > 0
        run.core.delete_namespaced_pod(master, run.ns)
        wait_for(lambda: run.phase(master) is None, 30, 0.2, "the master's pod gone")

        wait_for(
            lambda: set(run.workers().values()) == {"Failed"},
            60,
            0.3,
            "every worker pod ended on its own",
        )
        stopped_at = set()
        for name in workers:
            pod = run.core.read_namespaced_pod(name, run.ns)
            code = pod.status.container_statuses[0].state.terminated.exit_code
            log = run.log(name)
            assert code == ORPHANED_EXIT_CODE, (name, code, log[-3000:])
            assert re.search(r"no master for \d+ s: stopping", log), log[-3000:]
            stopped_at |= {int(step) for step in _STOPPED.findall(log)}
        # Every rank stopped at one agreed step, whose snapshot is committed and written.
        committed = run.committed()
        assert committed is not None and stopped_at == {committed.step}, (stopped_at, committed)
        snapshot = f"snapshot-{committed.step:09d}.pt"
        assert list(run.cluster.claim_path(SNAPSHOT_CLAIM).rglob(snapshot)), snapshot
        assert sorted(run.workers()) == workers  # no pod was replaced or deleted
        run.wait_no_leftovers()  # no pod running, no process of any pod alive
    assert not run.cluster.leftover_processes()
