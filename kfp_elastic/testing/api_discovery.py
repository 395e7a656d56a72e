"""The fake API server's discovery documents, pure: what ``kubectl`` (and any client-go client)
reads before anything else — ``/version``, ``/api``, ``/api/v1``, ``/apis`` and
``/apis/{group}/{version}`` — built from the kinds the server stores (pods and
``api_wire.OBJECT_KINDS``, passed in; Events also as ``events.k8s.io/v1``; the custom kinds of
the stored CRDs, ``api_crds``), in the shapes of
the Kubernetes API reference (``VersionInfo``, ``APIVersions``, ``APIGroupList``,
``APIResourceList``). Aggregated discovery (``apidiscovery.k8s.io/v2``) is not served: the
documents are plain JSON, which clients take as a server without it.

OpenAPI v3 (``/openapi/v3`` and a document per group version) is served: every resource's
paths with their operations, the ``x-kubernetes-group-version-kind`` of each and the query
parameters they take, so that ``kubectl apply`` and ``create`` see that the server validates
fields itself (``fieldValidation``) and leave validation to it; and the schemas of the group
version's kinds (``components.schemas``, ``api_openapi``), which ``kubectl explain`` reads. A
document's ``hash`` in ``/openapi/v3`` changes with its content (a CRD added or changed), so
clients do not keep a stale copy. OpenAPI v2 is not served.
"""

from __future__ import annotations

import hashlib
import json
import re
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
# Kinds created through a POST that the API server answers at once and keeps nothing of: the
# authorization.k8s.io reviews (``kubectl auth can-i``). resource -> (kind, apiVersion)
REVIEW_KINDS = {
    "selfsubjectaccessreviews": ("SelfSubjectAccessReview", "authorization.k8s.io/v1"),
    "subjectaccessreviews": ("SubjectAccessReview", "authorization.k8s.io/v1"),
}
_POD_VERBS = ["create", "delete", "get", "list", "patch", "watch"]
_SHORT_NAMES = {
    "pods": ["po"],
    "nodes": ["no"],
    "configmaps": ["cm"],
    "priorityclasses": ["pc"],
    "poddisruptionbudgets": ["pdb"],
    "statefulsets": ["sts"],
    "replicasets": ["rs"],
    "events": ["ev"],
    "namespaces": ["ns"],
    "serviceaccounts": ["sa"],
    "services": ["svc"],
    "networkpolicies": ["netpol"],
    "customresourcedefinitions": ["crd", "crds"],
}
# kube-apiserver's version priority (GA, then beta, then alpha; higher numbers first)
_VERSION = re.compile(r"v(\d+)(?:(alpha|beta)(\d+))?")


