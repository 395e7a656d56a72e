"""kubectl writing to the test cluster: ``apply`` (client-side and ``--server-side``, files and
the kustomizations under manifests/), ``patch`` (merge, JSON, strategic), ``scale`` of a
ReplicaSet the stand-in runs, ``auth can-i`` from the RBAC it enforces; and what it refuses as
a real API server refuses it."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kfp_elastic.testing.cluster import TestCluster
from kfp_elastic.testing.cluster.replica_set import ReplicaSet
from tests.helpers import MANIFESTS, find, render, run_kubectl, wait_for

MASTER = "system:serviceaccount:default:kfp-elastic-master"
WORKER = "system:serviceaccount:default:kfp-elastic-worker"
# What manifests/ holds that needs CustomResourceDefinitions: Kueue's kinds (a test cluster
# serves them once Kueue's CRDs are installed: TestCluster(kueue_crds=True)).
NEEDS_CRDS = {
    "kueue": ["ClusterQueue", "LocalQueue", "ResourceFlavor", "WorkloadPriorityClass"],
}
DEPRECATED_KUEUE = "Warning: This version is deprecated. Use v1beta2 instead."


def get_json(cluster: TestCluster, *args: str) -> dict:
    got = run_kubectl(cluster, "get", *args, "-o", "json")
    assert got.returncode == 0, got.stderr
    return json.loads(got.stdout)


@pytest.fixture
def cluster(test_cluster: TestCluster) -> TestCluster:
    return test_cluster


def config_map(data: dict[str, str]) -> str:
    return yaml.safe_dump(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "demo"}, "data": data}
    )


def test_kubectl_apply_client_side_creates_then_patches(
    cluster: TestCluster, tmp_path: Path
) -> None:
    manifest = tmp_path / "cm.yaml"
    manifest.write_text(config_map({"a": "1", "b": "2"}))
    created = run_kubectl(cluster, "apply", "-f", str(manifest))
    assert created.returncode == 0, created.stderr
    assert created.stdout.strip() == "configmap/demo created"
    again = run_kubectl(cluster, "apply", "-f", str(manifest))
    assert again.stdout.strip() == "configmap/demo unchanged"
    manifest.write_text(config_map({"a": "3"}))  # b left out: apply removes it
    changed = run_kubectl(cluster, "apply", "-f", str(manifest))
    assert changed.stdout.strip() == "configmap/demo configured", changed.stderr
    live = get_json(cluster, "configmap", "demo")
    assert live["data"] == {"a": "3"}
    applied = live["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"]
    assert json.loads(applied)["data"] == {"a": "3"}
    # a pod through apply: created, then a label added by a strategic merge patch
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "web", "labels": {"app": "web"}},
        "spec": {
            "containers": [
                {"name": "main", "image": "python", "resources": {"requests": {"cpu": "64"}}}
            ]
        },
    }
    assert run_kubectl(cluster, "apply", "-f", "-", stdin=json.dumps(pod)).returncode == 0
    pod["metadata"]["labels"]["tier"] = "front"
    relabelled = run_kubectl(cluster, "apply", "-f", "-", stdin=json.dumps(pod))
    assert relabelled.stdout.strip() == "pod/web configured", relabelled.stderr
    assert cluster.api.pod("web")["metadata"]["labels"] == {"app": "web", "tier": "front"}
    # what a pod update may not change is refused as the API server refuses it
    pod["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "1"
    refused = run_kubectl(cluster, "apply", "-f", "-", stdin=json.dumps(pod))
    assert refused.returncode == 1
    assert "Forbidden: pod updates may not change fields" in refused.stderr


def owners(cluster: TestCluster, *args: str) -> dict[str, set[str]]:
    """manager (with its operation and subresource) -> the fields it owns, as kubectl shows
    them (``--show-managed-fields``), the FieldsV1 flattened to ``data.a``-like paths."""

    def paths(fields: dict, prefix: str = "") -> set[str]:
        out = set()
        for key, sub in fields.items():
            if key == ".":
                out.add(prefix)
                continue
            path = f"{prefix}.{key[2:]}" if key.startswith("f:") else f"{prefix}[{key}]"
            out |= paths(sub, path) if sub else {path}
        return out

    live = get_json(cluster, *args, "--show-managed-fields")
    return {
        ":".join(filter(None, (m["manager"], m["operation"], m.get("subresource")))): paths(
            m["fieldsV1"]
        )
        for m in live["metadata"].get("managedFields") or []
    }


def test_kubectl_apply_server_side(cluster: TestCluster, tmp_path: Path) -> None:
    manifest = tmp_path / "cm.yaml"

    def apply(data: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
        manifest.write_text(config_map(data))
        return run_kubectl(cluster, "apply", "--server-side", *args, "-f", str(manifest))

    applied = apply({"a": "1"})
    assert applied.returncode == 0, applied.stderr
    assert applied.stdout.strip() == "configmap/demo serverside-applied"
    # another manager setting a field kubectl owns to another value: a conflict, which kubectl
    # prints as on a real cluster
    refused = apply({"a": "2", "c": "3"}, "--field-manager=team")
    assert refused.returncode == 1
    assert refused.stderr.splitlines()[0] == (
        'error: Apply failed with 1 conflict: conflict with "kubectl": .data.a'
    )
    assert "--force-conflicts" in refused.stderr
    assert get_json(cluster, "configmap", "demo")["data"] == {"a": "1"}  # nothing written
    # the same value: both own it
    shared = apply({"a": "1", "c": "3"}, "--field-manager=team")
    assert shared.returncode == 0, shared.stderr
    assert owners(cluster, "configmap", "demo") == {
        "kubectl:Apply": {".data.a"},
        "team:Apply": {".data.a", ".data.c"},
    }
    # kubectl leaves a out: team still owns it, it stays
    assert apply({"b": "2"}).returncode == 0
    assert get_json(cluster, "configmap", "demo")["data"] == {"a": "1", "b": "2", "c": "3"}
    # team leaves it out too: no one owns it, it is removed
    assert apply({"c": "3"}, "--field-manager=team").returncode == 0
    assert get_json(cluster, "configmap", "demo")["data"] == {"b": "2", "c": "3"}
    # --force-conflicts takes kubectl's field over: kubectl owns nothing left, its entry goes
    forced = apply({"b": "5", "c": "3"}, "--field-manager=team", "--force-conflicts")
    assert forced.returncode == 0, forced.stderr
    assert get_json(cluster, "configmap", "demo")["data"] == {"b": "5", "c": "3"}
    assert owners(cluster, "configmap", "demo") == {"team:Apply": {".data.b", ".data.c"}}


def test_kubectl_apply_server_side_over_client_side_apply(
    cluster: TestCluster, tmp_path: Path
) -> None:
    manifest = tmp_path / "cm.yaml"
    manifest.write_text(config_map({"a": "1"}))
    assert run_kubectl(cluster, "apply", "-f", str(manifest)).returncode == 0
    assert owners(cluster, "configmap", "demo") == {
        "kubectl-client-side-apply:Update": {
            ".data",
            ".data.a",
            ".metadata.annotations",
            ".metadata.annotations.kubectl.kubernetes.io/last-applied-configuration",
        }
    }
    manifest.write_text(config_map({"a": "2"}))
    # another server-side applier conflicts with client-side apply's field...
    refused = run_kubectl(
        cluster, "apply", "--server-side", "--field-manager=team", "-f", str(manifest)
    )
    assert refused.stderr.splitlines()[0] == (
        'error: Apply failed with 1 conflict: conflict with "kubectl-client-side-apply" '
        "using v1: .data.a"
    )
    # ...kubectl's own takes it over (what client-side apply last applied is still there), and
    # moves client-side apply's fields to its own manager
    moved = run_kubectl(cluster, "apply", "--server-side", "-f", str(manifest))
    assert moved.returncode == 0, moved.stderr
    live = get_json(cluster, "configmap", "demo")
    assert live["data"] == {"a": "2"}
    last_applied = live["metadata"]["annotations"][
        "kubectl.kubernetes.io/last-applied-configuration"
    ]
    assert json.loads(last_applied)["data"] == {"a": "2"}
    managers = owners(cluster, "configmap", "demo")
    assert "kubectl-client-side-apply:Update" not in managers
    assert ".data.a" in managers["kubectl:Apply"]
    # and a client-side apply after it still works from the annotation the server kept
    manifest.write_text(config_map({"a": "3"}))
    back = run_kubectl(cluster, "apply", "-f", str(manifest))
    assert back.stdout.strip() == "configmap/demo configured", back.stderr
    assert get_json(cluster, "configmap", "demo")["data"] == {"a": "3"}


def test_kubectl_apply_server_side_lists_and_scale(cluster: TestCluster, tmp_path: Path) -> None:
    def replica_set(containers: list[dict], replicas: int | None = 0) -> str:
        spec: dict = {
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {"containers": containers},
            },
        }
        if replicas is not None:
            spec["replicas"] = replicas
        return yaml.safe_dump(
            {
                "apiVersion": "apps/v1",
                "kind": "ReplicaSet",
                "metadata": {"name": "web"},
                "spec": spec,
            }
        )

    main = {
        "name": "main",
        "image": "web:1",
        "args": ["--port", "8080"],
        "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
        "ports": [{"containerPort": 8080}],
    }
    side = {"name": "side", "image": "proxy:1"}
    manifest = tmp_path / "rs.yaml"

    def apply(text: str, *args: str) -> subprocess.CompletedProcess[str]:
        manifest.write_text(text)
        return run_kubectl(cluster, "apply", "--server-side", *args, "-f", str(manifest))

    assert apply(replica_set([main, side])).returncode == 0
    fields = owners(cluster, "rs", "web")["kubectl:Apply"]
    container = '.spec.template.spec.containers[k:{"name":"main"}]'
    assert container in fields  # an item of a list merged by key
    assert f"{container}.args" in fields  # an atomic list: one field
    assert f'{container}.ports[k:{{"containerPort":8080,"protocol":"TCP"}}]' in fields
    # kubectl scale owns the replicas through the scale subresource
    scaled = run_kubectl(cluster, "scale", "rs", "web", "--replicas=2")
    assert scaled.returncode == 0, scaled.stderr
    assert owners(cluster, "rs", "web")["kubectl:Update:scale"] == {".spec.replicas"}
    refused = apply(replica_set([main, side]))
    assert refused.stderr.splitlines()[0] == (
        'error: Apply failed with 1 conflict: conflict with "kubectl" with subresource "scale" '
        "using apps/v1: .spec.replicas"
    )
    # left out: the side container, env B and (kubectl scale's now) the replicas
    main["env"] = [{"name": "A", "value": "1"}]
    trimmed = apply(replica_set([main], replicas=None))
    assert trimmed.returncode == 0, trimmed.stderr
    live = get_json(cluster, "rs", "web")
    assert live["spec"]["replicas"] == 2
    [container_spec] = live["spec"]["template"]["spec"]["containers"]
    assert container_spec["name"] == "main"
    assert container_spec["env"] == [{"name": "A", "value": "1"}]
    # forced: the replicas are the applier's again
    forced = apply(replica_set([main], replicas=1), "--force-conflicts")
    assert forced.returncode == 0, forced.stderr
    assert get_json(cluster, "rs", "web")["spec"]["replicas"] == 1
    assert "kubectl:Update:scale" not in owners(cluster, "rs", "web")


def test_kubectl_apply_k_manifests(cluster: TestCluster) -> None:
    base = run_kubectl(cluster, "apply", "-k", str(MANIFESTS / "base"))
    assert base.returncode == 0, base.stderr
    lines = set(base.stdout.splitlines())
    # created at start by the cluster itself (no last-applied annotation): kubectl warns and
    # patches, as on a real cluster
    assert "serviceaccount/kfp-elastic-master configured" in lines
    assert "rolebinding.rbac.authorization.k8s.io/kfp-elastic-master configured" in lines
    assert "priorityclass.scheduling.k8s.io/kfp-elastic-worker-level-0 configured" in lines
    assert "missing the kubectl.kubernetes.io/last-applied-configuration" in base.stderr
    for created in (
        "configmap/kfp-elastic-config",
        "service/kfp-elastic-etcd",
        "service/kfp-elastic-etcd-headless",
        "statefulset.apps/kfp-elastic-etcd",
        "poddisruptionbudget.policy/kfp-elastic-etcd",
        "networkpolicy.networking.k8s.io/kfp-elastic-etcd",
        "serviceaccount/kfp-elastic-worker",
    ):
        assert f"{created} created" in lines or f"{created} configured" in lines, created
    for overlay in ("local-kind", "production"):
        applied = run_kubectl(cluster, "apply", "-k", str(MANIFESTS / "overlays" / overlay))
        assert applied.returncode == 0, applied.stderr
    services = run_kubectl(cluster, "get", "services", "-n", "kfp-elastic").stdout.splitlines()
    assert services[0].split() == ["NAME", "TYPE", "CLUSTER-IP", "EXTERNAL-IP", "PORT(S)", "AGE"]
    rows = {line.split()[0]: line.split() for line in services[1:]}
    assert rows["kfp-elastic-etcd-headless"][2] == "None"
    assert rows["kfp-elastic-etcd"][4] == "2379/TCP,2381/TCP"
    sts = get_json(cluster, "statefulset", "kfp-elastic-etcd", "-n", "kfp-elastic")
    assert sts["spec"]["replicas"] == 3  # production's patch, applied over local-kind's 1
    namespaces = run_kubectl(cluster, "get", "namespaces", "--no-headers").stdout
    assert "kfp-elastic" in namespaces and "Active" in namespaces
    # the master's pods may now run in kfp-elastic: its RBAC came with the overlay
    can = run_kubectl(
        cluster,
        "auth",
        "can-i",
        "create",
        "pods",
        "-n",
        "kfp-elastic",
        "--as",
        "system:serviceaccount:kfp-elastic:kfp-elastic-master",
    )
    assert (can.returncode, can.stdout.strip()) == (0, "yes")
    # the server side too, over what the client side applied
    server_side = run_kubectl(cluster, "apply", "--server-side", "-k", str(MANIFESTS / "base"))
    assert server_side.returncode == 0, server_side.stderr
    assert "statefulset.apps/kfp-elastic-etcd serverside-applied" in server_side.stdout


@pytest.mark.parametrize("kustomization", sorted(NEEDS_CRDS))
def test_kubectl_apply_refuses_kinds_without_their_crds(
    cluster: TestCluster, kustomization: str
) -> None:
    """A cluster without Kueue's CRDs refuses Kueue's kinds, as a real one does."""
    rendered = run_kubectl(cluster, "kustomize", str(MANIFESTS / kustomization))
    kinds = sorted({doc["kind"] for doc in yaml.safe_load_all(rendered.stdout) if doc})
    assert kinds == NEEDS_CRDS[kustomization]
    for args in (("--validate=false",), ()):
        refused = run_kubectl(cluster, "apply", *args, "-k", str(MANIFESTS / kustomization))
        assert refused.returncode == 1
        assert refused.stdout == ""  # nothing created
        if args:  # no Kueue CRDs: kubectl finds no resource for the kinds
            assert 'no matches for kind "ClusterQueue"' in refused.stderr
            assert "ensure CRDs are installed first" in refused.stderr
        else:  # kubectl's own validation of an unknown kind asks for OpenAPI v2 (not served)
            assert "the server could not find the requested resource" in refused.stderr
    # a request for such a resource gets the API server's 404 Status
    raw = run_kubectl(cluster, "get", "--raw", "/apis/kueue.x-k8s.io/v1beta2/clusterqueues")
    assert raw.returncode == 1
    assert (
        "Error from server (NotFound): the server could not find the requested resource"
        in raw.stderr
    )


@pytest.fixture
def kueue_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestCluster]:
    """A test cluster with Kueue's CRDs installed (no node: nothing runs on it)."""
    with TestCluster(tmp_path_factory.mktemp("kueue"), nodes={}, kueue_crds=True) as cluster:
        yield cluster


