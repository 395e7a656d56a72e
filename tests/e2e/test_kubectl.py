"""kubectl against the test cluster: the kubeconfig it writes, discovery, and ``get`` printed by
the server as a real API server prints it (a Table for pods)."""

from __future__ import annotations

import json
import sys
import time

import pytest

from kfp_elastic.testing.cluster import TestCluster
from tests.helpers import kubectl_watch, run_kubectl, wait_for


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
    assert nodes.returncode == 0, nodes.stderr
    header, row = nodes.stdout.splitlines()
    assert header.split() == ["NAME", "STATUS", "ROLES", "AGE", "VERSION"]
    assert row.split()[:3] == ["node-1", "Ready", "<none>"] and row.split()[4] == "v1.36.0"
    wide = run_kubectl(cluster, "get", "node", "node-1", "-o", "wide").stdout.splitlines()
    assert wide[0].split()[5:] == [
        "INTERNAL-IP",
        "EXTERNAL-IP",
        "OS-IMAGE",
        "KERNEL-VERSION",
        "CONTAINER-RUNTIME",
    ]
    assert "127.0.0.1" in wide[1] and "testcluster://1" in wide[1]
    assert run_kubectl(cluster, "cordon", "node-1").returncode == 0
    cordoned = run_kubectl(cluster, "get", "nodes", "--no-headers").stdout
    assert cordoned.split()[1] == "Ready,SchedulingDisabled"
    unschedulable = run_kubectl(cluster, "get", "nodes", "--field-selector=spec.unschedulable=true")
    assert "node-1" in unschedulable.stdout
    classes = run_kubectl(cluster, "get", "priorityclasses")
    lines = classes.stdout.splitlines()
    assert lines[0].split() == ["NAME", "VALUE", "GLOBAL-DEFAULT", "AGE", "PREEMPTIONPOLICY"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["kfp-elastic-worker-level-0"][1:3] == ["-2", "false"]
    assert rows["kfp-elastic-worker-low"][4] == "Never"
    named = run_kubectl(cluster, "get", "pc", "-o", "name")
    assert "priorityclass.scheduling.k8s.io/kfp-elastic-worker-level-0" in named.stdout
    roles = run_kubectl(cluster, "get", "roles").stdout.splitlines()
    assert roles[0].split() == ["NAME", "CREATED", "AT"]  # a kind without a printer
    bindings = run_kubectl(cluster, "get", "rolebindings", "-o", "wide").stdout.splitlines()
    assert bindings[0].split() == ["NAME", "ROLE", "AGE", "USERS", "GROUPS", "SERVICEACCOUNTS"]
    assert bindings[1].split()[1] == "Role/kfp-elastic-master"


def test_kubectl_refuses_what_the_stand_in_does_not_serve(cluster: TestCluster) -> None:
    refused = run_kubectl(cluster, "get", "nodes", "--field-selector", "spec.providerID=x")
    assert refused.returncode == 1
    assert 'field label not supported: "spec.providerID"' in refused.stderr
    watch = run_kubectl(cluster, "get", "events.v1.events.k8s.io", "-w", "--request-timeout=20s")
    assert watch.returncode == 1 and "(MethodNotAllowed)" in watch.stderr  # get and list only
    raw = run_kubectl(cluster, "get", "--raw", "/openapi/v2")
    assert raw.returncode == 1 and "(NotFound)" in raw.stderr
    leases = run_kubectl(cluster, "get", "leases", "-A")
    assert leases.returncode == 1
    assert "doesn't have a resource type" in leases.stderr


def python_pod(name: str, code: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {
                    "name": "main",
                    "image": "python",
                    "command": [sys.executable, "-u", "-c", code],
                    "resources": {"requests": {"cpu": "100m"}},
                }
            ],
        },
    }


def test_kubectl_logs_of_a_pod_and_follow_until_it_ends(cluster: TestCluster) -> None:
    code = "import time\nfor i in range(6):\n    print('line', i)\n    time.sleep(0.3)\n"
    cluster.api.create(cluster.namespace, python_pod("talker", code))
    # -f follows from the start of the output to the pod's end
    wait_for(lambda: run_kubectl(cluster, "logs", "talker").returncode == 0, 30, 0.2, "started")
    followed = run_kubectl(cluster, "logs", "-f", "talker")
    assert followed.returncode == 0, followed.stderr
    assert followed.stdout.splitlines() == [f"line {i}" for i in range(6)]
    tail = run_kubectl(cluster, "logs", "talker", "--tail", "2")
    assert tail.stdout.splitlines() == ["line 4", "line 5"]
    wrong = run_kubectl(cluster, "logs", "talker", "-c", "other")
    assert wrong.returncode == 1 and "container other is not valid for pod talker" in wrong.stderr


