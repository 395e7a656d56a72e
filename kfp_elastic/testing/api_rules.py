"""The fake API server's policy decisions, pure: RBAC authorization (Roles, ClusterRoles and
their bindings against one request) and PodDisruptionBudgets (a budget's status from the pods it
selects, and whether the eviction API may evict a pod).

Both follow the Kubernetes code they stand for: ``plugin/pkg/auth/authorizer/rbac`` (rule and
subject matching, the Forbidden message) and ``pkg/controller/disruption`` with
``pkg/registry/core/pod/storage/eviction.go`` (healthy pods, scaled int-or-percent values, the
429 message).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kfp_elastic.testing.api_wire import ApiCall, labels_match

Obj = Mapping[str, Any]

# -- RBAC ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class User:
    """Who sent a request, as the authenticator hands it to RBAC."""

    name: str
    groups: tuple[str, ...] = ()


def service_account_user(namespace: str, name: str) -> User:
    """The user a service-account token authenticates as (with its implicit groups)."""
    return User(
        f"system:serviceaccount:{namespace}:{name}",
        ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"),
    )


def rule_allows(rule: Obj, call: ApiCall) -> bool:
    """Whether one PolicyRule grants ``call``: its apiGroups, resources (``pods/log`` for a
    subresource, ``*/log`` for that subresource of anything, ``*``), verbs and resourceNames
    (empty: every name) all match."""
    groups, verbs = rule.get("apiGroups") or [], rule.get("verbs") or []
    resources, names = rule.get("resources") or [], rule.get("resourceNames") or []
    wanted = f"{call.resource}/{call.subresource}" if call.subresource else call.resource
    resource_ok = (
        "*" in resources
        or wanted in resources
        or (call.subresource != "" and f"*/{call.subresource}" in resources)
    )
    return (
        ("*" in groups or call.group in groups)
        and resource_ok
        and ("*" in verbs or call.verb in verbs)
        and (not names or call.name in names)
    )


def subject_matches(subject: Obj, user: User, binding_namespace: str) -> bool:
    """Whether a binding's subject is ``user``: a ServiceAccount (in a RoleBinding its
    namespace may be left out and is then the binding's), a User or a Group."""
    kind, name = subject.get("kind"), subject.get("name", "")
    if kind == "ServiceAccount":
        namespace = subject.get("namespace") or binding_namespace
        return user.name == f"system:serviceaccount:{namespace}:{name}"
    if kind == "User":
        return user.name == name
    if kind == "Group":
        return name in user.groups
    return False


# What the bootstrap ClusterRole system:basic-user (bound to every authenticated user) grants:
# asking what one may do.
BASIC_USER_RULE = {
    "apiGroups": ["authorization.k8s.io"],
    "resources": ["selfsubjectaccessreviews", "selfsubjectrulesreviews"],
    "verbs": ["create"],
}
# The harness (no token, or an admin token) is the cluster's admin, as kube-apiserver's
# bootstrap binding makes system:masters one.
ADMIN_REASON = (
    'RBAC: allowed by ClusterRoleBinding "cluster-admin" of ClusterRole "cluster-admin" '
    'to Group "system:masters"'
)


def _subject_text(subject: Obj, binding_namespace: str) -> str:
    name = subject.get("name", "")
    if subject.get("kind") == "ServiceAccount":
        name = f"{name}/{subject.get('namespace') or binding_namespace}"
    return f'{subject.get("kind")} "{name}"'


def granted_by(
    user: User, call: ApiCall, objects: Mapping[tuple[str, str, str], Obj]
) -> str | None:
    """RBAC's decision for ``call`` by ``user``, from the stored objects (``(resource,
    namespace or "", name) -> object``): the reason it is allowed, as kube-apiserver's RBAC
    authorizer words it (``RBAC: allowed by RoleBinding "b/ns" of Role "r" to ServiceAccount
    "sa/ns"``), or None. A ClusterRoleBinding grants its ClusterRole's rules everywhere; a
    RoleBinding grants its Role's (or ClusterRole's) rules in its namespace only. A binding
    whose role does not exist grants nothing. Every authenticated user may create
    SelfSubjectAccessReviews (``BASIC_USER_RULE``)."""
    if rule_allows(BASIC_USER_RULE, call):
        return (
            'RBAC: allowed by ClusterRoleBinding "system:basic-user" of ClusterRole '
            '"system:basic-user" to Group "system:authenticated"'
        )
    for (resource, ns, name), binding in sorted(objects.items()):
        if resource == "clusterrolebindings":
            pass
        elif resource != "rolebindings" or ns != call.namespace or not call.namespace:
            continue
        subject = next(
            (s for s in binding.get("subjects") or [] if subject_matches(s, user, ns)), None
        )
        if subject is None:
            continue
        ref = binding.get("roleRef") or {}
        key = ("roles", ns, ref.get("name", ""))
        if ref.get("kind") == "ClusterRole":
            key = ("clusterroles", "", ref.get("name", ""))
        elif resource == "clusterrolebindings":
            continue  # a ClusterRoleBinding can only refer to a ClusterRole
        role = objects.get(key)
        if role is not None and any(rule_allows(r, call) for r in role.get("rules") or []):
            binding_kind = "ClusterRoleBinding" if ns == "" else "RoleBinding"
            binding_name = name if ns == "" else f"{name}/{ns}"
            return (
                f'RBAC: allowed by {binding_kind} "{binding_name}" of {ref.get("kind")} '
                f'"{ref.get("name")}" to {_subject_text(subject, ns)}'
            )
    return None


