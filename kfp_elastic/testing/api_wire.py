"""The API machinery of the fake Kubernetes API server (``testing/api_server.py``) that is not pod
storage: the object kinds it routes, Status errors, label selectors, merge patches, and the HTTP
transport (routing, JSON replies, chunked watch streams, connections closed on stop).
"""

from __future__ import annotations

import contextvars
import copy
import json
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import jsonpatch
import yaml

from kfp_elastic.testing.api_discovery import REVIEW_KINDS, discovery
from kfp_elastic.testing.api_events import to_events_v1, to_events_v1_list
from kfp_elastic.testing.api_tables import pod_table, wants_table
from kfp_elastic.testing.api_tables import table as object_table

# resource (the URL's plural) -> (kind, apiVersion) of the kinds other than Pod. StatefulSets
# are stored only (no controller runs them): a PodDisruptionBudget reads their replicas.
OBJECT_KINDS = {
    "priorityclasses": ("PriorityClass", "scheduling.k8s.io/v1"),
    "configmaps": ("ConfigMap", "v1"),
    "secrets": ("Secret", "v1"),
    "nodes": ("Node", "v1"),
    "roles": ("Role", "rbac.authorization.k8s.io/v1"),
    "rolebindings": ("RoleBinding", "rbac.authorization.k8s.io/v1"),
    "clusterroles": ("ClusterRole", "rbac.authorization.k8s.io/v1"),
    "clusterrolebindings": ("ClusterRoleBinding", "rbac.authorization.k8s.io/v1"),
    "poddisruptionbudgets": ("PodDisruptionBudget", "policy/v1"),
    "statefulsets": ("StatefulSet", "apps/v1"),
    "replicasets": ("ReplicaSet", "apps/v1"),
    "events": ("Event", "v1"),
    "namespaces": ("Namespace", "v1"),
    "serviceaccounts": ("ServiceAccount", "v1"),
    "services": ("Service", "v1"),
    "networkpolicies": ("NetworkPolicy", "networking.k8s.io/v1"),
    # what the stand-in serves of their custom kinds: api_crds
    "customresourcedefinitions": ("CustomResourceDefinition", "apiextensions.k8s.io/v1"),
}
CLUSTER_SCOPED = {
    "priorityclasses",
    "nodes",
    "clusterroles",
    "clusterrolebindings",
    "namespaces",
    "customresourcedefinitions",
}
# The patch formats of a PATCH request's Content-Type.
JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
PATCH_TYPES = (JSON_PATCH, MERGE_PATCH, STRATEGIC_MERGE_PATCH, APPLY_PATCH)


_REQUIREMENT = re.compile(
    r"\s*(?P<neg>!)?\s*(?P<key>[A-Za-z0-9./_-]+)\s*(?:(?P<op>==|=|!=)\s*"
    r"(?P<val>[A-Za-z0-9._-]*)|\s+(?P<set>in|notin)\s*\((?P<vals>[^)]*)\))?\s*"
)
# The lists a strategic merge patch merges instead of replacing, with their merge keys, as
# core/v1's ``patchStrategy:"merge" patchMergeKey:...`` tags say (``containerStatuses``: the
# kubelet's status writes here). Any other list (tolerations, args, envFrom...) is replaced.
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",  # a Service's ports: "port" (_merge_key)
    "imagePullSecrets": "name",
    "hostAliases": "ip",
    "schedulingGates": "name",
    "resourceClaims": "name",
    "conditions": "type",
    "containerStatuses": "name",
    "ownerReferences": "uid",
}
# Lists of scalars a strategic merge patch unions (metadata.finalizers).
_MERGED_SCALAR_LISTS = {"finalizers"}
_DIRECTIVE = "$patch"
_SET_ORDER = "$setElementOrder/"
_DELETE_FROM = "$deleteFromPrimitiveList/"
_RETAIN_KEYS = "$retainKeys"


@dataclass(frozen=True)
class ApiCall:
    """One request as RBAC authorizes it (the API server's RequestInfo): ``verb`` is get, list,
    watch, create, update, patch, delete or deletecollection; ``group`` is "" for the core API."""

    verb: str
    group: str
    resource: str
    subresource: str = ""
    namespace: str = ""
    name: str = ""


_API_PATH = re.compile(
    r"/(?:api/(?P<core_version>[^/]+)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
    r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<resource>[^/]+)(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?"
)
_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch"}


def api_call(method: str, path: str, query: dict[str, str]) -> ApiCall | None:
    """What RBAC sees in a request: the verb from the method (GET on a collection is list, or
    watch with ``watch=true``; DELETE on one is deletecollection), the API group, resource and
    subresource from the path. None for paths that are no resource (``/version``, ``/apis``)."""
    m = _API_PATH.fullmatch(path)
    if not m:
        return None
    ns, resource, name = m["ns"] or "", m["resource"], m["name"] or ""
    if method == "GET":
        watching = query.get("watch", "").lower() in ("true", "1")
        verb = "get" if name else ("watch" if watching else "list")
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        verb = _VERBS.get(method, method.lower())
    return ApiCall(verb, m["group"] or "", resource, m["sub"] or "", ns, name)


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code,
        }