def test_kubectl_delete_pod_graceful_and_forced(cluster: TestCluster) -> None:
    sleeper = "import time\nwhile True:\n    time.sleep(0.1)\n"
    for name in ("slow-0", "slow-1"):
        cluster.api.create(cluster.namespace, python_pod(name, sleeper))
    wait_for(
        lambda: all(
            cluster.api.pod(n)["status"].get("phase") == "Running" for n in ("slow-0", "slow-1")
        ),
        30,
        0.1,
        "running",
    )
    graceful = run_kubectl(cluster, "delete", "pod", "slow-0")
    assert graceful.returncode == 0 and 'pod "slow-0" deleted' in graceful.stdout
    forced = run_kubectl(cluster, "delete", "pod", "slow-1", "--grace-period=0", "--force")
    assert forced.returncode == 0, forced.stderr
    assert 'pod "slow-1" force deleted' in forced.stdout
    assert "Immediate deletion does not wait" in forced.stderr
    wait_for(lambda: not cluster.api.list(cluster.namespace)["items"], 30, 0.1, "pods gone")
    missing = run_kubectl(cluster, "delete", "pod", "slow-0")
    assert missing.returncode == 1 and "NotFound" in missing.stderr


def test_kubectl_get_watch_prints_rows_as_pods_change(cluster: TestCluster) -> None:
    with kubectl_watch(cluster, "pods") as watch:
        time.sleep(1.0)  # kubectl lists, then watches
        cluster.api.create(cluster.namespace, python_pod("quick", "print('done')"))
        wait_for(
            lambda: cluster.api.pod("quick")["status"].get("phase") == "Succeeded",
            30,
            0.1,
            "the pod ran",
        )
        time.sleep(1.0)
    out, err = watch.out, watch.err
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"], (out, err)
    statuses = [line.split()[2] for line in lines[1:] if line.startswith("quick")]
    assert statuses[0] == "Pending" and statuses[-1] in ("Completed", "Succeeded"), out
    assert sum(line.startswith("NAME") for line in lines) == 1  # one header


def test_kubectl_field_selectors_and_describe_node(cluster: TestCluster) -> None:
    cluster.api.create(cluster.namespace, pending_pod("waiting"))
    pending = run_kubectl(cluster, "get", "pods", "--field-selector", "status.phase=Pending")
    assert "waiting" in pending.stdout
    running = run_kubectl(cluster, "get", "pods", "--field-selector=status.phase=Running")
    assert "No resources found" in running.stderr
    everywhere = run_kubectl(cluster, "get", "pods", "-A", "--field-selector=spec.nodeName=")
    assert "waiting" in everywhere.stdout  # not scheduled: no node name
    refused = run_kubectl(cluster, "get", "pods", "--field-selector", "spec.priority=1")
    assert refused.returncode == 1
    assert 'field label not supported: "spec.priority"' in refused.stderr
    node = run_kubectl(cluster, "describe", "node", "node-1")
    assert node.returncode == 0, node.stderr
    assert "Name:               node-1" in node.stdout


def test_kubectl_cordon_and_drain_evict_through_the_eviction_api(cluster: TestCluster) -> None:
    cluster.add_node("node-2", cpu="2", memory="4Gi")
    sleeper = "import time\nwhile True:\n    time.sleep(0.1)\n"
    cordoned = run_kubectl(cluster, "cordon", "node-2")  # the pods go to node-1
    assert cordoned.returncode == 0 and "node/node-2 cordoned" in cordoned.stdout
    for name in ("bare-0", "bare-1"):
        cluster.api.create(cluster.namespace, python_pod(name, sleeper))
    wait_for(
        lambda: all(
            cluster.api.pod(n)["spec"].get("nodeName") == "node-1" for n in ("bare-0", "bare-1")
        ),
        30,
        0.1,
        "bound to node-1",
    )
    assert run_kubectl(cluster, "uncordon", "node-2").returncode == 0
    # kubectl's own rule: bare pods (no controller) need --force
    refused = run_kubectl(cluster, "drain", "node-1", "--timeout=20s")
    assert refused.returncode == 1
    assert "cannot delete Pods that declare no controller" in refused.stderr
    drained = run_kubectl(cluster, "drain", "node-1", "--force", "--timeout=60s")
    assert drained.returncode == 0, drained.stderr
    assert "node/node-1 drained" in drained.stdout
    assert "pod/bare-0 evicted" in drained.stdout and "pod/bare-1 evicted" in drained.stdout
    assert cluster.api.list(cluster.namespace)["items"] == []
    node = cluster.api.get_object("nodes", "", "node-1")
    assert node["spec"]["unschedulable"] is True


