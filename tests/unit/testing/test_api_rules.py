"""The fake API server's pure policy decisions: RBAC (rules, subjects, bindings, the Forbidden
message) and PodDisruptionBudgets (status from pods, the eviction decision)."""

from __future__ import annotations

from typing import Any

import pytest

from kfp_elastic.testing.api_rules import (
    TOO_MANY,
    User,
    authorized,
    budget_status,
    eviction_decision,
    forbidden_message,
    rule_allows,
    scaled,
    selector_requirements,
    service_account_user,
)
from kfp_elastic.testing.api_wire import ApiCall, labels_match

MASTER = service_account_user("team", "kfp-elastic-master")
PODS_RULE = {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "list", "watch"]}


@pytest.mark.parametrize(
    ("rule", "call", "allowed"),
    [
        (PODS_RULE, ApiCall("create", "", "pods", namespace="team"), True),
        (PODS_RULE, ApiCall("delete", "", "pods", namespace="team", name="w"), False),
        (PODS_RULE, ApiCall("list", "apps", "pods", namespace="team"), False),  # other group
        (PODS_RULE, ApiCall("create", "", "pods", "eviction", "team", "w"), False),  # subresource
        (
            {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]},
            ApiCall("create", "", "pods", "eviction", "team", "w"),
            True,
        ),
        (
            {"apiGroups": [""], "resources": ["*/log"], "verbs": ["get"]},
            ApiCall("get", "", "pods", "log", "team", "w"),
            True,
        ),
        (
            {"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]},
            ApiCall("deletecollection", "policy", "poddisruptionbudgets", namespace="team"),
            True,
        ),
        (
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "verbs": ["get"],
                "resourceNames": ["a"],
            },
            ApiCall("get", "", "configmaps", namespace="team", name="a"),
            True,
        ),
        (
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "verbs": ["get"],
                "resourceNames": ["a"],
            },
            ApiCall("get", "", "configmaps", namespace="team", name="b"),
            False,
        ),
    ],
)
def test_rule_allows(rule: dict[str, Any], call: ApiCall, allowed: bool) -> None:
    assert rule_allows(rule, call) is allowed


def objects(*objs: tuple[str, str, dict[str, Any]]) -> dict[tuple[str, str, str], Any]:
    return {(resource, ns, obj["metadata"]["name"]): obj for resource, ns, obj in objs}


def binding(name: str, role_kind: str, role: str, *subjects: dict[str, str]) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": role},
        "subjects": list(subjects),
    }


ROLE = {"metadata": {"name": "master"}, "rules": [PODS_RULE]}
SA = {"kind": "ServiceAccount", "name": "kfp-elastic-master"}  # namespace left out


def test_role_binding_grants_its_role_in_its_namespace_only() -> None:
    store = objects(
        ("roles", "team", ROLE), ("rolebindings", "team", binding("b", "Role", "master", SA))
    )
    create = ApiCall("create", "", "pods", namespace="team")
    assert authorized(MASTER, create, store)
    assert not authorized(MASTER, ApiCall("create", "", "pods", namespace="other"), store)
    assert not authorized(MASTER, ApiCall("delete", "", "pods", namespace="team", name="w"), store)
    # another account, the same account of another namespace: nothing
    assert not authorized(service_account_user("team", "default"), create, store)
    assert not authorized(service_account_user("other", "kfp-elastic-master"), create, store)
    # a binding whose Role is missing grants nothing
    assert not authorized(MASTER, create, {k: v for k, v in store.items() if k[0] != "roles"})


def test_cluster_roles_through_both_binding_kinds_and_group_subjects() -> None:
    cluster_role = {"metadata": {"name": "reader"}, "rules": [{**PODS_RULE, "verbs": ["get"]}]}
    get = ApiCall("get", "", "pods", namespace="team", name="w")
    via_role_binding = objects(
        ("clusterroles", "", cluster_role),
        ("rolebindings", "team", binding("b", "ClusterRole", "reader", SA)),
    )
    assert authorized(MASTER, get, via_role_binding)
    assert not authorized(
        MASTER, ApiCall("get", "", "pods", namespace="x", name="w"), via_role_binding
    )
    everywhere = objects(
        ("clusterroles", "", cluster_role),
        (
            "clusterrolebindings",
            "",
            binding(
                "b", "ClusterRole", "reader", {"kind": "Group", "name": "system:serviceaccounts"}
            ),
        ),
    )
    assert authorized(MASTER, ApiCall("get", "", "pods", namespace="x", name="w"), everywhere)
    assert not authorized(User("alice"), get, everywhere)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            ApiCall("list", "", "pods", namespace="team"),
            'pods is forbidden: User "system:serviceaccount:team:kfp-elastic-master" cannot list '
            'resource "pods" in API group "" in the namespace "team"',
        ),
        (
            ApiCall("create", "", "pods", "eviction", "team", "w"),
            'pods "w" is forbidden: User "system:serviceaccount:team:kfp-elastic-master" cannot '
            'create resource "pods/eviction" in API group "" in the namespace "team"',
        ),
        (
            ApiCall("list", "", "nodes"),
            'nodes is forbidden: User "system:serviceaccount:team:kfp-elastic-master" cannot list '
            'resource "nodes" in API group "" at the cluster scope',
        ),
    ],
)
def test_forbidden_message_is_the_api_servers(call: ApiCall, message: str) -> None:
    assert forbidden_message(MASTER, call) == message


