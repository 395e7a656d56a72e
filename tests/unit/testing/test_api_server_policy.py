"""The fake API server as a real one behaves, over HTTP through the ``kubernetes`` client:
service-account tokens authorized by RBAC (403 with the API server's Status), the eviction API
with PodDisruptionBudgets (429), and watches that time out, meet compaction (410) and get
BOOKMARKs."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from kfp_elastic.testing.api_rules import TOO_MANY
from kfp_elastic.testing.api_server import FakeKubernetes

NS = "team"
ADMIN = "admin-token"
SA = "kfp-elastic-master"
ROLE = {
    "metadata": {"name": SA},
    "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "list", "watch"]}],
}
BINDING = {
    "metadata": {"name": SA},
    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": SA},
    "subjects": [{"kind": "ServiceAccount", "name": SA}],
}
LABELS = {"app.kubernetes.io/name": "etcd", "app.kubernetes.io/instance": "kfp-elastic-etcd"}


@pytest.fixture
def k8s() -> Iterator[FakeKubernetes]:
    with FakeKubernetes(namespace=NS, admin_tokens=(ADMIN,), validate_pods=False) as fake:
        yield fake


def core_for(k8s: FakeKubernetes, token: str | None, scheme: str = "Bearer") -> client.CoreV1Api:
    configuration = client.Configuration(host=k8s.url)
    if token is not None:
        configuration.api_key = {"authorization": f"{scheme} {token}"}
    return client.CoreV1Api(client.ApiClient(configuration))


def pod(name: str, **labels: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "main", "image": "busybox:1"}]},
    }


def status_of(error: ApiException) -> dict[str, Any]:
    return json.loads(error.body)


def test_service_account_tokens_are_authorized_by_the_stored_role(k8s: FakeKubernetes) -> None:
    k8s.create_object("roles", NS, ROLE)
    k8s.create_object("rolebindings", NS, BINDING)
    # the scheme as load_incluster_config() writes it
    master = core_for(k8s, k8s.service_account_token(NS, SA), scheme="bearer")
    master.create_namespaced_pod(NS, pod("w"))
    assert [p.metadata.name for p in master.list_namespaced_pod(NS).items] == ["w"]
    with pytest.raises(ApiException) as caught:
        master.delete_namespaced_pod("w", NS)
    assert caught.value.status == 403
    body = status_of(caught.value)
    assert (body["kind"], body["reason"], body["code"]) == ("Status", "Forbidden", 403)
    assert body["message"] == (
        f'pods "w" is forbidden: User "system:serviceaccount:{NS}:{SA}" cannot delete resource '
        f'"pods" in API group "" in the namespace "{NS}"'
    )
    assert body["details"] == {"group": "", "kind": "pods", "name": "w"}
    # another account, another namespace: nothing granted
    worker = core_for(k8s, k8s.service_account_token(NS, "kfp-elastic-worker"))
    with pytest.raises(ApiException, match="Forbidden"):
        worker.list_namespaced_pod(NS)
    with pytest.raises(ApiException, match="Forbidden"):
        master.list_namespaced_pod("other")
    # a Role changed takes effect on the next request
    k8s.replace_object("roles", NS, {**ROLE, "rules": [{**ROLE["rules"][0], "verbs": ["*"]}]})
    master.delete_namespaced_pod("w", NS)
    # the harness: no token or the admin token may do anything; a made-up token may do nothing
    for harness in (core_for(k8s, None), core_for(k8s, ADMIN)):
        harness.list_node()
    with pytest.raises(ApiException) as caught:
        core_for(k8s, "made-up").list_namespaced_pod(NS)
    assert caught.value.status == 401


def test_bindings_are_validated(k8s: FakeKubernetes) -> None:
    cluster_binding = {**BINDING, "roleRef": {**BINDING["roleRef"], "kind": "ClusterRole"}}
    with pytest.raises(Exception, match="subjects\\[0\\].namespace: Required value"):
        k8s.create_object("clusterrolebindings", "", cluster_binding)
    with pytest.raises(Exception, match="cannot be both set"):
        k8s.create_object(
            "poddisruptionbudgets",
            NS,
            {"metadata": {"name": "b"}, "spec": {"minAvailable": 1, "maxUnavailable": 1}},
        )


def members(k8s: FakeKubernetes, *names: str) -> None:
    """StatefulSet pods, Running and Ready, owned by the stored StatefulSet."""
    owner = k8s.get_object("statefulsets", NS, "kfp-elastic-etcd")["metadata"]["uid"]
    ref = {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "kfp-elastic-etcd"}
    for name in names:
        body = pod(name, **LABELS)
        body["metadata"]["ownerReferences"] = [{**ref, "uid": owner, "controller": True}]
        k8s.create(NS, body)
        k8s.set_phase(name, "Running", ns=NS)


def budget(core: client.CoreV1Api) -> dict[str, Any]:
    resp = core.api_client.call_api(
        f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/kfp-elastic-etcd",
        "GET",
        _preload_content=False,
    )
    return json.loads(resp[0].data)["status"]


def test_eviction_respects_the_disruption_budget(k8s: FakeKubernetes) -> None:
    k8s.kubelet = False  # evicted pods stay Terminating until finish_deletion
    k8s.create_object(
        "statefulsets",
        NS,
        {"metadata": {"name": "kfp-elastic-etcd"}, "spec": {"replicas": 3}},
    )
    k8s.create_object(
        "poddisruptionbudgets",
        NS,
        {
            "metadata": {"name": "kfp-elastic-etcd"},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": LABELS}},
        },
    )
    members(k8s, "etcd-0", "etcd-1", "etcd-2")
    core = core_for(k8s, ADMIN)
    status = budget(core)
    assert (status["currentHealthy"], status["desiredHealthy"]) == (3, 2)
    assert (status["disruptionsAllowed"], status["expectedPods"]) == (1, 3)

    def evict(name: str) -> None:
        core.create_namespaced_pod_eviction(
            name,
            NS,
            client.V1Eviction(metadata=client.V1ObjectMeta(name=name, namespace=NS)),
        )

    evict("etcd-0")
    evicted = k8s.pod("etcd-0")
    assert evicted["metadata"]["deletionTimestamp"]
    target = next(c for c in evicted["status"]["conditions"] if c["type"] == "DisruptionTarget")
    assert target["reason"] == "EvictionByEvictionAPI"
    for blocked in ("etcd-1", "etcd-2"):
        with pytest.raises(ApiException) as caught:
            evict(blocked)
        body = status_of(caught.value)
        assert (caught.value.status, body["reason"], body["message"]) == (
            429,
            "TooManyRequests",
            TOO_MANY,
        )
        assert body["details"]["causes"][0]["message"] == (
            "The disruption budget kfp-elastic-etcd needs 2 healthy pods and has 2 currently"
        )
    k8s.finish_deletion("etcd-0")  # gone, not yet back: still one short of three
    assert budget(core)["disruptionsAllowed"] == 0
    members(k8s, "etcd-0")  # the StatefulSet's replacement is Ready
    assert budget(core)["disruptionsAllowed"] == 1
    evict("etcd-1")
    # RBAC covers the subresource: pods/eviction must be granted as such
    k8s.create_object("roles", NS, ROLE)
    k8s.create_object("rolebindings", NS, BINDING)
    master = core_for(k8s, k8s.service_account_token(NS, SA))
    with pytest.raises(ApiException, match='cannot create resource \\\\"pods/eviction\\\\"'):
        master.create_namespaced_pod_eviction("etcd-2", NS, client.V1Eviction())


# -- watches -----------------------------------------------------------------------------------


def raw_watch(k8s: FakeKubernetes, query: str) -> list[dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", k8s.port, timeout=10)
    try:
        conn.request("GET", f"/api/v1/namespaces/{NS}/pods?watch=true&{query}")
        resp = conn.getresponse()
        assert resp.status == 200
        return [json.loads(line) for line in resp.read().splitlines() if line]
    finally:
        conn.close()


def test_watches_end_after_the_server_timeout_whatever_they_asked() -> None:
    with FakeKubernetes(namespace=NS, watch_timeout_s=0.2, validate_pods=False) as k8s:
        k8s.create(NS, pod("a"))
        for query in ("", "timeoutSeconds=3600"):  # returns: the server ended the stream
            assert [e["type"] for e in raw_watch(k8s, query)] == ["ADDED"]


def test_compaction_by_age_answers_old_versions_410() -> None:
    with FakeKubernetes(namespace=NS, compaction_s=0.2, validate_pods=False) as k8s:
        old = k8s.create(NS, pod("a"))["metadata"]["resourceVersion"]
        k8s.set_phase("a", "Running", ns=NS)
        time.sleep(0.3)  # both events are now older than the compaction window
        k8s.create(NS, pod("b"))  # a write: the API server compacts on its schedule
        events = raw_watch(k8s, f"resourceVersion={old}&timeoutSeconds=1")
        assert [(e["type"], e["object"]["code"]) for e in events] == [("ERROR", 410)]
        # from a version still in the window: the events after it
        recent = k8s.pod("b", ns=NS)["metadata"]["resourceVersion"]
        k8s.set_phase("b", "Running", ns=NS)
        events = raw_watch(k8s, f"resourceVersion={recent}&timeoutSeconds=0.2")
        assert [e["type"] for e in events] == ["MODIFIED"]


def test_bookmarks_carry_the_current_resource_version_when_asked_for() -> None:
    with FakeKubernetes(namespace=NS, bookmark_s=0.1, validate_pods=False) as k8s:
        start = k8s.create(NS, pod("a"))["metadata"]["resourceVersion"]
        k8s.create(NS, {**pod("other"), "metadata": {"name": "other", "namespace": NS}})
        k8s.create_object("configmaps", NS, {"metadata": {"name": "c"}})  # rv moves, no event
        now = k8s.list_objects("configmaps", NS)["metadata"]["resourceVersion"]
        query = f"resourceVersion={start}&timeoutSeconds=0.5&labelSelector=x%3D1"
        assert raw_watch(k8s, query) == []  # nothing selected, nothing said
        events = raw_watch(k8s, query + "&allowWatchBookmarks=true")
        assert events and {e["type"] for e in events} == {"BOOKMARK"}
        assert events[-1]["object"] == {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": now},
        }