def test_kubectl_apply_kueue_with_its_crds(kueue_cluster: TestCluster, tmp_path: Path) -> None:
    """With Kueue's CRDs installed, ``kubectl apply -k manifests/kueue`` creates its objects
    (the LocalQueue in the overlay's namespace), kubectl lists and prints them, a misspelled
    field is refused as for built-in kinds, and the deprecated v1beta1 is served with Kueue's
    deprecation warning."""
    cluster = kueue_cluster
    overlay = run_kubectl(cluster, "apply", "-k", str(MANIFESTS / "overlays" / "local-kind"))
    assert overlay.returncode == 0, overlay.stderr
    applied = run_kubectl(cluster, "apply", "-k", str(MANIFESTS / "kueue"))
    assert applied.returncode == 0, applied.stderr
    objs = render("kueue")
    assert sorted(applied.stdout.splitlines()) == sorted(
        f"{o['kind'].lower()}.kueue.x-k8s.io/{o['metadata']['name']} created" for o in objs
    )
    (local_queue,) = find(objs, "LocalQueue")
    ns = local_queue["metadata"]["namespace"]
    queues = run_kubectl(cluster, "get", "clusterqueues,localqueues", "-A")
    assert queues.returncode == 0, queues.stderr
    lines = [line.split() for line in queues.stdout.splitlines() if line.strip()]
    assert lines[0] == ["NAME", "COHORT", "PENDING", "WORKLOADS"]  # its printer columns
    assert lines[1][0] == "clusterqueue.kueue.x-k8s.io/kfp-elastic"
    assert lines[3][:3] == [ns, "localqueue.kueue.x-k8s.io/kfp-elastic", "kfp-elastic"]
    classes = yaml.safe_load(
        run_kubectl(cluster, "get", "workloadpriorityclasses", "-o", "yaml").stdout
    )
    assert {o["metadata"]["name"]: o["value"] for o in classes["items"]} == {
        o["metadata"]["name"]: o["value"] for o in find(objs, "WorkloadPriorityClass")
    }
    assert {o["apiVersion"] for o in classes["items"]} == {"kueue.x-k8s.io/v1beta2"}
    again = run_kubectl(cluster, "apply", "-k", str(MANIFESTS / "kueue"))
    assert again.stdout.count(" unchanged") == len(objs), again.stdout
    # a misspelled field: refused (kubectl's default --validate=strict), or dropped with a
    # warning, as for built-in kinds
    (queue,) = find(objs, "ClusterQueue")
    typo = {**queue, "spec": {**queue["spec"], "cohrt": "x"}}
    refused = run_kubectl(cluster, "apply", "-f", "-", stdin=yaml.safe_dump(typo))
    assert refused.returncode == 1  # a patch of the live object
    assert 'patch: Invalid value: "{' in refused.stderr
    assert refused.stderr.endswith('": strict decoding error: unknown field "spec.cohrt"\n')
    new_typo = {**typo, "metadata": {"name": "typo"}}
    refused = run_kubectl(cluster, "create", "-f", "-", stdin=yaml.safe_dump(new_typo))
    assert refused.returncode == 1  # a create
    assert refused.stderr == (
        'Error from server (BadRequest): error when creating "STDIN": ClusterQueue in version '
        '"v1beta2" cannot be handled as a ClusterQueue: strict decoding error: unknown field '
        '"spec.cohrt"\n'
    )
    warned = run_kubectl(cluster, "apply", "--validate=warn", "-f", "-", stdin=yaml.safe_dump(typo))
    assert warned.returncode == 0, warned.stderr
    assert 'Warning: unknown field "spec.cohrt"' in warned.stderr
    assert "cohrt" not in get_json(cluster, "clusterqueue", "kfp-elastic")["spec"]
    # a value the schema refuses: 422 in kube's words
    wrong = {**queue, "spec": {**queue["spec"], "queueingStrategy": "Fifo"}}
    invalid = run_kubectl(cluster, "apply", "-f", "-", stdin=yaml.safe_dump(wrong))
    assert invalid.returncode == 1
    assert (
        'The ClusterQueue "kfp-elastic" is invalid: spec.queueingStrategy: Unsupported value: '
        '"Fifo": supported values: "StrictFIFO", "BestEffortFIFO"' in invalid.stderr
    )
    # the deprecated version: served, with Kueue's warning
    old = {
        "apiVersion": "kueue.x-k8s.io/v1beta1",
        "kind": "WorkloadPriorityClass",
        "metadata": {"name": "old-api"},
        "value": 7,
    }
    deprecated = run_kubectl(cluster, "apply", "-f", "-", stdin=yaml.safe_dump(old))
    assert deprecated.returncode == 0, deprecated.stderr
    assert deprecated.stdout.strip() == "workloadpriorityclass.kueue.x-k8s.io/old-api created"
    assert DEPRECATED_KUEUE in deprecated.stderr
    read_old = run_kubectl(
        cluster, "get", "workloadpriorityclasses.v1beta1.kueue.x-k8s.io", "old-api", "-o", "json"
    )
    assert json.loads(read_old.stdout)["apiVersion"] == "kueue.x-k8s.io/v1beta1"
    assert DEPRECATED_KUEUE in read_old.stderr
    assert get_json(cluster, "wpc", "old-api")["apiVersion"] == "kueue.x-k8s.io/v1beta2"


