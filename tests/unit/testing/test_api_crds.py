"""The custom kinds of CustomResourceDefinitions (``testing/api_crds.py``): version order,
discovery, validation against a version's schema in kube's words, printer columns."""

from __future__ import annotations

import contextvars
import copy
from typing import Any

import pytest

from kfp_elastic.testing import api_crds, api_validation
from kfp_elastic.testing.api_discovery import discovery, version_priority
from kfp_elastic.testing.api_server import FakeKubernetes
from kfp_elastic.testing.api_wire import CLUSTER_SCOPED, OBJECT_KINDS, ApiError

SCHEMA = {
    "type": "object",
    "required": ["spec"],
    "properties": {
        "spec": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 5},
                "note": {"type": "string", "nullable": True},
                "items": {"type": "array", "maxItems": 1, "items": {"type": "integer"}},
                "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                "open": {
                    "type": "object",
                    "x-kubernetes-preserve-unknown-fields": True,
                    "properties": {"known": {"type": "integer"}},
                },
            },
        },
    },
}


def crd(*versions: dict[str, Any], scope: str = "Cluster") -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "things.example.com"},
        "spec": {
            "group": "example.com",
            "scope": scope,
            "names": {"plural": "things", "kind": "Thing"},
            "versions": list(versions),
        },
    }


V1 = {"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": SCHEMA}}


def test_versions_in_kube_apiservers_order_of_preference() -> None:
    versions = ["v1alpha1", "foo", "v1beta1", "v2", "v1", "v1beta2", "v2alpha1"]
    ordered = sorted(versions, key=version_priority)
    assert ordered == ["v2", "v1", "v1beta2", "v1beta1", "v2alpha1", "v1alpha1", "foo"]


def test_discovery_lists_a_groups_versions_together_preferred_first() -> None:
    old = {**V1, "name": "v1beta1", "storage": False, "deprecated": True}
    kind = api_crds.custom_kind(crd(old, V1))
    custom = api_crds.discovery_resources([kind])
    assert sorted(custom) == ["example.com/v1", "example.com/v1beta1"]
    groups = discovery("/apis", OBJECT_KINDS, CLUSTER_SCOPED, custom)["groups"]
    (group,) = [g for g in groups if g["name"] == "example.com"]
    assert [v["version"] for v in group["versions"]] == ["v1", "v1beta1"]
    assert group["preferredVersion"] == {"groupVersion": "example.com/v1", "version": "v1"}
    listed = discovery("/apis/example.com/v1beta1", OBJECT_KINDS, CLUSTER_SCOPED, custom)
    (thing,) = listed["resources"]
    assert (thing["name"], thing["kind"], thing["namespaced"]) == ("things", "Thing", False)
    openapi = discovery("/openapi/v3/apis/example.com/v1", OBJECT_KINDS, CLUSTER_SCOPED, custom)
    assert "/apis/example.com/v1/things/{name}" in openapi["paths"]


def test_a_crds_name_scope_and_storage_version_are_checked() -> None:
    bad = crd({**V1, "storage": False}, scope="Everywhere")
    bad["metadata"]["name"] = "things"
    with pytest.raises(ApiError) as refused:
        api_crds.prepare(bad, set())
    assert refused.value.status["code"] == 422
    assert [c["field"] for c in refused.value.status["details"]["causes"]] == [
        "metadata.name",
        "spec.versions",
        "spec.scope",
    ]
    good = crd(V1)
    api_crds.prepare(good, set())
    assert good["status"]["acceptedNames"]["listKind"] == "ThingList"
    assert good["status"]["storedVersions"] == ["v1"]
    with pytest.raises(ApiError, match="serves a resource of this name"):
        api_crds.prepare(crd(V1), {"things"})


def check(obj: dict[str, Any]) -> dict[str, Any]:
    kind = api_crds.custom_kind(crd(V1))
    return api_crds.Validation(kind, "v1").check_body("Thing", "example.com/v1", obj)


def thing(spec: dict[str, Any]) -> dict[str, Any]:
    meta = {"name": "t"}
    return {"apiVersion": "example.com/v1", "kind": "Thing", "metadata": meta, "spec": spec}


