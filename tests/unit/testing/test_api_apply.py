"""Field ownership (managedFields) and server-side apply as kube-apiserver does them, pure: who
owns what after each write, conflicts, removal of what an applier leaves out, lists by key."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kfp_elastic.testing.api_apply import (
    LAST_APPLIED,
    compare,
    decode_fields,
    encode_fields,
    field_set,
    merge,
    path_string,
    server_side_apply,
    update_managed_fields,
)
from kfp_elastic.testing.api_wire import ApiError, dry_run, force_apply, user_agent_manager


def config_map(data: dict[str, str], **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "c", **meta},
        "data": data,
    }


def replica_set(containers: list[dict[str, Any]], replicas: int | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": {"matchLabels": {"app": "a"}},
        "template": {"metadata": {"labels": {"app": "a"}}, "spec": {"containers": containers}},
    }
    if replicas is not None:
        spec["replicas"] = replicas
    return {"apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": {"name": "r"}, "spec": spec}


def managers(obj: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(m["manager"], m["operation"]): m for m in obj["metadata"].get("managedFields") or []}


def owned(obj: dict[str, Any], manager: str, operation: str = "Apply") -> set[str]:
    entry = managers(obj)[(manager, operation)]
    return {path_string(p) for p in decode_fields(entry["fieldsV1"])}


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return obj["spec"]["template"]["spec"]["containers"]


def conflict(live: dict[str, Any], applied: dict[str, Any], manager: str) -> dict[str, Any]:
    with pytest.raises(ApiError) as refused:
        server_side_apply(live, applied, manager, "t9")
    return refused.value.status


def test_field_sets_in_fields_v1() -> None:
    pod_spec = {
        "containers": [
            {
                "name": "main",
                "image": "x",
                "args": ["a", "b"],  # atomic: one field
                "ports": [{"containerPort": 80}],  # keyed by port and protocol (default TCP)
                "resources": {},
            }
        ],
        "nodeSelector": {"zone": "a"},  # an atomic map
    }
    obj = {"metadata": {"finalizers": ["x"], "labels": {"a": "1"}}, "spec": pod_spec}
    fields = encode_fields(field_set(obj))
    container = fields["f:spec"]["f:containers"]['k:{"name":"main"}']
    assert container == {
        ".": {},
        "f:args": {},
        "f:image": {},
        "f:name": {},
        "f:ports": {'k:{"containerPort":80,"protocol":"TCP"}': {".": {}, "f:containerPort": {}}},
        "f:resources": {},
    }
    assert fields["f:spec"]["f:nodeSelector"] == {}
    assert fields["f:metadata"] == {"f:finalizers": {'v:"x"': {}}, "f:labels": {"f:a": {}}}
    assert decode_fields(fields) == field_set(obj)
    paths = {path_string(p) for p in field_set(obj)}
    assert '.spec.containers[name="main"].ports[containerPort=80,protocol="TCP"]' in paths
    assert '.metadata.finalizers[="x"]' in paths
    # a Service's ports: by port and protocol
    service_ports = field_set({"ports": [{"port": 2379, "protocol": "UDP"}]})
    assert [path_string(p) for p in service_ports if len(p) == 2] == [
        '.ports[port=2379,protocol="UDP"]'
    ]


def test_compare_records_new_subtrees_changed_leaves_and_gone_items() -> None:
    old = {"spec": {"containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "1"}]}}
    new = {
        "spec": {"containers": [{"name": "a", "image": "2"}], "tolerations": [{"key": "k"}]},
        "data": {"x": "1"},
    }
    changes = compare(old, new)
    assert {path_string(p) for p in changes.modified} == {'.spec.containers[name="a"].image'}
    assert {path_string(p) for p in changes.added} == {".spec.tolerations", ".data", ".data.x"}
    assert {path_string(p) for p in changes.removed} == {
        '.spec.containers[name="b"]',
        '.spec.containers[name="b"].name',
        '.spec.containers[name="b"].image',
    }


def test_merge_keeps_live_items_and_replaces_atomic_lists() -> None:
    live = {"containers": [{"name": "a", "args": ["1"]}, {"name": "b"}, {"name": "c"}]}
    merged = merge(live, {"containers": [{"name": "c", "image": "x"}, {"name": "a", "args": []}]})
    # the applied items in their order, a live-only one after the item it followed
    assert [c["name"] for c in merged["containers"]] == ["c", "a", "b"]
    assert merged["containers"][1] == {"name": "a", "args": []}
    assert merged["containers"][0] == {"name": "c", "image": "x"}
    grown = merge({"env": [{"name": "A"}, {"name": "B"}]}, {"env": [{"name": "A"}, {"name": "C"}]})
    assert [e["name"] for e in grown["env"]] == ["A", "B", "C"]


def test_creators_and_updaters_own_what_they_wrote() -> None:
    created = update_managed_fields(
        None, config_map({"a": "1"}, labels={"x": "y"}), "kubectl-create", "v1", "t0"
    )
    [entry] = created["metadata"]["managedFields"]
    assert entry == {
        "manager": "kubectl-create",
        "operation": "Update",
        "apiVersion": "v1",
        "time": "t0",
        "fieldsType": "FieldsV1",
        # maps the write added are members ("."); name, namespace, ... are never owned
        "fieldsV1": {
            "f:data": {".": {}, "f:a": {}},
            "f:metadata": {"f:labels": {".": {}, "f:x": {}}},
        },
    }
    patched = {**created, "data": {"a": "2", "b": "3"}}
    patched["metadata"] = {**created["metadata"], "labels": {}}
    after = update_managed_fields(created, patched, "kubectl-patch", "v1", "t1")
    # the patcher took .data.a and added .data.b; the removed label left the creator's set
    assert owned(after, "kubectl-create", "Update") == {".data", ".metadata.labels"}
    assert owned(after, "kubectl-patch", "Update") == {".data.a", ".data.b"}
    # an update that changes nothing records nothing (no new entry, no new time)
    same = update_managed_fields(after, after, "someone", "v1", "t2")
    assert same["metadata"]["managedFields"] == after["metadata"]["managedFields"]
    # a pod's creator does not own the skeleton every pod has, nor its status
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "m", "image": "i"}]},
        "status": {"phase": "Pending"},
    }
    [pod_entry] = update_managed_fields(None, pod, "OpenAPI-Generator", "v1", "t0")["metadata"][
        "managedFields"
    ]
    assert pod_entry["fieldsV1"] == {
        "f:spec": {"f:containers": {'k:{"name":"m"}': {".": {}, "f:image": {}, "f:name": {}}}}
    }


def test_written_managed_fields_are_taken_or_reset() -> None:
    created = update_managed_fields(None, config_map({"a": "1"}), "creator", "v1", "t0")
    # what kubectl writes when it moves client-side apply's fields to its server-side manager
    moved = json.loads(json.dumps(created))
    moved["metadata"]["managedFields"][0].update(manager="kubectl", operation="Apply")
    after = update_managed_fields(created, moved, "kubectl", "v1", "t1")
    assert [(m["manager"], m["operation"]) for m in after["metadata"]["managedFields"]] == [
        ("kubectl", "Apply")
    ]
    reset = {**created, "metadata": {**created["metadata"], "managedFields": [{}]}}
    assert "managedFields" not in update_managed_fields(created, reset, "x", "v1", "t1")["metadata"]
    # a status write owns status fields only, through the subresource; it cannot set
    # managedFields
    status = {**created, "status": {"phase": "Running"}}
    status["metadata"] = {**created["metadata"], "managedFields": [{}]}
    by_kubelet = update_managed_fields(created, status, "kubelet", "v1", "t2", "status")
    kubelet = managers(by_kubelet)[("kubelet", "Update")]
    assert kubelet["subresource"] == "status"
    assert kubelet["fieldsV1"] == {"f:status": {"f:phase": {}}}
    assert ("creator", "Update") in managers(by_kubelet)


def test_apply_conflicts_with_another_managers_value_unless_forced() -> None:
    created = update_managed_fields(
        None, config_map({"a": "1"}), "kubectl-client-side-apply", "v1", "t0"
    )
    status = conflict(created, config_map({"a": "2", "b": "x"}), "team")
    assert status["code"] == 409 and status["reason"] == "Conflict"
    assert status["message"] == (
        'Apply failed with 1 conflict: conflict with "kubectl-client-side-apply" using v1: .data.a'
    )
    assert status["details"] == {
        "causes": [
            {
                "reason": "FieldManagerConflict",
                "message": 'conflict with "kubectl-client-side-apply" using v1',
                "field": ".data.a",
            }
        ]
    }
    # the same value: shared ownership, no conflict
    shared = server_side_apply(created, config_map({"a": "1", "b": "x"}), "team", "t1")
    assert owned(shared, "team") == {".data.a", ".data.b"}
    assert owned(shared, "kubectl-client-side-apply", "Update") == {".data", ".data.a"}
    # forced: the field leaves the other manager's set
    forced = server_side_apply(shared, config_map({"a": "2"}), "team", "t2", force=True)
    assert forced["data"] == {"a": "2"}  # .data.b: team's alone, left out now: removed
    assert owned(forced, "kubectl-client-side-apply", "Update") == {".data"}
    assert owned(forced, "team") == {".data.a"}
    # several conflicts, several owners: grouped by manager, applier entries without apiVersion
    other = server_side_apply(forced, config_map({"a": "2", "z": "1"}), "other", "t3")
    status = conflict(other, config_map({"a": "3", "z": "2"}), "third")
    assert status["message"] == (
        'Apply failed with 3 conflicts: conflicts with "other":\n- .data.a\n- .data.z\n'
        'conflicts with "team":\n- .data.a'
    )
    assert [c["field"] for c in status["details"]["causes"]] == [".data.a", ".data.z", ".data.a"]


def test_apply_removes_what_the_manager_applied_before_unless_another_owns_it() -> None:
    first = server_side_apply(
        None, config_map({"a": "1", "b": "2", "c": "3"}, labels={"l": "1"}), "alice", "t0"
    )
    co_owned = server_side_apply(first, config_map({"c": "3"}), "bob", "t1")
    second = server_side_apply(co_owned, config_map({"a": "1"}), "alice", "t2")
    assert second["data"] == {"a": "1", "c": "3"}  # b removed; c stays (bob's)
    assert "labels" not in second["metadata"]  # the label and its map, no one's now
    assert owned(second, "alice") == {".data.a"}
    assert owned(second, "bob") == {".data.c"}
    # bob's apply changed nothing in the object: his entry has no time (ordered first)
    assert [m.get("time") for m in second["metadata"]["managedFields"]] == [None, "t2"]
    # applying what is there changes nothing: the applier's time stays
    again = server_side_apply(second, config_map({"a": "1"}), "alice", "t3")
    assert again["metadata"]["managedFields"] == second["metadata"]["managedFields"]


def test_apply_merges_lists_by_key_and_atomic_lists_whole() -> None:
    main = {
        "name": "main",
        "image": "x",
        "args": ["1"],
        "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
    }
    first = server_side_apply(
        None, replica_set([main, {"name": "side", "image": "y"}], 2), "alice", "t0"
    )
    # bob shares the main container (same image) and adds an env var to it
    bob = {"name": "main", "image": "x", "env": [{"name": "C", "value": "3"}]}
    shared = server_side_apply(first, replica_set([bob]), "bob", "t1")
    assert [e["name"] for e in containers(shared)[0]["env"]] == ["A", "B", "C"]
    # alice leaves out the side container and env B, and changes her atomic args
    main2 = {"name": "main", "image": "x", "args": ["2"], "env": [{"name": "A", "value": "1"}]}
    second = server_side_apply(shared, replica_set([main2], 2), "alice", "t2")
    assert [(c["name"], c["args"]) for c in containers(second)] == [("main", ["2"])]
    assert [e["name"] for e in containers(second)[0]["env"]] == ["A", "C"]
    status = conflict(second, replica_set([{"name": "main", "image": "z", "args": ["3"]}]), "bob")
    assert status["message"] == (
        'Apply failed with 2 conflicts: conflicts with "alice":\n'
        '- .spec.template.spec.containers[name="main"].args\n'
        '- .spec.template.spec.containers[name="main"].image'
    )
    # the image bob shares stays when alice leaves it out
    third = server_side_apply(
        second, replica_set([{"name": "main", "args": ["2"]}], 2), "alice", "t3"
    )
    assert containers(third) == [
        {"name": "main", "image": "x", "args": ["2"], "env": [{"name": "C", "value": "3"}]}
    ]


def test_kubectl_takes_over_what_its_client_side_apply_set() -> None:
    applied = config_map({"a": "1"})
    live = update_managed_fields(
        None,
        {**applied, "metadata": {"name": "c", "annotations": {LAST_APPLIED: json.dumps(applied)}}},
        "kubectl-client-side-apply",
        "v1",
        "t0",
    )
    assert conflict(live, config_map({"a": "2"}), "team")["code"] == 409
    moved = server_side_apply(live, config_map({"a": "2"}), "kubectl", "t1")
    assert moved["data"] == {"a": "2"}
    assert owned(moved, "kubectl") == {".data.a"}
    # the annotation follows what kubectl applied, for a later client-side apply
    annotation = moved["metadata"]["annotations"][LAST_APPLIED]
    assert annotation == (
        '{"apiVersion":"v1","data":{"a":"2"},"kind":"ConfigMap","metadata":{"name":"c"}}\n'
    )
    # a field changed since the last client-side apply is still a conflict
    changed = update_managed_fields(moved, {**moved, "data": {"a": "5"}}, "editor", "v1", "t2")
    assert conflict(changed, config_map({"a": "6"}), "kubectl")["message"].endswith(
        'conflict with "editor" using v1: .data.a'
    )


def test_apply_refusals() -> None:
    with pytest.raises(ApiError) as refused:
        server_side_apply(None, config_map({}), "", "t0")
    assert refused.value.status["code"] == 422
    with_fields = config_map({}, managedFields=[])
    with pytest.raises(ApiError) as refused:
        server_side_apply(None, with_fields, "m", "t0")
    assert refused.value.status["message"] == "metadata.managedFields must be nil"


def test_write_options() -> None:
    assert dry_run(["All"], "CreateOptions") and not dry_run([], "CreateOptions")
    with pytest.raises(ApiError) as refused:
        dry_run(["All", "Foo"], "DeleteOptions")
    assert refused.value.status["code"] == 422
    assert refused.value.status["message"] == (
        'DeleteOptions.meta.k8s.io "" is invalid: dryRun: Unsupported value: '
        '[]string{"All", "Foo"}: supported values: "All"'
    )
    assert refused.value.status["details"]["causes"][0]["field"] == "dryRun"
    assert force_apply("true", True) and not force_apply(None, False)
    with pytest.raises(ApiError) as refused:
        force_apply("false", False)
    assert refused.value.status["message"] == (
        'PatchOptions.meta.k8s.io "" is invalid: force: Forbidden: may not be specified for '
        "non-apply patch"
    )
    assert user_agent_manager("kubectl/v1.37.1 (linux/amd64) kubernetes/f78e722") == "kubectl"
    assert user_agent_manager("OpenAPI-Generator/30.1.0/python") == "OpenAPI-Generator"
    assert user_agent_manager("x" * 200) == "x" * 128
