"""kubectl against the test cluster: the kubeconfig it writes, discovery, and ``get`` printed by
the server as a real API server prints it (a Table for pods)."""

from __future__ import annotations

import os
import subprocess

import pytest

from kfp_elastic.testing.cluster import TestCluster
from tests.helpers import kubectl


def run_kubectl(cluster: TestCluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    return subprocess.run(
        [kubectl(), *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def pending_pod(name: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "demo"}},
        "spec": {
            "containers": [
                {"name": "main", "image": "python", "resources": {"requests": {"cpu": "64"}}}
            ]
        },
    }


@pytest.fixture
def cluster(test_cluster: TestCluster) -> TestCluster:
    return test_cluster


def test_kubectl_version_and_api_resources(cluster: TestCluster) -> None:
    version = run_kubectl(cluster, "version")
    assert version.returncode == 0, version.stderr
    assert "Server Version: v1.36.0" in version.stdout
    assert "exceeds the supported minor version skew" not in version.stderr
    resources = run_kubectl(cluster, "api-resources")
    assert resources.returncode == 0, resources.stderr
    rows = {line.split()[0]: line.split() for line in resources.stdout.splitlines()[1:]}
    assert rows["pods"][1:] == ["po", "v1", "true", "Pod"]
    assert rows["priorityclasses"][1:] == ["pc", "scheduling.k8s.io/v1", "false", "PriorityClass"]
    assert "poddisruptionbudgets" in rows and "rolebindings" in rows


def test_kubectl_get_prints_pods_as_a_real_server_does(cluster: TestCluster) -> None:
    empty = run_kubectl(cluster, "get", "pods")
    assert empty.returncode == 0 and "No resources found in default namespace." in empty.stderr
    cluster.api.create(cluster.namespace, pending_pod("demo-0"))  # 64 CPUs: never scheduled
    got = run_kubectl(cluster, "get", "pods")
    assert got.returncode == 0, got.stderr
    header, row = got.stdout.splitlines()
    assert header.split() == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    assert row.split()[:4] == ["demo-0", "0/1", "Pending", "0"]
    wide = run_kubectl(cluster, "get", "pod", "demo-0", "-o", "wide")
    assert wide.stdout.split()[5:9] == ["IP", "NODE", "NOMINATED", "NODE"]
    assert "<none>" in wide.stdout.splitlines()[1]
    labelled = run_kubectl(cluster, "get", "pods", "-l", "app=other")
    assert "No resources found" in labelled.stderr
    as_yaml = run_kubectl(cluster, "get", "pod", "demo-0", "-o", "yaml")
    assert "kind: Pod" in as_yaml.stdout and "name: demo-0" in as_yaml.stdout
    missing = run_kubectl(cluster, "get", "pod", "nope")
    assert missing.returncode == 1
    assert 'Error from server (NotFound): pods "nope" not found' in missing.stderr


def test_kubectl_get_nodes_and_priorityclasses(cluster: TestCluster) -> None:
    nodes = run_kubectl(cluster, "get", "nodes")
    assert nodes.returncode == 0 and "node-1" in nodes.stdout
    classes = run_kubectl(cluster, "get", "priorityclasses", "-o", "name")
    assert "priorityclass.scheduling.k8s.io/kfp-elastic-worker-level-0" in classes.stdout
