"""Field ownership as kube-apiserver tracks it in ``metadata.managedFields``, and server-side
apply on top of it: pure functions over plain objects (dicts), no storage, no HTTP.

Every write records who set what. A create, an update (PUT) or a patch by a field manager
(``?fieldManager=``, else the User-Agent up to its first ``/``: ``kubectl-create``,
``kubectl-client-side-apply``, ``kubectl-patch``, ``OpenAPI-Generator`` for the Python client)
gives it an ``Update`` entry owning the fields it added or changed, which no other manager
owns any more; fields it removed leave every manager's set. Server-side apply
(:func:`server_side_apply`) gives the applier an ``Apply`` entry owning exactly the fields of its
configuration: setting a field another manager owns to another value is a conflict (409, with
the message and ``details.causes`` kube-apiserver sends) unless forced (the fields then leave
the other managers' sets); the same value is shared ownership; a field it applied before and
leaves out now is removed from the object unless another manager owns it.

Field sets follow kubernetes-sigs/structured-merge-diff (``FieldsV1``): ``f:<name>`` per map
key, ``k:{...}`` per item of an associative list (containers by name, ports by port and
protocol, env, volumes, ...: the lists ``api_wire``'s strategic merge patch merges by key),
``v:<value>`` per item of a set (``metadata.finalizers``); any other list, and the label
selectors and ``nodeSelector``, are atomic (one field). A path is a tuple of those elements.
Simplified: the schema is known by field name only (no OpenAPI), a creator owns the fields it
sent (kube-apiserver also gives it its scheme's defaults), and Update managers are not capped
at ten.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, replace
from typing import Any

from kfp_elastic.testing.api_wire import _MERGE_KEYS, _MERGED_SCALAR_LISTS, ApiError

Path = tuple[str, ...]
FieldSet = frozenset[Path]

LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"
# kubectl apply --server-side's default manager: kube-apiserver lets it take over fields that
# kubectl's client-side apply set (the last-applied annotation) and keeps that annotation current.
KUBECTL_APPLY_MANAGER = "kubectl"
# The maps that are one field (structured-merge-diff's atomic maps and structs): LabelSelectors
# (``+structType=atomic``), a Service's selector and a pod's nodeSelector (``+mapType=atomic``).
ATOMIC_MAPS = frozenset(
    {"selector", "podSelector", "namespaceSelector", "labelSelector", "nodeSelector"}
)
# metadata fields no manager ever owns (kube-apiserver's stripMetaManager).
_SERVER_META = (
    "name",
    "namespace",
    "creationTimestamp",
    "selfLink",
    "uid",
    "clusterName",
    "generation",
    "managedFields",
    "resourceVersion",
)
_STRIPPED: FieldSet = frozenset(
    {("f:apiVersion",), ("f:kind",), ("f:metadata",)}
    | {("f:metadata", f"f:{name}") for name in _SERVER_META}
)
# What a created object is compared with: the fields the kind's empty Go object has (so that a
# creator's entry marks ``.`` on the maps it added, not on those every object has).
_POD_SPEC: dict[str, Any] = {"containers": None}
_TEMPLATE: dict[str, Any] = {"metadata": {}, "spec": _POD_SPEC}
_EMPTY_OBJECTS: dict[str, dict[str, Any]] = {
    "Pod": {"spec": _POD_SPEC},
    "ReplicaSet": {"spec": {"selector": None, "template": _TEMPLATE}},
    "StatefulSet": {"spec": {"selector": None, "template": _TEMPLATE}},
    "RoleBinding": {"roleRef": {}},
    "ClusterRoleBinding": {"roleRef": {}},
}
_KINDS_WITH_SPEC = frozenset(
    {"Node", "Namespace", "Service", "PodDisruptionBudget", "NetworkPolicy"}
)


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()  # a field that is not there (unlike one that is null)


# -- paths and FieldsV1 --------------------------------------------------------------------


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def list_keys(list_name: str, item: dict[str, Any]) -> dict[str, Any]:
    """The key fields of an associative list's item: the strategic merge key, and for ports the
    protocol too (``k:{"containerPort":80,"protocol":"TCP"}``; a Service's ports by ``port``);
    a missing protocol is its default, TCP."""
    if list_name == "ports":
        number = "containerPort" if "containerPort" in item else "port"
        return {number: item.get(number), "protocol": item.get("protocol", "TCP")}
    key = _MERGE_KEYS[list_name]
    return {key: item.get(key)}


def item_element(list_name: str, kind: str, item: Any) -> str:
    """The path element of a list item: ``k:{...}`` in an associative list, ``v:<value>`` in a
    set."""
    if kind == "set" or not isinstance(item, dict):
        return "v:" + _compact(item)
    return "k:" + _compact(dict(sorted(list_keys(list_name, item).items())))


def path_string(path: Path) -> str:
    """A path as kube-apiserver writes it in a conflict: ``.spec.containers[name="main"].image``,
    ``.spec.ports[port=80,protocol="TCP"]``, ``.metadata.finalizers[="x"]``."""
    out = []
    for element in path:
        kind, _, rest = element.partition(":")
        if kind == "f":
            out.append("." + rest)
        elif kind == "k":
            keys = json.loads(rest)
            out.append("[" + ",".join(f"{k}={_compact(keys[k])}" for k in sorted(keys)) + "]")
        elif kind == "v":
            out.append(f"[={_compact(json.loads(rest))}]")
        else:
            out.append(f"[{rest}]")
    return "".join(out)


def _element_order(element: str) -> tuple[int, str]:
    """structured-merge-diff's order of path elements: field names, then keys, values,
    indexes."""
    return ("fkvi".find(element[:1]), element[2:])


def path_order(path: Path) -> list[tuple[int, tuple[int, str]]]:
    """The order in which a set iterates its paths: at each level the members before the
    children, each sorted."""
    return [(0 if i == len(path) - 1 else 1, _element_order(e)) for i, e in enumerate(path)]


def encode_fields(paths: FieldSet | set[Path]) -> dict[str, Any]:
    """A set of paths as ``FieldsV1``: a member with children gets ``".": {}``."""
    members = {p[0] for p in paths if len(p) == 1}
    children: dict[str, set[Path]] = {}
    for p in paths:
        if len(p) > 1:
            children.setdefault(p[0], set()).add(p[1:])
    out: dict[str, Any] = {}
    for element in sorted(members | set(children), key=_element_order):
        sub = encode_fields(children.get(element, set()))
        out[element] = {".": {}, **sub} if element in members and sub else sub
    return out


def decode_fields(fields: dict[str, Any], prefix: Path = ()) -> set[Path]:
    """The paths a ``FieldsV1`` holds."""
    out: set[Path] = set()
    for element, sub in fields.items():
        if element == ".":
            if prefix:
                out.add(prefix)
        elif isinstance(sub, dict) and sub:
            out |= decode_fields(sub, (*prefix, element))
        else:
            out.add((*prefix, element))
    return out


# -- the schema, known by field name -------------------------------------------------------


def _kind(name: str | None, *values: Any) -> str:
    """How structured-merge-diff treats the field ``name`` holding ``values`` (either side of
    a comparison): ``map`` (merged key by key), ``assoc`` (a list merged by key), ``set`` (a list
    of scalars merged by value), ``atomic`` (one field) or ``leaf`` (a scalar or null)."""
    present = [v for v in values if v is not MISSING and v is not None]
    if not present:
        return "leaf"
    if all(isinstance(v, dict) for v in present):
        return "atomic" if name in ATOMIC_MAPS else "map"
    if all(isinstance(v, list) for v in present):
        if name in _MERGED_SCALAR_LISTS:
            return "set"
        if name in _MERGE_KEYS and all(isinstance(i, dict) for v in present for i in v):
            return "assoc"
        return "atomic"
    return "leaf"


def _items(name: str | None, kind: str, value: Any) -> dict[str, Any]:
    """A list's items by path element (a later duplicate wins)."""
    if not isinstance(value, list):
        return {}
    return {item_element(name or "", kind, item): item for item in value}


def field_set(obj: Any, prefix: Path = ()) -> set[Path]:
    """The fields ``obj`` sets (structured-merge-diff's ToFieldSet): its scalars, nulls, empty
    maps and atomic fields, and each item of its associative lists and sets; maps holding
    something are not members themselves."""
    out: set[Path] = set()
    if not isinstance(obj, dict):
        return out
    for name, value in obj.items():
        path = (*prefix, f"f:{name}")
        kind = _kind(name, value)
        if kind == "map":
            if value:
                out |= field_set(value, path)
            else:
                out.add(path)
        elif kind in ("assoc", "set"):
            for element, item in _items(name, kind, value).items():
                out.add((*path, element))
                if kind == "assoc":
                    out |= field_set(item, (*path, element))
        else:
            out.add(path)
    return out


def _named_closure(paths: set[Path] | FieldSet) -> set[Path]:
    """``paths`` and every field that holds one of them (structured-merge-diff's
    EnsureNamedFieldsAreMembers; the items of a list are not added)."""
    out = set(paths)
    for path in paths:
        for i in range(1, len(path)):
            if path[i - 1].startswith("f:"):
                out.add(path[:i])
    return out


# -- comparing and merging -----------------------------------------------------------------


@dataclass
class Comparison:
    """What changed from one object to another (structured-merge-diff's Compare): ``added``
    holds every path of a new subtree, ``removed`` of a gone one, ``modified`` the leaves and
    atomic fields whose value changed."""

    added: set[Path] = field(default_factory=set)
    modified: set[Path] = field(default_factory=set)
    removed: set[Path] = field(default_factory=set)


def _empty(value: Any) -> bool:
    return value is MISSING or value is None or value in ({}, [])


def compare(old: Any, new: Any) -> Comparison:
    """The changes from ``old`` to ``new`` (two objects, or MISSING)."""
    out = Comparison()
    _compare(old, new, (), None, out)
    return out


def _compare(lhs: Any, rhs: Any, path: Path, name: str | None, out: Comparison) -> None:
    kind = "map" if not path else _kind(name, lhs, rhs)
    if kind in ("map", "assoc", "set") and not (_empty(lhs) and _empty(rhs)):
        if kind == "map":
            left = lhs if isinstance(lhs, dict) else {}
            right = rhs if isinstance(rhs, dict) else {}
            for key in dict.fromkeys([*left, *right]):
                lval, rval = left.get(key, MISSING), right.get(key, MISSING)
                _compare(lval, rval, (*path, f"f:{key}"), key, out)
        else:
            left, right = _items(name, kind, lhs), _items(name, kind, rhs)
            for element in dict.fromkeys([*left, *right]):
                child = (*path, element)
                if kind == "set":
                    if element not in left:
                        out.added.add(child)
                    elif element not in right:
                        out.removed.add(child)
                else:
                    lval, rval = left.get(element, MISSING), right.get(element, MISSING)
                    _compare(lval, rval, child, None, out)
        if lhs is MISSING:
            out.added.add(path)
        elif rhs is MISSING:
            out.removed.add(path)
        return
    if lhs is MISSING:
        if rhs is not MISSING:
            out.added.add(path)
    elif rhs is MISSING:
        out.removed.add(path)
    elif lhs != rhs:
        out.modified.add(path)


def merge(live: Any, config: Any, name: str | None = None) -> Any:
    """``config`` merged into ``live`` as server-side apply merges them: maps key by key,
    associative lists and sets item by item (:func:`_merge_list`), anything else replaced."""
    if config is MISSING:
        return copy.deepcopy(live)
    if live is MISSING:
        return copy.deepcopy(config)
    kind = "map" if name is None and isinstance(config, dict) else _kind(name, live, config)
    if kind == "map" and isinstance(live, dict) and isinstance(config, dict):
        out = copy.deepcopy(live)
        for key, value in config.items():
            out[key] = merge(live.get(key, MISSING), value, key)
        return out
    if kind in ("assoc", "set") and isinstance(live, list) and isinstance(config, list):
        return _merge_list(name or "", kind, live, config)
    return copy.deepcopy(config)


def _merge_list(name: str, kind: str, live: list[Any], config: list[Any]) -> list[Any]:
    """Two keyed lists merged: the applied items in their order (each merged with its live
    one), and each live-only item right after the item it followed in the live list (at the
    front if none did)."""
    left, right = _items(name, kind, live), _items(name, kind, config)
    runs: dict[str | None, list[str]] = {None: []}  # live-only items by the item before them
    anchor = None
    for element in dict.fromkeys(item_element(name, kind, i) for i in live):
        if element in right:
            anchor = element
        else:
            runs.setdefault(anchor, []).append(element)
    order = [*runs[None]]
    for element in right:
        order += [element, *runs.get(element, [])]
    return [merge(left.get(e, MISSING), right.get(e, MISSING), None) for e in order]


def remove_paths(obj: Any, paths: set[Path]) -> Any:
    """A copy of ``obj`` without the fields and list items at ``paths`` (with what they hold)."""
    obj = copy.deepcopy(obj)
    for path in sorted(paths, key=len):
        _remove(obj, path, None)
    return obj


def _remove(value: Any, path: Path, name: str | None) -> None:
    element, rest = path[0], path[1:]
    if isinstance(value, dict) and element.startswith("f:"):
        key = element[2:]
        if key not in value:
            return
        if rest:
            _remove(value[key], rest, key)
        else:
            del value[key]
    elif isinstance(value, list):
        kind = _kind(name, value)
        if kind not in ("assoc", "set"):
            return
        for i, item in enumerate(value):
            if item_element(name or "", kind, item) == element:
                if rest:
                    _remove(item, rest, None)
                else:
                    del value[i]
                return


def _drop_nulls(value: Any) -> Any:
    """What the typed object keeps of an applied null: nothing."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


# -- managers ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manager:
    """One managedFields entry: who, how (``Apply`` or ``Update``), through which apiVersion and
    subresource, when, and the fields it owns."""

    manager: str
    operation: str
    api_version: str
    fields: FieldSet
    time: str | None = None
    subresource: str = ""

    @property
    def identifier(self) -> str:
        """kube-apiserver's manager identifier: one entry per applier (and subresource), one per
        updater, apiVersion and subresource; as JSON, which orders a conflict message."""
        entry = {"manager": self.manager, "operation": self.operation}
        if self.operation == "Update":
            entry["apiVersion"] = self.api_version
        if self.subresource:
            entry["subresource"] = self.subresource
        return _compact({k: v for k, v in entry.items() if v})

    def described(self) -> str:
        """The manager as a conflict names it: ``"kubectl-client-side-apply" using v1``."""
        text = json.dumps(self.manager)
        if self.subresource:
            text += f" with subresource {json.dumps(self.subresource)}"
        if self.operation == "Update":
            text += f" using {self.api_version}"
        return text

    def entry(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "manager": self.manager,
            "operation": self.operation,
            "apiVersion": self.api_version,
        }
        if self.time is not None:
            out["time"] = self.time
        out.update(fieldsType="FieldsV1", fieldsV1=encode_fields(self.fields))
        if self.subresource:
            out["subresource"] = self.subresource
        return out


Managers = dict[str, Manager]


def decode_managers(entries: Any) -> Managers | None:
    """The managers of a ``metadata.managedFields`` list; None where it is not one kube-apiserver
    can decode (an operation other than Apply or Update, no apiVersion, no FieldsV1)."""
    out: Managers = {}
    if not isinstance(entries, list):
        return None
    for entry in entries:
        if not isinstance(entry, dict) or entry.get("operation") not in ("Apply", "Update"):
            return None
        if not entry.get("apiVersion") or entry.get("fieldsType") != "FieldsV1":
            return None
        fields = entry.get("fieldsV1") or {}
        if not isinstance(fields, dict):
            return None
        manager = Manager(
            str(entry.get("manager", "")),
            entry["operation"],
            entry["apiVersion"],
            frozenset(decode_fields(fields)),
            entry.get("time"),
            entry.get("subresource", ""),
        )
        out[manager.identifier] = manager
    return out


def encode_managers(managers: Managers) -> list[dict[str, Any]]:
    """managedFields as kube-apiserver orders it: by operation (Apply first), time, manager,
    apiVersion, subresource."""
    ordered = sorted(
        managers.values(),
        key=lambda m: (m.operation, m.time or "", m.manager, m.api_version, m.subresource),
    )
    return [m.entry() for m in ordered]


def _managers_of(obj: dict[str, Any] | None) -> Managers:
    return decode_managers(((obj or {}).get("metadata") or {}).get("managedFields") or []) or {}


def _with_managers(obj: dict[str, Any], managers: Managers) -> dict[str, Any]:
    meta = obj.setdefault("metadata", {})
    if managers:
        meta["managedFields"] = encode_managers(managers)
    else:
        meta.pop("managedFields", None)
    return obj


def tracked(obj: dict[str, Any] | None, subresource: str = "") -> Any:
    """What the field managers of a write through ``subresource`` ("": the object itself) may
    own: the object without its status (reset by the main resource), type and server-set
    metadata; through ``status`` its status only; through ``scale`` its ``spec.replicas``."""
    if obj is None:
        return MISSING
    if subresource == "status":
        return {"status": copy.deepcopy(obj.get("status", {}))}
    if subresource == "scale":
        replicas = (obj.get("spec") or {}).get("replicas", MISSING)
        return {"spec": {} if replicas is MISSING else {"replicas": replicas}}
    out = {k: copy.deepcopy(v) for k, v in obj.items() if k not in ("apiVersion", "kind", "status")}
    meta = out.get("metadata")
    out["metadata"] = {
        k: v for k, v in (meta if isinstance(meta, dict) else {}).items() if k not in _SERVER_META
    }
    return out


def empty_object(kind: str) -> dict[str, Any]:
    """The object a create is compared with: what the kind's empty object has."""
    base = _EMPTY_OBJECTS.get(kind) or ({"spec": {}} if kind in _KINDS_WITH_SPEC else {})
    return {**copy.deepcopy(base), "metadata": {}}


# -- writes --------------------------------------------------------------------------------


def _is_reset(entries: Any) -> bool:
    """managedFields ``[]`` or ``[{}]`` in a write: the client clears them."""
    return isinstance(entries, list) and (entries == [] or entries == [{}])


def update_managed_fields(
    live: dict[str, Any] | None,
    new: dict[str, Any],
    manager: str,
    api_version: str,
    now: str,
    subresource: str = "",
) -> dict[str, Any]:
    """``new`` (a copy) with the managedFields of ``manager`` having written it over ``live``
    (None: a create) through ``subresource``: an ``Update`` entry owning the fields it added or
    changed (its earlier ones kept; the time now); every other manager loses those and the
    removed ones. managedFields that the write itself sets are the starting point (kubectl's
    move of client-side apply's fields to server-side apply writes them); ``[]`` or ``[{}]``
    clear them; a subresource cannot set them."""
    new = copy.deepcopy(new)
    sent = (new.get("metadata") or {}).get("managedFields")
    if subresource:
        managers = _managers_of(live)
    elif _is_reset(sent):
        managers = {}
    else:
        managers = decode_managers(sent) if sent else None
        if not managers:
            managers = _managers_of(live)
    old = tracked(live, subresource) if live is not None else empty_object(new.get("kind", ""))
    changes = compare(old, tracked(new, subresource))
    taken = (changes.added | changes.modified) - _STRIPPED
    for key, other in list(managers.items()):
        managers[key] = replace(
            other, fields=other.fields - changes.added - changes.modified - changes.removed
        )
    writer = Manager(manager, "Update", api_version, frozenset(), subresource=subresource)
    if taken:
        previous = managers.get(writer.identifier)
        owned = taken | (previous.fields if previous else frozenset())
        managers[writer.identifier] = replace(writer, fields=frozenset(owned), time=now)
    return _with_managers(new, {k: m for k, m in managers.items() if m.fields})


def conflict_error(conflicts: list[tuple[Manager, Path]]) -> ApiError:
    """kube-apiserver's 409 for an apply's conflicts: the message kubectl prints, one
    ``FieldManagerConflict`` cause per field."""
    ordered = sorted(conflicts, key=lambda c: (c[0].identifier, path_order(c[1])))
    if len(ordered) == 1:
        owner, path = ordered[0]
        message = (
            f"Apply failed with 1 conflict: conflict with {owner.described()}: {path_string(path)}"
        )
    else:
        lines = []
        for i, (owner, path) in enumerate(ordered):
            if i == 0 or ordered[i - 1][0].identifier != owner.identifier:
                lines.append(f"conflicts with {owner.described()}:")
            lines.append(f"- {path_string(path)}")
        message = f"Apply failed with {len(ordered)} conflicts: " + "\n".join(lines)
    error = ApiError(409, "Conflict", message)
    error.status["details"] = {
        "causes": [
            {
                "reason": "FieldManagerConflict",
                "message": f"conflict with {owner.described()}",
                "field": path_string(path),
            }
            for owner, path in ordered
        ]
    }
    return error


def _last_applied(obj: dict[str, Any] | None) -> str:
    annotations = ((obj or {}).get("metadata") or {}).get("annotations") or {}
    value = annotations.get(LAST_APPLIED) if isinstance(annotations, dict) else None
    return value if isinstance(value, str) else ""


def _allowed_by_last_applied(live: dict[str, Any]) -> set[Path] | None:
    """The fields kubectl's client-side apply last set to what they still are (its
    last-applied annotation): ``kubectl apply --server-side`` takes them over without a
    conflict. None without a usable annotation."""
    try:
        applied = json.loads(_last_applied(live))
    except ValueError:
        return None
    if not isinstance(applied, dict) or applied.get("apiVersion") != live.get("apiVersion"):
        return None
    changes = compare(tracked(applied), tracked(live))
    return field_set(tracked(applied)) - changes.modified - changes.added - changes.removed


def last_applied_value(applied: dict[str, Any]) -> str:
    """The last-applied annotation kube-apiserver writes for ``kubectl apply --server-side``:
    the applied configuration without that annotation, as Go encodes it (sorted keys, a
    newline)."""
    config = copy.deepcopy(applied)
    annotations = (config.get("metadata") or {}).get("annotations")
    if isinstance(annotations, dict):
        annotations.pop(LAST_APPLIED, None)
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026")):
        text = text.replace(char, escaped)
    return text + "\n"


def server_side_apply(
    live: dict[str, Any] | None,
    applied: dict[str, Any],
    manager: str,
    now: str,
    force: bool = False,
) -> dict[str, Any]:
    """The object after ``manager`` applied ``applied`` (``PATCH`` with
    ``application/apply-patch+yaml``) to ``live`` (None: it is created), with its managedFields.

    The configuration (its status aside) is merged into the live object (:func:`merge`); what
    the manager applied last time and leaves out now is removed unless another manager owns it;
    a changed field another manager owns is a conflict (409, :func:`conflict_error`) unless
    ``force``, which takes it from them. ``kubectl`` (kubectl's server-side default) may take
    the fields kubectl's client-side apply set and are unchanged since, and keeps the
    last-applied annotation, where there is one, equal to what it applied."""
    if not manager:
        raise ApiError(
            422,
            "Invalid",
            'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required value: is '
            "required for apply patch",
        )
    meta = applied.get("metadata") or {}
    if meta.get("managedFields") is not None:
        raise ApiError(400, "BadRequest", "metadata.managedFields must be nil")
    config = {k: v for k, v in applied.items() if k != "status"}
    managers = _managers_of(live)
    applier = Manager(manager, "Apply", str(applied.get("apiVersion", "")), frozenset())
    last = managers.get(applier.identifier)
    before = tracked(live)
    merged = merge({} if live is None else before, tracked(config))
    config_fields = field_set(config)
    managers[applier.identifier] = replace(
        applier,
        fields=frozenset(config_fields - _STRIPPED),
        time=last.time if last else None,
    )
    if last is not None:
        owned = _named_closure(config_fields.union(*(m.fields for m in managers.values())))
        merged = remove_paths(merged, _named_closure(last.fields) - owned)
    changes = compare(before, merged)
    conflicts = [
        (other, path)
        for key, other in managers.items()
        if key != applier.identifier
        for path in other.fields & (changes.added | changes.modified)
    ]
    if conflicts and not force:
        allowed = None
        if manager == KUBECTL_APPLY_MANAGER and live is not None:
            allowed = _allowed_by_last_applied(live)
        remaining = [c for c in conflicts if allowed is None or c[1] not in allowed]
        if remaining:
            raise conflict_error(remaining)
    taken = {path for _, path in conflicts}
    for key, other in list(managers.items()):
        if key != applier.identifier:
            managers[key] = replace(other, fields=other.fields - taken - changes.removed)
    if merged != before:
        managers[applier.identifier] = replace(managers[applier.identifier], time=now)
    new = _drop_nulls(merged)
    new.update(apiVersion=applied.get("apiVersion"), kind=applied.get("kind"))
    if live is not None:
        new["metadata"] = {
            **{k: v for k, v in (live.get("metadata") or {}).items() if k in _SERVER_META},
            **new.get("metadata", {}),
        }
        if "resourceVersion" in meta:  # a precondition: the write checks it
            new["metadata"]["resourceVersion"] = meta["resourceVersion"]
        if "status" in live:
            new["status"] = copy.deepcopy(live["status"])
        if manager == KUBECTL_APPLY_MANAGER and _last_applied(live):
            new["metadata"].setdefault("annotations", {})[LAST_APPLIED] = last_applied_value(
                applied
            )
    else:
        new.setdefault("metadata", {}).update(
            {k: v for k, v in meta.items() if k in _SERVER_META and k != "managedFields"}
        )
    return _with_managers(new, {k: m for k, m in managers.items() if m.fields})
