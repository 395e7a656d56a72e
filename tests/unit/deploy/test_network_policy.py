"""The NetworkPolicy in manifests/base against the labels our pods really carry.

The worker pod comes from ``master/pod_spec.py`` (what the master submits), the master's labels
from the compiled pipeline YAML (what KFP puts on the training task's pod), the etcd members'
from the rendered StatefulSet. The policy's selectors are evaluated as Kubernetes evaluates them
(``matchLabels`` and ``matchExpressions`` ANDed).
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from kfp_elastic.master.pod_spec import WorkerPodSpec, build_pod
from kfp_elastic.pipelines.compile import ROOT
from tests.helpers import Obj, find, one, render

TARGETS = ["base", "overlays/local-kind", "overlays/production"]
POLICY = "kfp-elastic-etcd"
CLIENT_PORT, PEER_PORT, METRICS_PORT = 2379, 2380, 2381
PIPELINE_YAML = ROOT / "pipelines" / "elastic_training.yaml"


def selector_matches(selector: Obj, labels: dict[str, str]) -> bool:
    """A LabelSelector against a pod's labels; ``{}`` selects every pod."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def allowed_ports(policy: Obj, source_labels: dict[str, str]) -> set[int]:
    """Ports of the selected pods that a pod with ``source_labels`` in the policy's namespace
    may reach (ingress rules with pod selectors only; the policy has no other kind)."""
    ports: set[int] = set()
    for rule in policy["spec"]["ingress"]:
        peers = rule["from"]
        assert all(set(peer) == {"podSelector"} for peer in peers), "pod selectors only"
        if any(selector_matches(peer["podSelector"], source_labels) for peer in peers):
            ports |= {p["port"] for p in rule["ports"]}
    return ports


def worker_labels() -> dict[str, str]:
    spec = WorkerPodSpec(
        job_name="job-1",
        image="registry.example/worker:1",
        entrypoint="kfp_elastic.worker",
        module=True,
        rdzv_endpoint="etcd:2379",
        min_nodes=1,
        max_nodes=3,
        labels={"team": "ml"},
    )
    return build_pod(spec)["metadata"]["labels"]


def master_labels(executor: str = "exec-elastic-train") -> dict[str, str]:
    """The labels KFP gives a task's pod (the elastic_train task: the master), from the
    compiled pipeline."""
    _, platform = [d for d in yaml.safe_load_all(PIPELINE_YAML.read_text()) if d]
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    return executors[executor]["podMetadata"]["labels"]


def etcd_pod_labels(objs: list[Obj]) -> dict[str, str]:
    return one(objs, "StatefulSet", "kfp-elastic-etcd")["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize("target", TARGETS)
def test_policy_selects_exactly_the_etcd_members(target: str) -> None:
    objs = render(target)
    policy = one(objs, "NetworkPolicy", POLICY)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    etcd = etcd_pod_labels(objs)
    assert selector_matches(policy["spec"]["podSelector"], etcd)
    assert not selector_matches(policy["spec"]["podSelector"], worker_labels())
    assert not selector_matches(policy["spec"]["podSelector"], master_labels())
    if target != "base":  # the overlay's namespace, like every other object
        assert policy["metadata"]["namespace"] == "kfp-elastic"
    assert len(find(objs, "NetworkPolicy")) == 1


@pytest.mark.parametrize("target", TARGETS)
def test_only_the_jobs_pods_reach_the_client_port_and_only_members_the_peer_port(
    target: str,
) -> None:
    objs = render(target)
    policy = one(objs, "NetworkPolicy", POLICY)
    assert allowed_ports(policy, worker_labels()) == {CLIENT_PORT}
    assert allowed_ports(policy, master_labels()) == {CLIENT_PORT}
    # The exit handler deletes the run's etcd keys: it reaches etcd as the master does.
    assert allowed_ports(policy, master_labels("exec-stop-workers")) == {CLIENT_PORT}
    assert allowed_ports(policy, etcd_pod_labels(objs)) == {PEER_PORT}
    others: list[dict[str, Any]] = [
        {},  # any unlabelled pod, e.g. the pipeline's other tasks (shard_dataset, evaluate)
        {"app.kubernetes.io/part-of": "kfp-elastic"},  # part of us, but neither worker nor master
        {"app.kubernetes.io/component": "worker"},  # someone else's worker
        {**worker_labels(), "app.kubernetes.io/part-of": "other"},
    ]
    for labels in others:
        assert allowed_ports(policy, labels) == set(), labels
    # The etcd containers serve exactly these ports; metrics (2381) is left to the node's probes.
    container = one(objs, "StatefulSet", "kfp-elastic-etcd")["spec"]["template"]["spec"][
        "containers"
    ][0]
    served = {p["containerPort"] for p in container["ports"]}
    assert served == {CLIENT_PORT, PEER_PORT, METRICS_PORT}
