"""Server-side printing, pure: the ``meta.k8s.io/v1`` ``Table`` a real API server returns when a
client asks ``Accept: application/json;as=Table;v=v1;g=meta.k8s.io`` (what ``kubectl get``
asks), with kube-apiserver's columns for every kind the stand-in stores
(``pkg/printers/internalversion/printers.go``): pods ``NAME READY STATUS RESTARTS AGE`` (``-o
wide`` adds ``IP NODE NOMINATED NODE READINESS GATES``), nodes ``NAME STATUS ROLES AGE VERSION``
(wide: ``INTERNAL-IP EXTERNAL-IP OS-IMAGE KERNEL-VERSION CONTAINER-RUNTIME``), PriorityClasses
``NAME VALUE GLOBAL-DEFAULT AGE PREEMPTIONPOLICY``, events ``LAST SEEN TYPE REASON OBJECT
MESSAGE``, ConfigMaps, Secrets, PodDisruptionBudgets, StatefulSets, ReplicaSets, Services,
ServiceAccounts, Namespaces, NetworkPolicies and (Cluster)RoleBindings theirs; kinds without a
printer (Roles, ClusterRoles) get the API server's default ``NAME CREATED AT``. As the API
server does, every row carries the wide cells too (priority-1 columns); kubectl shows them with
``-o wide``.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

Obj = Mapping[str, Any]
# (name, type, format, priority): a column as printers.go defines it; priority 1 is -o wide only
Column = tuple[str, str, str, int]
_NAME: Column = ("Name", "string", "name", 0)
_AGE: Column = ("Age", "string", "", 0)


def wants_table(accept: str) -> bool:
    """Whether a request's Accept header asks for a Table first (kubectl get)."""
    first = accept.split(",")[0]
    return "as=Table" in first and "g=meta.k8s.io" in first


def age(timestamp: str | None, now: datetime | None = None) -> str:
    """kubectl's age of a timestamp (apimachinery's ``duration.HumanDuration``): ``42s``,
    ``2m5s``, ``15m``, ``3h20m``, ``20h``, ``2d3h``, ``30d``, ``<unknown>`` without a time."""
    if not timestamp:
        return "<unknown>"
    since = datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    seconds = max(0, int(((now or datetime.now(timezone.utc)) - since).total_seconds()))
    minutes, hours = seconds // 60, seconds // 3600
    days, years = hours // 24, hours // (24 * 365)

    def pair(big: int, big_unit: str, small: int, small_unit: str) -> str:
        return f"{big}{big_unit}" + (f"{small}{small_unit}" if small else "")

    if seconds < 120:
        return f"{seconds}s"
    if minutes < 10:
        return pair(minutes, "m", seconds % 60, "s")
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return pair(hours, "h", minutes % 60, "m")
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return pair(days, "d", hours % 24, "h")
    if hours < 24 * 365 * 2:
        return f"{days}d"
    if hours < 24 * 365 * 8:
        return pair(years, "y", days % 365, "d")
    return f"{years}y"


def pod_status(pod: Obj) -> str:
    """The STATUS column: Terminating while deleted, else a waiting or terminated container's
    reason, else the phase."""
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return "Terminating"
    status = pod.get("status", {})
    for container in status.get("containerStatuses") or ():
        state = container.get("state") or {}
        for key in ("waiting", "terminated"):
            reason = (state.get(key) or {}).get("reason")
            if reason:
                return reason
    if status.get("reason"):
        return status["reason"]
    return status.get("phase") or "Pending"


def _meta(obj: Obj) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def _pod_cells(pod: Obj) -> list[Any]:
    meta, spec, status = _meta(pod), pod.get("spec") or {}, pod.get("status") or {}
    containers = status.get("containerStatuses") or ()
    ready = sum(1 for c in containers if c.get("ready"))
    restarts = sum(int(c.get("restartCount") or 0) for c in containers)
    return [
        meta.get("name", ""),
        f"{ready}/{len(spec.get('containers') or ())}",
        pod_status(pod),
        restarts,
        age(meta.get("creationTimestamp")),
        status.get("podIP") or "<none>",
        spec.get("nodeName") or "<none>",
        status.get("nominatedNodeName") or "<none>",
        "<none>",
    ]


