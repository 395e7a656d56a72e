"""The schemas of the fake API server's OpenAPI v3 documents (``components.schemas``), as
kube-apiserver publishes them, so that ``kubectl explain`` has something to explain.

A built-in group version carries the definitions of its kinds (each with its
``x-kubernetes-group-version-kind``) and every definition they reach through ``$ref``, taken
from the one schema source of the stand-in (``api_validation``: kubernetes-validate's strict
JSON schemas) and turned back into OpenAPI v3: a nullable ``type`` list becomes its one type,
a ``$ref`` points into ``#/components/schemas`` (wrapped in ``allOf`` where it sits beside a
description, as kube-apiserver writes it), and what the strict schemas add (objects closed with
``additionalProperties: false``, ``apiVersion``/``kind`` restricted to one value) is left out.

A custom kind carries its CRD version's ``openAPIV3Schema`` under apiextensions-apiserver's
name for it (the group reversed, the version, the kind: ``com.example.v1.Widget``) with the
GVK, ``apiVersion`` and ``kind`` described and ``metadata`` the server's ObjectMeta by
reference.

The documents are large (core v1 is several megabytes); each is built once per content and
kept (``schemas`` is cached).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

from kfp_elastic.testing import api_validation

_PREFIX = "#/components/schemas/"
_OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
_API_VERSION = (
    "APIVersion defines the versioned schema of this representation of an object. Servers "
    "should convert recognized schemas to the latest internal value, and may reject "
    "unrecognized values. More info: https://git.k8s.io/community/contributors/devel/"
    "sig-architecture/api-conventions.md#resources"
)
_KIND = (
    "Kind is a string value representing the REST resource this object represents. Servers "
    "may infer this from the endpoint the client submits requests to. Cannot be updated. In "
    "CamelCase. More info: https://git.k8s.io/community/contributors/devel/"
    "sig-architecture/api-conventions.md#types-kinds"
)
_METADATA = (
    "Standard object's metadata. More info: https://git.k8s.io/community/contributors/devel/"
    "sig-architecture/api-conventions.md#metadata"
)


@functools.cache
def _by_gvk() -> dict[tuple[str, str, str], str]:
    """(group, version, kind) -> the name of its definition."""
    out: dict[tuple[str, str, str], str] = {}
    for name, schema in api_validation.definitions().items():
        for gvk in schema.get("x-kubernetes-group-version-kind", ()):
            out.setdefault((gvk["group"], gvk["version"], gvk["kind"]), name)
    return out


def _ref_name(ref: str) -> str:
    return ref.rpartition("/")[2]


def _convert(schema: Any, reached: set[str]) -> Any:
    """``schema`` (JSON schema, strict) in OpenAPI v3; the definitions it names go into
    ``reached``."""
    if isinstance(schema, list):
        return [_convert(item, reached) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type" and isinstance(value, list):
            kinds = [k for k in value if k != "null"]
            if len(kinds) == 1:
                out[key] = kinds[0]
            elif kinds:
                out[key] = kinds
        elif key == "additionalProperties" and value is False:
            continue
        elif key == "$ref":
            reached.add(_ref_name(value))
        elif key in ("properties", "patternProperties"):
            out[key] = {name: _convert(sub, reached) for name, sub in value.items()}
        elif key.startswith("x-kubernetes-") or key in ("enum", "default", "example"):
            out[key] = value
        else:
            out[key] = _convert(value, reached)
    if "$ref" in schema:
        ref = {"$ref": _PREFIX + _ref_name(schema["$ref"])}
        return {"allOf": [ref], **out} if out else ref
    return out


def _definition(name: str, reached: set[str]) -> dict[str, Any]:
    schema = _convert(api_validation.definitions()[name], reached)
    if "x-kubernetes-group-version-kind" in schema:  # apiVersion and kind: any string
        for field in ("apiVersion", "kind"):
            prop = (schema.get("properties") or {}).get(field)
            if prop is not None:
                prop.pop("enum", None)
    return schema


def _closure(names: set[str]) -> dict[str, Any]:
    """The converted definitions of ``names`` and of all they reach."""
    out: dict[str, Any] = {}
    todo = sorted(names)
    while todo:
        name = todo.pop()
        if name in out:
            continue
        reached: set[str] = set()
        out[name] = _definition(name, reached)
        todo.extend(sorted(reached - out.keys()))
    return dict(sorted(out.items()))


def custom_name(group: str, version: str, kind: str) -> str:
    """apiextensions-apiserver's name of a custom kind's schema: ``com.example.v1.Widget``."""
    return ".".join([*reversed(group.split(".")), version, kind])


def _custom(group: str, version: str, kind: str, schema: Mapping[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(schema)) if schema else {}
    out.setdefault("type", "object")
    if not schema:
        out["x-kubernetes-preserve-unknown-fields"] = True
    out["properties"] = {
        "apiVersion": {"type": "string", "description": _API_VERSION},
        "kind": {"type": "string", "description": _KIND},
        "metadata": {"allOf": [{"$ref": _PREFIX + _OBJECT_META}], "description": _METADATA},
        **{k: v for k, v in (out.get("properties") or {}).items() if k != "metadata"},
    }
    out["x-kubernetes-group-version-kind"] = [{"group": group, "version": version, "kind": kind}]
    return out


@functools.lru_cache(maxsize=64)
def _schemas(group_version: str, kinds: tuple[str, ...], custom: str) -> dict[str, Any]:
    group, _, version = group_version.rpartition("/")
    wanted = set()
    for kind in kinds:
        for each in (kind, kind + "List"):
            name = _by_gvk().get((group, version, each))
            if name is not None:
                wanted.add(name)
    out = _closure(wanted)
    custom_kinds: dict[str, Any] = json.loads(custom)
    if custom_kinds:
        out.update(_closure({_OBJECT_META}))
        for kind, schema in custom_kinds.items():
            out[custom_name(group, version, kind)] = _custom(group, version, kind, schema)
    return dict(sorted(out.items()))


def schemas(
    group_version: str,
    kinds: list[str],
    custom: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """``components.schemas`` of the document of ``group_version``: the built-in ``kinds``
    (and their lists) with all they reach; ``custom``: kind -> its ``openAPIV3Schema`` (empty:
    none) of the custom kinds served in it. Built once for each content; the caller must not
    change what it gets."""
    key = json.dumps(dict(custom or {}), sort_keys=True)
    return _schemas(group_version, tuple(sorted(set(kinds) - set(custom or {}))), key)
