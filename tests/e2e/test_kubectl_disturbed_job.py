"""A training job on the test cluster watched and disturbed by hand with kubectl.

The compiled ``elastic-train`` task runs as the master pod (``training_run.TrainingRun``) with
two workers on three one-worker nodes, while ``kubectl get pods -w`` watches. While it trains,
``kubectl delete pod`` takes one worker (graceful: SIGTERM, a snapshot at the step the world
agreed on) and ``kubectl drain`` evicts another through the eviction API (the worker pods declare
no controller: the master is not their owner, so that deleting its pod leaves them running; drain
refuses them without ``--force``, as it refuses every bare pod). The master replaces each lost
worker, the job ends succeeded with no step lost and every sample of every epoch counted once,
and what happened to which pod reads from the watch's rows and from ``kubectl get events``: the
scheduler's and kubelets' events, and the master's own (each lost worker lost, and replaced by a
pod whose event names the one it replaces and why; ``kubectl describe`` of a replacement shows
it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kfp_elastic.master.pod_events import COMPONENT
from kfp_elastic.master.timeline import Committed, WorkerLost
from kfp_elastic.testing.cluster.chaos import commit_counts
from kfp_elastic.testing.cluster.training_run import TrainingRun
from tests.helpers import REPO_ROOT, kubectl_watch, run_kubectl, wait_for

NODE = {"cpu": "1", "memory": "8Gi"}  # one worker per node
PARAMS = {
    "model_def": "kfp_elastic.testing.model_defs.counting",  # 240 samples
    "num_shards": 12,
    "min_workers": 1,
    "max_workers": 2,
    # 15 steps an epoch at the base world of 2 (global batch 16); 90 steps in all, so that both
    # disturbances and the replacements' starts (seconds each, the world of one training on
    # meanwhile) fall inside the run on a loaded machine too
    "epochs": 6,
    "batch_size": 8,
    "snapshot_every": 3,
    "step_time": 0.3,
    "worker_cpu": "1",
    "max_wait_s": 120.0,
}


def recovered(run: TrainingRun, gone: set[str]) -> tuple[str, ...]:
    """Until two workers that are not ``gone`` run, their agents are the latest rendezvous
    round's participants and that round's world committed: the replacement took the lost
    worker's place and trains. The running workers."""

    def trains() -> bool:
        workers = set(run.running_workers()) - gone
        record, committed = run.round_record(), run.committed()
        return bool(
            len(workers) == 2
            and record is not None
            and committed is not None
            and len(run.round_members(workers, record)) == 2
            and (committed.round, committed.world_size) == (record.number, 2)
        )

    run.wait_until(trains, 90, f"a world of two workers, not {sorted(gone)}, committed")
    return tuple(sorted(run.running_workers()))


def rows(out: str, pod: str) -> list[str]:
    """The STATUS column of ``pod``'s rows in ``kubectl get pods -w`` output, in order."""
    return [line.split()[2] for line in out.splitlines() if line.split()[:1] == [pod]]