def _node_cells(node: Obj) -> list[Any]:
    meta, status = _meta(node), node.get("status") or {}
    ready = next((c for c in status.get("conditions") or () if c.get("type") == "Ready"), None)
    states = (
        ["Unknown"] if ready is None else ["Ready" if ready.get("status") == "True" else "NotReady"]
    )
    if (node.get("spec") or {}).get("unschedulable"):
        states.append("SchedulingDisabled")
    labels = meta.get("labels") or {}
    roles = sorted(
        {
            k.removeprefix("node-role.kubernetes.io/")
            for k in labels
            if k.startswith("node-role.kubernetes.io/") and k != "node-role.kubernetes.io/"
        }
        | ({labels["kubernetes.io/role"]} if labels.get("kubernetes.io/role") else set())
    )
    info = status.get("nodeInfo") or {}

    def address(kind: str) -> str:
        found = (a.get("address") for a in status.get("addresses") or () if a.get("type") == kind)
        return next(found, "<none>")

    return [
        meta.get("name", ""),
        ",".join(states),
        ",".join(roles) or "<none>",
        age(meta.get("creationTimestamp")),
        info.get("kubeletVersion", ""),
        address("InternalIP"),
        address("ExternalIP"),
        info.get("osImage") or "<unknown>",
        info.get("kernelVersion") or "<unknown>",
        info.get("containerRuntimeVersion") or "<unknown>",
    ]


def _event_cells(event: Obj) -> list[Any]:
    first = event.get("firstTimestamp") or (event.get("eventTime") or "")[:19] + "Z"
    last = event.get("lastTimestamp") or first
    involved = event.get("involvedObject") or {}
    kind = (involved.get("kind") or "").lower()
    source = event.get("source") or {}
    origin = source.get("component") or event.get("reportingComponent") or ""
    host = source.get("host") or event.get("reportingInstance") or ""
    return [
        age(last),
        event.get("type", ""),
        event.get("reason", ""),
        f"{kind}/{involved['name']}" if involved.get("name") else kind,
        involved.get("fieldPath", ""),
        f"{origin}, {host}" if host else origin,
        (event.get("message") or "").strip(),
        age(first),
        int(event.get("count") or 1),
        _meta(event).get("name", ""),
    ]


def _priority_class_cells(pc: Obj) -> list[Any]:
    return [
        _meta(pc).get("name", ""),
        pc.get("value", 0),
        bool(pc.get("globalDefault")),
        age(_meta(pc).get("creationTimestamp")),
        pc.get("preemptionPolicy") or "PreemptLowerPriority",
    ]


def _budget_cells(pdb: Obj) -> list[Any]:
    spec, status = pdb.get("spec") or {}, pdb.get("status") or {}
    return [
        _meta(pdb).get("name", ""),
        str(spec["minAvailable"]) if "minAvailable" in spec else "N/A",
        str(spec["maxUnavailable"]) if "maxUnavailable" in spec else "N/A",
        int(status.get("disruptionsAllowed") or 0),
        age(_meta(pdb).get("creationTimestamp")),
    ]


def _stateful_set_cells(sts: Obj) -> list[Any]:
    spec, status = sts.get("spec") or {}, sts.get("status") or {}
    containers = ((spec.get("template") or {}).get("spec") or {}).get("containers") or ()
    return [
        _meta(sts).get("name", ""),
        f"{int(status.get('readyReplicas') or 0)}/{int(spec.get('replicas', 1))}",
        age(_meta(sts).get("creationTimestamp")),
        ",".join(c.get("name", "") for c in containers),
        ",".join(c.get("image", "") for c in containers),
    ]


def _binding_cells(binding: Obj) -> list[Any]:
    ref = binding.get("roleRef") or {}
    subjects = binding.get("subjects") or ()

    def named(kind: str) -> str:
        return ", ".join(s.get("name", "") for s in subjects if s.get("kind") == kind)

    accounts = ", ".join(
        f"{s.get('namespace', '')}/{s.get('name', '')}"
        for s in subjects
        if s.get("kind") == "ServiceAccount"
    )
    return [
        _meta(binding).get("name", ""),
        f"{ref.get('kind', '')}/{ref.get('name', '')}",
        age(_meta(binding).get("creationTimestamp")),
        named("User"),
        named("Group"),
        accounts,
    ]