def version_priority(version: str) -> tuple[int, int, int]:
    """A sort key putting versions in kube-apiserver's order of preference (v2, v1, v1beta2,
    v1beta1, v1alpha1, then others)."""
    m = _VERSION.fullmatch(version)
    if not m:
        return (3, 0, 0)
    level = {None: 0, "beta": 1, "alpha": 2}[m[2]]
    return (level, -int(m[1]), -int(m[3] or 0))


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
    for resource, (kind, group_version) in REVIEW_KINDS.items():
        out.setdefault(group_version, []).append(
            {
                "name": resource,
                "singularName": kind.lower(),
                "namespaced": False,
                "kind": kind,
                "verbs": ["create"],
            }
        )
    if "replicasets" in kinds:
        out[kinds["replicasets"][1]].append(
            {
                "name": "replicasets/scale",
                "singularName": "",
                "namespaced": True,
                "kind": "Scale",
                "group": "autoscaling",
                "version": "v1",
                "verbs": ["get", "patch", "update"],
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
    path: str,
    object_kinds: Mapping[str, tuple[str, str]],
    cluster_scoped: Collection[str],
    custom: Mapping[str, list[dict[str, Any]]] | None = None,
    custom_schemas: Mapping[str, Mapping[str, Mapping[str, Any]]] | None = None,
) -> dict[str, Any] | None:
    """The discovery document at ``path`` (None: not a discovery path) of a server that
    stores pods and ``object_kinds`` (resource -> (kind, apiVersion)), ``cluster_scoped``
    among them without a namespace, and serves the custom kinds of ``custom``
    (groupVersion -> their APIResources, ``api_crds``) with the schemas of
    ``custom_schemas`` (groupVersion -> kind -> its ``openAPIV3Schema``)."""
    schemas = custom_schemas or {}
    resources = _resources(object_kinds, cluster_scoped)
    for group_version, entries in (custom or {}).items():
        resources.setdefault(group_version, []).extend(entries)
    if path == "/openapi/v3":
        return {
            "paths": {
                _gv_path(gv): {
                    "serverRelativeURL": f"/openapi/v3/{_gv_path(gv)}"
                    f"?hash={_hash(openapi_v3(gv, r, schemas.get(gv)))}"
                }
                for gv, r in resources.items()
            }
        }
    if path.startswith("/openapi/v3/"):
        wanted = path.removeprefix("/openapi/v3/")
        for gv, listed in resources.items():
            if _gv_path(gv) == wanted:
                return openapi_v3(gv, listed, schemas.get(gv))
        return None
    if path == "/version":
        return VERSION
    if path == "/api":
        return {
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": ""}],
        }
    if path == "/apis":  # each group with its versions, the preferred one first
        groups: dict[str, list[str]] = {}
        for gv in sorted(gv for gv in resources if "/" in gv):
            groups.setdefault(gv.partition("/")[0], []).append(gv.partition("/")[2])
        listed = []
        for group, versions in groups.items():
            versions.sort(key=version_priority)
            entries = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
            listed.append({"name": group, "versions": entries, "preferredVersion": entries[0]})
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": listed}
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


def _gv_path(group_version: str) -> str:
    return f"apis/{group_version}" if "/" in group_version else f"api/{group_version}"


def _hash(content: Any) -> str:
    return hashlib.sha512(json.dumps(content, sort_keys=True).encode()).hexdigest()[:128].upper()


# The query parameters of a write, as kube-apiserver's OpenAPI lists them.
_WRITE_PARAMETERS = ("dryRun", "fieldManager", "fieldValidation", "pretty")
_ACTIONS = {"create": ("post", False), "update": ("put", True), "patch": ("patch", True)}


def openapi_v3(
    group_version: str,
    listed: list[dict[str, Any]],
    custom_schemas: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The OpenAPI v3 document of one group version: per resource the collection and item
    paths with an operation per verb it serves, each naming its kind
    (``x-kubernetes-group-version-kind``) and, for writes, the query parameters; the schemas
    of its kinds (``api_openapi``; ``custom_schemas``: kind -> ``openAPIV3Schema`` of the
    custom ones)."""
    from kfp_elastic.testing import api_openapi  # it reads api_validation, which imports this

    group, _, version = group_version.rpartition("/")
    paths: dict[str, dict[str, Any]] = {}
    for entry in listed:
        if "/" in entry["name"]:  # subresources: not described
            continue
        gvk = {"group": group, "version": version, "kind": entry["kind"]}
        base = "/" + _gv_path(group_version)
        if entry["namespaced"]:
            base += "/namespaces/{namespace}"
        collection, item = f"{base}/{entry['name']}", f"{base}/{entry['name']}/{{name}}"
        for verb in entry["verbs"]:
            method, on_item = _ACTIONS.get(verb, ("get" if verb in ("get", "list") else "", False))
            if not method:
                continue
            on_item = on_item or verb == "get"
            paths.setdefault(item if on_item else collection, {})[method] = {
                "operationId": f"{verb}{entry['kind']}",
                "x-kubernetes-action": verb,
                "x-kubernetes-group-version-kind": gvk,
                "parameters": [
                    {"name": name, "in": "query", "schema": {"type": "string"}}
                    for name in (_WRITE_PARAMETERS if verb in _ACTIONS else ("pretty",))
                ],
                "responses": {"200": {"description": "OK"}},
            }
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": VERSION["gitVersion"]},
        "paths": paths,
        "components": {
            "schemas": api_openapi.schemas(
                group_version,
                [e["kind"] for e in listed if "/" not in e["name"]],
                custom_schemas,
            )
        },
    }
