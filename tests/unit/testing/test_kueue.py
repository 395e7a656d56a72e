"""Scheduling gates in the test cluster and its Kueue stand-in (``testing/cluster/kueue.py``):
the pure admission decision, the webhook, and the two worker tiers under a ClusterQueue quota
with pods built by the real ``build_pod`` (fake API server + scheduler + Kueue, no processes)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kfp_elastic.master.launcher import Reason
from kfp_elastic.master.pod_spec import (
    KUEUE_PRIORITY_CLASS_LABEL,
    KUEUE_QUEUE_LABEL,
)
from kfp_elastic.master.pod_status import classify
from kfp_elastic.testing.api_server import FakeKubernetes
from kfp_elastic.testing.api_wire import ApiError
from kfp_elastic.testing.cluster.cluster import TestCluster
from kfp_elastic.testing.cluster.kueue import (
    ADMISSION_GATE,
    WORKLOAD_PRIORITY_CLASSES,
    Kueue,
    KueueQueue,
    Workload,
    admit,
    gate,
    install_kueue_crds,
    stop_pod,
)
from kfp_elastic.testing.cluster.scheduler import Scheduler, plan
from tests.helpers import eventually, job_worker_pods, render

NS = "kfp-elastic"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"


def gpus(n: float) -> dict[str, float]:
    return {"cpu": 0.0, "memory": 0.0, "nvidia.com/gpu": n}


def wl(
    name: str, priority: int, order: int, admitted: int | None = None, evicted: bool = False
) -> Workload:
    return Workload(
        key=("ns", name),
        priority=priority,
        order=order,
        requests=gpus(1),
        admitted_order=admitted,
        evicted=evicted,
    )


# -- admit: the pure decision ---------------------------------------------------------------


def test_admits_by_priority_then_creation_order_within_the_quota() -> None:
    decided = admit(gpus(2), [wl("old", -5, 1), wl("new", -5, 3), wl("high", -3, 2)])
    assert decided.admit == [("ns", "high"), ("ns", "old")] and not decided.evict


def test_a_workload_that_does_not_fit_does_not_hold_back_smaller_ones() -> None:
    big = replace(wl("big", -3, 1), requests=gpus(4))
    decided = admit(gpus(2), [wl("a", -5, 0, admitted=1), big, wl("small", -5, 2)])
    assert decided.admit == [("ns", "small")]  # BestEffortFIFO
    assert decided.evict == []  # no lower-priority victims would make room for "big"


def test_evicts_strictly_lower_priority_most_recently_admitted_first() -> None:
    admitted = [wl("a-g", -3, 1, admitted=1), wl("a-o1", -5, 2, admitted=2)]
    admitted += [wl("a-o2", -5, 3, admitted=3)]
    decided = admit(gpus(3), [*admitted, wl("b-g", -3, 4), wl("b-o", -5, 5)])
    assert decided.evict == [("ns", "a-o2")] and decided.admit == []
    # equal priority never evicts: a second guaranteed one waits, the opportunistic one too
    full = [*admitted[:1], wl("b-g", -3, 4, admitted=4), wl("a-o1", -5, 2, admitted=2)]
    assert admit(gpus(3), [*full, wl("c-g", -3, 6)]).evict == [("ns", "a-o1")]
    only_guaranteed = [wl(f"g{i}", -3, i, admitted=i) for i in range(3)]
    stuck = admit(gpus(3), [*only_guaranteed, wl("c-g", -3, 9), wl("c-o", -5, 10)])
    assert stuck.admit == [] and stuck.evict == []


def test_waits_for_evicted_workloads_instead_of_evicting_more() -> None:
    running = [wl("g", -3, 1, admitted=1), wl("o1", -5, 2, admitted=2, evicted=True)]
    running += [wl("o2", -5, 3, admitted=3)]
    decided = admit(gpus(3), [*running, wl("new-g", -3, 4), wl("new-o", -5, 5)])
    assert decided.evict == [] and decided.admit == []  # o1's quota is kept for new-g
    gone = [r for r in running if r.key != ("ns", "o1")]
    assert admit(gpus(3), [*gone, wl("new-g", -3, 4)]).admit == [("ns", "new-g")]


def test_reprieves_victims_it_does_not_need_and_honours_preemption_never() -> None:
    two = replace(wl("two", -3, 9), requests=gpus(2))
    admitted = [replace(wl("big-low", -5, 1, admitted=1), requests=gpus(2))]
    admitted += [wl("small-low", -5, 2, admitted=2)]
    # most recently admitted (small-low) is taken first, then big-low; small-low is reprieved
    assert admit(gpus(3), [*admitted, two]).evict == [("ns", "big-low")]
    assert admit(gpus(3), [*admitted, two], preemption="Never").evict == []


def test_the_webhook_gates_only_pods_that_name_a_queue() -> None:
    queued = {"metadata": {"labels": {KUEUE_QUEUE_LABEL: "q"}}, "spec": {}}
    plain: dict[str, Any] = {"metadata": {"name": "p"}, "spec": {}}
    gate(NS, queued)
    gate(NS, plain)
    gate(NS, queued)  # idempotent
    assert queued["spec"]["schedulingGates"] == [{"name": ADMISSION_GATE}]
    assert queued["metadata"]["labels"]["kueue.x-k8s.io/managed"] == "true"
    assert "schedulingGates" not in plain["spec"]


def test_the_workload_priority_classes_are_the_priority_classes_values() -> None:
    from kfp_elastic.testing.api_server import PRIORITY_CLASSES

    tiers = ("kfp-elastic-worker-guaranteed", "kfp-elastic-worker-opportunistic")
    levels = tuple(f"kfp-elastic-worker-level-{i}" for i in range(3))  # the ladder's
    assert WORKLOAD_PRIORITY_CLASSES == {
        name: PRIORITY_CLASSES[name][0] for name in (*tiers, *levels)
    }


# -- scheduling gates in the scheduler and the API server -----------------------------------


def test_the_scheduler_never_binds_nominates_or_preempts_for_a_gated_pod() -> None:
    def pod(name: str, priority: int, node: str | None = None, gated: bool = False) -> dict:
        spec: dict[str, Any] = {
            "containers": [{"name": "c", "resources": {"requests": {"cpu": "1"}}}],
            "priority": priority,
        }
        if node:
            spec["nodeName"] = node
        if gated:
            spec["schedulingGates"] = [{"name": ADMISSION_GATE}]
        meta = {"name": name, "namespace": "ns", "resourceVersion": "1"}
        return {"metadata": meta, "spec": spec, "status": {"phase": "Pending"}}

    nodes = {"n1": {"cpu": 2.0, "memory": 1e12, "nvidia.com/gpu": 0.0}}
    free = plan(nodes, [pod("g", 0, gated=True)])
    assert free.gated == [("ns", "g")] and not free.binds and not free.unschedulable
    full = plan(nodes, [pod("low", -5, "n1"), pod("low2", -5, "n1"), pod("g", 10, gated=True)])
    assert full.gated == [("ns", "g")]
    assert not full.victims and not full.nominated and not full.unschedulable


def worker(name: str, gates: bool = False, node: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "c", "image": "busybox:1"}]}
    if gates:
        spec["schedulingGates"] = [{"name": "example.com/a"}, {"name": "example.com/b"}]
    if node:
        spec["nodeName"] = node
    return {"metadata": {"name": name}, "spec": spec}


def test_gates_are_reported_and_may_only_be_removed() -> None:
    with FakeKubernetes(namespace=NS, validate_pods=False) as k8s:
        created = k8s.create(NS, worker("w", gates=True))
        scheduled = next(c for c in created["status"]["conditions"] if c["type"] == "PodScheduled")
        assert (scheduled["status"], scheduled["reason"]) == ("False", "SchedulingGated")
        with pytest.raises(ApiError) as added:
            gates = [*created["spec"]["schedulingGates"], {"name": "example.com/c"}]
            k8s.patch(NS, "w", {"spec": {"schedulingGates": gates}}, MERGE)
        assert added.value.status["code"] == 422
        assert "only deletion is allowed" in added.value.status["message"]
        one = k8s.patch(NS, "w", {"spec": {"schedulingGates": [{"name": "example.com/b"}]}}, MERGE)
        assert one["spec"]["schedulingGates"] == [{"name": "example.com/b"}]
        none = k8s.patch(NS, "w", {"spec": {"schedulingGates": None}}, MERGE)
        assert "schedulingGates" not in none["spec"]
        k8s.create(NS, worker("plain"))
        with pytest.raises(ApiError) as late:
            k8s.patch(NS, "plain", {"spec": {"schedulingGates": [{"name": "x.io/y"}]}}, MERGE)
        assert late.value.status["code"] == 422
        with pytest.raises(ApiError) as bound:
            k8s.create(NS, worker("bound", gates=True, node="n1"))
        assert bound.value.status["code"] == 422


def test_a_strategic_merge_patch_merges_gates_by_name_as_kubernetes_does() -> None:
    # core/v1 tags schedulingGates patchStrategy=merge, patchMergeKey=name: a strategic patch
    # naming one gate adds it (refused: gates may only go) instead of replacing the list, and
    # ``$patch: delete`` removes one.
    with FakeKubernetes(namespace=NS, validate_pods=False) as k8s:
        k8s.create(NS, worker("w", gates=True))
        with pytest.raises(ApiError) as added:
            k8s.patch(NS, "w", {"spec": {"schedulingGates": [{"name": "x.io/c"}]}}, STRATEGIC)
        assert added.value.status["code"] == 422
        delete_a = {"spec": {"schedulingGates": [{"name": "example.com/a", "$patch": "delete"}]}}
        left = k8s.patch(NS, "w", delete_a, STRATEGIC)
        assert left["spec"]["schedulingGates"] == [{"name": "example.com/b"}]
        with pytest.raises(ApiError) as unknown:
            bad = {"spec": {"schedulingGates": [{"name": "example.com/b", "$patch": "drop"}]}}
            k8s.patch(NS, "w", bad, STRATEGIC)
        assert unknown.value.status["code"] == 400


def test_a_pod_kueue_evicted_is_a_preemption_for_the_master() -> None:
    with FakeKubernetes(namespace=NS, validate_pods=False, kubelet=False) as k8s:
        k8s.create(NS, worker("w"))
        k8s.bind(NS, "w", "n1")
        stop_pod(k8s, NS, "w")
        status = classify(k8s.pod("w"))
        assert status.reason == Reason.PREEMPTED and status.is_disruption
        assert not status.is_failure and "WorkloadEvictedDueToPreempted" in status.message


# -- two jobs' tiers under a ClusterQueue quota --------------------------------------------


def job_pods(job: str, min_workers: int, max_workers: int) -> list[dict[str, Any]]:
    """Job ``job``'s worker pods as the master builds them with ``kueue_queue`` set."""
    return job_worker_pods(
        job, min_workers, max_workers, gpu=1, namespace=NS, kueue_queue="kfp-elastic"
    )


