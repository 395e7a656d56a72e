"""The test cluster's kubelet records the events of its node as the kubelet does: a cordon
(``spec.unschedulable``) is ``NodeNotSchedulable``, an uncordon ``NodeSchedulable``, each once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kfp_elastic.testing.api_server import FakeKubernetes
from kfp_elastic.testing.cluster.kubelet import ClusterAccess, Kubelet
from kfp_elastic.testing.nodes import wait_for


@pytest.fixture
def k8s() -> Iterator[FakeKubernetes]:
    with FakeKubernetes() as fake:
        yield fake


def node_events(k8s: FakeKubernetes) -> list[tuple[str, str, str]]:
    return [
        (e["reason"], e["message"], e["source"]["component"])
        for e in k8s.events("node-1", ns="default")
    ]


def set_unschedulable(k8s: FakeKubernetes, value: bool) -> None:
    body = {"spec": {"unschedulable": value}}
    k8s.patch_object("nodes", "", "node-1", body, "application/strategic-merge-patch+json")


def test_cordon_and_uncordon_are_node_events(k8s: FakeKubernetes, tmp_path: Path) -> None:
    access = ClusterAccess("127.0.0.1", k8s.port, tmp_path / "ca.crt", "token", "test")
    kubelet = Kubelet(k8s, "node-1", tmp_path, access)
    try:
        k8s.create_object("nodes", "", {"metadata": {"name": "node-1"}, "spec": {}})
        set_unschedulable(k8s, True)
        cordoned = ("NodeNotSchedulable", "Node node-1 status is now: NodeNotSchedulable")
        wait_for(lambda: len(node_events(k8s)) == 1, 10, 0.05, "the cordon's event")
        assert node_events(k8s) == [(*cordoned, "kubelet")]
        set_unschedulable(k8s, True)  # no change: no event
        set_unschedulable(k8s, False)
        wait_for(lambda: len(node_events(k8s)) == 2, 10, 0.05, "the uncordon's event")
        assert node_events(k8s) == [
            (*cordoned, "kubelet"),
            ("NodeSchedulable", "Node node-1 status is now: NodeSchedulable", "kubelet"),
        ]
        involved = k8s.events("node-1", ns="default")[0]["involvedObject"]
        assert (involved["kind"], involved["name"]) == ("Node", "node-1")
    finally:
        kubelet.stop()
