"""CustomResourceDefinitions on the fake API server, pure: what apiextensions-apiserver makes of
a stored ``apiextensions.k8s.io/v1`` CustomResourceDefinition: the custom kind it serves (its
names, scope, served versions), the discovery entries and the Table columns of that kind, and
the validation of a custom resource against the ``openAPIV3Schema`` of the version it is
written in.

A custom resource is served under ``/apis/<group>/<version>/[namespaces/<ns>/]<plural>`` for
every served version and stored as the server's other kinds are (``api_server``); it reads in
whatever served version a request names (no conversion: the object is the same, its
``apiVersion`` that of the request, as with the CRD conversion strategy ``None``). A request
to a deprecated version gets the version's ``deprecationWarning`` (or kube-apiserver's default
text) as a ``Warning`` header.

Validation is in two steps, as in apiextensions-apiserver: unknown fields (those the schema
does not declare, outside ``x-kubernetes-preserve-unknown-fields``) are pruned and handled as
for built-in kinds by the request's ``fieldValidation`` (``api_validation``: ``Strict`` refuses
with a ``strict decoding error``, ``Warn`` warns); then the pruned object is checked against
the schema (``jsonschema``): types, enums, required fields, patterns, bounds, refused with
kube's 422 ``Invalid`` (``ClusterQueue.kueue.x-k8s.io "x" is invalid: spec.foo: Unsupported
value: ...``). CEL rules (``x-kubernetes-validations``), defaults (``default``), status and
scale subresources and conversion webhooks are not implemented; ``metadata`` is checked as the
server's ObjectMeta.
"""

from __future__ import annotations

import contextvars
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import jsonschema

from kfp_elastic.testing import api_validation
from kfp_elastic.testing.api_discovery import version_priority
from kfp_elastic.testing.api_tables import Printer, age, use_printer
from kfp_elastic.testing.api_wire import ApiError, now_timestamp

