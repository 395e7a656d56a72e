"""The master's Role (manifests/base/rbac.yaml) against the API calls the master really makes.

The master runs as a pod of the test cluster under its service account (in-cluster config, as in
a real cluster) with the Kubernetes launcher; its worker pods run torchrun with the built-in
runtime on a tiny model. One worker is preempted and replaced, so create, list, watch and delete
all happen; the exit handler's cleanup (``stop_workers``) runs as a pod too. The API server
authorizes each pod's requests by the Role and RoleBinding that ``kubectl apply -k
manifests/overlays/local-kind`` installed first, as a user installs them (a refused call fails
the run), and records every request as RBAC sees it; the scheduler and kubelets call it
directly, so what it recorded over HTTP after the apply is exactly what the two pods asked for.
The workers run in the overlay's namespace as its worker ServiceAccount, at the priorities of
the PriorityClasses it applied. The master records its decisions as Events; the count of one
seen again is patched, which a third test does as the master's account.
A Role missing one verb makes the master fail at once, saying which verb to grant.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest

from kfp_elastic.etcd.client import connect
from kfp_elastic.etcd.embedded import EmbeddedEtcd
from kfp_elastic.master.k8s_events import EventRecorder
from kfp_elastic.master.pod_events import COMPONENT
from kfp_elastic.master.pod_spec_checks import MASTER_POD_LABELS, RUN_ID_LABEL
from kfp_elastic.master.timeline import (
    LaunchFailed,
    WorkerLaunched,
    WorkerLost,
    of_type,
    read_timeline,
)
from kfp_elastic.testing.api_rules import service_account_user
from kfp_elastic.testing.api_wire import ApiCall, ApiError
from kfp_elastic.testing.cluster import TestCluster
from kfp_elastic.worker.progress import Progress
from tests.helpers import (
    MANIFESTS,
    REPO_ROOT,
    committed_step,
    find,
    master_command,
    one,
    render,
    role_allows,
    run_kubectl,
    wait_for,
)

MASTER_SA = "kfp-elastic-master"
WORKER_SA = "kfp-elastic-worker"
# What a user applies first: `kubectl apply -k manifests/overlays/local-kind` (its namespace).
OVERLAY = "overlays/local-kind"
# Verbs the Role grants that the run below does not exercise, each with the reason it stays.
JUSTIFIED: dict[tuple[str, str, str], str] = {
    ("", "events", "patch"): "the count of an Event seen again (a repeated refused create, ...):"
    " nothing repeats in this run; test_the_role_lets_the_master_count_a_repeated_event"
    " makes that call under the same Role",
}


def phase(cluster: TestCluster, name: str) -> str | None:
    for pod in cluster.api.pods_snapshot():
        if pod["metadata"]["name"] == name:
            return pod["status"].get("phase", "Pending")
    return None


def workers(cluster: TestCluster, run_id: str) -> dict[str, str]:
    return {
        p["metadata"]["name"]: p["status"].get("phase", "Pending")
        for p in cluster.api.pods_snapshot()
        if p["metadata"].get("labels", {}).get(RUN_ID_LABEL) == run_id
        and not p["metadata"].get("deletionTimestamp")
    }


def python_pod(name: str, command: list[str], **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "serviceAccountName": MASTER_SA,
            "containers": [
                {
                    "name": "main",
                    "image": "kfp-elastic-master:test",
                    "command": command,
                    # As the KFP backend sets it: the master watches its own pod by this name.
                    "env": [
                        {
                            "name": "KFP_POD_NAME",
                            "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                        }
                    ],
                }
            ],
        },
    }


@pytest.fixture
def cluster(test_cluster: TestCluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestCluster]:
    # Pod processes inherit this PYTHONPATH: the worker pods import
    # kfp_elastic.testing.model_defs.counting.
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    # The project's manifests as a user installs them: kubectl apply -k of an overlay (the
    # master's and workers' ServiceAccounts, Role, RoleBinding, PriorityClasses, ...).
    applied = run_kubectl(test_cluster, "apply", "-k", str(MANIFESTS / OVERLAY))
    assert applied.returncode == 0, applied.stderr
    test_cluster.api.api_calls.clear()  # kubectl's own (an admin's): not the master's
    yield test_cluster


def overlay_namespace() -> str:
    (namespace,) = find(render(OVERLAY), "Namespace")
    return namespace["metadata"]["name"]


def master(run_id: str, etcd: EmbeddedEtcd, ns: str, tmp_path: Path) -> list[str]:
    return master_command(
        run_id=run_id,
        etcd=etcd.endpoint,
        model_def="kfp_elastic.testing.model_defs.counting",
        min_workers="1",
        max_workers="2",
        dataset_length="240",
        shard_size="40",
        epochs="3",
        batch_size="4",
        snapshot_every="3",
        step_time="0.1",
        snapshot_dir=str(tmp_path / "snapshots"),
        launcher="kubernetes",
        image="kfp-elastic-worker:test",
        namespace=ns,
        leader_ttl="2",
        finish_grace="5",
        rdzv_conf="last_call_timeout=1",
    )


def test_master_role_allows_every_call_and_grants_nothing_unused(
    cluster: TestCluster, etcd: EmbeddedEtcd, run_id: str, tmp_path: Path
) -> None:
    ns = overlay_namespace()
    # RBAC is on: the master's account may not do what its Role does not grant.
    with pytest.raises(ApiError, match="cannot get resource"):
        cluster.api.authorize(
            service_account_user(ns, MASTER_SA), ApiCall("get", "", "secrets", "", ns, "s")
        )
    command = master(run_id, etcd, ns, tmp_path)
    cluster.api.create(ns, python_pod("master", command, **MASTER_POD_LABELS))
    client = connect(etcd.client_settings())
    progress = Progress(client, f"/kfp-elastic/{run_id}")
    try:
        wait_for(lambda: committed_step(progress) >= 3, 90, 0.2, "training under way")
        first = sorted(workers(cluster, run_id))
        # The workers run as the applied ServiceAccount, at the applied classes' priorities.
        classes = {
            o["metadata"]["name"]: o["value"] for o in find(render(OVERLAY), "PriorityClass")
        }
        for pod in cluster.api.pods_snapshot():
            if pod["metadata"]["name"] in first:
                spec = pod["spec"]
                assert pod["metadata"]["namespace"] == ns
                assert spec["serviceAccountName"] == WORKER_SA
                assert spec["priority"] == classes[spec["priorityClassName"]], spec
        cluster.api.preempt(first[0], ns=ns)  # graceful: SIGTERM, the master replaces it
        wait_for(lambda: phase(cluster, "master") in ("Succeeded", "Failed"), 120, 0.2, "job end")
        assert phase(cluster, "master") == "Succeeded", cluster.log("master", ns=ns)[-4000:]
        timeline = read_timeline(client, f"/kfp-elastic/{run_id}")
        lost = of_type(timeline, WorkerLost)
        # The preempted worker is lost as preempted. Its replacement may start after the two
        # survivors finished (a loaded machine) and find the run closed: also lost, and beside
        # the point here, which is the API calls the master made.
        assert (lost[0].name, lost[0].cause) == (first[0], "preempted"), lost
        assert len(of_type(timeline, WorkerLaunched)) == len(first) + 1  # the replacement
    finally:
        client.close()
    cleanup = [
        sys.executable,
        "-c",
        "from kfp_elastic.components.common import delete_run_pods; "
        f"print(delete_run_pods({run_id!r}, {ns!r}))",
    ]
    cluster.api.create(ns, python_pod("stop-workers", cleanup))
    wait_for(lambda: phase(cluster, "stop-workers") == "Succeeded", 60, 0.2, "exit handler")

    calls = {
        (c.group, c.resource + (f"/{c.subresource}" if c.subresource else ""), c.verb)
        for c in cluster.api.api_calls
    }
    role = one(render("base"), "Role", MASTER_SA)
    refused = {call for call in calls if not role_allows(role, *call)}
    assert not refused, f"the Role refuses calls the code makes: {sorted(refused)}"
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    unused = granted - calls - set(JUSTIFIED)
    assert not unused, f"the Role grants what nothing calls: {sorted(unused)}"
    assert ("", "pods", "delete") in calls and ("", "pods", "watch") in calls
    # The master recorded its decisions as Events (allowed: the Role has events create).
    assert ("", "events", "create") in calls
    reasons = {
        (e["involvedObject"]["name"], e["reason"])
        for e in cluster.api.events(ns=ns)
        if e["source"]["component"] == COMPONENT
    }
    assert (first[0], "WorkerLost") in reasons and ("master", "JobSucceeded") in reasons, reasons


def test_the_role_lets_the_master_count_a_repeated_event(
    cluster: TestCluster, tmp_path: Path
) -> None:
    """The recorder as the master's service account under the applied Role: an Event, then the
    same again (its count patched), both allowed."""
    ns = overlay_namespace()
    cluster.api.create(ns, python_pod("master", [sys.executable, "-c", "pass"]))
    configuration = kubernetes.client.Configuration()
    configuration.host = cluster.api.url
    configuration.ssl_ca_cert = str(cluster.ca_file)
    token = cluster.api.service_account_token(ns, MASTER_SA)
    configuration.api_key = {"authorization": f"Bearer {token}"}
    with kubernetes.client.ApiClient(configuration) as api:
        recorder = EventRecorder(ns, api, own_pod="master").start()
        for _ in range(2):
            recorder.record(LaunchFailed(index=1, message="exceeded quota"))
        recorder.close()
    assert recorder.written == 2
    calls = [(c.verb, c.resource) for c in cluster.api.api_calls if c.resource == "events"]
    assert calls == [("create", "events"), ("patch", "events")]
    (event,) = [e for e in cluster.api.events("master", ns=ns) if e["reason"] == "FailedCreate"]
    assert event["count"] == 2 and event["source"]["component"] == COMPONENT


def test_a_role_missing_a_verb_fails_the_master_saying_what_to_grant(
    cluster: TestCluster, etcd: EmbeddedEtcd, run_id: str, tmp_path: Path
) -> None:
    ns = overlay_namespace()
    role = one(render("base"), "Role", MASTER_SA)
    rules = [
        {**rule, "verbs": [v for v in rule["verbs"] if v != "create"]} for rule in role["rules"]
    ]
    cluster.apply({**role, "rules": rules}, ns)
    command = master(run_id, etcd, ns, tmp_path)
    cluster.api.create(ns, python_pod("master", command, **MASTER_POD_LABELS))
    wait_for(lambda: phase(cluster, "master") in ("Succeeded", "Failed"), 60, 0.2, "master end")
    assert phase(cluster, "master") == "Failed"
    assert (
        f"the master's service account (system:serviceaccount:{ns}:{MASTER_SA}) may not create "
        f"pods in namespace {ns}: grant verb 'create' on 'pods' in its Role "
        "(manifests/base/rbac.yaml, Role kfp-elastic-master)"
    ) in cluster.log("master", ns=ns)
    assert not workers(cluster, run_id)


# The optional cluster-wide grant (manifests/priorityclass-reader): what the master needs to
# check a ladder's PriorityClasses before any worker starts.
READER = "priorityclass-reader"


def read_class_in_pod(cluster: TestCluster, ns: str, name: str, class_name: str) -> str:
    """What the master's own read of PriorityClass ``class_name`` gives in a pod of ``ns`` under
    its ServiceAccount (in-cluster credentials): the value, or the error's class name."""
    read = (
        "from kfp_elastic.master.wiring import cluster_priority_value as value\n"
        "try:\n"
        f"    print('value', value({class_name!r}))\n"
        "except Exception as error:\n"
        "    print('error', type(error).__name__)\n"
    )
    cluster.api.create(ns, python_pod(name, [sys.executable, "-c", read]))
    wait_for(lambda: phase(cluster, name) in ("Succeeded", "Failed"), 60, 0.2, name)
    log = cluster.log(name, ns=ns)
    assert phase(cluster, name) == "Succeeded", log[-2000:]
    return log.strip().splitlines()[-1]