def authorized(user: User, call: ApiCall, objects: Mapping[tuple[str, str, str], Obj]) -> bool:
    """Whether RBAC allows ``call`` by ``user`` (:func:`granted_by`)."""
    return granted_by(user, call, objects) is not None


def impersonated(name: str, groups: Sequence[str]) -> User:
    """Who a request acts as with ``Impersonate-User: name`` (and ``Impersonate-Group``s): a
    service account's name (``system:serviceaccount:<ns>:<name>``) gets that account's groups
    unless groups are given, as kube-apiserver's impersonation filter does; every user is in
    ``system:authenticated``."""
    parts = name.split(":")
    if len(parts) == 4 and parts[:2] == ["system", "serviceaccount"] and not groups:
        return service_account_user(parts[2], parts[3])
    return User(name, tuple(dict.fromkeys([*groups, "system:authenticated"])))


def impersonation_calls(name: str, groups: Sequence[str]) -> list[ApiCall]:
    """What RBAC must allow the impersonator: ``impersonate`` of the service account (in its
    namespace) or the user, and of each group."""
    parts = name.split(":")
    if len(parts) == 4 and parts[:2] == ["system", "serviceaccount"]:
        calls = [ApiCall("impersonate", "", "serviceaccounts", namespace=parts[2], name=parts[3])]
    else:
        calls = [ApiCall("impersonate", "", "users", name=name)]
    return calls + [ApiCall("impersonate", "", "groups", name=group) for group in groups]


# The non-resource URLs every authenticated user may GET (system:discovery, system:basic-user).
DISCOVERY_PATHS = (
    "/api",
    "/api/*",
    "/apis",
    "/apis/*",
    "/healthz",
    "/livez",
    "/openapi",
    "/openapi/*",
    "/readyz",
    "/version",
    "/version/",
)


def access_review(
    user: User | None, spec: Obj, objects: Mapping[tuple[str, str, str], Obj]
) -> dict[str, Any]:
    """A (Self)SubjectAccessReview's ``status`` for ``user`` (None: the admin): RBAC's answer
    for ``spec.resourceAttributes`` (namespace, verb, group, resource, subresource, name) or
    ``spec.nonResourceAttributes`` (path, verb: the discovery paths only). Denied carries no
    reason, as RBAC gives none."""
    attrs = spec.get("resourceAttributes")
    if user is None:
        return {"allowed": True, "reason": ADMIN_REASON}
    if attrs is None:
        other = spec.get("nonResourceAttributes") or {}
        path, verb = other.get("path", ""), other.get("verb", "")
        allowed = verb == "get" and any(
            path == p or (p.endswith("*") and path.startswith(p[:-1])) for p in DISCOVERY_PATHS
        )
        return {"allowed": allowed}
    call = ApiCall(
        attrs.get("verb", ""),
        attrs.get("group", ""),
        attrs.get("resource", ""),
        attrs.get("subresource", ""),
        attrs.get("namespace", ""),
        attrs.get("name", ""),
    )
    reason = granted_by(user, call, objects)
    return {"allowed": True, "reason": reason} if reason else {"allowed": False}


def forbidden_message(user: User, call: ApiCall) -> str:
    """The message of RBAC's 403, word for word as the API server writes it."""
    what = call.resource + (f' "{call.name}"' if call.name else "")
    resource = f"{call.resource}/{call.subresource}" if call.subresource else call.resource
    scope = f'in the namespace "{call.namespace}"' if call.namespace else "at the cluster scope"
    return (
        f'{what} is forbidden: User "{user.name}" cannot {call.verb} resource "{resource}" '
        f'in API group "{call.group}" {scope}'
    )


# -- PodDisruptionBudgets --------------------------------------------------------------------


