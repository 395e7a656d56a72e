"""The test cluster's pure decisions: scheduling and preemption (scheduler.plan), taints and
tolerations, the node lifecycle (when a node is unreachable, when the taint manager evicts), the
DefaultTolerationSeconds admission, and how the kubelet builds a container's env, mounts and
volume files."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest

from kfp_elastic.testing.api_server import FakeKubernetes, add_default_tolerations
from kfp_elastic.testing.api_wire import api_call
from kfp_elastic.testing.cluster.kubelet import (
    PodConfigError,
    container_env,
    exit_code,
    expand_vars,
    prepare_volumes,
    rewrite_mount_paths,
)
from kfp_elastic.testing.cluster.node_lifecycle import (
    NodeLifecycle,
    NodeLifecycleSettings,
    eviction_delay,
    unreachable,
    unreachable_taints,
)
from kfp_elastic.testing.cluster.scheduler import (
    parse_quantity,
    plan,
    pod_requests,
    tolerates,
    untolerated,
)


def pod(
    name: str,
    cpu: str = "1",
    priority: int = 0,
    node: str | None = None,
    policy: str = "PreemptLowerPriority",
    rv: int = 1,
    terminating: bool = False,
    phase: str = "Pending",
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "resourceVersion": str(rv)}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    spec: dict[str, Any] = {
        "containers": [{"name": "c", "resources": {"requests": {"cpu": cpu}}}],
        "priority": priority,
        "preemptionPolicy": policy,
    }
    if node:
        spec["nodeName"] = node
    return {"metadata": meta, "spec": spec, "status": {"phase": phase}}


def cpus(n: float) -> dict[str, float]:
    return {"cpu": n, "memory": 1e12, "nvidia.com/gpu": 0}


def test_quantities_and_requests() -> None:
    assert parse_quantity("500m") == 0.5
    assert parse_quantity("2Gi") == 2 * 2**30
    assert parse_quantity(3) == 3
    with pytest.raises(ValueError):
        parse_quantity("lots")
    two = pod("a", cpu="1500m")
    two["spec"]["containers"].append(
        {"name": "gpu", "resources": {"limits": {"nvidia.com/gpu": "1", "memory": "1Gi"}}}
    )
    assert pod_requests(two) == {"cpu": 1.5, "memory": 2**30, "nvidia.com/gpu": 1}


def test_binds_what_fits_and_leaves_the_rest_unschedulable() -> None:
    decided = plan({"n1": cpus(2)}, [pod("a", rv=1), pod("b", rv=2), pod("c", rv=3)])
    assert decided.binds == [(("ns", "a"), "n1"), (("ns", "b"), "n1")]
    assert [key for key, _ in decided.unschedulable] == [("ns", "c")]
    assert not decided.victims  # same priority: nothing to preempt


def test_gpu_slots_are_capacity() -> None:
    gpu_pod = pod("g", cpu="0")
    gpu_pod["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] = "1"
    no_gpu = plan({"n1": cpus(8)}, [gpu_pod])
    one_gpu = plan({"n1": {**cpus(8), "nvidia.com/gpu": 1}}, [gpu_pod])
    assert not no_gpu.binds and one_gpu.binds == [(("ns", "g"), "n1")]


def test_higher_priority_goes_first() -> None:
    decided = plan({"n1": cpus(1)}, [pod("low", rv=1), pod("high", priority=10, rv=2)])
    assert decided.binds == [(("ns", "high"), "n1")]


def test_preempts_the_fewest_lowest_priority_pods_on_one_node() -> None:
    running = [
        pod("n1-a", priority=1, node="n1"),
        pod("n1-b", priority=1, node="n1"),
        pod("n2-a", cpu="2", priority=5, node="n2"),
        pod("n3-a", cpu="2", priority=-5, node="n3"),
    ]
    decided = plan(
        {"n1": cpus(2), "n2": cpus(2), "n3": cpus(2)}, [*running, pod("x", cpu="2", priority=10)]
    )
    assert decided.victims == [("ns", "n3-a")]  # one victim, and the least important
    assert decided.nominated == [(("ns", "x"), "n3")]


def test_reprieves_victims_it_does_not_need() -> None:
    running = [
        pod("tiny", cpu="0.5", priority=-5, node="n1"),
        pod("big", cpu="1.5", priority=0, node="n1"),
    ]
    decided = plan({"n1": cpus(2)}, [*running, pod("x", cpu="1.5", priority=10)])
    assert decided.victims == [("ns", "big")]


def test_never_preempts_with_policy_never_or_equal_priority() -> None:
    running = [pod("low", cpu="2", priority=-5, node="n1")]
    never = plan({"n1": cpus(2)}, [*running, pod("x", cpu="2", priority=10, policy="Never")])
    equal = plan({"n1": cpus(2)}, [*running, pod("x", cpu="2", priority=-5)])
    assert not never.victims and not equal.victims
    assert [k for k, _ in never.unschedulable] == [("ns", "x")]


def test_waits_for_terminating_victims_instead_of_preempting_again() -> None:
    pods = [
        pod("victim", cpu="2", priority=-5, node="n1", terminating=True),
        pod("other", cpu="2", priority=-5, node="n2"),
        pod("x", cpu="2", priority=10),
    ]
    decided = plan({"n1": cpus(2), "n2": cpus(2)}, pods)
    assert not decided.victims
    assert decided.nominated == [(("ns", "x"), "n1")]


def test_node_selector_limits_binding_and_preemption_to_matching_nodes() -> None:
    labels = {"n1": {"kubernetes.io/hostname": "n1"}, "n2": {"kubernetes.io/hostname": "n2"}}
    on_n2 = pod("x", cpu="1", priority=10)
    on_n2["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "n2"}
    free_n1 = plan({"n1": cpus(1), "n2": cpus(1)}, [on_n2], labels)
    assert free_n1.binds == [(("ns", "x"), "n2")]
    running = [pod("w1", priority=-5, node="n1"), pod("w2", priority=-5, node="n2")]
    full = plan({"n1": cpus(1), "n2": cpus(1)}, [*running, on_n2], labels)
    assert full.victims == [("ns", "w2")] and full.nominated == [(("ns", "x"), "n2")]
    nowhere = plan({"n1": cpus(1)}, [on_n2], {"n1": labels["n1"]})
    assert not nowhere.binds and not nowhere.victims


def test_terminal_pods_free_their_capacity_and_pods_of_gone_nodes_are_ignored() -> None:
    pods = [pod("done", cpu="2", node="n1", phase="Succeeded"), pod("lost", node="gone")]
    decided = plan({"n1": cpus(2)}, [*pods, pod("x", cpu="2")])
    assert decided.binds == [(("ns", "x"), "n1")]


def test_a_nominated_pods_room_is_not_given_to_a_lower_priority_pod() -> None:
    # One of the preemptor's two victims is gone, the other still terminating: the room freed
    # so far is the preemptor's (counted as used, as kube-scheduler's addNominatedPods does),
    # not the Pending low-priority pod's, which would be preempted again a moment later.
    pods = [
        pod("victim", cpu="1", priority=-5, node="n1", terminating=True),
        pod("serving", cpu="2", priority=10, rv=5),
        pod("replacement", cpu="1", priority=-5, policy="Never", rv=6),
    ]
    pods[1]["status"]["nominatedNodeName"] = "n1"
    decided = plan({"n1": cpus(2)}, pods)
    assert decided.binds == []
    assert decided.nominated == [(("ns", "serving"), "n1")]
    assert [k for k, _ in decided.unschedulable] == [("ns", "serving"), ("ns", "replacement")]
    # Once the preemptor is bound the rest of the node is free for others again.
    bound = plan({"n1": cpus(3)}, [pod("serving", cpu="2", priority=10, node="n1"), pods[2]])
    assert bound.binds == [(("ns", "replacement"), "n1")]


def test_a_fresh_nomination_reserves_room_within_the_same_pass() -> None:
    running = [pod("a", priority=-5, node="n1"), pod("b", priority=-5, node="n1")]
    pods = [*running, pod("x", cpu="2", priority=10, rv=5), pod("low", priority=-5, rv=6)]
    decided = plan({"n1": cpus(2), "n2": cpus(0.5)}, pods)
    assert sorted(decided.victims) == [("ns", "a"), ("ns", "b")]
    assert decided.binds == []  # "low" does not take the room freed for "x"


def test_tolerations_match_as_kubernetes_matches_them() -> None:
    taint = {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}
    assert tolerates({"key": taint["key"], "operator": "Exists"}, taint)
    assert tolerates({"key": taint["key"], "operator": "Exists", "effect": "NoExecute"}, taint)
    assert not tolerates({"key": taint["key"], "operator": "Exists", "effect": "NoSchedule"}, taint)
    assert tolerates({"operator": "Exists"}, taint)  # empty key with Exists: every taint
    assert not tolerates({"key": "other", "operator": "Exists"}, taint)
    gpu = {"key": "gpu", "value": "a100", "effect": "NoSchedule"}
    assert tolerates({"key": "gpu", "value": "a100"}, gpu)  # Equal is the default operator
    assert tolerates({"key": "gpu", "operator": "Equal", "value": "a100"}, gpu)
    assert not tolerates({"key": "gpu", "operator": "Equal", "value": "h100"}, gpu)
    prefer = {"key": "gpu", "effect": "PreferNoSchedule"}
    assert untolerated(pod("x"), [gpu, prefer]) == [gpu]  # a preference keeps nobody off


def test_pods_are_not_scheduled_on_nodes_whose_taints_they_do_not_tolerate() -> None:
    taints = {"n1": unreachable_taints("2026-01-01T00:00:00Z")}
    plain = plan({"n1": cpus(2), "n2": cpus(1)}, [pod("a", rv=1), pod("b", rv=2)], taints=taints)
    assert plain.binds == [(("ns", "a"), "n2")]
    assert [k for k, _ in plain.unschedulable] == [("ns", "b")]
    assert "untolerated taints" in plain.unschedulable[0][1]
    tolerant = pod("t")
    tolerant["spec"]["tolerations"] = [{"operator": "Exists"}]
    assert plan({"n1": cpus(2)}, [tolerant], taints=taints).binds == [(("ns", "t"), "n1")]
    # Nor does a preemptor pick victims on such a node.
    running = [pod("low", cpu="2", priority=-5, node="n1")]
    blocked = plan({"n1": cpus(2)}, [*running, pod("x", cpu="2", priority=10)], taints=taints)
    assert not blocked.victims and not blocked.nominated


def test_a_node_is_unreachable_after_the_monitor_grace() -> None:
    assert not unreachable(now=140.0, last_heartbeat=100.0, grace_s=40.0)
    assert unreachable(now=140.5, last_heartbeat=100.0, grace_s=40.0)


def test_the_taint_manager_evicts_after_the_shortest_toleration() -> None:
    taints = unreachable_taints("2026-01-01T00:00:00Z")
    bare = pod("bare")
    assert eviction_delay(bare, taints) == 0  # no toleration at all: at once
    assert eviction_delay(bare, [t for t in taints if t["effect"] == "NoSchedule"]) is None
    worker = pod("worker")
    worker["spec"]["tolerations"] = [
        {
            "key": "node.kubernetes.io/unreachable",
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": 10,
        },
        {
            "key": "node.kubernetes.io/unreachable",
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": 30,
        },
    ]
    assert eviction_delay(worker, taints) == 10
    forever = pod("forever")
    forever["spec"]["tolerations"] = [{"operator": "Exists"}]
    assert eviction_delay(forever, taints) is None
    negative = pod("negative")
    negative["spec"]["tolerations"] = [{"operator": "Exists", "tolerationSeconds": -5}]
    assert eviction_delay(negative, taints) == 0


def test_node_lifecycle_marks_a_silent_node_and_evicts_on_each_pods_timeline() -> None:
    # The API side of a lost node, time driven by hand: no kubelet, no processes.
    beat = {"n1": 100.0}
    settings = NodeLifecycleSettings(monitor_grace_s=1, monitor_period_s=3600)
    with FakeKubernetes(validate_pods=False, kubelet=False, default_toleration_seconds=None) as k8s:
        k8s.create_object("nodes", "", {"metadata": {"name": "n1"}, "status": {"conditions": []}})
        unreachable_for = {
            "bare": None,
            "five": [
                {
                    "key": "node.kubernetes.io/unreachable",
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": 5,
                }
            ],
            "forever": [{"operator": "Exists"}],
        }
        for name, tolerations in unreachable_for.items():
            spec: dict[str, Any] = {"containers": [{"name": "c", "image": "i"}]}
            if tolerations:
                spec["tolerations"] = tolerations
            k8s.create("default", {"metadata": {"name": name}, "spec": spec})
            k8s.bind("default", name, "n1")
            k8s.set_phase(name, "Running", node="n1")
        lifecycle = NodeLifecycle(k8s, beat.get, settings)
        try:
            lifecycle.monitor_once(now=100.5)  # within the grace: nothing happens
            node = k8s.get_object("nodes", "", "n1")
            assert not node.get("spec", {}).get("taints")
            assert {p["metadata"]["name"] for p in k8s.pods_snapshot()} == set(unreachable_for)
            lifecycle.monitor_once(now=102.0)  # silent past the grace
            node = k8s.get_object("nodes", "", "n1")
            ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
            assert (ready["status"], ready["reason"]) == ("Unknown", "NodeStatusUnknown")
            assert {(t["key"], t["effect"]) for t in node["spec"]["taints"]} == {
                ("node.kubernetes.io/unreachable", "NoSchedule"),
                ("node.kubernetes.io/unreachable", "NoExecute"),
            }
            names = lambda: {p["metadata"]["name"] for p in k8s.pods_snapshot()}  # noqa: E731
            assert names() == {"five", "forever"}  # no toleration: evicted at once
            lifecycle.monitor_once(now=106.5)
            assert names() == {"five", "forever"}
            lifecycle.monitor_once(now=107.5)  # 5 s after the taint
            assert names() == {"forever"}
        finally:
            lifecycle.stop()


def test_default_toleration_seconds_admission_adds_only_what_is_missing() -> None:
    spec: dict[str, Any] = {}
    add_default_tolerations(spec, 300)
    assert spec["tolerations"] == [
        {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}
        for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
    ]
    own = {
        "key": "node.kubernetes.io/unreachable",
        "operator": "Exists",
        "effect": "NoExecute",
        "tolerationSeconds": 10,
    }
    spec = {"tolerations": [own]}
    add_default_tolerations(spec, 300)
    assert [t["key"] for t in spec["tolerations"]] == [
        "node.kubernetes.io/unreachable",
        "node.kubernetes.io/not-ready",
    ]
    assert spec["tolerations"][0] == own
    everything = {"tolerations": [{"operator": "Exists"}]}
    add_default_tolerations(everything, 300)
    assert everything["tolerations"] == [{"operator": "Exists"}]


# -- kubelet -------------------------------------------------------------------------------


def test_mount_paths_are_rewritten_at_path_boundaries() -> None:
    mounts = {"/etc/tls": "/host/tls", "/etc/tls/ca": "/host/ca", "/data": "/host/data"}
    assert rewrite_mount_paths("--ca=/etc/tls/ca.crt", mounts) == "--ca=/host/tls/ca.crt"
    assert rewrite_mount_paths("/etc/tls/ca/x.pem", mounts) == "/host/ca/x.pem"
    assert rewrite_mount_paths("/data", mounts) == "/host/data"
    assert rewrite_mount_paths("/database /etc/tlsx", mounts) == "/database /etc/tlsx"
    assert rewrite_mount_paths("open('/data/x')", mounts) == "open('/host/data/x')"


def test_env_resolves_value_from_and_expands_variables() -> None:
    objects = {
        ("configmaps", "cfg"): {"kind": "ConfigMap", "data": {"endpoint": "e:1", "a": "A"}},
        ("secrets", "sec"): {"kind": "Secret", "data": {"pw": base64.b64encode(b"s3").decode()}},
    }
    the_pod = {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "labels": {"run": "r7"}},
        "spec": {"nodeName": "n1"},
    }
    container = {
        "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "CFG_"}],
        "env": [
            {"name": "EP", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "endpoint"}}},
            {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "pw"}}},
            {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "RUN", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['run']"}}},
            {"name": "URL", "value": "http://$(IP):80/$(NAME)/$(MISSING)/$$(NAME)"},
            {
                "name": "OPT",
                "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k", "optional": True}},
            },
        ],
    }
    env = container_env(the_pod, container, lambda r, n: objects.get((r, n)), {"BASE": "1"})
    assert env["CFG_endpoint"] == "e:1" and env["CFG_a"] == "A" and env["BASE"] == "1"
    assert (env["EP"], env["PW"], env["NAME"], env["UID"]) == ("e:1", "s3", "p", "u-1")
    assert (env["IP"], env["RUN"]) == ("127.0.0.1", "r7")
    assert env["URL"] == "http://127.0.0.1:80/p/$(MISSING)/$(NAME)"
    assert "OPT" not in env
    missing = {"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "no", "key": "k"}}}]}
    with pytest.raises(PodConfigError, match='secret "no" not found'):
        container_env(the_pod, missing, lambda r, n: None, {})
    assert expand_vars("$(A)$(B)", {"A": "1"}) == "1$(B)"


def test_volumes_become_host_directories(tmp_path: Path) -> None:
    objects = {
        ("secrets", "tls"): {
            "kind": "Secret",
            "data": {
                k: base64.b64encode(v.encode()).decode() for k, v in {"ca": "C", "x": "X"}.items()
            },
        },
        ("configmaps", "cfg"): {"kind": "ConfigMap", "data": {"a.yaml": "a: 1"}},
    }
    volumes = [
        {"name": "scratch", "emptyDir": {}},
        {"name": "shared", "persistentVolumeClaim": {"claimName": "ckpt"}},
        {"name": "tls", "secret": {"secretName": "tls", "items": [{"key": "ca", "path": "d/ca"}]}},
        {"name": "cfg", "configMap": {"name": "cfg"}},
    ]
    the_pod = {"metadata": {"name": "p"}, "spec": {"volumes": volumes}}
    found = prepare_volumes(
        the_pod, tmp_path / "pod", tmp_path / "claims", lambda r, n: objects.get((r, n))
    )
    assert found["shared"] == tmp_path / "claims" / "ckpt" and found["shared"].is_dir()
    assert found["scratch"].is_dir()
    assert (found["tls"] / "d" / "ca").read_text() == "C"
    assert not (found["tls"] / "x").exists()  # only the items asked for
    assert (found["cfg"] / "a.yaml").read_text() == "a: 1"
    the_pod["spec"]["volumes"] = [{"name": "v", "csi": {"driver": "x"}}]
    with pytest.raises(PodConfigError, match="not supported"):
        prepare_volumes(the_pod, tmp_path / "p2", tmp_path / "claims", lambda r, n: None)


def test_exit_codes_as_a_runtime_reports_them() -> None:
    assert (exit_code(0), exit_code(3), exit_code(-15), exit_code(-9)) == (0, 3, 143, 137)


@pytest.mark.parametrize(
    ("method", "path", "query", "expected"),
    [
        ("GET", "/api/v1/namespaces/ns/pods", {}, ("list", "", "pods", "")),
        ("GET", "/api/v1/namespaces/ns/pods", {"watch": "True"}, ("watch", "", "pods", "")),
        ("GET", "/api/v1/namespaces/ns/pods/p", {}, ("get", "", "pods", "")),
        ("GET", "/api/v1/namespaces/ns/pods/p/log", {}, ("get", "", "pods", "log")),
        ("POST", "/api/v1/namespaces/ns/pods", {}, ("create", "", "pods", "")),
        ("PATCH", "/api/v1/namespaces/ns/pods/p/status", {}, ("patch", "", "pods", "status")),
        ("DELETE", "/api/v1/namespaces/ns/pods/p", {}, ("delete", "", "pods", "")),
        ("DELETE", "/api/v1/namespaces/ns/pods", {}, ("deletecollection", "", "pods", "")),
        (
            "POST",
            "/apis/events.k8s.io/v1/namespaces/ns/events",
            {},
            ("create", "events.k8s.io", "events", ""),
        ),
        (
            "GET",
            "/apis/scheduling.k8s.io/v1/priorityclasses/x",
            {},
            ("get", "scheduling.k8s.io", "priorityclasses", ""),
        ),
    ],
)
def test_requests_are_recorded_as_rbac_sees_them(
    method: str, path: str, query: dict[str, str], expected: tuple[str, str, str, str]
) -> None:
    call = api_call(method, path, query)
    assert call is not None
    assert (call.verb, call.group, call.resource, call.subresource) == expected
    assert api_call("GET", "/version", {}) is None
