"""Kubernetes Events of the test cluster, pure: the core ``v1`` Event a component's event
recorder writes (what ``kubectl get events`` and ``kubectl describe`` show) and its
``events.k8s.io/v1`` form (the same object under the newer field names, as kube-apiserver
converts between the two versions).

The reasons and messages are those of the components the stand-in plays
(``pkg/kubelet/events``, kube-scheduler, the taint-eviction and node-lifecycle controllers).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# component -> what it writes into ``source.component`` / ``reportingComponent``
SCHEDULER = "default-scheduler"
KUBELET = "kubelet"
TAINT_EVICTION = "taint-eviction-controller"
NODE_CONTROLLER = "node-controller"
# The namespace that holds the events of cluster-scoped objects (nodes), as client-go's
# recorder puts them.
CLUSTER_EVENTS_NAMESPACE = "default"


def new_event(
    involved: Mapping[str, Any],
    reason: str,
    message: str,
    *,
    component: str,
    now: str,
    now_ns: int,
    event_type: str = "Normal",
    host: str = "",
    field_path: str = "",
) -> dict[str, Any]:
    """A core/v1 Event about ``involved`` (a stored object: its kind, apiVersion and metadata
    give the reference) seen once at ``now`` (``now_ns``: the same in Unix nanoseconds, unique
    per event); its namespace is the object's, or :data:`CLUSTER_EVENTS_NAMESPACE` for a
    cluster-scoped one."""
    meta = involved.get("metadata") or {}
    reference = {
        "kind": involved.get("kind", ""),
        "apiVersion": involved.get("apiVersion", ""),
        "name": meta.get("name", ""),
        "uid": meta.get("uid", ""),
        "resourceVersion": meta.get("resourceVersion", ""),
    }
    if meta.get("namespace"):
        reference["namespace"] = meta["namespace"]
    if field_path:
        reference["fieldPath"] = field_path
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            # client-go's recorder: the object's name and the time in hex, so that a list (in
            # name order, as etcd keeps them) has each object's events oldest first
            "name": f"{meta.get('name', 'event')}.{now_ns:x}",
            "namespace": meta.get("namespace") or CLUSTER_EVENTS_NAMESPACE,
        },
        "involvedObject": reference,
        "reason": reason,
        "message": message,
        "source": {"component": component, **({"host": host} if host else {})},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
        "type": event_type,
        "eventTime": None,
        "reportingComponent": component,
        "reportingInstance": host,
    }


def container_path(container: str) -> str:
    """The ``fieldPath`` of a pod's container, as the kubelet's events name it."""
    return f"spec.containers{{{container}}}"


def to_events_v1(event: Mapping[str, Any]) -> dict[str, Any]:
    """``event`` (core/v1) as ``events.k8s.io/v1`` returns it."""
    out: dict[str, Any] = {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": dict(event.get("metadata") or {}),
        "eventTime": event.get("eventTime"),
        "reportingController": event.get("reportingComponent", ""),
        "reportingInstance": event.get("reportingInstance", ""),
        "reason": event.get("reason", ""),
        "regarding": dict(event.get("involvedObject") or {}),
        "note": event.get("message", ""),
        "type": event.get("type", ""),
        "deprecatedSource": dict(event.get("source") or {}),
        "deprecatedFirstTimestamp": event.get("firstTimestamp"),
        "deprecatedLastTimestamp": event.get("lastTimestamp"),
        "deprecatedCount": event.get("count", 1),
    }
    if event.get("action"):
        out["action"] = event["action"]
    return out


def to_events_v1_list(listed: Mapping[str, Any]) -> dict[str, Any]:
    """An EventList (core/v1) as ``events.k8s.io/v1`` returns it."""
    return {
        "kind": "EventList",
        "apiVersion": "events.k8s.io/v1",
        "metadata": dict(listed.get("metadata") or {}),
        "items": [to_events_v1(item) for item in listed.get("items") or ()],
    }
