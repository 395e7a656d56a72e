"""The schemas of the OpenAPI v3 documents (``testing/api_openapi.py``): kube-apiserver's form
of the definitions a group version's kinds reach, custom kinds from their CRD's schema, and a
document's hash that follows its content."""

from __future__ import annotations

from typing import Any

from kfp_elastic.testing.api_discovery import discovery
from kfp_elastic.testing.api_wire import CLUSTER_SCOPED, OBJECT_KINDS

REF = "#/components/schemas/"
META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
CUSTOM = {
    "example.com/v1": [
        {
            "name": "things",
            "singularName": "thing",
            "namespaced": True,
            "kind": "Thing",
            "verbs": ["get", "list", "create"],
        }
    ]
}
THING = {
    "type": "object",
    "properties": {"spec": {"type": "object", "properties": {"size": {"type": "integer"}}}},
}


def schemas(group_version: str, **custom: Any) -> dict[str, Any]:
    path = "api/v1" if group_version == "v1" else f"apis/{group_version}"
    document = discovery(f"/openapi/v3/{path}", OBJECT_KINDS, CLUSTER_SCOPED, **custom)
    assert document is not None
    return document["components"]["schemas"]


def refs(schema: Any) -> set[str]:
    if isinstance(schema, list):
        return set().union(*map(refs, schema)) if schema else set()
    if not isinstance(schema, dict):
        return set()
    found = {schema["$ref"]} if "$ref" in schema else set()
    return found.union(*map(refs, schema.values()))


def test_a_group_versions_kinds_with_all_they_reach_in_openapi_v3_form() -> None:
    core = schemas("v1")
    pod = core["io.k8s.api.core.v1.Pod"]
    assert pod["x-kubernetes-group-version-kind"] == [{"group": "", "kind": "Pod", "version": "v1"}]
    assert pod["type"] == "object" and "additionalProperties" not in pod
    assert pod["properties"]["apiVersion"]["type"] == "string"
    assert "enum" not in pod["properties"]["kind"]
    assert pod["properties"]["spec"]["allOf"] == [{"$ref": REF + "io.k8s.api.core.v1.PodSpec"}]
    containers = core["io.k8s.api.core.v1.PodSpec"]["properties"]["containers"]
    assert containers["items"] == {"$ref": REF + "io.k8s.api.core.v1.Container"}
    assert "io.k8s.api.core.v1.PodList" in core
    every = refs(core)
    assert every and all(ref.removeprefix(REF) in core for ref in every)  # closed under $ref
    scheduling = schemas("scheduling.k8s.io/v1")
    assert "io.k8s.api.core.v1.Pod" not in scheduling
    value = scheduling["io.k8s.api.scheduling.v1.PriorityClass"]["properties"]["value"]
    assert value["type"] == "integer"


def test_a_custom_kind_has_its_crd_schema_with_object_meta_by_reference() -> None:
    custom = {"custom": CUSTOM, "custom_schemas": {"example.com/v1": {"Thing": THING}}}
    found = schemas("example.com/v1", **custom)
    thing = found["com.example.v1.Thing"]
    assert thing["x-kubernetes-group-version-kind"] == [
        {"group": "example.com", "version": "v1", "kind": "Thing"}
    ]
    assert thing["properties"]["spec"] == THING["properties"]["spec"]
    assert thing["properties"]["metadata"]["allOf"] == [{"$ref": REF + META}]
    assert META in found and "io.k8s.apimachinery.pkg.apis.meta.v1.Time" in found
    assert "properties" not in THING or "metadata" not in THING["properties"]  # not changed


def test_a_documents_hash_changes_with_its_schemas() -> None:
    def hashes(**custom: Any) -> dict[str, str]:
        root = discovery("/openapi/v3", OBJECT_KINDS, CLUSTER_SCOPED, **custom)
        assert root is not None
        return {path: entry["serverRelativeURL"] for path, entry in root["paths"].items()}

    plain = hashes(custom=CUSTOM, custom_schemas={"example.com/v1": {"Thing": {}}})
    typed = hashes(custom=CUSTOM, custom_schemas={"example.com/v1": {"Thing": THING}})
    assert plain["apis/example.com/v1"] != typed["apis/example.com/v1"]
    assert plain["api/v1"] == typed["api/v1"]
    assert plain["api/v1"].startswith("/openapi/v3/api/v1?hash=")