def kubectl_patch(
    cluster: TestCluster, target: str, body: object, patch_type: str = ""
) -> subprocess.CompletedProcess[str]:
    """``kubectl patch TARGET [--type TYPE] -p BODY`` (``target``: "pod web"; no type: kubectl's
    default, a strategic merge patch)."""
    kind = ("--type", patch_type) if patch_type else ()
    return run_kubectl(cluster, "patch", *target.split(), *kind, "-p", json.dumps(body))


def test_kubectl_patch_pod_node_and_replicaset(cluster: TestCluster) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "web"},
        "spec": {
            "containers": [
                {"name": "main", "image": "python:3", "resources": {"requests": {"cpu": "64"}}}
            ]
        },
    }
    cluster.api.create(cluster.namespace, pod)
    labels_a = {"metadata": {"labels": {"a": "1"}}}
    merge = kubectl_patch(cluster, "pod web", labels_a, "merge")
    assert (merge.returncode, merge.stdout.strip()) == (0, "pod/web patched"), merge.stderr
    json_patch = kubectl_patch(
        cluster,
        "pod web",
        [
            {"op": "replace", "path": "/spec/containers/0/image", "value": "python:3.12"},
            {"op": "add", "path": "/metadata/labels/b", "value": "2"},
        ],
        "json",
    )
    assert json_patch.returncode == 0, json_patch.stderr
    strategic = kubectl_patch(
        cluster, "pod web", {"spec": {"containers": [{"name": "main", "image": "python:3.13"}]}}
    )
    assert strategic.returncode == 0, strategic.stderr
    live = cluster.api.pod("web")
    assert live["metadata"]["labels"] == {"a": "1", "b": "2"}
    assert [c["image"] for c in live["spec"]["containers"]] == ["python:3.13"]  # merged by name
    unchanged = kubectl_patch(cluster, "pod web", labels_a, "merge")
    assert unchanged.stdout.strip() == "pod/web patched (no change)"
    failing = kubectl_patch(
        cluster, "pod web", [{"op": "remove", "path": "/metadata/labels/zzz"}], "json"
    )
    assert failing.returncode == 1 and "The request is invalid" in failing.stderr
    forbidden = kubectl_patch(cluster, "pod web", {"spec": {"restartPolicy": "Never"}}, "merge")
    assert forbidden.returncode == 1 and "pod updates may not change fields" in forbidden.stderr
    node = kubectl_patch(
        cluster,
        "node node-1",
        [{"op": "add", "path": "/metadata/labels/zone", "value": "a"}],
        "json",
    )
    assert node.returncode == 0, node.stderr
    assert cluster.api.get_object("nodes", "", "node-1")["metadata"]["labels"]["zone"] == "a"
    template = {
        "metadata": {"labels": {"app": "serving"}},
        "spec": {
            "containers": [
                {"name": "main", "image": "serving:1", "resources": {"requests": {"cpu": "64"}}}
            ]
        },
    }
    with ReplicaSet(cluster.api, "serving", template, replicas=0):
        patched = kubectl_patch(
            cluster, "replicaset serving", {"metadata": {"labels": {"tier": "web"}}}, "merge"
        )
        assert patched.returncode == 0, patched.stderr
        selector = kubectl_patch(
            cluster, "rs serving", {"spec": {"selector": {"matchLabels": {"app": "x"}}}}, "merge"
        )
        assert selector.returncode == 1 and "field is immutable" in selector.stderr


