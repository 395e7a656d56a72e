"""Server-side printing, pure: the ``meta.k8s.io/v1`` ``Table`` a real API server returns when a
client asks ``Accept: application/json;as=Table;v=v1;g=meta.k8s.io`` (what ``kubectl get``
asks), for pods with kube-apiserver's columns (``NAME READY STATUS RESTARTS AGE``, and with
``-o wide`` ``IP NODE NOMINATED NODE READINESS GATES``). Other kinds are answered as plain
objects, which kubectl prints with its own default columns (``NAME AGE``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

_POD_COLUMNS = (
    ("Name", "string", "name", 0),
    ("Ready", "string", "", 0),
    ("Status", "string", "", 0),
    ("Restarts", "string", "", 0),
    ("Age", "string", "", 0),
    ("IP", "string", "", 1),
    ("Node", "string", "", 1),
    ("Nominated Node", "string", "", 1),
    ("Readiness Gates", "string", "", 1),
)


def wants_table(accept: str) -> bool:
    """Whether a request's Accept header asks for a Table first (kubectl get)."""
    first = accept.split(",")[0]
    return "as=Table" in first and "g=meta.k8s.io" in first


def age(timestamp: str | None, now: datetime | None = None) -> str:
    """kubectl's short age: ``42s``, ``5m``, ``3h``, ``2d`` (``<unknown>`` without a time)."""
    if not timestamp:
        return "<unknown>"
    since = datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    seconds = max(0, int(((now or datetime.now(timezone.utc)) - since).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size or (unit == "m" and seconds >= 120):
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def pod_status(pod: Mapping[str, Any]) -> str:
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


def pod_row(pod: Mapping[str, Any]) -> dict[str, Any]:
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    containers = status.get("containerStatuses") or ()
    ready = sum(1 for c in containers if c.get("ready"))
    restarts = sum(int(c.get("restartCount") or 0) for c in containers)
    return {
        "cells": [
            meta.get("name", ""),
            f"{ready}/{len(spec.get('containers') or ())}",
            pod_status(pod),
            restarts,
            age(meta.get("creationTimestamp")),
            status.get("podIP") or "<none>",
            spec.get("nodeName") or "<none>",
            status.get("nominatedNodeName") or "<none>",
            "<none>",
        ],
        "object": {
            "kind": "PartialObjectMetadata",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": dict(meta),
        },
    }


def pod_table(pods: Sequence[Mapping[str, Any]], resource_version: str) -> dict[str, Any]:
    """The Table of ``pods`` (a list's items, or one pod)."""
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": [
            {"name": name, "type": kind, "format": fmt, "description": name, "priority": prio}
            for name, kind, fmt, prio in _POD_COLUMNS
        ],
        "rows": [pod_row(pod) for pod in pods],
    }
