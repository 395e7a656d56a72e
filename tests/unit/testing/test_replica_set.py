"""The test cluster's ReplicaSet stand-in: the pure decision (create the missing pods, delete the
surplus newest-first, unscheduled and Pending ones before Running ones) and the controller over
the fake API server (scale up and down, a failed or deleted pod replaced)."""

from __future__ import annotations

from typing import Any

import pytest

from kfp_elastic.testing.api_server import FakeKubernetes
from kfp_elastic.testing.cluster.replica_set import (
    ReplicaSet,
    is_active,
    reconcile,
    scale_down_order,
)
from tests.helpers import eventually

TEMPLATE = {
    "metadata": {"labels": {"app": "web"}},
    "spec": {"containers": [{"name": "main", "image": "web:1"}], "restartPolicy": "Never"},
}


def pod(name: str, phase: str = "Running", node: str | None = "n1", **meta: Any) -> dict:
    return {
        "metadata": {"name": name, **meta},
        "spec": {"nodeName": node} if node else {},
        "status": {"phase": phase},
    }


def test_reconcile_creates_the_missing_pods_counting_only_active_ones() -> None:
    pods = [pod("a"), pod("b", phase="Failed"), pod("c", deletionTimestamp="2026-01-01T00:00:00Z")]
    assert [is_active(p) for p in pods] == [True, False, False]
    decision = reconcile(3, pods, {})
    assert (decision.create, decision.delete) == (2, ())
    assert reconcile(1, pods, {}).create == 0 and reconcile(1, pods, {}).delete == ()


def test_scale_down_deletes_unscheduled_then_pending_then_the_newest() -> None:
    created = {"old": 1.0, "mid": 2.0, "new": 3.0, "pending": 0.5, "unbound": 0.1}
    pods = [
        pod("old"),
        pod("new"),
        pod("mid"),
        pod("pending", phase="Pending"),
        pod("unbound", phase="Pending", node=None),
        pod("adopted"),  # not created by this controller: the oldest
    ]
    order = [p["metadata"]["name"] for p in scale_down_order(pods, created)]
    assert order == ["unbound", "pending", "new", "mid", "old", "adopted"]
    assert reconcile(4, pods, created).delete == ("unbound", "pending")
    assert reconcile(2, pods, created).delete == ("unbound", "pending", "new", "mid")
    with pytest.raises(ValueError, match="replicas must be >= 0"):
        reconcile(-1, pods, created)


def test_controller_scales_and_replaces_lost_pods() -> None:
    with (
        FakeKubernetes(validate_pods=False, kubelet=True) as k8s,
        ReplicaSet(k8s, "web", TEMPLATE) as rs,
    ):
        with pytest.raises(ValueError, match="no labels"):
            ReplicaSet(k8s, "bare", {"spec": TEMPLATE["spec"]})
        assert rs.scale(3).create == 3
        names = sorted(rs.created_at, key=rs.created_at.__getitem__)
        assert sorted(p["metadata"]["name"] for p in rs.pods()) == sorted(names)
        assert all(n.startswith("web-") for n in names)
        for name in names:  # bound and running, oldest first
            k8s.bind("default", name, "n1")
            k8s.set_phase(name, "Running")
        # scale-down: the newest goes (no node runs the pods here: it is removed at once)
        assert rs.scale(2).delete == (names[-1],)
        assert eventually(lambda: len(rs.pods()) == 2)
        assert set(rs.deleted_at) == {names[-1]}
        # a pod that fails or is deleted by someone else is replaced
        k8s.set_phase(names[0], "Failed")
        assert eventually(lambda: sum(is_active(p) for p in rs.pods()) == 2)
        assert len(rs.created_at) == 4
        k8s.delete("default", names[1], grace=0)
        assert eventually(lambda: sum(is_active(p) for p in rs.pods()) == 2)
        assert len(rs.created_at) == 5
        rs.stop()
        k8s.delete("default", next(n for n in rs.created_at if n not in names), grace=0)
        assert sum(is_active(p) for p in rs.pods()) == 1  # stopped: nothing replaced
