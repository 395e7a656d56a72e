"""kubectl's ``--dry-run=server`` against the stand-in API server: every write it sends with
``dryRun=All`` (create, apply client- and server-side, patch, label, scale, replace, delete) is
answered as it would be, and nothing is stored: no object changes, no resourceVersion is spent,
no watch event is sent. An unknown dryRun value is refused as kube-apiserver refuses it. Also the
field managers kubectl's commands and the Python client write as."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from kfp_elastic.testing.api_server import FakeKubernetes
from tests.helpers import kubectl

NS = "default"
CONFIG_MAP = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "demo"}}
POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "web"},
    "spec": {"containers": [{"name": "main", "image": "python:3"}]},
}
REPLICA_SET = {
    "apiVersion": "apps/v1",
    "kind": "ReplicaSet",
    "metadata": {"name": "web"},
    "spec": {
        "replicas": 1,
        "selector": {"matchLabels": {"app": "web"}},
        "template": {
            "metadata": {"labels": {"app": "web"}},
            "spec": {"containers": [{"name": "main", "image": "python:3"}]},
        },
    },
}


class Kubectl:
    """The real kubectl against a quiet stand-in API server (nothing else writes to it)."""

    def __init__(self, api: FakeKubernetes, root: Path) -> None:
        self.api = api
        self.root = root
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
            "users": [{"name": "admin", "user": {}}],
            "contexts": [
                {"name": "fake", "context": {"cluster": "fake", "user": "admin", "namespace": NS}}
            ],
            "current-context": "fake",
        }
        self.kubeconfig = root / "kubeconfig"
        self.kubeconfig.write_text(yaml.safe_dump(config))

    def __call__(self, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [kubectl(), *args],
            env={**os.environ, "KUBECONFIG": str(self.kubeconfig)},
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def ok(self, *args: str, stdin: str = "") -> str:
        done = self(*args, stdin=stdin)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def file(self, obj: dict) -> str:
        path = self.root / f"{obj['kind']}-{len(list(self.root.iterdir()))}.yaml"
        path.write_text(yaml.safe_dump(obj))
        return str(path)

    def resource_version(self) -> str:
        """The server's current resourceVersion: every stored change and watch event takes
        the next one."""
        return self.api.list_objects("configmaps", NS)["metadata"]["resourceVersion"]


@pytest.fixture
def kc(tmp_path: Path) -> Iterator[Kubectl]:
    with FakeKubernetes(namespace=NS) as api:
        yield Kubectl(api, tmp_path)


def test_dry_run_server_answers_every_write_and_stores_nothing(kc: Kubectl) -> None:
    cm = {**CONFIG_MAP, "data": {"a": "1"}}
    rv = kc.resource_version()
    # creates: nothing there afterwards
    assert kc.ok("create", "-f", kc.file(cm), "--dry-run=server") == (
        "configmap/demo created (server dry run)"
    )
    assert kc.ok("apply", "-f", kc.file(POD), "--dry-run=server") == (
        "pod/web created (server dry run)"
    )
    assert kc.ok("apply", "--server-side", "-f", kc.file(cm), "--dry-run=server") == (
        "configmap/demo serverside-applied (server dry run)"
    )
    dry_created = json.loads(
        kc.ok(
            "create", "-f", kc.file(cm), "--dry-run=server", "-o", "json", "--show-managed-fields"
        )
    )
    assert dry_created["metadata"]["uid"] and "resourceVersion" not in dry_created["metadata"]
    assert [m["manager"] for m in dry_created["metadata"]["managedFields"]] == ["kubectl-create"]
    assert kc.resource_version() == rv
    assert kc("get", "configmap", "demo").returncode == 1
    assert kc("get", "pod", "web").returncode == 1
    # writes to what exists: it stays as it was
    kc.ok("apply", "-f", kc.file(cm))
    kc.ok("create", "-f", kc.file(POD))
    kc.ok("create", "-f", kc.file(REPLICA_SET))
    rv = kc.resource_version()
    before = {
        kind: kc.api.get_object(r, NS, n)
        for kind, r, n in (("cm", "configmaps", "demo"), ("rs", "replicasets", "web"))
    }
    pod_before = kc.api.pod("web", NS)
    changed = {**cm, "data": {"a": "2"}}
    assert kc.ok("apply", "-f", kc.file(changed), "--dry-run=server") == (
        "configmap/demo configured (server dry run)"
    )
    answered = json.loads(
        kc.ok("apply", "--server-side", "-f", kc.file(changed), "--dry-run=server", "-o", "json")
    )
    assert answered["data"] == {"a": "2"}  # what the apply would store...
    assert answered["metadata"]["resourceVersion"] == before["cm"]["metadata"]["resourceVersion"]
    patched = kc.ok(
        "patch", "configmap", "demo", "-p", '{"data":{"b":"2"}}', "--dry-run=server", "-o", "json"
    )
    assert json.loads(patched)["data"] == {"a": "1", "b": "2"}
    assert kc.ok("label", "pod", "web", "x=y", "--dry-run=server") == (
        "pod/web labeled (server dry run)"
    )
    assert kc.ok("annotate", "rs", "web", "x=y", "--dry-run=server") == (
        "replicaset.apps/web annotated (server dry run)"
    )
    assert kc.ok("scale", "rs", "web", "--replicas=3", "--dry-run=server") == (
        "replicaset.apps/web scaled (server dry run)"
    )
    replaced = {**REPLICA_SET, "spec": {**REPLICA_SET["spec"], "replicas": 5}}
    assert kc.ok("replace", "-f", kc.file(replaced), "--dry-run=server") == (
        "replicaset.apps/web replaced (server dry run)"
    )
    assert kc.ok("delete", "configmap", "demo", "--dry-run=server") == (
        'configmap "demo" deleted from default namespace (server dry run)'
    )
    assert kc.ok("delete", "pod", "web", "--dry-run=server") == (
        'pod "web" deleted from default namespace (server dry run)'
    )
    # ...and stored nothing: no resourceVersion spent (so no watch event), objects unchanged
    assert kc.resource_version() == rv
    assert kc.api.get_object("configmaps", NS, "demo") == before["cm"]
    assert kc.api.get_object("replicasets", NS, "web") == before["rs"]
    assert kc.api.pod("web", NS) == pod_before
    # a drain: the cordon and the eviction answered, the node and its pod left alone
    kc.ok("create", "-f", kc.file({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}}))
    on_node = {**POD, "metadata": {"name": "on-n1"}, "spec": {**POD["spec"], "nodeName": "n1"}}
    kc.ok("create", "-f", kc.file(on_node))
    rv = kc.resource_version()
    drained = kc.ok("drain", "n1", "--force", "--dry-run=server").splitlines()
    assert drained == [
        "node/n1 cordoned (server dry run)",
        "evicting pod default/on-n1 (server dry run)",
        "node/n1 drained (server dry run)",
    ]
    assert kc.resource_version() == rv
    assert not kc.api.get_object("nodes", "", "n1").get("spec", {}).get("unschedulable")
    assert not kc.api.pod("on-n1", NS)["metadata"].get("deletionTimestamp")
    # every one of those writes asked for a dry run
    writes = [
        (method, query)
        for method, _, query in kc.api.requests
        if method in ("POST", "PUT", "PATCH", "DELETE")
    ]
    assert sum(query.get("dryRun") == "All" for _, query in writes) >= 10
    # a dry run that would fail fails the same way
    refused = kc("create", "-f", kc.file(cm), "--dry-run=server")
    assert "AlreadyExists" in refused.stderr
    bad = kc("patch", "pod", "web", "-p", '{"spec":{"restartPolicy":"Never"}}', "--dry-run=server")
    assert bad.returncode == 1 and "pod updates may not change fields" in bad.stderr


def test_an_unknown_dry_run_value_is_refused(kc: Kubectl) -> None:
    path = kc.file({**CONFIG_MAP, "data": {"a": "1"}})
    url = f"/api/v1/namespaces/{NS}/configmaps"
    created = kc("create", "--raw", f"{url}?dryRun=Yes", "-f", path)
    assert created.returncode == 1
    assert created.stderr.strip() == (
        # kubectl's words for kube-apiserver's 422 (its details name the options kind)
        'The CreateOptions "" is invalid: dryRun: Unsupported value: []string{"Yes"}: '
        'supported values: "All"'
    )
    kc.ok("create", "-f", path)
    replaced = kc("replace", "--raw", f"{url}/demo?dryRun=All&dryRun=Yes", "-f", path)
    assert 'The UpdateOptions "" is invalid: dryRun: Unsupported value: ' in replaced.stderr
    assert '[]string{"All", "Yes"}' in replaced.stderr
    deleted = kc("delete", "--raw", f"{url}/demo?dryRun=Yes")
    assert 'The DeleteOptions "" is invalid' in deleted.stderr
    assert kc.ok("get", "configmap", "demo", "-o", "name") == "configmap/demo"


def test_field_managers_of_kubectl_commands_and_the_python_client(kc: Kubectl) -> None:
    kc.ok("create", "-f", kc.file({**CONFIG_MAP, "data": {"a": "1"}}))
    kc.ok("patch", "configmap", "demo", "-p", '{"data":{"b":"2"}}')
    kc.ok("label", "configmap", "demo", "x=y")
    kc.ok("create", "-f", kc.file(REPLICA_SET))
    kc.ok("scale", "rs", "web", "--replicas=2")
    api = client.CoreV1Api(client.ApiClient(client.Configuration(host=kc.api.url)))
    api.create_namespaced_config_map(NS, {**CONFIG_MAP, "metadata": {"name": "py"}, "data": {}})
    api.api_client.close()

    def managers(*args: str) -> list[tuple[str, str, str]]:
        live = json.loads(kc.ok("get", *args, "-o", "json", "--show-managed-fields"))
        return sorted(
            (m["manager"], m["operation"], m.get("subresource", ""))
            for m in live["metadata"]["managedFields"]
        )

    assert managers("configmap", "demo") == [
        ("kubectl-create", "Update", ""),
        ("kubectl-label", "Update", ""),
        ("kubectl-patch", "Update", ""),
    ]
    assert managers("rs", "web") == [
        ("kubectl", "Update", "scale"),  # kubectl scale names none: its User-Agent's
        ("kubectl-create", "Update", ""),
    ]
    assert managers("configmap", "py") == [("OpenAPI-Generator", "Update", "")]