RESOURCE = "customresourcedefinitions"
KIND = ("CustomResourceDefinition", "apiextensions.k8s.io/v1")
_OBJECT_META = {"$ref": "#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
_VERBS = ["delete", "deletecollection", "get", "list", "patch", "create", "update", "watch"]


@dataclass(frozen=True)
class CustomKind:
    """The kind one CRD serves: ``versions`` its served versions, name -> the CRD's entry."""

    resource: str
    group: str
    kind: str
    singular: str
    list_kind: str
    short_names: tuple[str, ...]
    categories: tuple[str, ...]
    namespaced: bool
    storage: str
    versions: Mapping[str, Mapping[str, Any]]

    def api_version(self, version: str | None = None) -> str:
        return f"{self.group}/{version or self.storage}"


def custom_kind(crd: Mapping[str, Any]) -> CustomKind:
    spec = crd["spec"]
    names = spec["names"]
    served = {v["name"]: v for v in spec["versions"] if v.get("served")}
    return CustomKind(
        resource=names["plural"],
        group=spec["group"],
        kind=names["kind"],
        singular=names.get("singular") or names["kind"].lower(),
        list_kind=names.get("listKind") or names["kind"] + "List",
        short_names=tuple(names.get("shortNames") or ()),
        categories=tuple(names.get("categories") or ()),
        namespaced=spec["scope"] == "Namespaced",
        storage=next(v["name"] for v in spec["versions"] if v.get("storage")),
        versions=dict(sorted(served.items(), key=lambda item: version_priority(item[0]))),
    )


def custom_kinds(crds: Iterable[Mapping[str, Any]]) -> dict[str, CustomKind]:
    """resource (the plural) -> the kind each stored CRD serves."""
    return {kind.resource: kind for kind in map(custom_kind, crds)}


def prepare(crd: dict[str, Any], taken: Iterable[str]) -> None:
    """A CRD about to be created or replaced: 422 for names apiextensions-apiserver refuses
    (the name must be ``<plural>.<group>``, exactly one storage version); ``taken``: the
    resources the server already serves otherwise (the stand-in keys its stores by plural, so
    a second kind of the same plural is refused too). Its status is what the CRD controllers
    set: names accepted, Established, the stored versions."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    name = (crd.get("metadata") or {}).get("name", "")
    problems = []
    if name != f"{names.get('plural')}.{spec.get('group')}":
        problems.append(
            f'metadata.name: Invalid value: "{name}": must be spec.names.plural+"."+spec.group'
        )
    storage = [v for v in spec.get("versions") or [] if v.get("storage")]
    if len(storage) != 1:
        problems.append(
            "spec.versions: Invalid value: "
            + json.dumps([v.get("name") for v in spec.get("versions") or []])
            + ": must have exactly one version marked as storage version"
        )
    if spec.get("scope") not in ("Namespaced", "Cluster"):
        problems.append(
            f'spec.scope: Unsupported value: "{spec.get("scope")}": supported values: '
            '"Cluster", "Namespaced"'
        )
    if names.get("plural") in taken:
        problems.append(
            f'spec.names.plural: Invalid value: "{names.get("plural")}": the test cluster '
            "serves a resource of this name already"
        )
    if problems:
        raise invalid(KIND[0], "apiextensions.k8s.io", name, problems)
    now = now_timestamp()
    accepted = {k: v for k, v in names.items() if k in ("plural", "singular", "kind", "listKind")}
    accepted.setdefault("singular", names["kind"].lower())
    accepted.setdefault("listKind", names["kind"] + "List")
    for key in ("shortNames", "categories"):
        if names.get(key):
            accepted[key] = names[key]
    crd["status"] = {
        "acceptedNames": accepted,
        "conditions": [
            {"type": t, "status": "True", "lastTransitionTime": now, "reason": r, "message": m}
            for t, r, m in (
                ("NamesAccepted", "NoConflicts", "no conflicts found"),
                ("Established", "InitialNamesAccepted", "the initial names have been accepted"),
            )
        ],
        "storedVersions": [storage[0]["name"]],
    }


def invalid(kind: str, group: str, name: str, problems: list[str]) -> ApiError:
    """kube-apiserver's 422 Invalid of an object (``<Kind>.<group> "<name>" is invalid:
    <problems>``), with the causes kubectl lists."""
    text = problems[0] if len(problems) == 1 else "[" + ", ".join(problems) + "]"
    error = ApiError(422, "Invalid", f'{kind}.{group} "{name}" is invalid: {text}')
    error.status["details"] = {
        "name": name,
        "group": group,
        "kind": kind,
        "causes": [
            {
                "reason": "FieldValueInvalid",
                "message": problem.partition(": ")[2],
                "field": problem.partition(": ")[0],
            }
            for problem in problems
        ],
    }
    return error


# -- the request's version ---------------------------------------------------------------

_served: contextvars.ContextVar[tuple[CustomKind, str] | None] = contextvars.ContextVar(
    "fake_k8s_custom_version", default=None
)


def begin_request(custom: CustomKind, version: str) -> None:
    """A request to ``custom`` in ``version`` (the URL's): 404 for a version the CRD does not
    serve; a deprecated version's warning recorded for the response. Until the request ends,
    :func:`served_version` is ``version``."""
    entry = custom.versions.get(version)
    if entry is None:
        raise ApiError(404, "NotFound", "the server could not find the requested resource")
    if entry.get("deprecated"):
        api_validation.warn(entry.get("deprecationWarning") or _deprecated(custom, version))
    _served.set((custom, version))
    use_printer(custom.resource, printer(custom))


def _deprecated(custom: CustomKind, version: str) -> str:
    """apiextensions-apiserver's warning for a deprecated version without its own: the most
    preferred served version that is not deprecated and preferred to it, if any."""
    text = f"{custom.group}/{version} {custom.kind} is deprecated"
    better = [
        v
        for v, entry in custom.versions.items()  # most preferred first
        if not entry.get("deprecated") and version_priority(v) < version_priority(version)
    ]
    return f"{text}; use {custom.group}/{better[0]} {custom.kind}" if better else text


def served_version(custom: CustomKind) -> str:
    """The version the request being served reads and writes ``custom`` in (the storage
    version outside such a request)."""
    current = _served.get()
    if current is not None and current[0].resource == custom.resource:
        return current[1]
    return custom.storage


def in_served_version(custom: CustomKind, obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` as the request's version reads it (conversion ``None``: its apiVersion)."""
    obj["apiVersion"] = custom.api_version(served_version(custom))
    return obj


# -- discovery and tables ----------------------------------------------------------------


def discovery_resources(kinds: Iterable[CustomKind]) -> dict[str, list[dict[str, Any]]]:
    """groupVersion -> the APIResources of the custom kinds served in it, ordered as
    kube-apiserver orders a group's versions (its preferred version first)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for custom in kinds:
        for version in custom.versions:
            entry: dict[str, Any] = {
                "name": custom.resource,
                "singularName": custom.singular,
                "namespaced": custom.namespaced,
                "kind": custom.kind,
                "verbs": _VERBS,
            }
            if custom.short_names:
                entry["shortNames"] = list(custom.short_names)
            if custom.categories:
                entry["categories"] = list(custom.categories)
            out.setdefault(custom.api_version(version), []).append(entry)
    return out


def openapi_schemas(kinds: Iterable[CustomKind]) -> dict[str, dict[str, dict[str, Any]]]:
    """groupVersion -> kind -> the ``openAPIV3Schema`` of the custom kinds served in it
    (empty for a version without one), which the OpenAPI v3 documents publish."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for custom in kinds:
        for version, entry in custom.versions.items():
            schema = (entry.get("schema") or {}).get("openAPIV3Schema") or {}
            out.setdefault(custom.api_version(version), {})[custom.kind] = schema
    return out


def printer(custom: CustomKind) -> Printer:
    """The Table columns of ``custom`` in the request's version (its
    ``additionalPrinterColumns`` after the name; Age without any) and the function that makes
    a row's cells, as apiextensions-apiserver's table convertor: a column's ``jsonPath`` read
    from the object, a ``date`` shown as an age."""
    columns = custom.versions[served_version(custom)].get("additionalPrinterColumns")
    if columns is None:
        columns = [
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ]
    defs = (("Name", "string", "name", 0),) + tuple(
        (c["name"], c["type"], c.get("format", ""), c.get("priority", 0)) for c in columns
    )

    def cells(obj: Mapping[str, Any]) -> list[Any]:
        row: list[Any] = [(obj.get("metadata") or {}).get("name", "")]
        for column in columns:
            value = _json_path(obj, column["jsonPath"])
            if column["type"] == "date" and isinstance(value, str):
                value = age(value)
            elif isinstance(value, (dict, list)):
                value = json.dumps(value, separators=(",", ":"))
            row.append(value)
        return row

    return defs, cells


def _json_path(obj: Any, path: str) -> Any:
    """A printer column's simple JSONPath (``.a.b``, ``.a[0].b``); None where it finds
    nothing."""
    for key, index in re.findall(r"\.([^.\[]+)|\[(\d+)\]", path):
        if key:
            obj = obj.get(key) if isinstance(obj, dict) else None
        else:
            obj = obj[int(index)] if isinstance(obj, list) and int(index) < len(obj) else None
    return obj


# -- validation --------------------------------------------------------------------------


class Validation:
    """The field validation of a custom kind in one version, with the signatures of
    ``api_validation``'s checks of built-in kinds (``check_body``, ``check_patched``,
    ``check_applied``)."""

    def __init__(self, custom: CustomKind, version: str) -> None:
        self.custom = custom
        schema = dict(
            (custom.versions[version].get("schema") or {}).get("openAPIV3Schema")
            or {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        )
        properties = {"apiVersion": {"type": "string"}, "kind": {"type": "string"}}
        # metadata is the server's ObjectMeta whatever the CRD says of it
        self.decode_schema = {
            **schema,
            "properties": {**(schema.get("properties") or {}), **properties},
        }
        self.decode_schema["properties"]["metadata"] = _OBJECT_META
        checked = _nullable(schema)
        checked["properties"] = {**(checked.get("properties") or {}), "metadata": {}}
        self.validator = jsonschema.Draft4Validator(checked)

    def _decode(self, obj: dict[str, Any]) -> api_validation.Decoded:
        return api_validation.decode(self.custom.kind, "", obj, self.decode_schema)

    def _check(self, obj: dict[str, Any]) -> None:
        name = (obj.get("metadata") or {}).get("name", "")
        problems = [
            problem for error in self.validator.iter_errors(obj) for problem in _problems(error)
        ]
        if problems:
            raise invalid(self.custom.kind, self.custom.group, name, problems)

    def check_body(self, kind: str, api_version: str, obj: dict[str, Any]) -> dict[str, Any]:
        decoded = self._decode(obj)
        problem = api_validation.settle(decoded)
        if problem:
            version = str(obj.get("apiVersion") or api_version).rpartition("/")[2]
            raise ApiError(
                400,
                "BadRequest",
                f'{obj.get("kind") or kind} in version "{version}" cannot be handled as a '
                f"{kind}: {problem}",
            )
        self._check(decoded.obj)
        return decoded.obj

    def check_patched(
        self, kind: str, api_version: str, patched: dict[str, Any], patch: Any, strategic: bool
    ) -> dict[str, Any]:
        decoded = self._decode(patched)
        problem = api_validation.settle(decoded)
        if problem:
            shown = json.dumps(patched, separators=(",", ":"))
            raise ApiError(
                422,
                "Invalid",
                f' "" is invalid: patch: Invalid value: {json.dumps(shown)}: {problem}',
            )
        self._check(decoded.obj)
        return decoded.obj

    def check_applied(
        self, kind: str, api_version: str, ns: str, name: str, body: dict[str, Any]
    ) -> None:
        api_validation.check_applied(kind, api_version, ns, name, body, self.decode_schema)


def _nullable(schema: Any) -> Any:
    """An OpenAPI v3 schema as JSON Schema: ``nullable: true`` lets a value be null."""
    if isinstance(schema, list):
        return [_nullable(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: (
            {p: _nullable(s) for p, s in v.items()}
            if k in ("properties", "patternProperties")
            else _nullable(v)
        )
        for k, v in schema.items()
        if k != "default" and not k.startswith("x-kubernetes-")
    }
    if out.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


def _go_value(value: Any) -> str:
    """A value as kube's field errors print it (Go's ``%#v`` / ``%q``)."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return json.dumps(value, separators=(",", ":"))


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    return "array" if isinstance(value, list) else "object"


def _problems(error: jsonschema.ValidationError) -> list[str]:
    """A schema violation in kube-openapi's words (``<path>: <error>``)."""
    path = ""
    for part in error.absolute_path:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    where = path or "<nil>"
    value, rule = error.instance, error.validator_value
    if error.validator == "required":  # one error per missing field, named in its message
        key = error.message.partition("'")[2].rpartition("'")[0]
        return [f"{path + '.' if path else ''}{key}: Required value"]
    if error.validator == "enum":
        supported = ", ".join(_go_value(v) for v in rule)
        return [f"{where}: Unsupported value: {_go_value(value)}: supported values: {supported}"]
    if error.validator == "type":
        wanted = rule if isinstance(rule, str) else next(t for t in rule if t != "null")
        got = _json_type(value)
        return [
            f'{where}: Invalid value: "{got}": {where} in body must be of type {wanted}: "{got}"'
        ]
    if error.validator == "pattern":
        return [
            f"{where}: Invalid value: {_go_value(value)}: {where} in body should match '{rule}'"
        ]
    if error.validator == "maxLength":
        return [f"{where}: Too long: may not be more than {rule} bytes"]
    if error.validator == "maxItems":
        return [f"{where}: Too many: {len(value)}: must have at most {rule} items"]
    if error.validator in ("minimum", "maximum"):
        relation = "greater" if error.validator == "minimum" else "less"
        return [
            f"{where}: Invalid value: {_go_value(value)}: {where} in body should be {relation} "
            f"than or equal to {rule}"
        ]
    return [f"{where}: Invalid value: {_go_value(value)}: {where} in body {error.message}"]