def test_kubectl_scale_the_serving_replicaset(cluster: TestCluster) -> None:
    template = {
        "metadata": {"labels": {"app": "serving"}},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": "serving:1",
                    "command": ["python", "-c", "import time; time.sleep(600)"],
                    "resources": {"requests": {"cpu": "100m"}},
                }
            ],
        },
    }

    def serving_pods() -> list[dict]:
        return [
            p
            for p in cluster.api.pods_snapshot()
            if p["metadata"].get("labels", {}).get("app") == "serving"
            and not p["metadata"].get("deletionTimestamp")
        ]

    with ReplicaSet(cluster.api, "serving", template, replicas=1) as rs:
        wait_for(lambda: len(serving_pods()) == 1, 30, what="one serving pod")
        scaled = run_kubectl(cluster, "scale", "replicaset", "serving", "--replicas=3")
        assert (scaled.returncode, scaled.stdout.strip()) == (0, "replicaset.apps/serving scaled")
        wait_for(lambda: len(serving_pods()) == 3, 30, what="three serving pods")
        assert rs.replicas == 3
        owners = {p["metadata"]["ownerReferences"][0]["name"] for p in serving_pods()}
        assert owners == {"serving"}
        wait_for(
            lambda: get_json(cluster, "rs", "serving")["status"].get("readyReplicas") == 3,
            60,
            what="three ready replicas",
        )
        table = run_kubectl(cluster, "get", "rs", "serving").stdout.splitlines()
        assert table[0].split() == ["NAME", "DESIRED", "CURRENT", "READY", "AGE"]
        assert table[1].split()[:4] == ["serving", "3", "3", "3"]
        stale = run_kubectl(
            cluster, "scale", "rs", "serving", "--replicas=1", "--current-replicas=2"
        )
        assert stale.returncode == 1 and "Expected replicas to be 2, was 3" in stale.stderr
        down = run_kubectl(
            cluster, "scale", "rs", "serving", "--replicas=1", "--current-replicas=3"
        )
        assert down.returncode == 0, down.stderr
        wait_for(lambda: len(serving_pods()) == 1, 30, what="one serving pod again")
        negative = run_kubectl(cluster, "scale", "rs", "serving", "--replicas=-1")
        assert negative.returncode == 1
        rs.scale(0)
        wait_for(lambda: not serving_pods(), 30, what="no serving pod")


