"""Field validation of the fake API server: what kube-apiserver's decoder makes of a request body
for every kind the stand-in stores, from one schema source (the ``kubernetes-validate``
package's strict JSON schemas of the served Kubernetes version).

kube-apiserver decodes a body into its Go type with ``sigs.k8s.io/json``: a field the type does
not declare is an *unknown field* (``unknown field "spec.foo"``), a value of the wrong JSON type
is a decode error (``json: cannot unmarshal string into Go struct field
PriorityClass.value of type int32``). What happens to unknown fields is the request's
``fieldValidation`` (kubectl's ``--validate``): ``Strict`` refuses them, ``Warn`` (the default
when a request names none) stores the object without them and says so in ``Warning`` headers,
``Ignore`` drops them silently. A decode error is refused whatever the directive.

The refusal depends on the verb, as in kube-apiserver's handlers: a create or update is a 400
BadRequest (``PriorityClass in version "v1" cannot be handled as a PriorityClass: strict
decoding error: unknown field "foo"``), a JSON, merge or strategic merge patch a 422 Invalid
about the ``patch``, and a server-side apply a 500 whatever the directive (structured-merge-diff
finds the field ``not declared in schema``).

Warnings go to the request being served: :func:`serving` opens a request's context (its
directive and the warnings recorded for it), :func:`warnings` reads them back for the
response. Outside any request (the test cluster's own components) the directive is
``Strict``, so that the harness never stores a field a real server would drop.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kfp_elastic.testing.api_discovery import VERSION
from kfp_elastic.testing.api_wire import ApiError

STRICT, WARN, IGNORE = "Strict", "Warn", "Ignore"
DIRECTIVES = (IGNORE, STRICT, WARN)
# The schemas of the version the stand-in answers as.
SCHEMA_VERSION = f"{VERSION['major']}.{VERSION['minor']}"
_OPTIONS = {"POST": "CreateOptions", "PUT": "UpdateOptions", "PATCH": "PatchOptions"}
# resource.Quantity's own parser (k8s.io/apimachinery/pkg/api/resource)
_QUANTITY = re.compile(
    r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+|[KMGTPE]i|[numkMGTPE])?"
)
_QUANTITY_ERROR = (
    "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
)
_INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
_STRING_DEFS = {  # types with an UnmarshalJSON that reads a JSON string into a Go string
    "io.k8s.apimachinery.pkg.apis.meta.v1.Time",
    "io.k8s.apimachinery.pkg.apis.meta.v1.MicroTime",
}
_INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"
_QUANTITY_DEF = "io.k8s.apimachinery.pkg.api.resource.Quantity"


@dataclass
class _Request:
    directive: str
    warnings: list[str] = field(default_factory=list)


_current: contextvars.ContextVar[_Request | None] = contextvars.ContextVar(
    "fake_k8s_request", default=None
)


@contextlib.contextmanager
def serving() -> Iterator[None]:
    """The context of one request over HTTP: its directive (see :func:`begin_write`), and the
    warnings it collects."""
    token = _current.set(_Request(WARN))
    try:
        yield
    finally:
        _current.reset(token)


def begin_write(method: str, query: dict[str, str]) -> None:
    """A write's ``fieldValidation`` for the request being served (``Warn`` when it names
    none, as kube-apiserver defaults it); another value is refused as the API server validates
    its options (422)."""
    value = query.get("fieldValidation", "")
    if value and value not in DIRECTIVES:
        supported = ", ".join(f'"{d}"' for d in ("", *DIRECTIVES))
        raise ApiError(
            422,
            "Invalid",
            f'{_OPTIONS.get(method, "CreateOptions")}.meta.k8s.io "" is invalid: '
            f'fieldValidation: Unsupported value: "{value}": supported values: {supported}',
        )
    request = _current.get()
    if request is not None:
        request.directive = value or WARN


def warnings() -> list[str]:
    """The warnings recorded for the request being served (none outside a request)."""
    request = _current.get()
    return list(request.warnings) if request else []


def _directive() -> str:
    request = _current.get()
    return request.directive if request else STRICT


def warn(*texts: str) -> None:
    """Warnings for the request being served (kubectl prints each as ``Warning: <text>``)."""
    request = _current.get()
    if request is not None:
        request.warnings.extend(t for t in texts if t not in request.warnings)


def warning_header(text: str) -> str:
    """A ``Warning`` response header's value as kube-apiserver writes it (RFC 7234, code 299,
    no agent): kubectl prints ``Warning: <text>``."""
    return '299 - "' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


# -- the schemas -------------------------------------------------------------------------


def _schema_file(name: str) -> dict[str, Any]:
    from kubernetes_validate.utils import schema_contents

    return schema_contents(
        f"kubernetes-json-schema/v{SCHEMA_VERSION}.0-local-strict/{name}", SCHEMA_VERSION
    )


@functools.cache
def definitions() -> dict[str, Any]:
    """Every definition of the schemas (name -> its strict JSON schema), ``api_openapi``'s
    source too."""
    return _schema_file("_definitions.json")["$defs"]


@functools.cache
def kind_schema(kind: str, api_version: str) -> dict[str, Any]:
    """The strict schema of ``kind`` in ``api_version`` (``rbac.authorization.k8s.io/v1`` is
    the package's ``rbac-v1``)."""
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    return _schema_file(f"{kind.lower()}-{group_version}.json")


def _resolve(schema: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """``schema`` with its ``$ref`` followed; the definition's name ("" for none)."""
    ref = schema.get("$ref")
    if ref is None:
        return schema, ""
    name = ref.rpartition("/")[2]
    return definitions()[name], name


def _types(schema: dict[str, Any]) -> set[str]:
    kinds = schema.get("type", [])
    return ({kinds} if isinstance(kinds, str) else set(kinds)) - {"null"}


def _go_type(schema: dict[str, Any]) -> str:
    """The Go type a schema stands for, as ``reflect.Type.String()`` names it."""
    schema, name = _resolve(schema)
    if name in _STRING_DEFS:
        return "string"
    if name:
        parts = name.split(".")
        return f"{parts[-2]}.{parts[-1]}"
    kinds = _types(schema)
    if "integer" in kinds:
        return schema.get("format", "int64")
    if "number" in kinds:
        return "float64"
    if "boolean" in kinds:
        return "bool"
    if "string" in kinds:
        return "[]uint8" if schema.get("format") == "byte" else "string"
    if "array" in kinds:
        return "[]" + _go_type(schema.get("items") or {})
    if isinstance(schema.get("additionalProperties"), dict):
        return "map[string]" + _go_type(schema["additionalProperties"])
    return "map[string]interface {}"


def _json_kind(value: Any, literal: bool = False) -> str:
    """How Go's decoder names a JSON value in an UnmarshalTypeError; ``literal``: a number
    with its text (a number that does not fit the integer it is decoded into)."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return f"number {json.dumps(value)}" if literal else "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


# -- decoding ----------------------------------------------------------------------------


@dataclass
class Decoded:
    """What decoding a body found: the object as decoded (without its unknown fields), the
    paths of its unknown fields in the order they came, and the first decode error."""

    obj: dict[str, Any]
    unknown: list[str]
    error: str | None
    # the same, as structured-merge-diff's typed conversion (server-side apply) words them
    apply_errors: list[str]


class _Walk:
    def __init__(self) -> None:
        self.unknown: list[str] = []
        self.error: str | None = None
        self.apply_errors: list[str] = []

    def type_error(
        self,
        value: Any,
        go_type: str,
        struct: str,
        stack: list[str],
        smd: str,
        path: str,
        literal: bool = False,
    ) -> None:
        """A value Go cannot decode into ``go_type``; ``literal``: a number that does not fit
        the integer (Go names it with its text)."""
        literal = literal and isinstance(value, (int, float)) and not isinstance(value, bool)
        if self.error is None:
            where = f"Go struct field {struct}.{'.'.join(stack)}" if stack else "Go value"
            self.error = (
                f"json: cannot unmarshal {_json_kind(value, literal)} into {where} of type "
                f"{go_type}"
            )
        self.apply_errors.append(f"{_smd_path(path)}: {smd}")

    def value(
        self, value: Any, schema: dict[str, Any], path: str, stack: list[str], struct: str
    ) -> Any:
        """``value`` decoded as ``schema`` says: unknown fields recorded and dropped, type
        errors recorded (the first in Go's words)."""
        if value is None:
            return None
        schema, name = _resolve(schema)
        if name == _INT_OR_STRING:
            if not isinstance(value, (str, int)) or isinstance(value, bool):
                self.type_error(value, "int32", struct, stack, "expected int or string", path)
            return value
        if name == _QUANTITY_DEF:
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                self.error = self.error or _QUANTITY_ERROR
                self.apply_errors.append(f"{_smd_path(path)}: expected string or number")
            elif isinstance(value, str) and not _QUANTITY.fullmatch(value.strip()):
                self.error = self.error or _QUANTITY_ERROR
            return value
        kinds = _types(schema)
        if "object" in kinds and (schema.get("properties") is not None or not kinds - {"object"}):
            return self.object(value, schema, name, path, stack, struct)
        if "array" in kinds:
            if not isinstance(value, list):
                self.type_error(
                    value, _go_type(schema), struct, stack, f"expected list, got {value!r}", path
                )
                return value
            items = schema.get("items") or {}
            return [
                self.value(item, items, f"{path}[{i}]", stack, struct)
                for i, item in enumerate(value)
            ]
        if "integer" in kinds:
            low, high = _INT_RANGES[schema.get("format", "int64")]
            ok = isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
            if not ok:
                self.type_error(
                    value,
                    _go_type(schema),
                    struct,
                    stack,
                    f"expected numeric (int or float), got {_smd_type(value)}",
                    path,
                    literal=True,
                )
            return value
        if "number" in kinds:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                self.type_error(
                    value,
                    "float64",
                    struct,
                    stack,
                    f"expected numeric (int or float), got {_smd_type(value)}",
                    path,
                )
            return value
        if "boolean" in kinds:
            if not isinstance(value, bool):
                self.type_error(
                    value, "bool", struct, stack, f"expected boolean, got {value!r}", path
                )
            return value
        if "string" in kinds:
            if not isinstance(value, str):
                self.type_error(
                    value, _go_type(schema), struct, stack, f"expected string, got {value!r}", path
                )
            return value
        return value  # FieldsV1, RawExtension: anything

    def object(
        self,
        value: Any,
        schema: dict[str, Any],
        name: str,
        path: str,
        stack: list[str],
        struct: str,
    ) -> Any:
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        if properties is None and not isinstance(extra, dict):  # FieldsV1, RawExtension
            return value
        if not isinstance(value, dict):
            go_type = _go_type({"$ref": f"#/$defs/{name}"} if name else schema)
            self.type_error(value, go_type, struct, stack, f"expected map, got {value!r}", path)
            return value
        out: dict[str, Any] = {}
        for key, item in value.items():
            where = f"{path}.{key}" if path else key
            if properties is None:  # a map: its values decoded, no field of its own
                out[key] = self.value(item, extra, where, stack, struct)
            elif key in properties:
                go_struct = name.rpartition(".")[2] if name else struct
                out[key] = self.value(item, properties[key], where, [*stack, key], go_struct)
            elif isinstance(extra, dict):
                out[key] = self.value(item, extra, where, stack, struct)
            elif schema.get("x-kubernetes-preserve-unknown-fields"):  # a CRD's open object
                out[key] = item
            else:
                self.unknown.append(where)
                self.apply_errors.append(f"{_smd_path(where)}: field not declared in schema")
        return out


def _smd_path(path: str) -> str:
    return "." + path if path else ""


def _smd_type(value: Any) -> str:
    """Go's ``%T`` of an unstructured value."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int64"
    if isinstance(value, float):
        return "float64"
    if isinstance(value, str):
        return "string"
    return "[]interface {}" if isinstance(value, list) else "map[string]interface {}"


def decode(
    kind: str, api_version: str, obj: dict[str, Any], schema: dict[str, Any] | None = None
) -> Decoded:
    """``obj`` decoded as kube-apiserver decodes a body of ``kind`` (``schema``: the kind's,
    a custom kind's from its CRD; by default the built-in kind's)."""
    walk = _Walk()
    decoded = walk.value(obj, schema or kind_schema(kind, api_version), "", [], kind)
    return Decoded(decoded, walk.unknown, walk.error, walk.apply_errors)


def _strict_error(unknown: list[str]) -> str:
    return "strict decoding error: " + ", ".join(f'unknown field "{p}"' for p in unknown)


def settle(decoded: Decoded) -> str | None:
    """What the request's directive makes of the unknown fields: the strict decoding error to
    refuse with (Strict), else None after recording the warnings (Warn)."""
    if not decoded.unknown:
        return None
    directive = _directive()
    if directive == STRICT:
        return _strict_error(decoded.unknown)
    if directive == WARN:
        warn(*(f'unknown field "{p}"' for p in decoded.unknown))
    return None


def check_body(kind: str, api_version: str, obj: dict[str, Any]) -> dict[str, Any]:
    """A create's or update's body (POST, PUT): the object to store (unknown fields dropped),
    or 400 as kube-apiserver's decoder refuses it."""
    decoded = decode(kind, api_version, obj)
    problem = decoded.error or settle(decoded)
    if problem:
        version = str(obj.get("apiVersion") or api_version).rpartition("/")[2]
        raise ApiError(
            400,
            "BadRequest",
            f'{obj.get("kind") or kind} in version "{version}" cannot be handled as a {kind}: '
            f"{problem}",
        )
    return decoded.obj


def check_patched(
    kind: str, api_version: str, patched: dict[str, Any], patch: Any, strategic: bool
) -> dict[str, Any]:
    """The result of a JSON, merge or strategic merge patch: the object to store, or 422 about
    the ``patch`` as kube-apiserver's patch handler words it (the patched object as JSON, a
    strategic merge patch as Go prints the patch map)."""
    decoded = decode(kind, api_version, patched)
    problem = decoded.error or settle(decoded)
    if problem:
        shown = _go_format(patch) if strategic else json.dumps(patched, separators=(",", ":"))
        raise ApiError(
            422,
            "Invalid",
            f' "" is invalid: patch: Invalid value: {json.dumps(shown)}: {problem}',
        )
    return decoded.obj


def check_applied(
    kind: str,
    api_version: str,
    ns: str,
    name: str,
    body: dict[str, Any],
    schema: dict[str, Any] | None = None,
) -> None:
    """A server-side apply's body: refused with the 500 kube-apiserver answers (its
    structured-merge-diff conversion fails, an error with no Status reason) when it names a
    field the schema does not declare or has a value of the wrong type, whatever the
    directive (``schema``: as for :func:`decode`)."""
    errors = decode(kind, api_version, body, schema).apply_errors
    if not errors:
        return
    text = errors[0] if len(errors) == 1 else "\n".join(["errors:", *("  " + e for e in errors)])
    group, _, version = api_version.rpartition("/")
    error = ApiError(
        500,
        "",
        f"failed to create typed patch object ({ns}/{name}; {group}/{version}, Kind={kind}): "
        f"{text}",
    )
    del error.status["reason"]
    raise error


def _go_format(value: Any) -> str:
    """``fmt.Sprintf("%+v", value)`` of a decoded JSON value (maps with their keys sorted)."""
    if isinstance(value, dict):
        return "map[" + " ".join(f"{k}:{_go_format(value[k])}" for k in sorted(value)) + "]"
    if isinstance(value, list):
        return "[" + " ".join(_go_format(v) for v in value) + "]"
    if value is None:
        return "<nil>"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
