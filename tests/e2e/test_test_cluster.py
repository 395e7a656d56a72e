"""The test cluster end to end: real HTTPS API server, scheduler and kubelets running pods as
local processes, driven through the real ``kubernetes`` client."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from kfp_elastic import processes
from kfp_elastic.testing.cluster import TestCluster
from tests.helpers import eventually, job_worker_pods

NS = "default"
TERMINAL = ("Succeeded", "Failed")


@pytest.fixture
def core(test_cluster: TestCluster) -> Iterator[client.CoreV1Api]:
    api_client = test_cluster.client()
    yield client.CoreV1Api(api_client)
    api_client.close()


def python_pod(name: str, code: str, **spec: Any) -> dict[str, Any]:
    """A pod whose one container runs ``python -c code``; ``spec`` adds to the pod spec, and
    ``container`` (a dict) to the container."""
    container = {
        "name": "main",
        "image": "python:3.12",
        "command": ["python", "-c", code],
        **spec.pop("container", {}),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, **spec.pop("metadata", {})},
        "spec": {"restartPolicy": "Never", "containers": [container], **spec},
    }


def phase(core: client.CoreV1Api, name: str) -> str | None:
    try:
        return core.read_namespaced_pod(name, NS).status.phase
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def gone(core: client.CoreV1Api, name: str) -> bool:
    return phase(core, name) is None


def condition(core: client.CoreV1Api, name: str, kind: str) -> Any:
    for c in core.read_namespaced_pod(name, NS).status.conditions or []:
        if c.type == kind:
            return c
    return None


SLEEP = "import time\nwhile True: time.sleep(0.1)"
# Writes /flag/<pod name> when SIGTERMed (the path is a volume mount), then exits a second later;
# /flag/<pod name>.ready says the handler is in place (Running only means the process started).
ON_SIGTERM = """
import os, signal, sys, time
def stop(*_):
    open('/flag/' + os.environ['POD'], 'w').write('sigterm')
    time.sleep(1)
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
open('/flag/' + os.environ['POD'] + '.ready', 'w').close()
while True: time.sleep(0.1)
"""


def flagging_pod(name: str, cpu: str, priority_class: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 20,
        "volumes": [{"name": "flag", "persistentVolumeClaim": {"claimName": "flags"}}],
        "container": {
            "resources": {"requests": {"cpu": cpu}},
            "volumeMounts": [{"name": "flag", "mountPath": "/flag"}],
            "env": [{"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        },
    }
    if priority_class:
        spec["priorityClassName"] = priority_class
    return python_pod(name, ON_SIGTERM, **spec)


def test_pods_run_to_succeeded_or_failed_with_their_exit_code(
    test_cluster: TestCluster, core: client.CoreV1Api
) -> None:
    core.create_namespaced_pod(NS, python_pod("ok", "print('hello from the pod')"))
    core.create_namespaced_pod(NS, python_pod("bad", "raise SystemExit(3)"))
    assert eventually(lambda: phase(core, "ok") in TERMINAL and phase(core, "bad") in TERMINAL)
    ok, bad = core.read_namespaced_pod("ok", NS), core.read_namespaced_pod("bad", NS)
    assert ok.status.phase == "Succeeded" and bad.status.phase == "Failed"
    ok_state, bad_state = ok.status.container_statuses[0].state, bad.status.container_statuses[0]
    assert (ok_state.terminated.exit_code, ok_state.terminated.reason) == (0, "Completed")
    assert (bad_state.state.terminated.exit_code, bad_state.state.terminated.reason) == (3, "Error")
    assert ok.spec.node_name == "node-1" and ok.status.pod_ip == "127.0.0.1"
    assert condition(core, "ok", "PodScheduled").status == "True"
    assert "hello from the pod" in test_cluster.log("ok")


def test_running_pod_reports_running(test_cluster: TestCluster, core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(NS, python_pod("sleeper", SLEEP))
    assert eventually(lambda: phase(core, "sleeper") == "Running")
    status = core.read_namespaced_pod("sleeper", NS).status.container_statuses[0]
    assert status.ready and status.state.running.started_at
    core.delete_namespaced_pod("sleeper", NS)
    assert eventually(lambda: gone(core, "sleeper"))


def test_env_from_config_map_secret_and_field_refs(
    test_cluster: TestCluster, core: client.CoreV1Api
) -> None:
    core.create_namespaced_config_map(
        NS, {"metadata": {"name": "settings"}, "data": {"endpoint": "https://etcd:2379"}}
    )
    core.create_namespaced_secret(
        NS, {"metadata": {"name": "creds"}, "stringData": {"password": "s3cret"}}
    )
    env = [
        {"name": "EP", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "endpoint"}}},
        {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}},
        {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    code = "import json, os; print(json.dumps(dict(os.environ)))"
    core.create_namespaced_pod(NS, python_pod("env", code, container={"env": env}))
    assert eventually(lambda: phase(core, "env") == "Succeeded")
    seen = json.loads(test_cluster.log("env").strip().splitlines()[-1])
    uid = core.read_namespaced_pod("env", NS).metadata.uid
    assert (seen["EP"], seen["PW"], seen["NAME"], seen["NAMESPACE"]) == (
        "https://etcd:2379",
        "s3cret",
        "env",
        NS,
    )
    assert (seen["UID"], seen["IP"]) == (uid, "127.0.0.1")


def test_missing_config_map_holds_the_pod_until_it_exists(
    test_cluster: TestCluster, core: client.CoreV1Api
) -> None:
    env = [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "later", "key": "x"}}}]
    code = "import os; raise SystemExit(0 if os.environ['X'] == 'ok' else 1)"
    core.create_namespaced_pod(NS, python_pod("waits", code, container={"env": env}))

    def waiting_reason() -> str | None:
        statuses = core.read_namespaced_pod("waits", NS).status.container_statuses or []
        return statuses[0].state.waiting.reason if statuses and statuses[0].state.waiting else None

    assert eventually(lambda: waiting_reason() == "CreateContainerConfigError")
    assert phase(core, "waits") == "Pending"
    core.create_namespaced_config_map(NS, {"metadata": {"name": "later"}, "data": {"x": "ok"}})
    assert eventually(lambda: phase(core, "waits") == "Succeeded")


def test_secret_and_config_map_volumes_are_files(
    test_cluster: TestCluster, core: client.CoreV1Api
) -> None:
    core.create_namespaced_secret(
        NS,
        {
            "metadata": {"name": "etcd-client"},
            "stringData": {"ca.crt": "CA", "tls.crt": "CERT", "tls.key": "KEY"},
        },
    )
    core.create_namespaced_config_map(
        NS, {"metadata": {"name": "cfg"}, "data": {"settings.json": '{"a": 1}'}}
    )
    volumes = [
        {
            "name": "tls",
            "secret": {
                "secretName": "etcd-client",
                "items": [{"key": "ca.crt", "path": "ca/ca.crt"}, {"key": "tls.key", "path": "k"}],
            },
        },
        {"name": "cfg", "configMap": {"name": "cfg"}},
    ]
    mounts = [
        {"name": "tls", "mountPath": "/etc/etcd-tls", "readOnly": True},
        {"name": "cfg", "mountPath": "/etc/cfg"},
    ]
    code = (
        "import json, os, sys\n"
        "out = {p: open(p).read() for p in sys.argv[1:]}\n"
        "out['listing'] = sorted(os.listdir('/etc/etcd-tls'))\n"
        "print(json.dumps(out))"
    )
    core.create_namespaced_pod(
        NS,
        python_pod(
            "files",
            code,
            volumes=volumes,
            container={
                "args": ["/etc/etcd-tls/ca/ca.crt", "/etc/etcd-tls/k", "/etc/cfg/settings.json"],
                "volumeMounts": mounts,
            },
        ),
    )
    assert eventually(lambda: phase(core, "files") == "Succeeded")
    seen = json.loads(test_cluster.log("files").strip().splitlines()[-1])
    assert list(seen.values())[:3] == ["CA", "KEY", '{"a": 1}']
    assert seen["listing"] == ["ca", "k"]  # only the items asked for


def test_persistent_volume_claims_are_shared_between_pods(
    test_cluster: TestCluster, core: client.CoreV1Api
) -> None:
    def with_claim(name: str, code: str) -> dict[str, Any]:
        return python_pod(
            name,
            code,
            volumes=[{"name": "data", "persistentVolumeClaim": {"claimName": "ckpt"}}],
            container={"volumeMounts": [{"name": "data", "mountPath": "/ckpt"}]},
        )

    core.create_namespaced_pod(NS, with_claim("writer", "open('/ckpt/x', 'w').write('1')"))
    assert eventually(lambda: phase(core, "writer") == "Succeeded")
    core.create_namespaced_pod(NS, with_claim("reader", "assert open('/ckpt/x').read() == '1'"))
    assert eventually(lambda: phase(core, "reader") == "Succeeded")


def test_pods_over_capacity_stay_pending_unschedulable(
    test_cluster: TestCluster, core: client.CoreV1Api
) -> None:
    for name in ("first", "second"):
        body = python_pod(name, SLEEP, container={"resources": {"requests": {"cpu": "1500m"}}})
        core.create_namespaced_pod(NS, body)
    assert eventually(lambda: phase(core, "first") == "Running")
    assert eventually(lambda: (condition(core, "second", "PodScheduled") or {}) != {})
    scheduled = condition(core, "second", "PodScheduled")
    assert (scheduled.status, scheduled.reason) == ("False", "Unschedulable")
    assert phase(core, "second") == "Pending"
    # capacity freed (a node added) -> it is scheduled
    test_cluster.add_node("node-2", cpu="2", memory="4Gi")
    assert eventually(lambda: phase(core, "second") == "Running")
    assert core.read_namespaced_pod("second", NS).spec.node_name == "node-2"
    for name in ("first", "second"):
        core.delete_namespaced_pod(name, NS, grace_period_seconds=0)
    assert eventually(lambda: gone(core, "first") and gone(core, "second"))


def test_higher_priority_pod_preempts_a_lower_one_gracefully(
    test_cluster: TestCluster, core: client.CoreV1Api
) -> None:
    flags = test_cluster.root / "claims" / NS / "flags"
    core.create_namespaced_pod(NS, flagging_pod("worker", "2", "kfp-elastic-worker-low"))
    assert eventually(lambda: (flags / "worker.ready").exists())
    body = python_pod("serving", SLEEP, container={"resources": {"requests": {"cpu": "2"}}})
    core.create_namespaced_pod(NS, body)  # no class: priority 0 > -5
    assert eventually(lambda: gone(core, "worker") or condition(core, "worker", "DisruptionTarget"))
    disruption = condition(core, "worker", "DisruptionTarget")
    assert disruption is not None, "the victim was deleted before it was marked"
    assert (disruption.status, disruption.reason) == ("True", "PreemptionByScheduler")
    assert disruption.message == (
        "default-scheduler: preempting to accommodate a higher priority pod"
    )
    assert eventually(lambda: gone(core, "worker"), timeout=20)
    assert (flags / "worker").read_text() == "sigterm"
    assert eventually(lambda: phase(core, "serving") == "Running")
    core.delete_namespaced_pod("serving", NS, grace_period_seconds=0)
    assert eventually(lambda: gone(core, "serving"))


# Runs ON_SIGTERM as its child (same process group) and keeps SIGTERM's default: it dies of it.
PARENT = """
import os, subprocess, sys, time
env = {**os.environ, 'POD': os.environ['POD'] + '-child'}
subprocess.Popen([sys.executable, '-c', os.environ['CHILD']], env=env)
while True: time.sleep(0.1)
"""


def test_graceful_deletion_signals_the_main_process_only_and_its_end_ends_the_rest(
    test_cluster: TestCluster, core: client.CoreV1Api
) -> None:
    """As a container runtime does: SIGTERM goes to PID 1 of the container, not to its process
    group; when PID 1 ends, the processes it left are SIGKILLed (its PID namespace ends)."""
    flags = test_cluster.root / "claims" / NS / "flags"
    body = flagging_pod("parent", "1")
    body["spec"]["containers"][0]["command"] = ["python", "-c", PARENT]
    body["spec"]["containers"][0]["env"].append({"name": "CHILD", "value": ON_SIGTERM})
    core.create_namespaced_pod(NS, body)
    assert eventually(lambda: (flags / "parent-child.ready").exists())
    core.delete_namespaced_pod("parent", NS)  # graceful (20 s), but the parent dies at once
    assert eventually(lambda: gone(core, "parent"), timeout=15)
    assert not (flags / "parent-child").exists(), "the child got SIGTERM: only PID 1 should"
    assert not test_cluster.leftover_processes()


def test_priority_class_with_preemption_policy_never_does_not_preempt(
    test_cluster: TestCluster, core: client.CoreV1Api
) -> None:
    client.SchedulingV1Api(core.api_client).create_priority_class(
        {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": "polite"},
            "value": 1000,
            "preemptionPolicy": "Never",
        }
    )
    core.create_namespaced_pod(NS, flagging_pod("low", "2", "kfp-elastic-worker-low"))
    flags = test_cluster.root / "claims" / NS / "flags"
    assert eventually(lambda: (flags / "low.ready").exists())
    polite = python_pod(
        "polite",
        SLEEP,
        priorityClassName="polite",
        container={"resources": {"requests": {"cpu": "2"}}},
    )
    created = core.create_namespaced_pod(NS, polite)
    assert (created.spec.priority, created.spec.preemption_policy) == (1000, "Never")
    assert eventually(lambda: condition(core, "polite", "PodScheduled") is not None)
    assert condition(core, "polite", "PodScheduled").reason == "Unschedulable"
    assert condition(core, "low", "DisruptionTarget") is None and phase(core, "low") == "Running"
    core.delete_namespaced_pod("low", NS)  # graceful: the handler runs, then it is gone
    assert eventually(lambda: gone(core, "low"), timeout=20)
    assert (flags / "low").read_text() == "sigterm"
    assert eventually(lambda: phase(core, "polite") == "Running")
    core.delete_namespaced_pod("polite", NS, grace_period_seconds=0)
    assert eventually(lambda: gone(core, "polite"))


def elastic_worker_pods(job: str, min_workers: int, max_workers: int) -> list[dict[str, Any]]:
    """Job ``job``'s worker pods as the master builds them, running ``sleep`` instead of an
    agent (the torchrun args land in $0, $1, ...); half a CPU each."""
    command = ("/bin/sh", "-c", "exec sleep 600")
    return job_worker_pods(job, min_workers, max_workers, command=command, cpu="500m", namespace=NS)


def test_a_new_jobs_guaranteed_workers_preempt_only_opportunistic_ones(
    test_cluster: TestCluster, core: client.CoreV1Api
) -> None:
    """Job A fills the node (2 guaranteed + 2 opportunistic workers); job B (MIN=2, MAX=4)
    arrives: its 2 guaranteed workers take A's opportunistic places, its opportunistic ones wait
    Pending, A's guaranteed ones stay. Job C's guaranteed worker then finds nothing below it
    to preempt and waits: equal priority never preempts."""
    a, b, c = (elastic_worker_pods(*job) for job in (("a", 2, 4), ("b", 2, 4), ("c", 1, 1)))
    for pod in a:
        core.create_namespaced_pod(NS, pod)
    a_names = [p["metadata"]["name"] for p in a]
    assert eventually(lambda: all(phase(core, n) == "Running" for n in a_names))
    a_kept, a_lost = a_names[:2], a_names[2:]
    b_names = [p["metadata"]["name"] for p in b]
    b_run, b_wait = b_names[:2], b_names[2:]
    for pod in b:
        core.create_namespaced_pod(NS, pod)
    assert core.read_namespaced_pod(b_run[0], NS).spec.priority == -3  # resolved from its class

    assert eventually(lambda: all(phase(core, n) == "Running" for n in b_run), timeout=20)
    assert eventually(lambda: all(gone(core, n) for n in a_lost))  # preempted, then deleted
    assert all(phase(core, n) == "Running" for n in a_kept)
    for name in b_wait:
        scheduled = condition(core, name, "PodScheduled")
        assert phase(core, name) == "Pending" and scheduled.reason == "Unschedulable"

    (c_pod,) = c
    core.create_namespaced_pod(NS, c_pod)
    c_name = c_pod["metadata"]["name"]
    assert eventually(lambda: condition(core, c_name, "PodScheduled") is not None)
    assert condition(core, c_name, "PodScheduled").reason == "Unschedulable"
    for name in (*a_kept, *b_run):
        assert condition(core, name, "DisruptionTarget") is None, name
        assert phase(core, name) == "Running", name
    for name in (*a_kept, *b_names, c_name):
        core.delete_namespaced_pod(name, NS, grace_period_seconds=0)
    assert eventually(lambda: not core.list_namespaced_pod(NS).items)


def test_deleting_an_owner_deletes_its_dependents(
    test_cluster: TestCluster, core: client.CoreV1Api
) -> None:
    owner = core.create_namespaced_pod(NS, python_pod("owner", SLEEP))
    ref = {"apiVersion": "v1", "kind": "Pod", "name": "owner", "uid": owner.metadata.uid}
    for name in ("dep-1", "dep-2"):
        core.create_namespaced_pod(NS, python_pod(name, SLEEP, metadata={"ownerReferences": [ref]}))
    core.create_namespaced_config_map(
        NS, {"metadata": {"name": "dep-cfg", "ownerReferences": [ref]}, "data": {}}
    )
    core.create_namespaced_pod(NS, python_pod("bystander", SLEEP))
    assert eventually(lambda: all(phase(core, n) == "Running" for n in ("dep-1", "dep-2")))
    core.delete_namespaced_pod("owner", NS)
    assert eventually(lambda: all(gone(core, n) for n in ("owner", "dep-1", "dep-2")), 15)
    with pytest.raises(ApiException) as missing:
        core.read_namespaced_config_map("dep-cfg", NS)
    assert missing.value.status == 404
    assert phase(core, "bystander") == "Running"
    core.delete_namespaced_pod("bystander", NS, grace_period_seconds=0)
    assert eventually(lambda: gone(core, "bystander"))


def test_in_cluster_config_inside_a_pod_reaches_the_api_server(
    test_cluster: TestCluster, core: client.CoreV1Api
) -> None:
    code = (
        "from kubernetes import client, config\n"
        "config.load_incluster_config()\n"
        "ns = open('/var/run/secrets/kubernetes.io/serviceaccount/namespace').read()\n"
        "pods = client.CoreV1Api().list_namespaced_pod(ns).items\n"
        "print('pods:', ','.join(sorted(p.metadata.name for p in pods)))\n"
        "from kfp_elastic.master import wiring\n"  # reads its own namespace from the SA files
        "print('own namespace file:', wiring.SA_NAMESPACE.exists())\n"
        "try:\n"  # RBAC: the master's Role grants no Secrets
        "    client.CoreV1Api().list_namespaced_secret(ns)\n"
        "except client.ApiException as e:\n"
        "    print('secrets:', e.status)"
    )
    # The pod's own service account's token: the master's, whose Role (installed by the test
    # cluster from the manifests) lets it list pods.
    pod = python_pod("incluster", code, serviceAccountName="kfp-elastic-master")
    core.create_namespaced_pod(NS, pod)
    assert eventually(lambda: phase(core, "incluster") in TERMINAL, timeout=30)
    log = test_cluster.log("incluster")
    assert phase(core, "incluster") == "Succeeded", log
    assert "pods: incluster" in log
    assert "own namespace file: True" in log
    assert "secrets: 403" in log
    assert any(path == f"/api/v1/namespaces/{NS}/pods" for _, path, _ in test_cluster.api.requests)


def test_pod_spec_with_an_unknown_field_is_refused_when_strict(core: client.CoreV1Api) -> None:
    body = python_pod("typo", SLEEP, container={"imagePullPolicey": "Always"})
    with pytest.raises(ApiException) as rejected:
        core.create_namespaced_pod(NS, body, field_validation="Strict")
    assert rejected.value.status == 400
    assert json.loads(rejected.value.body)["message"] == (
        'Pod in version "v1" cannot be handled as a Pod: strict decoding error: unknown field '
        '"spec.containers[0].imagePullPolicey"'
    )
    # without a directive (Warn, the API server's default): stored without the field
    created = core.create_namespaced_pod(NS, body)
    assert created.spec.containers[0].image_pull_policy == "IfNotPresent"
    stored = core.api_client.sanitize_for_serialization(core.read_namespaced_pod("typo", NS))
    assert "imagePullPolicey" not in json.dumps(stored)
    core.delete_namespaced_pod("typo", NS, grace_period_seconds=0)


# A pod that starts a child in a session of its own, as torchrun does with its workers.
WITH_CHILD = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'],"
    " start_new_session=True)\n"
    "print('child', child.pid, flush=True)\n"
    "while True: time.sleep(0.1)"
)
UNREACHABLE = "node.kubernetes.io/unreachable"


def node_ready(core: client.CoreV1Api, name: str) -> str:
    node = core.read_node(name)
    return next(c.status for c in node.status.conditions if c.type == "Ready")


process_state = processes.state


@pytest.mark.parametrize("how", ["remove", "hang"])
def test_a_lost_node_goes_not_ready_and_its_pods_are_evicted_after_their_tolerations(
    test_cluster: TestCluster, core: client.CoreV1Api, how: str
) -> None:
    # The fixture's FAST_NODE_LIFECYCLE: 1 s of monitor grace, 2 s of default toleration.
    test_cluster.set_capacity("node-1", cpu="0", memory="4Gi")
    test_cluster.add_node("node-2", cpu="2", memory="4Gi")
    one_cpu = {"resources": {"requests": {"cpu": "1"}}}
    forever = [{"key": UNREACHABLE, "operator": "Exists", "effect": "NoExecute"}]
    core.create_namespaced_pod(NS, python_pod("evicted", WITH_CHILD, container=one_cpu))
    core.create_namespaced_pod(
        NS, python_pod("tolerant", SLEEP, container=one_cpu, tolerations=forever)
    )
    assert eventually(lambda: "child" in test_cluster.log("evicted"), timeout=15)
    assert eventually(lambda: phase(core, "tolerant") == "Running", timeout=15)
    child = int(test_cluster.log("evicted").split()[1])
    assert core.read_namespaced_pod("evicted", NS).spec.node_name == "node-2"
    if how == "remove":
        test_cluster.remove_node("node-2")  # powered off: its processes die with it
        assert eventually(lambda: process_state(child) in "ZX")
    else:
        test_cluster.hang_node("node-2")  # its processes stopped, their sockets open
        # SIGSTOP takes effect when the kernel next schedules the child: not at once under load.
        assert eventually(lambda: process_state(child) == "T")
    # The API server learns of it only after the monitor grace (with time driven by hand, so
    # without a race: tests/unit/testing/test_cluster_decisions.py).
    assert eventually(lambda: node_ready(core, "node-2") == "Unknown", timeout=10)
    taints = {(t.key, t.effect) for t in core.read_node("node-2").spec.taints}
    assert taints == {(UNREACHABLE, "NoSchedule"), (UNREACHABLE, "NoExecute")}
    # Evicted once the admission's default toleration ran out; the tolerant pod stays.
    assert eventually(lambda: gone(core, "evicted"), timeout=15)
    assert phase(core, "tolerant") == "Running"
    # Nothing new lands on the tainted node.
    core.create_namespaced_pod(NS, python_pod("after", SLEEP, container=one_cpu))
    assert eventually(lambda: condition(core, "after", "PodScheduled") is not None)
    assert core.read_namespaced_pod("after", NS).spec.node_name is None
    if how == "hang":
        assert process_state(child) == "T"  # a hung node's processes stay until it is gone
    for name in ("tolerant", "after"):
        core.delete_namespaced_pod(name, NS, grace_period_seconds=0)
    assert eventually(lambda: gone(core, "tolerant") and gone(core, "after"))
    assert [n.metadata.name for n in core.list_node().items] == ["node-1", "node-2"]
    if how == "remove":
        assert not test_cluster.leftover_processes()


def test_a_node_with_a_start_delay_holds_pods_in_container_creating(
    test_cluster: TestCluster, core: client.CoreV1Api
) -> None:
    test_cluster.set_capacity("node-1", cpu="0", memory="4Gi")
    test_cluster.add_node("pulling", start_delay_s=1.5, cpu="1", memory="4Gi")
    one_cpu = {"resources": {"requests": {"cpu": "1"}}}
    core.create_namespaced_pod(NS, python_pod("late", "print('started')", container=one_cpu))

    def waiting_reason() -> str | None:
        statuses = core.read_namespaced_pod("late", NS).status.container_statuses or []
        return statuses[0].state.waiting.reason if statuses and statuses[0].state.waiting else None

    assert eventually(lambda: waiting_reason() == "ContainerCreating")
    pod = core.read_namespaced_pod("late", NS)
    assert (pod.status.phase, pod.spec.node_name) == ("Pending", "pulling")
    assert "started" not in test_cluster.log("late")
    assert eventually(lambda: phase(core, "late") == "Succeeded", timeout=15)
    assert "started" in test_cluster.log("late")


# Exits STOP_AFTER seconds after SIGTERM; prints "ready" once the handler is in place.
SLOW_STOP = """
import os, signal, sys, time
def stop(*_):
    time.sleep(float(os.environ['STOP_AFTER']))
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
print('ready', flush=True)
while True: time.sleep(0.1)
"""


def test_room_freed_for_a_preemptor_is_not_given_to_lower_priority_pods(
    test_cluster: TestCluster, core: client.CoreV1Api
) -> None:
    # 4 slots held by 4 low-priority workers; a serving pod needs 2. Its victims stop one fast
    # and one slowly: between the two, the freed slot is the serving pod's (nominated), not a
    # Pending replacement worker's, which would otherwise be bound and preempted again.
    test_cluster.set_capacity("node-1", cpu="4", memory="4Gi")
    one_cpu = {"resources": {"requests": {"cpu": "1"}}}
    for index, stop_after in enumerate(["0", "2", "0", "2"]):
        worker = python_pod(
            f"w{index}",
            SLOW_STOP,
            priorityClassName="kfp-elastic-worker-low",
            terminationGracePeriodSeconds=20,
            container={**one_cpu, "env": [{"name": "STOP_AFTER", "value": stop_after}]},
        )
        core.create_namespaced_pod(NS, worker)
    for index in range(4):
        assert eventually(lambda i=index: "ready" in test_cluster.log(f"w{i}"), timeout=20)
    for name in ("r1", "r2"):  # what the master creates for lost workers
        body = python_pod(
            name, SLEEP, priorityClassName="kfp-elastic-worker-low", container=one_cpu
        )
        core.create_namespaced_pod(NS, body)
    serving = python_pod("serving", SLEEP, container={"resources": {"requests": {"cpu": "2"}}})
    core.create_namespaced_pod(NS, serving)
    assert eventually(lambda: phase(core, "serving") == "Running", timeout=20)
    survivors = [f"w{i}" for i in range(4) if phase(core, f"w{i}") == "Running"]
    assert len(survivors) == 2
    for name in ("r1", "r2"):  # never bound, so never preempted
        assert core.read_namespaced_pod(name, NS).spec.node_name is None
        assert condition(core, name, "DisruptionTarget") is None
    for name in ("serving", "r1", "r2", *survivors):
        core.delete_namespaced_pod(name, NS, grace_period_seconds=0)
    assert eventually(lambda: all(gone(core, n) for n in ("serving", "r1", "r2", *survivors)))


def test_stopping_the_cluster_leaves_no_process_or_port(tmp_path: Path) -> None:
    with TestCluster(tmp_path / "c") as cluster:
        api_client = cluster.client()
        core = client.CoreV1Api(api_client)
        core.create_namespaced_pod(NS, python_pod("forever", SLEEP))
        assert eventually(lambda: phase(core, "forever") == "Running")
        api_client.close()
        port = cluster.api.port
        assert cluster.leftover_processes()
    assert not cluster.leftover_processes()
    with socket.socket() as probe, pytest.raises(OSError):
        probe.settimeout(1)
        probe.connect(("127.0.0.1", port))
    assert not [t for t in _threads() if t.startswith(("kubelet-", "test-cluster", "fake-k8s"))]


def _threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate()]
