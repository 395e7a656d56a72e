"""The stand-in API server's patch formats, access reviews and OpenAPI paths, pure (server-side
apply and field ownership: test_api_apply.py)."""

from __future__ import annotations

import pytest

from kfp_elastic.testing.api_discovery import discovery
from kfp_elastic.testing.api_rules import User, access_review, impersonated, service_account_user
from kfp_elastic.testing.api_tables import table
from kfp_elastic.testing.api_wire import (
    APPLY_PATCH,
    CLUSTER_SCOPED,
    JSON_PATCH,
    MERGE_PATCH,
    OBJECT_KINDS,
    STRATEGIC_MERGE_PATCH,
    ApiError,
    decode_review,
    merge_patch,
    patch_type,
    patched,
    to_scale,
)


def cells(resource: str, obj: dict) -> list:
    return table(resource, [obj], "7")["rows"][0]["cells"]


POD = {
    "metadata": {"name": "p", "labels": {"a": "1"}},
    "spec": {"containers": [{"name": "main", "image": "x"}, {"name": "side", "image": "y"}]},
}


def test_json_patch_operations() -> None:
    new = patched(
        POD,
        [
            {"op": "add", "path": "/metadata/labels/b", "value": "2"},
            {"op": "replace", "path": "/spec/containers/1/image", "value": "z"},
            {"op": "test", "path": "/metadata/name", "value": "p"},
            {"op": "copy", "from": "/metadata/labels/a", "path": "/metadata/labels/c"},
            {"op": "move", "from": "/metadata/labels/a", "path": "/metadata/labels/d"},
            {"op": "add", "path": "/spec/containers/-", "value": {"name": "last"}},
            {"op": "remove", "path": "/spec/containers/0"},
        ],
        JSON_PATCH,
    )
    assert new["metadata"]["labels"] == {"b": "2", "c": "1", "d": "1"}
    assert [c["name"] for c in new["spec"]["containers"]] == ["side", "last"]
    assert POD["metadata"]["labels"] == {"a": "1"}  # the original is untouched
    for bad in (
        [{"op": "remove", "path": "/metadata/labels/zzz"}],
        [{"op": "test", "path": "/metadata/name", "value": "q"}],
        [{"op": "replace", "path": "/spec/containers/5/image", "value": "z"}],
    ):
        with pytest.raises(ApiError) as refused:
            patched(POD, bad, JSON_PATCH)
        assert refused.value.status["code"] == 422


def test_strategic_merge_directives_kubectl_apply_sends() -> None:
    patch = {
        "$setElementOrder/containers": [{"name": "side"}, {"name": "main"}],
        "containers": [{"name": "main", "image": "x2"}, {"name": "side", "$patch": "delete"}],
    }
    spec = merge_patch(POD["spec"], patch, strategic=True)
    assert spec == {"containers": [{"name": "main", "image": "x2"}]}
    listed = merge_patch(
        {"finalizers": ["a", "b", "c"]}, {"$deleteFromPrimitiveList/finalizers": ["b"]}, True
    )
    assert listed == {"finalizers": ["a", "c"]}
    retained = merge_patch({"x": 1, "y": 2}, {"$retainKeys": ["y", "z"], "z": 3}, True)
    assert retained == {"y": 2, "z": 3}
    replaced = merge_patch({"m": {"a": 1}}, {"m": {"$patch": "replace", "b": 2}}, True)
    assert replaced == {"m": {"b": 2}}
    ports = merge_patch(
        {"ports": [{"port": 80, "name": "http"}, {"port": 443, "name": "https"}]},
        {"ports": [{"port": 443, "name": "tls"}]},
        True,
    )
    assert ports["ports"] == [{"port": 80, "name": "http"}, {"port": 443, "name": "tls"}]
    assert merge_patch({"m": {"a": 1}, "k": 1}, {"m": {"$patch": "delete"}}, True) == {"k": 1}


def test_patch_types_and_unknown_media_type() -> None:
    assert patch_type("application/merge-patch+json; charset=utf-8") == MERGE_PATCH
    assert patch_type(APPLY_PATCH) == APPLY_PATCH
    with pytest.raises(ApiError) as refused:
        patch_type("application/json")
    assert refused.value.status["code"] == 415
    assert patched({"a": [1, 2]}, {"a": [3]}, STRATEGIC_MERGE_PATCH) == {"a": [3]}