def test_kubectl_events_describe_pod_and_json(cluster: TestCluster) -> None:
    sleeper = "import time\nwhile True:\n    time.sleep(0.1)\n"
    cluster.api.create(cluster.namespace, python_pod("watched", sleeper))
    cluster.api.create(cluster.namespace, pending_pod("too-big"))
    wait_for(
        lambda: cluster.api.pod("watched")["status"].get("phase") == "Running", 30, 0.1, "running"
    )
    wait_for(lambda: cluster.api.events("too-big"), 30, 0.1, "FailedScheduling recorded")
    described = run_kubectl(cluster, "describe", "pod", "watched")
    assert described.returncode == 0, described.stderr
    events = described.stdout.split("Events:")[1].splitlines()
    assert events[1].split() == ["Type", "Reason", "Age", "From", "Message"]
    reasons = [line.split()[1] for line in events[3:] if line.strip()]
    assert reasons == ["Scheduled", "Pulled", "Created", "Started"]
    assert "Successfully assigned default/watched to node-1" in described.stdout
    assert "spec.containers{main}: Started container main" in described.stdout
    pending = run_kubectl(cluster, "describe", "pod", "too-big").stdout
    assert "Warning  FailedScheduling" in pending and "0/1 nodes are available" in pending
    assert run_kubectl(cluster, "delete", "pod", "watched").returncode == 0
    listed = run_kubectl(cluster, "get", "events")
    lines = listed.stdout.splitlines()
    assert lines[0].split() == ["LAST", "SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"]
    assert any(line.split()[1:4] == ["Normal", "Killing", "pod/watched"] for line in lines)
    assert any(line.split()[1:4] == ["Normal", "Starting", "node/node-1"] for line in lines)
    selected = run_kubectl(
        cluster, "get", "events", "--field-selector", "involvedObject.name=watched,reason=Killing"
    )
    assert [line.split()[2] for line in selected.stdout.splitlines()[1:]] == ["Killing"]
    newer = run_kubectl(cluster, "get", "events.v1.events.k8s.io", "-o", "json")
    assert newer.returncode == 0, newer.stderr
    items = json.loads(newer.stdout)["items"]
    assert {"apiVersion": "events.k8s.io/v1", "reason": "Killing"}.items() <= next(
        i for i in items if i["reason"] == "Killing"
    ).items()
    as_json = json.loads(run_kubectl(cluster, "get", "pod", "too-big", "-o", "json").stdout)
    assert as_json["kind"] == "Pod" and as_json["status"]["phase"] == "Pending"
    by_namespace = run_kubectl(
        cluster, "get", "pods", "-A", "--field-selector", "metadata.namespace=default"
    )
    assert "too-big" in by_namespace.stdout


def test_kubectl_get_watch_of_nodes_and_events(cluster: TestCluster) -> None:
    with (
        kubectl_watch(cluster, "nodes") as nodes_watch,
        kubectl_watch(
            cluster, "events", "--field-selector=involvedObject.name=ran"
        ) as events_watch,
    ):
        time.sleep(1.0)  # kubectl lists, then watches
        assert run_kubectl(cluster, "cordon", "node-1").returncode == 0
        assert run_kubectl(cluster, "uncordon", "node-1").returncode == 0
        cluster.api.create(cluster.namespace, python_pod("ran", "print('done')"))
        wait_for(
            lambda: cluster.api.pod("ran")["status"].get("phase") == "Succeeded",
            30,
            0.1,
            "the pod ran",
        )
        time.sleep(1.0)
    nodes, nodes_err = nodes_watch.out, nodes_watch.err
    events, events_err = events_watch.out, events_watch.err
    statuses = [line.split()[1] for line in nodes.splitlines()[1:]]
    assert statuses == ["Ready", "Ready,SchedulingDisabled", "Ready"], (nodes, nodes_err)
    lines = events.splitlines()
    assert lines[0].split() == ["LAST", "SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"], events_err
    assert [line.split()[2] for line in lines[1:]] == ["Scheduled", "Pulled", "Created", "Started"]


def test_kubectl_create_of_a_protobuf_body_is_refused_as_an_unsupported_media_type(
    cluster: TestCluster,
) -> None:
    """kubectl sends some built-in kinds as protobuf (``create namespace``, ``create
    configmap``), which the stand-in does not decode: refused with kube-apiserver's 415 and the
    media types it takes, nothing created; the same objects as YAML through ``apply -f`` are."""
    refused = run_kubectl(cluster, "create", "namespace", "proto")
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.strip() == (
        "Error from server (UnsupportedMediaType): the body of the request was in an unknown "
        "format - accepted media types include: application/json, application/yaml"
    )
    refused = run_kubectl(cluster, "create", "configmap", "proto", "--from-literal=a=b")
    assert refused.returncode == 1 and "unknown format" in refused.stderr
    assert run_kubectl(cluster, "get", "namespace", "proto").returncode == 1
    manifest = "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: proto\n"
    applied = run_kubectl(cluster, "apply", "-f", "-", stdin=manifest)
    assert (applied.returncode, applied.stdout.strip()) == (0, "namespace/proto created")
