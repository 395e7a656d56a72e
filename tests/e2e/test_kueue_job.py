"""A training job under Kueue, with the Kueue objects applied from the project's manifests.

On a test cluster with Kueue's own CRDs, ``kubectl apply -k`` installs the local-kind overlay
and ``manifests/kueue`` (ClusterQueue, LocalQueue, ResourceFlavor, WorkloadPriorityClasses), as
a user installs them; the ClusterQueue's quota is then cut to one worker's CPU with ``kubectl
patch``, and the Kueue stand-in reads its queue from those stored objects. The master runs as
a pod of the overlay's namespace under its ServiceAccount with ``--kueue-queue kfp-elastic``
(min 1, max 2 workers): every worker pod is gated by Kueue's webhook, carries its tier's
WorkloadPriorityClass, and only what the applied quota holds is admitted (the second worker
waits gated), and the job ends succeeded on the one admitted worker.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kfp_elastic.etcd.client import connect
from kfp_elastic.etcd.embedded import EmbeddedEtcd
from kfp_elastic.master.pod_spec_checks import MASTER_POD_LABELS
from kfp_elastic.testing.cluster import TestCluster
from kfp_elastic.testing.cluster.kueue import (
    ADMISSION_GATE,
    MANAGED_LABEL,
    PRIORITY_CLASS_LABEL,
    QUEUE_LABEL,
)
from kfp_elastic.worker.progress import Progress
from tests.e2e.test_master_rbac import master, overlay_namespace, phase, python_pod, workers
from tests.helpers import MANIFESTS, REPO_ROOT, committed_step, find, render, run_kubectl, wait_for

QUEUE = "kfp-elastic"


def gated(cluster: TestCluster, name: str) -> bool:
    pod = cluster.api.pod(name, cluster.namespace)
    return {"name": ADMISSION_GATE} in (pod["spec"].get("schedulingGates") or [])


def test_a_job_runs_under_kueue_with_the_applied_queue_and_priorities(
    tmp_path: Path, etcd: EmbeddedEtcd, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))  # pods import the counting model
    ns = overlay_namespace()
    nodes = {f"node-{i}": {"cpu": "2", "memory": "4Gi"} for i in (1, 2)}
    with TestCluster(tmp_path / "cluster", nodes=nodes, namespace=ns, kueue_crds=True) as cluster:
        for target in ("overlays/local-kind", "kueue"):
            applied = run_kubectl(cluster, "apply", "-k", str(MANIFESTS / target))
            assert applied.returncode == 0, applied.stderr
        # One worker's CPU: the quota, not the nodes, decides how many workers run.
        quota = "/spec/resourceGroups/0/flavors/0/resources/0"
        patch = [
            {"op": "test", "path": f"{quota}/name", "value": "cpu"},
            {"op": "replace", "path": f"{quota}/nominalQuota", "value": "1"},
        ]
        patched = run_kubectl(
            cluster, "patch", "clusterqueue", QUEUE, "--type", "json", "-p", json.dumps(patch)
        )
        assert patched.returncode == 0, patched.stderr
        kueue = cluster.start_kueue()
        applied_values = {
            o["metadata"]["name"]: o["value"]
            for o in find(render("kueue"), "WorkloadPriorityClass")
        }
        assert kueue.queue.priority_classes == applied_values
        assert kueue.queue.nominal()["cpu"] == 1

        command = [*master(run_id, etcd, ns, tmp_path), "--kueue-queue", QUEUE]
        command += ["--cpu", "1"]
        cluster.api.create(ns, python_pod("master", command, **MASTER_POD_LABELS))
        client = connect(etcd.client_settings())
        progress = Progress(client, f"/kfp-elastic/{run_id}")
        try:
            try:
                wait_for(lambda: committed_step(progress) >= 3, 90, 0.2, "training under way")
            except TimeoutError:
                states = {
                    p["metadata"]["name"]: (
                        p["status"].get("phase"),
                        p["spec"].get("schedulingGates"),
                        p["spec"].get("nodeName"),
                    )
                    for p in cluster.api.pods_snapshot()
                }
                raise AssertionError(f"{states}\n{cluster.log('master', ns=ns)[-6000:]}") from None
            wait_for(lambda: len(workers(cluster, run_id)) == 2, 30, 0.2, "the second worker")
            pods = {
                p["metadata"]["name"]: p
                for p in cluster.api.pods_snapshot()
                if p["metadata"]["name"] in workers(cluster, run_id)
            }
            for name, pod in pods.items():
                labels = pod["metadata"]["labels"]
                assert labels[QUEUE_LABEL] == QUEUE and labels[MANAGED_LABEL] == "true", name
                assert labels[PRIORITY_CLASS_LABEL] in applied_values, name
            # the quota admits one: the guaranteed worker trains, the opportunistic one waits
            waiting = [name for name in pods if gated(cluster, name)]
            assert len(waiting) == 1, {n: p["spec"].get("schedulingGates") for n, p in pods.items()}
            assert pods[waiting[0]]["metadata"]["labels"][PRIORITY_CLASS_LABEL] == (
                "kfp-elastic-worker-opportunistic"
            )
            assert pods[waiting[0]]["status"].get("phase", "Pending") == "Pending"
            wait_for(
                lambda: phase(cluster, "master") in ("Succeeded", "Failed"), 180, 0.2, "job end"
            )
            assert phase(cluster, "master") == "Succeeded", cluster.log("master", ns=ns)[-4000:]
        finally:
            client.close()