def _selector_text(selector: Obj | None) -> str:
    """metav1.FormatLabelSelector: the requirements sorted by key, ``<none>`` for none."""
    parts = [(k, f"{k}={v}") for k, v in ((selector or {}).get("matchLabels") or {}).items()]
    ops = {"In": "in", "NotIn": "notin"}
    for expr in (selector or {}).get("matchExpressions") or ():
        key, op = expr.get("key", ""), expr.get("operator", "")
        values = ",".join(sorted(expr.get("values") or ()))
        text = {"Exists": key, "DoesNotExist": f"!{key}"}.get(
            op, f"{key} {ops.get(op, op)} ({values})"
        )
        parts.append((key, text))
    return ",".join(text for _, text in sorted(parts)) or "<none>"


def _replica_set_cells(rs: Obj) -> list[Any]:
    spec, status = rs.get("spec") or {}, rs.get("status") or {}
    containers = ((spec.get("template") or {}).get("spec") or {}).get("containers") or ()
    return [
        _meta(rs).get("name", ""),
        int(spec.get("replicas", 1)),
        int(status.get("replicas") or 0),
        int(status.get("readyReplicas") or 0),
        age(_meta(rs).get("creationTimestamp")),
        ",".join(c.get("name", "") for c in containers),
        ",".join(c.get("image", "") for c in containers),
        _selector_text(spec.get("selector")),
    ]


def _service_cells(svc: Obj) -> list[Any]:
    spec = svc.get("spec") or {}
    ports = ",".join(
        f"{p.get('port')}"
        + (f":{p['nodePort']}" if p.get("nodePort") else "")
        + f"/{p.get('protocol', 'TCP')}"
        for p in spec.get("ports") or ()
    )
    selector = ",".join(f"{k}={v}" for k, v in sorted((spec.get("selector") or {}).items()))
    external = ",".join(spec.get("externalIPs") or ()) or "<none>"
    return [
        _meta(svc).get("name", ""),
        spec.get("type") or "ClusterIP",
        spec.get("clusterIP") or "<none>",
        external,
        ports or "<none>",
        age(_meta(svc).get("creationTimestamp")),
        selector or "<none>",
    ]


def _default_cells(obj: Obj) -> list[Any]:
    return [_meta(obj).get("name", ""), _meta(obj).get("creationTimestamp", "")]


