"""docs/deploy.md's claim that the etcd PodDisruptionBudget keeps quorum through node drains.

Three nodes of the test cluster hold one etcd member each (stand-in ``sleep`` containers with
the StatefulSet's labels and owner, requests that fit one per node). The manifests' StatefulSet
is stored and its PodDisruptionBudget applied; a small loop plays the StatefulSet controller
(a missing member is created again under its name). Every node is then drained as
``kubectl drain`` does it (cordon, evict each pod retrying on 429, wait until it is gone,
uncordon), the first two at once, as an operator upgrading two nodes together would. Replaying
every pod event of the run shows that at no moment were fewer members healthy than the budget
demands: quorum (2 of 3) was kept.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from kfp_elastic.testing.api_rules import healthy
from kfp_elastic.testing.cluster import TestCluster
from tests.helpers import one, render, wait_for

NAME = "kfp-elastic-etcd"
NODES = ("node-1", "node-2", "node-3")


def member(index: int, template: dict[str, Any], owner_uid: str) -> dict[str, Any]:
    """A StatefulSet pod as the controller makes it; its container a stand-in for etcd."""
    return {
        "metadata": {
            "name": f"{NAME}-{index}",
            "labels": template["metadata"]["labels"],
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "StatefulSet",
                    "name": NAME,
                    "uid": owner_uid,
                    "controller": True,
                }
            ],
        },
        "spec": {
            "priorityClassName": template["spec"]["priorityClassName"],
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {
                    "name": "etcd",
                    "image": "busybox:1.36",
                    "command": ["sleep", "600"],
                    "resources": {"requests": {"cpu": "600m"}},  # one member per node
                }
            ],
        },
    }


class StatefulSetController:
    """Creates a member again, under its name, once the old pod is gone."""

    def __init__(self, cluster: TestCluster, template: dict[str, Any], owner_uid: str) -> None:
        self.cluster, self.template, self.owner_uid = cluster, template, owner_uid
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="statefulset", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        api, seen = self.cluster.api, 0
        while not self.stop.is_set():
            names = {p["metadata"]["name"] for p in api.pods_snapshot()}
            for index in range(3):
                if f"{NAME}-{index}" not in names:
                    api.create(self.cluster.namespace, member(index, self.template, self.owner_uid))
            seen = api.wait_for_change(seen, 0.2)


def drain(
    cluster: TestCluster,
    core: client.CoreV1Api,
    node: str,
    refusals: list[str],
    together: threading.Barrier | None = None,
) -> None:
    """``kubectl drain``: cordon, evict every pod of the node (again after each 429), wait until
    they are gone; then uncordon (the node is back from its upgrade). ``together``: the drains
    that start evicting at the same moment."""
    ns = cluster.namespace
    set_unschedulable(cluster, node, True)
    if together is not None:
        together.wait(30)
    on_node = [p for p in cluster.api.pods_snapshot() if p["spec"].get("nodeName") == node]
    for pod in on_node:
        name = pod["metadata"]["name"]
        eviction = client.V1Eviction(metadata=client.V1ObjectMeta(name=name, namespace=ns))

        def evicted(name: str = name, eviction: Any = eviction) -> bool:
            try:
                core.create_namespaced_pod_eviction(name, ns, eviction)
                return True
            except ApiException as error:
                if error.status != 429:
                    raise
                refusals.append(name)
                return False

        wait_for(evicted, 60, 0.1, f"eviction of {name}")
    uids = {p["metadata"]["uid"] for p in on_node}
    wait_for(
        lambda: not uids & {p["metadata"]["uid"] for p in cluster.api.pods_snapshot()},
        60,
        0.05,
        f"pods of {node} gone",
    )
    set_unschedulable(cluster, node, False)


def set_unschedulable(cluster: TestCluster, node: str, value: bool) -> None:
    obj = cluster.api.get_object("nodes", "", node)
    cluster.api.replace_object("nodes", "", {**obj, "spec": {"unschedulable": value}})


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[TestCluster]:
    nodes = {node: {"cpu": "1", "memory": "1Gi"} for node in NODES}
    with TestCluster(tmp_path / "cluster", nodes=nodes) as c:
        yield c
    assert not c.leftover_processes()


def test_drains_keep_etcd_quorum_under_the_manifests_budget(cluster: TestCluster) -> None:
    ns = cluster.namespace
    objs = render("base")
    statefulset = one(objs, "StatefulSet", NAME)
    budget = one(objs, "PodDisruptionBudget", NAME)
    cluster.apply(statefulset)
    cluster.apply(budget)
    owner = cluster.api.get_object("statefulsets", ns, NAME)["metadata"]["uid"]

    def members_healthy() -> int:
        return sum(1 for p in cluster.api.pods_snapshot() if healthy(p))

    controller = StatefulSetController(cluster, statefulset["spec"]["template"], owner)
    api = cluster.client()
    core = client.CoreV1Api(api)
    try:
        wait_for(lambda: members_healthy() == 3, 60, 0.05, "three healthy members")
        start = cluster.api.pods_snapshot()
        start_rv = max(int(p["metadata"]["resourceVersion"]) for p in start)
        placed = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in start}
        assert sorted(placed.values()) == sorted(NODES)  # one member per node
        refusals: list[str] = []
        together = threading.Barrier(2)
        pair = [
            threading.Thread(target=drain, args=(cluster, core, node, refusals, together))
            for node in NODES[:2]
        ]
        for thread in pair:
            thread.start()
        for thread in pair:
            thread.join(120)
        drain(cluster, core, NODES[2], refusals)
        wait_for(lambda: members_healthy() == 3, 60, 0.05, "three healthy members again")
        # Every pod event since the start, in order: count the healthy members after each.
        events = watch.Watch().stream(
            core.list_namespaced_pod, ns, resource_version=str(start_rv), timeout_seconds=1
        )
        state = {p["metadata"]["name"]: p for p in start}
        lowest = 3
        for event in events:
            pod = api.sanitize_for_serialization(event["object"])
            if event["type"] == "DELETED":
                state.pop(pod["metadata"]["name"], None)
            else:
                state[pod["metadata"]["name"]] = pod
            lowest = min(lowest, sum(1 for p in state.values() if healthy(p)))
    finally:
        controller.stop.set()
        controller.thread.join(5)
        api.close()
    status = cluster.api.get_object("poddisruptionbudgets", ns, NAME)["status"]
    assert (status["desiredHealthy"], status["expectedPods"]) == (2, 3)
    assert lowest == status["desiredHealthy"], "more members down at once than the budget allows"
    # The two drains overlapped: the budget refused one of them until the other's member was
    # back; and every member moved.
    assert refusals
    moved = {p["metadata"]["name"]: p["metadata"]["uid"] for p in cluster.api.pods_snapshot()}
    assert not {p["metadata"]["uid"] for p in start} & set(moved.values())