def test_access_reviews_answer_from_rbac() -> None:
    objects = {
        ("roles", "ns", "r"): {
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["create"]}]
        },
        ("rolebindings", "ns", "b"): {
            "roleRef": {"kind": "Role", "name": "r"},
            "subjects": [{"kind": "ServiceAccount", "name": "sa"}],
        },
    }
    user = impersonated("system:serviceaccount:ns:sa", [])
    assert user == service_account_user("ns", "sa")
    create = {"resourceAttributes": {"namespace": "ns", "verb": "create", "resource": "pods"}}
    allowed = access_review(user, create, objects)
    assert allowed == {
        "allowed": True,
        "reason": 'RBAC: allowed by RoleBinding "b/ns" of Role "r" to ServiceAccount "sa/ns"',
    }
    delete = {"resourceAttributes": {"namespace": "ns", "verb": "delete", "resource": "pods"}}
    assert access_review(user, delete, objects) == {"allowed": False}
    assert access_review(None, delete, objects)["allowed"]  # the admin
    version = {"nonResourceAttributes": {"path": "/version", "verb": "get"}}
    assert access_review(User("u"), version, {})["allowed"]


def test_reviews_decode_from_kubectl_protobuf() -> None:
    def field(number: int, payload: bytes) -> bytes:
        return bytes([number << 3 | 2, len(payload)]) + payload

    attributes = field(1, b"ns") + field(2, b"create") + field(5, b"pods")
    review = field(2, field(1, attributes))
    type_meta = field(1, b"authorization.k8s.io/v1") + field(2, b"SelfSubjectAccessReview")
    raw = b"k8s\x00" + field(1, type_meta) + field(2, review)
    decoded = decode_review(raw, "application/vnd.kubernetes.protobuf")
    assert decoded["kind"] == "SelfSubjectAccessReview"
    assert decoded["spec"]["resourceAttributes"] == {
        "namespace": "ns",
        "verb": "create",
        "resource": "pods",
    }


def test_openapi_v3_names_every_kind_with_its_patch_parameters() -> None:
    root = discovery("/openapi/v3", OBJECT_KINDS, CLUSTER_SCOPED)
    assert root is not None
    url = root["paths"]["apis/apps/v1"]["serverRelativeURL"]
    document = discovery(url.partition("?")[0], OBJECT_KINDS, CLUSTER_SCOPED)
    assert document is not None
    item = document["paths"]["/apis/apps/v1/namespaces/{namespace}/replicasets/{name}"]
    assert item["patch"]["x-kubernetes-group-version-kind"] == {
        "group": "apps",
        "version": "v1",
        "kind": "ReplicaSet",
    }
    assert "fieldValidation" in {p["name"] for p in item["patch"]["parameters"]}
    assert (
        discovery("/openapi/v3/apis/kueue.x-k8s.io/v1beta2", OBJECT_KINDS, CLUSTER_SCOPED) is None
    )


def test_scale_and_printers_of_the_new_kinds() -> None:
    rs = {
        "metadata": {"name": "s", "namespace": "d", "resourceVersion": "7"},
        "spec": {"replicas": 3, "selector": {"matchLabels": {"app": "s"}}},
        "status": {"replicas": 2, "readyReplicas": 1},
    }
    assert to_scale(rs)["spec"] == {"replicas": 3}
    assert to_scale(rs)["status"] == {"replicas": 2, "selector": "app=s"}
    assert cells("replicasets", rs)[1:4] == [3, 2, 1]
    svc = {"metadata": {"name": "e"}, "spec": {"clusterIP": "None", "ports": [{"port": 2379}]}}
    assert cells("services", svc)[1:5] == ["ClusterIP", "None", "<none>", "2379/TCP"]
    policy = {
        "metadata": {"name": "n"},
        "spec": {"podSelector": {"matchLabels": {"b": "2", "a": "1"}}},
    }
    assert cells("networkpolicies", policy)[1] == "a=1,b=2"