def selector_requirements(selector: Obj) -> list[tuple[str, str, set[str]]]:
    """A LabelSelector object (matchLabels, matchExpressions) as the requirements
    :func:`~kfp_elastic.testing.api_wire.labels_match` evaluates."""
    ops = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!"}
    out = [(k, "=", {v}) for k, v in (selector.get("matchLabels") or {}).items()]
    for expr in selector.get("matchExpressions") or []:
        if expr.get("operator") not in ops:
            raise ValueError(f"unknown selector operator {expr.get('operator')!r}")
        out.append((expr["key"], ops[expr["operator"]], set(expr.get("values") or [""])))
    return out


def selects(pdb: Obj, pod: Obj) -> bool:
    """Whether the budget covers the pod (same namespace; an empty selector selects all)."""
    if pdb["metadata"].get("namespace") != pod["metadata"].get("namespace"):
        return False
    selector = pdb.get("spec", {}).get("selector") or {}
    return labels_match(selector_requirements(selector), pod["metadata"].get("labels") or {})


def healthy(pod: Obj) -> bool:
    """What the disruption controller counts: Running, Ready, and not being deleted."""
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in pod.get("status", {}).get("conditions") or []
    )
    return (
        pod.get("status", {}).get("phase") == "Running"
        and ready
        and not pod["metadata"].get("deletionTimestamp")
    )


def scaled(value: int | str, total: int) -> int:
    """An int-or-percent field against ``total`` pods; percentages round up (for minAvailable
    and maxUnavailable alike, as the controller does)."""
    if isinstance(value, int):
        return value
    if not value.endswith("%") or not value[:-1].isdigit():
        raise ValueError(f"invalid int-or-percent value {value!r}")
    return math.ceil(int(value[:-1]) * total / 100)


def budget_status(pdb: Obj, pods: Iterable[Obj], expected: int | None) -> dict[str, Any]:
    """A budget's ``status`` from every pod of the cluster. ``expected``: the summed replicas of
    the controllers (StatefulSets) owning the selected pods, None if one has none. An integer
    minAvailable counts the selected pods instead; maxUnavailable and a percent minAvailable
    need ``expected``, and without it nothing may be disrupted (the controller will not guess
    how many pods there should be)."""
    spec = pdb.get("spec") or {}
    selected = [p for p in pods if selects(pdb, p)]
    current = sum(1 for p in selected if healthy(p))
    min_available, max_unavailable = spec.get("minAvailable"), spec.get("maxUnavailable")
    total: int | None = expected
    if isinstance(min_available, int):
        total, desired = len(selected), min_available
    elif min_available is None and max_unavailable is None:
        total, desired = len(selected), 0
    elif expected is None:
        desired = 0
    elif max_unavailable is not None:
        desired = max(0, expected - scaled(max_unavailable, expected))
    else:
        desired = scaled(min_available, expected)
    return {
        "currentHealthy": current,
        "desiredHealthy": desired,
        "disruptionsAllowed": 0 if total is None else max(0, current - desired),
        "expectedPods": total or 0,
        "observedGeneration": pdb["metadata"].get("generation", 1),
    }


@dataclass(frozen=True)
class EvictionDecision:
    """What the eviction API does with one pod: ``delete`` it (after marking it with the
    DisruptionTarget condition unless it already terminates), or refuse with ``code``."""

    delete: bool
    code: int = 201
    reason: str = ""
    message: str = ""
    cause: str = ""  # the Status' details.causes[0].message (which budget, how many healthy)


TOO_MANY = "Cannot evict pod as it would violate the pod's disruption budget."


def eviction_decision(pod: Obj, budgets: Sequence[tuple[str, Obj]]) -> EvictionDecision:
    """``budgets``: (name, status) of every budget selecting the pod. A pod that is not running
    (Pending, Succeeded, Failed) or already terminating ignores budgets; more than one budget is
    an error (the eviction API refuses to choose); an unhealthy pod may go while the budget
    holds (unhealthyPodEvictionPolicy IfHealthyBudget); otherwise it needs a disruption the
    budget allows."""
    phase = pod.get("status", {}).get("phase")
    if pod["metadata"].get("deletionTimestamp") or phase in ("Pending", "Succeeded", "Failed"):
        return EvictionDecision(True)
    if not budgets:
        return EvictionDecision(True)
    if len(budgets) > 1:
        return EvictionDecision(
            False,
            500,
            "InternalError",
            "This pod has more than one PodDisruptionBudget, which the eviction subresource "
            "does not support.",
        )
    name, status = budgets[0]
    if not healthy(pod) and status["currentHealthy"] >= status["desiredHealthy"]:
        return EvictionDecision(True)
    if status["disruptionsAllowed"] <= 0:
        return EvictionDecision(
            False,
            429,
            "TooManyRequests",
            TOO_MANY,
            f"The disruption budget {name} needs {status['desiredHealthy']} healthy pods and "
            f"has {status['currentHealthy']} currently",
        )
    return EvictionDecision(True)
