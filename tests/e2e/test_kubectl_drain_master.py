"""The master's node drained with kubectl: the master steps down, KFP's retry takes over.

``kubectl drain`` of the node that runs the job's master evicts the master's pod (a bare pod, as
the KFP backend creates task pods: drain wants ``--force``) and any worker on that node. The
eviction is a graceful deletion: the master sees its pod's deletion start and steps down, the
workers on other nodes train on without it, and the task's retry (``TrainingRun``'s stand-in
for a KFP retry policy) runs a new master pod, which the cordoned node cannot take. The new
master adopts the running workers, replaces what the drain took, and the job ends succeeded
with no step lost and every sample of every epoch counted once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kfp_elastic.master.timeline import (
    Committed,
    MasterRecovered,
    MasterSteppedDown,
    WorkerLost,
    of_type,
)
from kfp_elastic.testing.cluster.chaos import commit_counts
from kfp_elastic.testing.cluster.training_run import TrainingRun
from tests.e2e.test_kubectl_disturbed_job import NODE, PARAMS
from tests.helpers import REPO_ROOT, run_kubectl


def test_draining_the_masters_node_hands_the_job_to_the_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))  # pods import the counting model from here
    nodes = {f"node-{i}": NODE for i in range(1, 4)}
    with TrainingRun(tmp_path, PARAMS, nodes=nodes) as run:
        run.start()
        run.wait_committed(1, world=2, what="training with 2 workers")
        first_master = run.master
        node = run.core.read_namespaced_pod(first_master, run.ns).spec.node_name
        on_node = {w for w, n in run.running_workers().items() if n == node}

        command = ["drain", node, "--ignore-daemonsets", "--delete-emptydir-data"]
        refused = run_kubectl(run.cluster, *command, "--timeout=30s")
        assert refused.returncode == 1, refused.stdout
        assert f"{run.ns}/{first_master}" in refused.stderr  # a bare pod: drain wants --force
        out = run_kubectl(run.cluster, *command, "--force", "--timeout=60s", timeout=90)
        assert out.returncode == 0, out.stderr
        assert f"pod/{first_master} evicted" in out.stdout and f"node/{node} drained" in out.stdout
        assert run.phase(first_master) is None  # drain waited until it was gone

        # Without a master the workers elsewhere train on; then KFP's retry runs a new one.
        step = run.step()
        if not on_node:
            run.wait_committed(step + 1, what="training on without a master")
        assert run.retry_master_if_lost()
        retry = run.master
        assert run.wait_done(180) == "Succeeded", run.log_tail()
        assert run.core.read_namespaced_pod(retry, run.ns).spec.node_name != node  # cordoned

        run.check_exactly_once()
        timeline = run.timeline()
        # the first master stepped down for its pod's deletion; the retry recovered the run
        stepped = [e for e in timeline if isinstance(e, MasterSteppedDown)]
        # (the kubelet's SIGTERM or its watch of its own pod, whichever came first)
        assert len(stepped) == 1, stepped
        assert stepped[0].reason in ("SIGTERM", "its pod is being deleted"), stepped
        assert len(of_type(timeline, MasterRecovered)) == 1
        lost = [(e.name, e.cause) for e in timeline if isinstance(e, WorkerLost)]
        # A worker on the drained node is evicted with the master: seen as evicted by a master
        # that still watched, else from its own record of its SIGTERM stop (preempted: the
        # record does not tell a preemption from an eviction)
        assert {name for name, _ in lost} == on_node, lost
        assert {cause for _, cause in lost} <= {"evicted", "preempted"}, lost
        counts = commit_counts([e for e in timeline if isinstance(e, Committed)])
        assert counts["steps_taken_back"] == 0, counts
        assert run.metrics()["lost_steps"] == 0

        # kubectl get events: the master's pod stopped on the drained node
        listed = run_kubectl(
            run.cluster,
            "get",
            "events",
            "-o",
            "json",
            "--field-selector",
            f"involvedObject.name={first_master}",
        )
        assert listed.returncode == 0, listed.stderr
        killing = [e for e in json.loads(listed.stdout)["items"] if e["reason"] == "Killing"]
        assert len(killing) == 1 and killing[0]["source"]["host"] == node, listed.stdout

        run.wait_no_leftovers()
    assert not run.cluster.leftover_processes()