def test_a_job_watched_deleted_from_and_drained_with_kubectl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))  # pods import the counting model from here
    nodes = {f"node-{i}": NODE for i in range(1, 4)}
    with TrainingRun(tmp_path, PARAMS, nodes=nodes) as run:
        with kubectl_watch(run.cluster, "pods") as watch:
            run.start()
            run.wait_committed(1, world=2, what="training with 2 workers")
            first = run.running_workers()
            # the node to drain holds a worker and not the master (whose pod, bare too, --force
            # would evict with it)
            master_node = run.core.read_namespaced_pod(run.master, run.ns).spec.node_name
            drained = sorted(w for w, n in first.items() if n != master_node)[0]
            node = first[drained]
            deleted = sorted(set(first) - {drained})[0]

            # 1. kubectl delete pod: graceful; kubectl waits until the pod is gone
            out = run_kubectl(run.cluster, "delete", "pod", deleted)
            assert out.returncode == 0 and f'pod "{deleted}" deleted' in out.stdout, out.stderr
            second = recovered(run, {deleted})
            assert drained in second
            # The master's Event about the replacement, in kubectl describe (by the pod's uid)
            (new,) = set(second) - set(first)
            described = wait_for(
                lambda: (
                    (out := run_kubectl(run.cluster, "describe", "pod", new)).returncode == 0
                    and "WorkerReplaced" in out.stdout
                    and out.stdout
                ),
                30,
                0.5,
                "the master's WorkerReplaced event in kubectl describe",
            )
            assert f"to replace {deleted} (deleted_externally)" in described, described

            # 2. kubectl drain: the workers declare no controller, so it wants --force
            command = ["drain", node, "--ignore-daemonsets", "--delete-emptydir-data"]
            refused = run_kubectl(run.cluster, *command, "--timeout=30s")
            assert refused.returncode == 1, refused.stdout
            assert "cannot delete Pods that declare no controller" in refused.stderr
            assert f"{run.ns}/{drained}" in refused.stderr
            step = run.step()
            out = run_kubectl(run.cluster, *command, "--force", "--timeout=60s", timeout=90)
            assert out.returncode == 0, out.stderr
            assert f"pod/{drained} evicted" in out.stdout and f"node/{node} drained" in out.stdout
            third = recovered(run, {deleted, drained})
            assert node not in {run.running_workers().get(w) for w in third}  # cordoned
            print(f"drained at step {step}; the world of two again at {run.step()}")

            assert run.wait_done(180) == "Succeeded", run.log_tail()
        uncordoned = run_kubectl(run.cluster, "uncordon", node)
        assert uncordoned.returncode == 0, uncordoned.stderr
        wait_for(  # the kubelet records it once it sees the change
            lambda: "NodeSchedulable" in _reasons(run.cluster.api.events(node, ns="default"), node),
            10,
            0.1,
            "the uncordon's event",
        )
        replacements = sorted((set(second) | set(third)) - set(first))
        assert len(replacements) == 2, (first, second, third)

        # The job: complete, exactly once, no step lost, each loss as it happened
        run.check_exactly_once()
        timeline = run.timeline()
        lost = [(e.name, e.cause) for e in timeline if isinstance(e, WorkerLost)]
        assert lost == [(deleted, "deleted_externally"), (drained, "evicted")], lost
        commits = [e for e in timeline if isinstance(e, Committed)]
        # every world but the last stopped at a step it committed (SIGTERM -> an agreed stop ->
        # a snapshot): the deletion, the eviction and the growth back to two cost no step
        last_commit = {c.round: c for c in commits}
        worlds = [last_commit[r] for r in sorted(last_commit)]
        assert len(worlds) >= 3 and all(c.stopping for c in worlds[:-1]), worlds
        counts = commit_counts(commits)
        assert counts["steps_taken_back"] == 0, counts
        metrics = run.metrics()
        assert metrics["lost_steps"] == 0 and metrics["workers_lost"] == 2, metrics

        # The watch: each lost worker Running, then Terminating; each replacement Pending,
        # then Running
        for pod in (deleted, drained):
            statuses = rows(watch.out, pod)
            assert "Terminating" in statuses[statuses.index("Running") :], (pod, watch.out)
        for pod in replacements:
            statuses = rows(watch.out, pod)
            assert statuses[0] == "Pending" and "Running" in statuses, (pod, watch.out)

        # The events: what happened to which pod, and to the drained node
        listed = run_kubectl(run.cluster, "get", "events", "-A", "-o", "json")
        assert listed.returncode == 0, listed.stderr
        events = sorted(
            json.loads(listed.stdout)["items"], key=lambda e: int(e["metadata"]["resourceVersion"])
        )
        text = _events_text(events)
        # The kubelet's events in their order; the scheduler's Scheduled is recorded after the
        # binding, which the kubelet may act on first (as on a real cluster: events are
        # recorded asynchronously), so it is only required once.
        started = ["Pulled", "Created", "Started"]
        for pod, on in ((deleted, first[deleted]), (drained, node)):
            assert _kubelets(events, pod) == [*started, "Killing"], text
            _one(events, pod, "Scheduled")
            killing = _one(events, pod, "Killing")
            assert killing["message"] == "Stopping container worker", text
            assert killing["source"] == {"component": "kubelet", "host": on}, text
        cordon = _one(events, node, "NodeNotSchedulable")
        assert cordon["message"] == f"Node {node} status is now: NodeNotSchedulable", text
        assert cordon["involvedObject"]["kind"] == "Node", text
        assert events.index(cordon) < events.index(_one(events, drained, "Killing")), text
        assert _reasons(events, node)[-2:] == ["NodeNotSchedulable", "NodeSchedulable"], text
        for pod in replacements:
            assert _kubelets(events, pod)[:3] == started, text
            scheduled = _one(events, pod, "Scheduled")["message"]
            assert scheduled.startswith(f"Successfully assigned {run.ns}/{pod} to "), text
            assert not scheduled.endswith(f" to {node}"), text
        # the same as kubectl prints it
        table = run_kubectl(
            run.cluster,
            "get",
            "events",
            "--field-selector",
            f"involvedObject.name={drained},source=kubelet",
        ).stdout.splitlines()
        assert table[-1].split()[1:5] == ["Normal", "Killing", f"pod/{drained}", "Stopping"]

        # The master's own Events: each lost worker lost, and replaced naming the old and new pod
        mine = [e for e in events if e["source"]["component"] == COMPONENT]
        for pod in first:
            assert _one(mine, pod, "SuccessfulCreate")["message"].startswith(
                f"Created worker pod {pod} "
            ), text
        replaced = {
            e["involvedObject"]["name"]: e["message"]
            for e in mine
            if e["reason"] == "WorkerReplaced"
        }
        assert set(replaced) == set(replacements), text
        for old, cause in ((deleted, "deleted_externally"), (drained, "evicted")):
            lost = _one(mine, old, "WorkerLost")
            assert lost["type"] == "Normal", text
            assert lost["message"].startswith(f"Worker pod {old} (worker "), text
            assert f" lost ({cause}): " in lost["message"], text
            (new,) = [p for p, m in replaced.items() if m.endswith(f" to replace {old} ({cause})")]
            assert replaced[new].startswith(f"Created worker pod {new} (worker "), text
        done = _one(mine, run.master, "JobSucceeded")
        assert done["involvedObject"]["kind"] == "Pod" and done["involvedObject"]["uid"], text
        table = run_kubectl(
            run.cluster, "get", "events", "--field-selector", "source=kfp-elastic-master"
        ).stdout
        rows_of_new = [line.split() for line in table.splitlines() if f"pod/{new}" in line]
        assert [row[1:4] for row in rows_of_new] == [["Normal", "WorkerReplaced", f"pod/{new}"]], (
            table
        )

        run.wait_no_leftovers()
    assert not run.cluster.leftover_processes()


def _reasons(events: list[dict[str, Any]], name: str) -> list[str]:
    """The reasons of the events about the object called ``name``, oldest first."""
    return [e["reason"] for e in events if e["involvedObject"]["name"] == name]


def _kubelets(events: list[dict[str, Any]], name: str) -> list[str]:
    """The reasons of the kubelet's events about the pod called ``name``, oldest first."""
    return _reasons([e for e in events if e["source"]["component"] == "kubelet"], name)


def _one(events: list[dict[str, Any]], name: str, reason: str) -> dict[str, Any]:
    found = [e for e in events if e["involvedObject"]["name"] == name and e["reason"] == reason]
    assert len(found) == 1, (name, reason, _events_text(events))
    return found[0]


def _events_text(events: list[dict[str, Any]]) -> str:
    """The events in short, one a line (for failure messages)."""
    return "\n".join(
        f"{e['involvedObject']['kind']}/{e['involvedObject']['name']} {e['reason']}: {e['message']}"
        for e in events
    )
