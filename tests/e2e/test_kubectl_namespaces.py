"""kubectl and the test cluster's namespaces, whose lifecycle is kube-apiserver's
NamespaceLifecycle admission and the namespace controller: nothing is created in a namespace
that does not exist or is being terminated, the cluster's own namespaces cannot be deleted, and
deleting a namespace deletes everything in it (its pods gracefully) before the namespace goes."""

from __future__ import annotations

import json

import pytest

from kfp_elastic.testing.cluster import TestCluster
from tests.helpers import run_kubectl, wait_for

NAMESPACE = "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: team\n"
CONFIG_MAP = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {name}\ndata:\n  a: b\n"
# A pod that ignores SIGTERM: it stays Terminating for its grace period.
POD = """apiVersion: v1
kind: Pod
metadata:
  name: stubborn
spec:
  terminationGracePeriodSeconds: 3
  containers:
  - name: main
    image: python:3.13
    command:
    - python
    - -c
    - import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)
"""


@pytest.fixture
def cluster(test_cluster: TestCluster) -> TestCluster:
    return test_cluster


def phase(cluster: TestCluster, pod: str, ns: str) -> str:
    got = run_kubectl(cluster, "get", "pod", pod, "-n", ns, "-o", "jsonpath={.status.phase}")
    return got.stdout


def test_kubectl_namespace_lifecycle(cluster: TestCluster) -> None:
    missing = run_kubectl(cluster, "apply", "-n", "team", "-f", "-", stdin=POD)
    assert missing.returncode == 1
    assert missing.stderr.strip() == (
        'Error from server (NotFound): error when creating "STDIN": namespaces "team" not found'
    )
    assert run_kubectl(cluster, "apply", "-f", "-", stdin=NAMESPACE).returncode == 0
    for manifest in (POD, CONFIG_MAP.format(name="settings")):
        created = run_kubectl(cluster, "apply", "-n", "team", "-f", "-", stdin=manifest)
        assert created.returncode == 0, created.stderr
    assert wait_for(lambda: phase(cluster, "stubborn", "team") == "Running", 60)

    deleting = run_kubectl(cluster, "delete", "namespace", "team", "--wait=false")
    assert deleting.stdout.strip() == 'namespace "team" deleted', deleting.stderr
    live = json.loads(run_kubectl(cluster, "get", "namespace", "team", "-o", "json").stdout)
    assert live["status"]["phase"] == "Terminating"
    assert live["metadata"]["deletionTimestamp"]
    refused = run_kubectl(
        cluster, "apply", "-n", "team", "-f", "-", stdin=CONFIG_MAP.format(name="late")
    )
    assert refused.returncode == 1
    assert refused.stderr.strip() == (
        'Error from server (Forbidden): error when creating "STDIN": configmaps "late" is '
        "forbidden: unable to create new content in namespace team because it is being "
        "terminated"
    )
    # the content goes: the config map at once, the pod through its kubelet, gracefully
    assert run_kubectl(cluster, "get", "configmap", "settings", "-n", "team").returncode == 1
    pod = json.loads(
        run_kubectl(cluster, "get", "pod", "stubborn", "-n", "team", "-o", "json").stdout
    )
    assert pod["metadata"]["deletionTimestamp"]
    again = run_kubectl(cluster, "delete", "namespace", "team", "--wait=false")
    assert again.returncode == 1
    assert again.stderr.strip() == (
        'Error from server (Conflict): Operation cannot be fulfilled on namespaces "team": The '
        "system is ensuring all content is removed from this namespace.  Upon completion, this "
        "namespace will automatically be purged by the system."
    )
    # kubectl waits for the namespace to be gone (here: once the pod's grace period is over)
    waited = run_kubectl(cluster, "wait", "--for=delete", "namespace/team", "--timeout=60s")
    assert waited.returncode == 0, waited.stderr
    assert run_kubectl(cluster, "get", "pods", "-n", "team").stderr.strip() == (
        "No resources found in team namespace."
    )
    assert not any(e["involvedObject"]["name"] == "stubborn" for e in cluster.api.events(ns="team"))


def test_kubectl_delete_namespace_waits_until_its_content_is_gone(cluster: TestCluster) -> None:
    assert run_kubectl(cluster, "apply", "-f", "-", stdin=NAMESPACE).returncode == 0
    created = run_kubectl(cluster, "apply", "-n", "team", "-f", "-", stdin=POD)
    assert created.returncode == 0, created.stderr
    assert wait_for(lambda: phase(cluster, "stubborn", "team") == "Running", 60)
    deleted = run_kubectl(cluster, "delete", "namespace", "team", "--wait=true", timeout=90)
    assert deleted.returncode == 0, deleted.stderr
    assert deleted.stdout.strip() == 'namespace "team" deleted'
    assert run_kubectl(cluster, "get", "namespace", "team").returncode == 1  # gone on return
    assert "team" not in {pod["metadata"]["namespace"] for pod in cluster.api.pods_snapshot()}


def test_kubectl_the_cluster_s_namespaces_cannot_be_deleted(cluster: TestCluster) -> None:
    for name in ("default", "kube-system", "kube-public"):
        refused = run_kubectl(cluster, "delete", "namespace", name)
        assert refused.returncode == 1
        assert refused.stderr.strip() == (
            f'Error from server (Forbidden): namespaces "{name}" is forbidden: this namespace '
            "may not be deleted"
        )
    listed = run_kubectl(cluster, "get", "namespaces", "-o", "name").stdout.split()
    assert {"namespace/kube-node-lease", f"namespace/{cluster.api.namespace}"} <= set(listed)