_PRINTERS: dict[str, tuple[tuple[Column, ...], Callable[[Obj], list[Any]]]] = {
    "pods": (
        (
            _NAME,
            ("Ready", "string", "", 0),
            ("Status", "string", "", 0),
            ("Restarts", "string", "", 0),
            _AGE,
            ("IP", "string", "", 1),
            ("Node", "string", "", 1),
            ("Nominated Node", "string", "", 1),
            ("Readiness Gates", "string", "", 1),
        ),
        _pod_cells,
    ),
    "nodes": (
        (
            _NAME,
            ("Status", "string", "", 0),
            ("Roles", "string", "", 0),
            _AGE,
            ("Version", "string", "", 0),
            ("Internal-IP", "string", "", 1),
            ("External-IP", "string", "", 1),
            ("OS-Image", "string", "", 1),
            ("Kernel-Version", "string", "", 1),
            ("Container-Runtime", "string", "", 1),
        ),
        _node_cells,
    ),
    "events": (
        (
            ("Last Seen", "string", "", 0),
            ("Type", "string", "", 0),
            ("Reason", "string", "", 0),
            ("Object", "string", "", 0),
            ("Subobject", "string", "", 1),
            ("Source", "string", "", 1),
            ("Message", "string", "", 0),
            ("First Seen", "string", "", 1),
            ("Count", "string", "", 1),
            ("Name", "string", "name", 1),
        ),
        _event_cells,
    ),
    "priorityclasses": (
        (
            _NAME,
            ("Value", "integer", "", 0),
            ("Global-Default", "boolean", "", 0),
            _AGE,
            ("PreemptionPolicy", "string", "", 0),
        ),
        _priority_class_cells,
    ),
    "configmaps": (
        (_NAME, ("Data", "string", "", 0), _AGE),
        lambda cm: [
            _meta(cm).get("name", ""),
            len(cm.get("data") or {}) + len(cm.get("binaryData") or {}),
            age(_meta(cm).get("creationTimestamp")),
        ],
    ),
    "secrets": (
        (_NAME, ("Type", "string", "", 0), ("Data", "string", "", 0), _AGE),
        lambda secret: [
            _meta(secret).get("name", ""),
            secret.get("type") or "Opaque",
            len(secret.get("data") or {}),
            age(_meta(secret).get("creationTimestamp")),
        ],
    ),
    "poddisruptionbudgets": (
        (
            _NAME,
            ("Min Available", "string", "", 0),
            ("Max Unavailable", "string", "", 0),
            ("Allowed Disruptions", "integer", "", 0),
            _AGE,
        ),
        _budget_cells,
    ),
    "statefulsets": (
        (
            _NAME,
            ("Ready", "string", "", 0),
            _AGE,
            ("Containers", "string", "", 1),
            ("Images", "string", "", 1),
        ),
        _stateful_set_cells,
    ),
}
_PRINTERS.update(
    {
        "replicasets": (
            (
                _NAME,
                ("Desired", "integer", "", 0),
                ("Current", "integer", "", 0),
                ("Ready", "integer", "", 0),
                _AGE,
                ("Containers", "string", "", 1),
                ("Images", "string", "", 1),
                ("Selector", "string", "", 1),
            ),
            _replica_set_cells,
        ),
        "services": (
            (
                _NAME,
                ("Type", "string", "", 0),
                ("Cluster-IP", "string", "", 0),
                ("External-IP", "string", "", 0),
                ("Port(s)", "string", "", 0),
                _AGE,
                ("Selector", "string", "", 1),
            ),
            _service_cells,
        ),
        "serviceaccounts": (
            (_NAME, ("Secrets", "string", "", 0), _AGE),
            lambda sa: [
                _meta(sa).get("name", ""),
                len(sa.get("secrets") or ()),
                age(_meta(sa).get("creationTimestamp")),
            ],
        ),
        "namespaces": (
            (_NAME, ("Status", "string", "", 0), _AGE),
            lambda ns: [
                _meta(ns).get("name", ""),
                (ns.get("status") or {}).get("phase") or "Active",
                age(_meta(ns).get("creationTimestamp")),
            ],
        ),
        "networkpolicies": (
            (_NAME, ("Pod-Selector", "string", "", 0), _AGE),
            lambda policy: [
                _meta(policy).get("name", ""),
                _selector_text((policy.get("spec") or {}).get("podSelector")),
                age(_meta(policy).get("creationTimestamp")),
            ],
        ),
    }
)
_BINDING_COLUMNS: tuple[Column, ...] = (
    _NAME,
    ("Role", "string", "", 0),
    _AGE,
    ("Users", "string", "", 1),
    ("Groups", "string", "", 1),
    ("ServiceAccounts", "string", "", 1),
)
_PRINTERS["rolebindings"] = _PRINTERS["clusterrolebindings"] = (_BINDING_COLUMNS, _binding_cells)
# rest.NewDefaultTableConvertor: what the API server prints for a kind without a printer
_DEFAULT: tuple[tuple[Column, ...], Callable[[Obj], list[Any]]] = (
    (_NAME, ("Created At", "date", "", 0)),
    _default_cells,
)


Printer = tuple[tuple[Column, ...], Callable[[Obj], list[Any]]]
# The printer of the custom kind the request being served reads (``api_crds``): resource ->
# its columns from the CRD's additionalPrinterColumns.
_custom_printer: contextvars.ContextVar[tuple[str, Printer] | None] = contextvars.ContextVar(
    "fake_k8s_custom_printer", default=None
)


def use_printer(resource: str, printer: Printer) -> None:
    """The printer of ``resource`` (a custom kind) for the rest of the request being served."""
    _custom_printer.set((resource, printer))


def table(resource: str, objects: Sequence[Obj], resource_version: str) -> dict[str, Any]:
    """The Table of ``objects`` (a list's items, or one object) of ``resource`` (the URL's
    plural), each row with its object's metadata as a ``PartialObjectMetadata``."""
    custom = _custom_printer.get()
    if custom is not None and custom[0] == resource:
        columns, cells = custom[1]
    else:
        columns, cells = _PRINTERS.get(resource, _DEFAULT)
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": [
            {"name": name, "type": kind, "format": fmt, "description": name, "priority": prio}
            for name, kind, fmt, prio in columns
        ],
        "rows": [
            {
                "cells": cells(obj),
                "object": {
                    "kind": "PartialObjectMetadata",
                    "apiVersion": "meta.k8s.io/v1",
                    "metadata": dict(_meta(obj)),
                },
            }
            for obj in objects
        ],
    }


def pod_table(pods: Sequence[Obj], resource_version: str) -> dict[str, Any]:
    """The Table of ``pods`` (a list's items, or one pod)."""
    return table("pods", pods, resource_version)