def test_schema_violations_in_kube_apiservers_words() -> None:
    with pytest.raises(ApiError) as refused:
        check(thing({"name": "ABCDEFG", "items": [1, "two"]}))
    status = refused.value.status
    assert (status["code"], status["reason"]) == (422, "Invalid")
    assert sorted(c["field"] + ": " + c["message"] for c in status["details"]["causes"]) == [
        "spec.items: Too many: 2: must have at most 1 items",
        'spec.items[1]: Invalid value: "string": spec.items[1] in body must be of type '
        'integer: "string"',
        "spec.name: Invalid value: \"ABCDEFG\": spec.name in body should match '^[a-z]+$'",
        "spec.name: Too long: may not be more than 5 bytes",
    ]
    assert status["message"].startswith('Thing.example.com "t" is invalid: [')
    with pytest.raises(ApiError, match=r'"t" is invalid: spec: Required value$'):
        check({k: v for k, v in thing({}).items() if k != "spec"})


def test_unknown_fields_pruned_except_where_preserved() -> None:
    obj = thing({"note": None, "free": {"a": {"b": 1}}, "open": {"known": 1, "other": 2}})
    assert check(copy.deepcopy(obj)) == obj  # null where nullable; preserved fields kept
    with pytest.raises(ApiError) as refused:  # outside the request: Strict
        check(thing({"nmae": "x", "open": {"known": 1}}))
    assert refused.value.status["code"] == 400
    assert refused.value.status["message"] == (
        'Thing in version "v1" cannot be handled as a Thing: strict decoding error: unknown '
        'field "spec.nmae"'
    )
    with api_validation.serving():  # Warn: dropped, with a warning
        assert check(thing({"nmae": "x"})) == thing({})
        assert api_validation.warnings() == ['unknown field "spec.nmae"']


def test_server_side_apply_refuses_an_undeclared_field() -> None:
    validation = api_crds.Validation(api_crds.custom_kind(crd(V1)), "v1")
    with pytest.raises(ApiError) as refused:
        validation.check_applied("Thing", "example.com/v1", "", "t", thing({"nmae": "x"}))
    assert refused.value.status["code"] == 500
    assert refused.value.status["message"].endswith(".spec.nmae: field not declared in schema")


def test_deprecated_versions_warn() -> None:
    old = {**V1, "name": "v1beta1", "storage": False, "deprecated": True}
    own = {**old, "name": "v1alpha1", "deprecationWarning": "gone soon"}
    kind = api_crds.custom_kind(crd(old, own, V1))

    def request() -> None:  # in a context of its own, as the server serves one
        with api_validation.serving():
            api_crds.begin_request(kind, "v1beta1")
            api_crds.begin_request(kind, "v1alpha1")
            assert api_validation.warnings() == [
                "example.com/v1beta1 Thing is deprecated; use example.com/v1 Thing",
                "gone soon",
            ]
            assert api_crds.served_version(kind) == "v1alpha1"
            with pytest.raises(ApiError, match="could not find the requested resource"):
                api_crds.begin_request(kind, "v2")

    contextvars.copy_context().run(request)
    assert api_crds.served_version(kind) == "v1"  # outside a request: the storage version


def test_printer_columns_from_json_paths() -> None:
    version = {
        **V1,
        "additionalPrinterColumns": [
            {"name": "First", "type": "integer", "jsonPath": ".spec.items[0]"},
            {"name": "Missing", "type": "string", "jsonPath": ".status.phase"},
            {"name": "Free", "type": "string", "jsonPath": ".spec.free"},
        ],
    }
    columns, cells = api_crds.printer(api_crds.custom_kind(crd(version)))
    assert [c[0] for c in columns] == ["Name", "First", "Missing", "Free"]
    assert cells(thing({"items": [4], "free": {"a": 1}})) == ["t", 4, None, '{"a":1}']


def test_a_second_crd_of_the_same_plural_is_refused() -> None:
    with FakeKubernetes() as k8s:
        k8s.create_object(api_crds.RESOURCE, "", crd(V1))
        k8s.replace_object(api_crds.RESOURCE, "", crd(V1))  # the same CRD again: fine
        other = crd(V1)
        other["spec"]["group"] = "example.org"
        other["metadata"]["name"] = "things.example.org"
        with pytest.raises(ApiError, match="serves a resource of this name already"):
            k8s.create_object(api_crds.RESOURCE, "", other)
        built_in = crd(V1)
        built_in["spec"]["names"] = {"plural": "events", "kind": "Event"}
        built_in["metadata"]["name"] = "events.example.com"
        with pytest.raises(ApiError, match="serves a resource of this name already"):
            k8s.create_object(api_crds.RESOURCE, "", built_in)