def now_timestamp(delta: float = 0) -> str:
    return (datetime.now(timezone.utc) + timedelta(seconds=delta)).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_label_selector(text: str) -> list[tuple[str, str, set[str]]]:
    parts = re.findall(r"(?:[^,(]|\([^)]*\))+", text or "")
    out = []
    for part in parts:
        m = _REQUIREMENT.fullmatch(part)
        if not m or (m["neg"] and (m["op"] or m["set"])):
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {part!r}")
        if m["set"]:
            out.append((m["key"], m["set"], {v.strip() for v in m["vals"].split(",")}))
        else:
            op = "!" if m["neg"] else {"==": "="}.get(m["op"], m["op"] or "exists")
            out.append((m["key"], op, {m["val"] or ""}))
    return out


# The fields a field selector may name, per resource, as kube-apiserver's registries allow them
# (for pods a subset: the fields the stand-in keeps), each with where it lives in the object;
# every kind allows metadata.name and metadata.namespace.
_COMMON_FIELDS: dict[str, tuple[str, ...]] = {
    "metadata.name": ("metadata", "name"),
    "metadata.namespace": ("metadata", "namespace"),
}
POD_FIELDS: dict[str, tuple[str, ...]] = {
    **_COMMON_FIELDS,
    "spec.nodeName": ("spec", "nodeName"),
    "spec.restartPolicy": ("spec", "restartPolicy"),
    "spec.schedulerName": ("spec", "schedulerName"),
    "spec.serviceAccountName": ("spec", "serviceAccountName"),
    "status.phase": ("status", "phase"),
    "status.podIP": ("status", "podIP"),
    "status.nominatedNodeName": ("status", "nominatedNodeName"),
}
SELECTABLE_FIELDS: dict[str, dict[str, tuple[str, ...]]] = {
    "pods": POD_FIELDS,
    "nodes": {**_COMMON_FIELDS, "spec.unschedulable": ("spec", "unschedulable")},
    "secrets": {**_COMMON_FIELDS, "type": ("type",)},
    "events": {
        **_COMMON_FIELDS,
        **{
            f"involvedObject.{key}": ("involvedObject", key)
            for key in ("kind", "namespace", "name", "uid", "apiVersion", "resourceVersion")
        },
        "involvedObject.fieldPath": ("involvedObject", "fieldPath"),
        "reason": ("reason",),
        "reportingComponent": ("reportingComponent",),
        "source": ("source", "component"),
        "type": ("type",),
    },
}
FieldSelector = list[tuple[tuple[str, ...], bool, str]]  # (path, equal, value): all must hold


def parse_field_selector(text: str, resource: str = "pods") -> FieldSelector:
    """A field selector's requirements on ``resource`` (``a=b``, ``a==b``, ``a!=b``,
    comma-separated); a field its registry does not allow (:data:`SELECTABLE_FIELDS`) is
    refused as kube-apiserver refuses it (400)."""
    allowed = SELECTABLE_FIELDS.get(resource, _COMMON_FIELDS)
    out: FieldSelector = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"([A-Za-z.]+)\s*(!=|==|=)\s*(.*)", part)
        if not m:
            raise ApiError(400, "BadRequest", f'invalid selector: "{part}"')
        if m[1] not in allowed:
            raise ApiError(400, "BadRequest", f'field label not supported: "{m[1]}"')
        out.append((allowed[m[1]], m[2] != "!=", m[3]))
    return out


def _field_value(obj: Any, path: tuple[str, ...]) -> str:
    for key in path:
        obj = obj.get(key) if isinstance(obj, dict) else None
    if isinstance(obj, bool):  # the registries format booleans with strconv.FormatBool
        return "true" if obj else "false"
    if obj is None and path == ("spec", "unschedulable"):
        return "false"
    return "" if obj is None else str(obj)


def fields_match(selector: FieldSelector, obj: dict[str, Any]) -> bool:
    return all((_field_value(obj, path) == value) == equal for path, equal, value in selector)