@pytest.fixture
def cluster() -> Iterator[tuple[FakeKubernetes, Kueue]]:
    """4 GPUs on one node, a ClusterQueue of 4 GPUs; the kubelet part of deletions is done
    at once (no pod processes)."""
    with FakeKubernetes(namespace=NS) as k8s:
        k8s.create_object(
            "nodes",
            "",
            {
                "metadata": {"name": "gpu-node"},
                "status": {"allocatable": {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": "4"}},
            },
        )
        scheduler = Scheduler(k8s)
        kueue = Kueue(k8s, KueueQueue(quota={"gpu": 4, "cpu": 64, "memory": "512Gi"}), NS)
        try:
            yield k8s, kueue
        finally:
            kueue.stop()
            scheduler.stop()


def names(pods: list[dict[str, Any]]) -> list[str]:
    return [p["metadata"]["name"] for p in pods]


def bound(k8s: FakeKubernetes, name: str) -> bool:
    try:
        return bool(k8s.pod(name)["spec"].get("nodeName"))
    except ApiError:
        return False


def gone(k8s: FakeKubernetes, name: str) -> bool:
    return not k8s.list(NS, name=name)["items"]


def test_guaranteed_workers_evict_only_opportunistic_ones_under_kueue(
    cluster: tuple[FakeKubernetes, Kueue],
) -> None:
    k8s, kueue = cluster
    a, b, c = job_pods("a", 1, 4), job_pods("b", 1, 3), job_pods("c", 1, 1)
    assert a[0]["metadata"]["labels"][KUEUE_PRIORITY_CLASS_LABEL] == (
        "kfp-elastic-worker-guaranteed"
    )
    for pod in a:
        created = k8s.create(NS, pod)
        assert created["spec"]["schedulingGates"] == [{"name": ADMISSION_GATE}]  # the webhook
    assert eventually(lambda: all(bound(k8s, n) for n in names(a)))

    for pod in b:
        k8s.create(NS, pod)
    b_guaranteed, b_opportunistic = names(b)[0], names(b)[1:]
    assert eventually(lambda: bound(k8s, b_guaranteed))
    kueue.admit_once()  # settled: nothing more to decide
    lost = [n for n in names(a) if gone(k8s, n)]
    assert lost == [names(a)[3]]  # one opportunistic worker, the most recently admitted
    assert bound(k8s, names(a)[0])  # A's guaranteed worker stays
    for name in b_opportunistic:  # wait gated, never evict anyone
        pod = k8s.pod(name)
        assert pod["spec"]["schedulingGates"] == [{"name": ADMISSION_GATE}]
        scheduled = next(c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled")
        assert scheduled["reason"] == "SchedulingGated"

    # Two more jobs' guaranteed workers take A's last opportunistic ones; a fifth job's finds
    # guaranteed workers only (equal priority) and waits, gated, evicting nobody.
    d = job_pods("d", 1, 1)
    for job in (c, d):
        k8s.create(NS, job[0])
        assert eventually(lambda job=job: bound(k8s, names(job)[0]))
    assert all(gone(k8s, n) for n in names(a)[1:])
    e = job_pods("e", 1, 1)
    k8s.create(NS, e[0])
    decided = kueue.admit_once()
    assert decided.evict == [] and decided.admit == []
    assert all(bound(k8s, n) for n in (names(a)[0], b_guaranteed, names(c)[0], names(d)[0]))
    for name in (*b_opportunistic, names(e)[0]):
        assert k8s.pod(name)["spec"]["schedulingGates"] == [{"name": ADMISSION_GATE}]


def test_the_test_cluster_runs_the_stand_in_when_asked(tmp_path: Path) -> None:
    """``TestCluster(kueue=...)``: a queued pod runs once admitted, the next waits gated for
    the quota (not for a node: the node has room for both) until the first is gone."""

    def sleeper(name: str) -> dict[str, Any]:
        container = {
            "name": "c",
            "image": "busybox:1",
            "command": ["sleep", "30"],
            "resources": {"requests": {"cpu": "1"}},
        }
        labels = {KUEUE_QUEUE_LABEL: "kfp-elastic"}
        return {"metadata": {"name": name, "labels": labels}, "spec": {"containers": [container]}}

    quota = KueueQueue(quota={"cpu": 1})
    with TestCluster(tmp_path, nodes={"n1": {"cpu": "2"}}, kueue=quota) as cluster:
        api, ns = cluster.api, cluster.namespace
        api.create(ns, sleeper("first"))
        assert eventually(lambda: api.pod("first")["status"]["phase"] == "Running")
        api.create(ns, sleeper("second"))
        assert cluster.kueue is not None
        assert (ns, "second") not in cluster.kueue.admit_once().admit
        assert api.pod("second")["spec"]["schedulingGates"] == [{"name": ADMISSION_GATE}]
        api.delete(ns, "first", grace=0)
        assert eventually(lambda: api.pod("second")["status"]["phase"] == "Running")
        api.delete(ns, "second", grace=0)
    assert not cluster.leftover_processes()


QUOTAS = "/spec/resourceGroups/0/flavors/0/resources"  # a ClusterQueue's first flavor's


def test_the_queue_from_the_applied_kueue_objects() -> None:
    """With Kueue's CRDs installed and manifests/kueue's objects stored, the stand-in's queue
    is read from them (the ClusterQueue's quota and preemption, the WorkloadPriorityClasses),
    and it gates and admits by that quota."""
    with FakeKubernetes(namespace=NS) as k8s:
        install_kueue_crds(k8s)
        resources = {c.kind: r for r, c in k8s.custom_kinds().items()}
        for obj in render("kueue"):
            ns = obj["metadata"].get("namespace", "")
            k8s.create_object(resources[obj["kind"]], ns, obj)
        queue = KueueQueue.from_api(k8s, NS)
        assert queue.priority_classes == WORKLOAD_PRIORITY_CLASSES
        assert queue.preemption == "LowerPriority"
        assert queue.nominal() == {"cpu": 64, "memory": 512 * 2**30, "nvidia.com/gpu": 8}
        # another ClusterQueue: its own quota and Kueue's default preemption
        k8s.patch_object(
            "clusterqueues",
            "",
            "kfp-elastic",
            [
                {"op": "remove", "path": "/spec/preemption"},
                {"op": "replace", "path": f"{QUOTAS}/0/nominalQuota", "value": 2},
            ],
            "application/json-patch+json",
        )
        queue = KueueQueue.from_api(k8s, NS)
        assert (queue.preemption, queue.nominal()["cpu"]) == ("Never", 2)
        kueue = Kueue(k8s, queue, NS)
        try:
            for name, cpu in (("big", "3"), ("small", "1")):
                k8s.create(NS, queued_pod(name, cpu))
            assert eventually(lambda: not k8s.pod("small")["spec"].get("schedulingGates"))
            assert k8s.pod("big")["spec"]["schedulingGates"] == [{"name": ADMISSION_GATE}]
        finally:
            kueue.stop()


def queued_pod(name: str, cpu: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {KUEUE_QUEUE_LABEL: "kfp-elastic"}},
        "spec": {
            "containers": [
                {"name": "c", "image": "python", "resources": {"requests": {"cpu": cpu}}}
            ]
        },
    }
