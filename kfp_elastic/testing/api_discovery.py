"""The fake API server's discovery documents, pure: what ``kubectl`` (and any client-go client)
reads before anything else — ``/version``, ``/api``, ``/api/v1``, ``/apis`` and
``/apis/{group}/{version}`` — built from the kinds the server stores (pods and
``api_wire.OBJECT_KINDS``, passed in; Events also as ``events.k8s.io/v1``), in the shapes of
the Kubernetes API reference (``VersionInfo``, ``APIVersions``, ``APIGroupList``,
``APIResourceList``). Aggregated discovery (``apidiscovery.k8s.io/v2``) is not served: the
documents are plain JSON, which clients take as a server without it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

# The Kubernetes version the stand-in answers as (within kubectl's supported skew).
VERSION = {
    "major": "1",
    "minor": "36",
    "gitVersion": "v1.36.0-kfp-elastic-test-cluster",
    "gitCommit": "",
    "gitTreeState": "clean",
    "buildDate": "2026-01-01T00:00:00Z",
    "goVersion": "",
    "compiler": "python",
    "platform": "linux/amd64",
}
_OBJECT_VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]
_POD_VERBS = ["create", "delete", "get", "list", "patch", "watch"]
_SHORT_NAMES = {
    "pods": ["po"],
    "nodes": ["no"],
    "configmaps": ["cm"],
    "priorityclasses": ["pc"],
    "poddisruptionbudgets": ["pdb"],
    "statefulsets": ["sts"],
    "events": ["ev"],
}


def _resources(
    object_kinds: Mapping[str, tuple[str, str]], cluster_scoped: Collection[str]
) -> dict[str, list[dict[str, Any]]]:
    """groupVersion -> its APIResources."""
    kinds = {"pods": ("Pod", "v1"), **object_kinds}
    out: dict[str, list[dict[str, Any]]] = {}
    for resource, (kind, group_version) in kinds.items():
        entry = {
            "name": resource,
            "singularName": kind.lower(),
            "namespaced": resource not in cluster_scoped,
            "kind": kind,
            "verbs": _POD_VERBS if resource == "pods" else _OBJECT_VERBS,
        }
        if resource in _SHORT_NAMES:
            entry["shortNames"] = _SHORT_NAMES[resource]
        out.setdefault(group_version, []).append(entry)
    if "events" in kinds:  # the same Events, read through the newer API (get and list)
        out.setdefault("events.k8s.io/v1", []).append(
            {
                "name": "events",
                "singularName": "event",
                "namespaced": True,
                "kind": "Event",
                "verbs": ["get", "list"],
                "shortNames": ["ev"],
            }
        )
    pods = out["v1"]
    pods.append(
        {
            "name": "pods/eviction",
            "singularName": "",
            "namespaced": True,
            "kind": "Eviction",
            "group": "policy",
            "version": "v1",
            "verbs": ["create"],
        }
    )
    pods.append(
        {
            "name": "pods/status",
            "singularName": "",
            "namespaced": True,
            "kind": "Pod",
            "verbs": ["get", "patch"],
        }
    )
    return out


def discovery(
    path: str, object_kinds: Mapping[str, tuple[str, str]], cluster_scoped: Collection[str]
) -> dict[str, Any] | None:
    """The discovery document at ``path`` (None: not a discovery path) of a server that
    stores pods and ``object_kinds`` (resource -> (kind, apiVersion)), ``cluster_scoped``
    among them without a namespace."""
    resources = _resources(object_kinds, cluster_scoped)
    if path == "/version":
        return VERSION
    if path == "/api":
        return {
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": ""}],
        }
    if path == "/apis":
        groups = sorted({gv for gv in resources if "/" in gv})
        return {
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [
                {
                    "name": gv.partition("/")[0],
                    "versions": [{"groupVersion": gv, "version": gv.partition("/")[2]}],
                    "preferredVersion": {"groupVersion": gv, "version": gv.partition("/")[2]},
                }
                for gv in groups
            ],
        }
    group_version = path.removeprefix("/api/") if path.startswith("/api/") else None
    if path.startswith("/apis/"):
        group_version = path.removeprefix("/apis/")
    if group_version in resources:
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": group_version,
            "resources": resources[group_version],
        }
    return None