def labels_match(selector: list[tuple[str, str, set[str]]], labels: dict[str, str]) -> bool:
    for key, op, values in selector:
        value = labels.get(key)
        ok = {
            "=": value in values,
            "in": value in values,
            "!=": value not in values,
            "notin": value not in values,
            "exists": key in labels,
            "!": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def merge_patch(target: Any, patch: Any, strategic: bool = False) -> Any:
    """RFC 7386 merge patch; ``strategic``: a strategic merge patch, which merges the lists
    Kubernetes merges by key (``_MERGE_KEYS``; ``_MERGED_SCALAR_LISTS`` by value) instead of
    replacing them, and honours its directives: ``$patch`` on a list item (``delete``: remove
    the item with that key), in a list (``{"$patch": "replace"}``: the list is the patch's other
    items) and in a map (``replace``, ``delete``); ``$setElementOrder/<list>`` (the order of a
    merged list), ``$deleteFromPrimitiveList/<list>`` and ``$retainKeys`` (what ``kubectl
    apply`` sends)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    if strategic:
        directive = patch.get(_DIRECTIVE)
        if directive == "delete":
            return None
        if directive == "replace":
            return {k: copy.deepcopy(v) for k, v in patch.items() if k != _DIRECTIVE}
        if directive is not None:
            raise ValueError(f"unknown strategic merge patch directive {directive!r}")
        if isinstance(patch.get(_RETAIN_KEYS), list):
            out = {k: v for k, v in out.items() if k in patch[_RETAIN_KEYS]}
    orders = {}
    for key, value in patch.items():
        if strategic and key.startswith(_SET_ORDER):
            orders[key.removeprefix(_SET_ORDER)] = value
        elif strategic and key.startswith(_DELETE_FROM):
            name = key.removeprefix(_DELETE_FROM)
            out[name] = [item for item in out.get(name) or [] if item not in value]
        elif strategic and key in (_DIRECTIVE, _RETAIN_KEYS):
            continue
        elif value is None:
            out.pop(key, None)
        elif strategic and key in _MERGE_KEYS and isinstance(value, list):
            out[key] = _merge_keyed_list(out.get(key) or [], value, _MERGE_KEYS[key])
        elif strategic and key in _MERGED_SCALAR_LISTS and isinstance(value, list):
            old = list(out.get(key) or [])
            out[key] = old + [item for item in value if item not in old]
        elif strategic and isinstance(value, dict) and value.get(_DIRECTIVE) == "delete":
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value, strategic)
    for key, order in orders.items():
        if isinstance(out.get(key), list) and isinstance(order, list):
            out[key] = _in_order(out[key], order, _MERGE_KEYS.get(key))
    return out


def _merge_key(item: Any, merge_key: str) -> Any:
    """An item's key in a merged list; a Service's ports merge by ``port`` (theirs have no
    ``containerPort``)."""
    if not isinstance(item, dict):
        return item
    if merge_key == "containerPort" and "containerPort" not in item:
        return item.get("port")
    return item.get(merge_key)


def _in_order(items: list[Any], order: list[Any], merge_key: str | None) -> list[Any]:
    """``$setElementOrder``: the items the order names first, in its order; the others after."""
    keys = [_merge_key(o, merge_key) if merge_key else o for o in order]
    rank = {key: i for i, key in enumerate(keys)}

    def position(item: Any) -> int:
        key = _merge_key(item, merge_key) if merge_key else item
        return rank.get(key, len(rank))

    return sorted(items, key=position)


def _merge_keyed_list(old: list[Any], patch: list[Any], merge_key: str) -> list[Any]:
    if any(isinstance(item, dict) and item.get(_DIRECTIVE) == "replace" for item in patch):
        return [copy.deepcopy(i) for i in patch if not (isinstance(i, dict) and _DIRECTIVE in i)]
    merged = {_merge_key(item, merge_key): item for item in old}
    for item in patch:
        key = _merge_key(item, merge_key)
        if item.get(_DIRECTIVE) == "delete":
            merged.pop(key, None)
        elif item.get(_DIRECTIVE, "merge") != "merge":
            raise ValueError(f"unknown strategic merge patch directive {item[_DIRECTIVE]!r}")
        else:
            fields = {k: v for k, v in item.items() if k != _DIRECTIVE}
            merged[key] = merge_patch(merged.get(key, {}), fields, True)
    return list(merged.values())


def json_patch(target: Any, operations: Any) -> Any:
    """An RFC 6902 JSON patch (``add``, ``remove``, ``replace``, ``move``, ``copy``, ``test``;
    the ``jsonpatch`` library) applied to a copy of ``target``; ValueError for an operation
    that does not apply (the API server's 422)."""
    if not isinstance(operations, list):
        raise ValueError("a JSON patch is a list of operations")
    try:
        return jsonpatch.JsonPatch(operations).apply(target, in_place=False)
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as error:
        raise ValueError(str(error)) from error
    except (KeyError, TypeError, IndexError) as error:  # a malformed operation
        raise ValueError(f"invalid JSON patch operation: {error}") from error


def patch_type(content_type: str) -> str:
    """The patch format a PATCH request's Content-Type names; 415 for any other, with the
    message the API server writes."""
    media = content_type.split(";")[0].strip()
    if media not in PATCH_TYPES:
        raise ApiError(
            415,
            "UnsupportedMediaType",
            f"the body of the request was in an unknown format - accepted media types "
            f"include: {', '.join(PATCH_TYPES)}",
        )
    return media


# The media types a request body may have here (kube-apiserver also takes protobuf for built-in
# kinds, which the stand-in does not decode: refused as an unsupported media type).
BODY_MEDIA_TYPES = ("application/json", "application/yaml")


def decode_body(raw: bytes, content_type: str) -> Any:
    """A POST, PUT or DELETE body: JSON (also when no Content-Type is given) or YAML; None when
    empty. 415 for another media type, with kube-apiserver's message."""
    media = content_type.partition(";")[0].strip().lower()
    if media not in ("", "*/*", *BODY_MEDIA_TYPES):
        raise ApiError(
            415,
            "UnsupportedMediaType",
            "the body of the request was in an unknown format - accepted media types include: "
            + ", ".join(BODY_MEDIA_TYPES),
        )
    if not raw:
        return None
    if media == "application/yaml":
        try:
            return yaml.safe_load(raw.decode())
        except yaml.YAMLError as error:
            raise ApiError(400, "BadRequest", f"error decoding YAML: {error}") from None
    return json.loads(raw)


def decode_patch(raw: bytes, kind: str) -> Any:
    """A PATCH body of ``kind`` (:func:`patch_type`): JSON, or YAML for server-side apply."""
    if kind == APPLY_PATCH:
        try:
            body = yaml.safe_load(raw.decode() or "{}")
        except yaml.YAMLError as error:
            raise ApiError(400, "BadRequest", f"error decoding YAML: {error}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the apply patch is not an object")
        return body
    return json.loads(raw or b"{}")


def patched(old: dict[str, Any], body: Any, kind: str) -> dict[str, Any]:
    """``old`` after a JSON, merge or strategic merge patch ``body`` (:func:`patch_type`); 422
    for a JSON patch that does not apply, 400 for a malformed one."""
    try:
        if kind == JSON_PATCH:
            new = json_patch(old, body)
        elif isinstance(body, dict):
            new = merge_patch(old, body, strategic=kind != MERGE_PATCH)
        else:
            raise ApiError(400, "BadRequest", "the patch is not a JSON object")
    except ValueError as error:
        if kind == JSON_PATCH:
            raise ApiError(422, "Invalid", str(error)) from None
        raise ApiError(400, "BadRequest", str(error)) from None
    if not isinstance(new, dict):
        raise ApiError(422, "Invalid", "the patched object is not an object")
    return new


# kube-apiserver's limit on a field manager's name (and on the part of a User-Agent it takes)
FIELD_MANAGER_MAX_LENGTH = 128
# the options kind a write's query parameters decode into, by HTTP method
OPTIONS_KINDS = {
    "POST": "CreateOptions",
    "PUT": "UpdateOptions",
    "PATCH": "PatchOptions",
    "DELETE": "DeleteOptions",
}


def _go_strings(values: list[str]) -> str:
    return "[]string{" + ", ".join(json.dumps(v) for v in values) + "}"


def dry_run(values: list[str], options_kind: str) -> bool:
    """Whether a write's ``dryRun`` values ask for a dry run (``All``: validated and answered,
    nothing stored); any other value is refused with kube-apiserver's 422."""
    if all(v == "All" for v in values):
        return bool(values)
    detail = f'Unsupported value: {_go_strings(values)}: supported values: "All"'
    error = ApiError(422, "Invalid", f'{options_kind}.meta.k8s.io "" is invalid: dryRun: {detail}')
    error.status["details"] = {
        "group": "meta.k8s.io",
        "kind": options_kind,
        "causes": [{"reason": "FieldValueNotSupported", "message": detail, "field": "dryRun"}],
    }
    raise error


def force_apply(value: str | None, apply_patch: bool) -> bool:
    """A PATCH's ``force`` (``--force-conflicts``): only server-side apply takes it (422
    otherwise, as kube-apiserver's PatchOptions validation says)."""
    if value is None:
        return False
    if not apply_patch:
        detail = "Forbidden: may not be specified for non-apply patch"
        error = ApiError(422, "Invalid", f'PatchOptions.meta.k8s.io "" is invalid: force: {detail}')
        error.status["details"] = {
            "group": "meta.k8s.io",
            "kind": "PatchOptions",
            "causes": [{"reason": "FieldValueForbidden", "message": detail, "field": "force"}],
        }
        raise error
    if value in ("1", "t", "T", "true", "TRUE", "True"):
        return True
    if value in ("0", "f", "F", "false", "FALSE", "False"):
        return False
    raise ApiError(400, "BadRequest", f'strconv.ParseBool: parsing "{value}": invalid syntax')


def user_agent_manager(user_agent: str) -> str:
    """The field manager of a request that names none: its User-Agent up to the first ``/``,
    printable characters only, at most 128 bytes (kube-apiserver's prefixFromUserAgent)."""
    out = ""
    for char in user_agent.split("/")[0]:
        if not char.isprintable():
            continue
        if len((out + char).encode()) > FIELD_MANAGER_MAX_LENGTH:
            break
        out += char
    return out


def to_scale(obj: dict[str, Any]) -> dict[str, Any]:
    """The ``autoscaling/v1`` Scale of a ReplicaSet (its ``scale`` subresource): the desired
    replicas, the current ones and the selector as text."""
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    labels = (spec.get("selector") or {}).get("matchLabels") or {}
    meta = obj.get("metadata") or {}
    return {
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {
            k: meta[k]
            for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
            if k in meta
        },
        "spec": {"replicas": int(spec.get("replicas", 1))},
        "status": {
            "replicas": int(status.get("replicas") or 0),
            "selector": ",".join(f"{k}={v}" for k, v in sorted(labels.items())),
        },
    }


PROTOBUF = "application/vnd.kubernetes.protobuf"
_PROTOBUF_MAGIC = b"k8s\x00"


def _proto_fields(data: bytes) -> dict[int, list[Any]]:
    """A protobuf message's fields: number -> values (ints for varints, bytes for
    length-delimited fields; fixed-width ones are skipped)."""
    out: dict[int, list[Any]] = {}
    i = 0

    def varint() -> int:
        nonlocal i
        value = shift = 0
        while True:
            byte = data[i]
            i += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    while i < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            out.setdefault(number, []).append(varint())
        elif wire == 2:
            size = varint()
            out.setdefault(number, []).append(data[i : i + size])
            i += size
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
    return out


def _proto_strings(data: bytes, names: dict[int, str]) -> dict[str, str]:
    fields = _proto_fields(data)
    return {name: fields[n][-1].decode() for n, name in names.items() if n in fields}


_RESOURCE_ATTRIBUTES = {
    1: "namespace",
    2: "verb",
    3: "group",
    4: "version",
    5: "resource",
    6: "subresource",
    7: "name",
}


def decode_review(raw: bytes, content_type: str) -> dict[str, Any]:
    """A (Self)SubjectAccessReview as sent: JSON, or the protobuf that client-go's typed
    clients send for built-in kinds (``kubectl auth can-i``): the ``k8s\\0`` envelope
    (runtime.Unknown) around the review, of which the spec's attributes, user and groups are
    read."""
    if content_type.split(";")[0].strip() != PROTOBUF:
        return json.loads(raw or b"{}")
    if not raw.startswith(_PROTOBUF_MAGIC):
        raise ApiError(400, "BadRequest", "provided protobuf is not a Kubernetes object")
    unknown = _proto_fields(raw[len(_PROTOBUF_MAGIC) :])
    type_meta = _proto_strings(unknown.get(1, [b""])[-1], {1: "apiVersion", 2: "kind"})
    review = _proto_fields(unknown.get(2, [b""])[-1])
    spec_fields = _proto_fields(review.get(2, [b""])[-1])
    spec: dict[str, Any] = {}
    if 1 in spec_fields:
        spec["resourceAttributes"] = _proto_strings(spec_fields[1][-1], _RESOURCE_ATTRIBUTES)
    if 2 in spec_fields:
        spec["nonResourceAttributes"] = _proto_strings(spec_fields[2][-1], {1: "path", 2: "verb"})
    if type_meta.get("kind") == "SubjectAccessReview":
        if 3 in spec_fields:
            spec["user"] = spec_fields[3][-1].decode()
        spec["groups"] = [g.decode() for g in spec_fields.get(4, [])]
    return {**type_meta, "metadata": {}, "spec": spec}


def _header_list(handler: BaseHTTPRequestHandler, name: str) -> list[str]:
    return [v.strip() for v in handler.headers.get_all(name) or [] if v.strip()]


class Server(ThreadingHTTPServer):
    daemon_threads = False
    block_on_close = True  # server_close() joins every handler thread
    # The fake API server this transport serves (``api_server.FakeKubernetes``, which sets it):
    # typed loosely so that the transport does not import the server built on it.
    fake: Any

    def __init__(self, *args: Any) -> None:
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(*args)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conns_lock:
            self._conns.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a client hanging up is no error
            super().handle_error(request, client_address)

    def close_connections(self) -> None:
        """Unblock handler threads waiting on idle keep-alive connections."""
        with self._conns_lock:
            for conn in list(self._conns):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class _TableEvents:
    """A watch's events with each object as a one-row Table (``kubectl get -w``): the columns
    in the first event only, as kube-apiserver sends them."""

    def __init__(self, handler: Handler, resource: str = "pods") -> None:
        self.handler = handler
        self.resource = resource
        self.first = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handler, name)

    def write_chunk(self, event: dict[str, Any]) -> None:
        obj = event.get("object") or {}
        if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
            rv = obj.get("metadata", {}).get("resourceVersion", "")
            table = object_table(self.resource, [obj], rv)
            if not self.first:
                table["columnDefinitions"] = []
            self.first = False
            event = {**event, "object": table}
        self.handler.write_chunk(event)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as separate small writes
    server: Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, code: int, body: dict[str, Any]) -> None:
        from kfp_elastic.testing import api_validation  # built on this module

        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        for text in api_validation.warnings():  # what kubectl prints as "Warning: <text>"
            self.send_header("Warning", api_validation.warning_header(text))
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()

    def write_chunk(self, event: dict[str, Any]) -> None:
        self.write_bytes(json.dumps(event).encode() + b"\n")

    def write_bytes(self, data: bytes) -> None:
        """One chunk of a chunked response."""
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def end_stream(self) -> None:
        try:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            self.close_connection = True

    def _dispatch(self, method: str) -> None:
        from kfp_elastic.testing import api_validation  # built on this module

        fake = self.server.fake
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        fake.requests.append((method, url.path, query))
        call = api_call(method, url.path, query)
        if call is not None:
            fake.api_calls.append(call)
        raw = self._read_body()
        try:
            # Authentication, then RBAC, then the handler, as the API server's filters run.
            user = fake.authenticate(self.headers.get("Authorization", ""))
            user = fake.impersonate(
                user, self.headers.get("Impersonate-User"), _header_list(self, "Impersonate-Group")
            )
            if call is None:
                found = (
                    discovery(
                        url.path,
                        OBJECT_KINDS,
                        CLUSTER_SCOPED,
                        fake.custom_discovery(),
                        fake.custom_schemas() if url.path.startswith("/openapi/") else None,
                    )
                    if method == "GET"
                    else None
                )
                if found is not None:  # kubectl's first requests
                    return self._send(200, found)
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            fake.authorize(user, call)
            if method in ("POST", "PUT", "PATCH"):
                api_validation.begin_write(method, query)
            # A write's options: dryRun=All answers it as it would be answered and stores
            # nothing; the field manager defaults to the User-Agent's first part.
            dry = method in OPTIONS_KINDS and dry_run(
                self._dry_run_values(method, url.query, raw), OPTIONS_KINDS[method]
            )
            manager = query.get("fieldManager") or user_agent_manager(
                self.headers.get("User-Agent", "")
            )
            review = REVIEW_KINDS.get(call.resource, ("", "-"))
            if call.group == review[1].partition("/")[0] and not call.name:
                if method != "POST":
                    raise ApiError(
                        405,
                        "MethodNotAllowed",
                        "the server does not allow this method on the requested resource",
                    )
                body = decode_review(raw, self.headers.get("Content-Type", ""))
                if (body.get("kind"), body.get("apiVersion")) != review:
                    raise ApiError(400, "BadRequest", f"expected a {review[0]} of {review[1]}")
                return self._send(201, fake.review_access(user, body))
            kinds, cluster_scoped = fake.object_kinds()  # built-in and custom (api_crds)
            kind = kinds.get(call.resource, ("", ""))
            if kind[1].rpartition("/")[0] == call.group and call.resource not in OBJECT_KINDS:
                fake.serve_custom(call.resource, _API_PATH.fullmatch(url.path)["version"])
            every_namespace = not call.namespace and method == "GET" and not call.name
            events_v1 = (call.group, call.resource) == ("events.k8s.io", "events")
            if (
                call.resource != "pods"
                and (kind[1].rpartition("/")[0] == call.group or events_v1)
                and (
                    not call.namespace
                    if call.resource in cluster_scoped
                    else call.namespace or every_namespace
                )
                and call.subresource in ("", "scale" if call.resource == "replicasets" else "")
            ):
                return self._dispatch_object(method, call, query, raw, events_v1, dry, manager)
            if call.group or call.resource != "pods" or not (call.namespace or every_namespace):
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            ns, name, sub = call.namespace, call.name or None, call.subresource
            fields = parse_field_selector(query.get("fieldSelector", ""))
            if method == "PATCH" and name and sub in ("", "status"):
                kind = patch_type(self.headers.get("Content-Type", ""))
                force = force_apply(query.get("force"), kind == APPLY_PATCH)
                patch = decode_patch(raw, kind)
                if kind == APPLY_PATCH and not sub:
                    pod, created = fake.apply(
                        ns, name, patch, query.get("fieldManager", ""), force=force, dry_run=dry
                    )
                    return self._send(201 if created else 200, pod)
                if kind == APPLY_PATCH:
                    raise ApiError(
                        405, "MethodNotAllowed", "server-side apply of pods/status is not served"
                    )
                return self._send(
                    200,
                    fake.patch(
                        ns, name, patch, kind, status_only=bool(sub), manager=manager, dry_run=dry
                    ),
                )
            body = decode_body(raw, self.headers.get("Content-Type", ""))
            table = wants_table(self.headers.get("Accept", ""))
            if method == "GET" and name is None and query.get("watch", "").lower() in ("true", "1"):
                try:
                    return fake.watch(_TableEvents(self) if table else self, ns, query)
                except OSError:  # the client went away mid-stream
                    self.close_connection = True
                    return
            if method == "GET" and name is None:
                listed = fake.list(ns, query.get("labelSelector", ""), fields=fields)
                if table:
                    rv = listed["metadata"].get("resourceVersion", "")
                    return self._send(200, pod_table(listed["items"], rv))
                return self._send(200, listed)
            if method == "POST" and name is None:
                return self._send(201, fake.create(ns, body or {}, dry, manager=manager))
            if method == "GET" and name and not sub:
                pod = fake.pod(name, ns)
                if table:
                    return self._send(200, pod_table([pod], pod["metadata"]["resourceVersion"]))
                return self._send(200, pod)
            if method == "DELETE" and name and not sub:
                opts = body or {}
                grace = query.get("gracePeriodSeconds", opts.get("gracePeriodSeconds"))
                return self._send(
                    200,
                    fake.delete(
                        ns,
                        name,
                        None if grace is None else int(grace),
                        opts.get("preconditions"),
                        dry_run=dry,
                    ),
                )
            if method == "GET" and name and sub == "log":
                return self._send_log(ns, name, query)
            if method == "POST" and name and sub == "eviction":
                return self._send(201, fake.create_eviction(ns, name, body, dry_run=dry))
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on {url.path}")
        except ApiError as exc:
            self._send(exc.status["code"], exc.status)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            self._send(400, ApiError(400, "BadRequest", f"bad request: {exc}").status)

    def _read_body(self) -> bytes:
        """The request's body: ``Content-Length`` bytes, or the chunks of a chunked one
        (``kubectl create --raw -f`` streams its file)."""
        if "chunked" not in self.headers.get("Transfer-Encoding", "").lower():
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""
        chunks = []
        while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
            chunks.append(self.rfile.read(size))
            self.rfile.readline()  # the chunk's CRLF
        while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
            pass
        return b"".join(chunks)

    def _dry_run_values(self, method: str, query: str, raw: bytes) -> list[str]:
        """A write's ``dryRun`` values: the query's, or for a delete its DeleteOptions body's
        where that names them (kubectl delete --dry-run=server sends them there)."""
        values = parse_qs(query, keep_blank_values=True).get("dryRun", [])
        if method == "DELETE" and raw:
            try:
                options = json.loads(raw)
            except ValueError:
                options = None
            if isinstance(options, dict) and isinstance(options.get("dryRun"), list):
                values = [str(v) for v in options["dryRun"]]
        return values

    def _send_log(self, ns: str, name: str, query: dict[str, str]) -> None:
        """``pods/log`` (``kubectl logs``): a container's output as text; ``tailLines``; with
        ``follow=true`` streamed until the pod has ended or is gone."""
        fake = self.server.fake
        pod = fake.pod(name, ns)  # 404 for an unknown pod
        containers = [c["name"] for c in pod["spec"].get("containers") or ()]
        container = query.get("container") or (containers[0] if len(containers) == 1 else "")
        if container not in containers:
            raise ApiError(
                400,
                "BadRequest",
                f"a container name must be specified for pod {name}, choose one of: {containers}"
                if not container
                else f"container {container} is not valid for pod {name}",
            )

        def read() -> str | None:
            return None if fake.pod_logs is None else fake.pod_logs(ns, name, container)

        text = read()
        if text is None:
            raise ApiError(
                400,
                "BadRequest",
                f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating',
            )
        if query.get("tailLines"):
            lines = text.splitlines(keepends=True)
            text = "".join(lines[-int(query["tailLines"]) :]) if int(query["tailLines"]) else ""
        if query.get("follow", "").lower() not in ("true", "1"):
            data = text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        sent = len(read() or "")
        try:
            if text:
                self.write_bytes(text.encode())
            while True:
                try:
                    phase = fake.pod(name, ns)["status"].get("phase")
                except ApiError:
                    phase = "gone"
                now = read() or ""
                if len(now) > sent:
                    self.write_bytes(now[sent:].encode())
                    sent = len(now)
                if phase in ("Succeeded", "Failed", "gone"):
                    break
                time.sleep(0.2)
        except OSError:
            self.close_connection = True
            return
        self.end_stream()

    def _dispatch_object(
        self,
        method: str,
        call: ApiCall,
        query: dict[str, str],
        raw: bytes,
        events_v1: bool,
        dry: bool = False,
        manager: str = "",
    ) -> None:
        """A stored object of a kind other than Pod; ``events_v1``: an Event read through
        ``events.k8s.io/v1`` (get and list only). ``dry``: a dry run of a write; ``manager``:
        the write's field manager."""
        fake = self.server.fake
        resource, ns, name = call.resource, call.namespace, call.name or None
        if call.subresource == "scale":
            return self._dispatch_scale(method, call, raw, dry, manager)
        table = wants_table(self.headers.get("Accept", ""))
        watching = query.get("watch", "").lower() in ("true", "1")
        if events_v1 and (method != "GET" or watching):
            # discovery lists get and list only: refused as a real server refuses a verb a
            # resource does not support
            raise ApiError(
                405,
                "MethodNotAllowed",
                "the server does not allow this method on the requested resource",
            )
        if method == "GET" and name is None and watching:
            try:
                return fake.watch(
                    _TableEvents(self, resource) if table else self, ns, query, resource
                )
            except OSError:  # the client went away mid-stream
                self.close_connection = True
                return
        if method == "GET" and name is None:
            fields = parse_field_selector(query.get("fieldSelector", ""), resource)
            listed = fake.list_objects(resource, ns, query.get("labelSelector", ""), fields)
            if table:
                rv = listed["metadata"]["resourceVersion"]
                return self._send(200, object_table(resource, listed["items"], rv))
            return self._send(200, to_events_v1_list(listed) if events_v1 else listed)
        if method == "POST" and name is None:
            body = decode_body(raw, self.headers.get("Content-Type", "")) or {}
            return self._send(
                201, fake.create_object(resource, ns, body, manager=manager, dry_run=dry)
            )
        if method == "GET" and name:
            obj = fake.get_object(resource, ns, name)
            if table:
                rv = obj["metadata"].get("resourceVersion", "")
                return self._send(200, object_table(resource, [obj], rv))
            return self._send(200, to_events_v1(obj) if events_v1 else obj)
        if method == "PUT" and name:
            body = decode_body(raw, self.headers.get("Content-Type", "")) or {}
            return self._send(
                200, fake.replace_object(resource, ns, body, manager=manager, dry_run=dry)
            )
        if method == "PATCH" and name:
            kind = patch_type(self.headers.get("Content-Type", ""))
            force = force_apply(query.get("force"), kind == APPLY_PATCH)
            body = decode_patch(raw, kind)
            if kind == APPLY_PATCH:
                applier = query.get("fieldManager", "")
                obj, created = fake.apply_object(
                    resource, ns, name, body, applier, force=force, dry_run=dry
                )
                return self._send(201 if created else 200, obj)
            return self._send(
                200,
                fake.patch_object(resource, ns, name, body, kind, manager=manager, dry_run=dry),
            )
        if method == "DELETE" and name:
            return self._send(200, fake.delete_object(resource, ns, name, dry_run=dry))
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on {resource}")

    def _dispatch_scale(
        self, method: str, call: ApiCall, raw: bytes, dry: bool = False, manager: str = ""
    ) -> None:
        """A ReplicaSet's ``scale`` subresource (``kubectl scale``): GET, PUT and PATCH of its
        autoscaling/v1 Scale; a write changes the ReplicaSet's ``spec.replicas`` (its manager's
        ``Update`` entry through the ``scale`` subresource owns it)."""
        fake = self.server.fake
        obj = fake.get_object(call.resource, call.namespace, call.name)
        scale = to_scale(obj)
        if method == "GET":
            return self._send(200, scale)
        if method == "PUT":
            wanted = decode_body(raw, self.headers.get("Content-Type", "")) or {}
        elif method == "PATCH":
            kind = patch_type(self.headers.get("Content-Type", ""))
            if kind == APPLY_PATCH:
                raise ApiError(
                    415, "UnsupportedMediaType", "server-side apply of a scale is not served"
                )
            wanted = patched(scale, decode_patch(raw, kind), kind)
        else:
            raise ApiError(
                405, "MethodNotAllowed", "the server does not allow this method on scale"
            )
        rv = (wanted.get("metadata") or {}).get("resourceVersion")
        if rv not in (None, "", scale["metadata"]["resourceVersion"]):
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on replicasets.apps "{call.name}": the object '
                "has been modified; please apply your changes to the latest version and try "
                "again",
            )
        replicas = (wanted.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise ApiError(
                422,
                "Invalid",
                f'Scale.autoscaling "{call.name}" is invalid: spec.replicas: Invalid value: '
                f"{replicas}: must be greater than or equal to 0",
            )
        new = fake.patch_object(
            call.resource,
            call.namespace,
            call.name,
            {"spec": {"replicas": replicas}},
            MERGE_PATCH,
            manager=manager,
            dry_run=dry,
            subresource="scale",
        )
        return self._send(200, to_scale(new))

    def _handle(self) -> None:
        from kfp_elastic.testing import api_validation  # built on this module

        def serve() -> None:
            with api_validation.serving():  # the request's fieldValidation and warnings
                self._dispatch(self.command)

        # in a context of its own: what a request sets there (api_crds) ends with it
        contextvars.copy_context().run(serve)

    do_GET = do_POST = do_DELETE = do_PATCH = do_PUT = _handle  # http.server's naming