# -- PodDisruptionBudgets --------------------------------------------------------------------

LABELS = {"app.kubernetes.io/name": "etcd", "app.kubernetes.io/instance": "kfp-elastic-etcd"}


def member(name: str, phase: str = "Running", ready: bool = True, deleting: bool = False) -> Any:
    meta: dict[str, Any] = {"name": name, "namespace": "team", "labels": LABELS}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    condition = {"type": "Ready", "status": "True" if ready else "False"}
    return {"metadata": meta, "status": {"phase": phase, "conditions": [condition]}}


def pdb(**spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "kfp-elastic-etcd", "namespace": "team"},
        "spec": {"selector": {"matchLabels": LABELS}, **spec},
    }


def test_selector_objects_match_labels_and_expressions() -> None:
    selector = {
        "matchLabels": {"app": "etcd"},
        "matchExpressions": [
            {"key": "tier", "operator": "In", "values": ["a", "b"]},
            {"key": "canary", "operator": "DoesNotExist"},
            {"key": "zone", "operator": "Exists"},
            {"key": "role", "operator": "NotIn", "values": ["spare"]},
        ],
    }
    req = selector_requirements(selector)
    assert labels_match(req, {"app": "etcd", "tier": "a", "zone": "z"})
    assert not labels_match(req, {"app": "etcd", "tier": "c", "zone": "z"})
    assert not labels_match(req, {"app": "etcd", "tier": "a", "zone": "z", "canary": "1"})
    assert not labels_match(req, {"app": "etcd", "tier": "a"})
    assert not labels_match(req, {"app": "etcd", "tier": "a", "zone": "z", "role": "spare"})
    with pytest.raises(ValueError, match="operator"):
        selector_requirements({"matchExpressions": [{"key": "a", "operator": "Gt"}]})


def test_scaled_int_or_percent_rounds_up() -> None:
    assert (scaled(1, 3), scaled("34%", 3), scaled("50%", 3), scaled("100%", 3)) == (1, 2, 2, 3)
    with pytest.raises(ValueError):
        scaled("1.5", 3)


@pytest.mark.parametrize(
    ("spec", "pods", "expected", "status"),
    [
        # the manifests' etcd budget, three healthy members of a 3-replica StatefulSet
        ({"maxUnavailable": 1}, ["up", "up", "up"], 3, (3, 2, 1)),
        # one member terminating, or gone and not yet back: no further disruption
        ({"maxUnavailable": 1}, ["up", "up", "deleting"], 3, (2, 2, 0)),
        ({"maxUnavailable": 1}, ["up", "up"], 3, (2, 2, 0)),
        ({"maxUnavailable": 1}, ["up", "up", "unready"], 3, (2, 2, 0)),
        ({"maxUnavailable": "34%"}, ["up", "up", "up"], 3, (3, 1, 2)),
        ({"minAvailable": 2}, ["up", "up", "up"], None, (3, 2, 1)),
        ({"minAvailable": "50%"}, ["up", "up", "up", "up"], 4, (4, 2, 2)),
        # no controller to say how many there should be: nothing may be disrupted
        ({"maxUnavailable": 1}, ["up", "up", "up"], None, (3, 0, 0)),
    ],
)
def test_budget_status(
    spec: dict[str, Any], pods: list[str], expected: int | None, status: tuple[int, int, int]
) -> None:
    shapes = {
        "up": {},
        "deleting": {"deleting": True},
        "unready": {"ready": False},
    }
    members = [member(f"m-{i}", **shapes[p]) for i, p in enumerate(pods)]
    stranger = {**member("other"), "metadata": {"name": "other", "namespace": "team", "labels": {}}}
    got = budget_status(pdb(**spec), [*members, stranger], expected)
    assert (got["currentHealthy"], got["desiredHealthy"], got["disruptionsAllowed"]) == status


def allowed(n: int, current: int = 3, desired: int = 2) -> dict[str, int]:
    return {"disruptionsAllowed": n, "currentHealthy": current, "desiredHealthy": desired}


def test_eviction_decision() -> None:
    assert eviction_decision(member("a"), [("b", allowed(1))]).delete
    refused = eviction_decision(member("a"), [("etcd", allowed(0, 2, 2))])
    assert (refused.delete, refused.code, refused.reason, refused.message) == (
        False,
        429,
        "TooManyRequests",
        TOO_MANY,
    )
    assert refused.cause == "The disruption budget etcd needs 2 healthy pods and has 2 currently"
    assert eviction_decision(member("a"), []).delete  # no budget
    # not running or already going: budgets do not apply
    assert eviction_decision(member("a", phase="Pending"), [("b", allowed(0))]).delete
    assert eviction_decision(member("a", deleting=True), [("b", allowed(0))]).delete
    # an unready pod may go while the budget holds, not when it is already short
    assert eviction_decision(member("a", ready=False), [("b", allowed(0, 2, 2))]).delete
    assert not eviction_decision(member("a", ready=False), [("b", allowed(0, 1, 2))]).delete
    two = eviction_decision(member("a"), [("b", allowed(1)), ("c", allowed(1))])
    assert (two.delete, two.code) == (False, 500)