def test_the_priorityclass_reader_lets_the_master_check_its_ladder(cluster: TestCluster) -> None:
    """Without manifests/priorityclass-reader the master's account may not read PriorityClasses
    (the master then runs a ladder unchecked, with a warning); `kubectl apply -k` of it grants
    exactly that read, to the overlay's master account and no one else."""
    ns = overlay_namespace()
    master_user = f"--as=system:serviceaccount:{ns}:{MASTER_SA}"
    level = "kfp-elastic-worker-level-0"
    denied = run_kubectl(cluster, "auth", "can-i", "get", f"priorityclasses/{level}", master_user)
    assert (denied.returncode, denied.stdout.strip()) == (1, "no"), denied
    assert read_class_in_pod(cluster, ns, "read-before", level) == "error PriorityClassesUnreadable"

    applied = run_kubectl(cluster, "apply", "-k", str(MANIFESTS / READER))
    assert applied.returncode == 0, applied.stderr
    assert "clusterrolebinding.rbac.authorization.k8s.io/" in applied.stdout, applied.stdout
    allowed = run_kubectl(cluster, "auth", "can-i", "get", f"priorityclasses/{level}", master_user)
    assert (allowed.returncode, allowed.stdout.strip()) == (0, "yes"), allowed
    value = one(render(OVERLAY), "PriorityClass", level)["value"]
    assert read_class_in_pod(cluster, ns, "read-after", level) == f"value {value}"
    # Read-only, and only for the master's account.
    for verb, user in (
        ("delete", master_user),
        ("list", master_user),
        ("get", f"--as=system:serviceaccount:{ns}:{WORKER_SA}"),
    ):
        refused = run_kubectl(cluster, "auth", "can-i", verb, "priorityclasses", user)
        assert refused.stdout.strip() == "no", (verb, user, refused)