def test_kubectl_auth_can_i_from_the_enforced_rbac(cluster: TestCluster) -> None:
    def can_i(*args: str) -> tuple[int, str]:
        done = run_kubectl(cluster, "auth", "can-i", *args)
        return done.returncode, done.stdout.strip()

    assert can_i("create", "pods", "--as", MASTER) == (0, "yes")
    assert can_i("watch", "pods", "--as", MASTER) == (0, "yes")
    assert can_i("get", "secrets", "--as", MASTER) == (1, "no")
    assert can_i("create", "pods", "-n", "elsewhere", "--as", MASTER) == (1, "no")
    assert can_i("list", "pods", "--as", WORKER) == (1, "no")
    assert can_i("create", "pods") == (0, "yes")  # the admin
    # what can-i says is what the server enforces for that account's own token
    token = cluster.api.service_account_token(cluster.namespace, "kfp-elastic-master")
    for verb, resource, expected in (("list", "pods", 0), ("list", "secrets", 1)):
        as_master = run_kubectl(cluster, "get", resource, f"--token={token}")
        assert (as_master.returncode == 0) == (expected == 0), as_master.stderr
        assert can_i(verb, resource, "--as", MASTER)[0] == expected
    denied = run_kubectl(cluster, "get", "secrets", f"--token={token}")
    assert "(Forbidden)" in denied.stderr
    # granted by a binding made now
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "worker-reads"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": "kfp-elastic-master",
        },
        "subjects": [{"kind": "ServiceAccount", "name": "kfp-elastic-worker"}],
    }
    assert run_kubectl(cluster, "apply", "-f", "-", stdin=json.dumps(binding)).returncode == 0
    assert can_i("list", "pods", "--as", WORKER) == (0, "yes")
    # a service account may not impersonate another
    as_master = run_kubectl(
        cluster, "auth", "can-i", "list", "pods", "--as", WORKER, f"--token={token}"
    )
    assert as_master.returncode == 1 and "cannot impersonate resource" in as_master.stderr
