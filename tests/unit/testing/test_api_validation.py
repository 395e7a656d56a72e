"""Field validation of the fake API server (``kfp_elastic/testing/api_validation.py``): what
kube-apiserver's decoder makes of a body of each stored kind, and what each ``fieldValidation``
directive does with it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from kfp_elastic.testing import api_validation
from kfp_elastic.testing.api_server import FakeKubernetes
from kfp_elastic.testing.api_validation import (
    begin_write,
    check_applied,
    check_body,
    check_patched,
    decode,
    serving,
    warning_header,
    warnings,
)
from kfp_elastic.testing.api_wire import OBJECT_KINDS, ApiError

PC = ("PriorityClass", "scheduling.k8s.io/v1")


def test_every_stored_kind_has_a_schema() -> None:
    for kind, api_version in [("Pod", "v1"), *OBJECT_KINDS.values()]:
        assert api_validation.kind_schema(kind, api_version)["type"] == "object"


def test_unknown_fields_are_named_by_their_path_in_the_order_they_came() -> None:
    body = {
        "metadata": {"name": "web", "labelz": {"a": "b"}},
        "spec": {
            "ports": [{"port": 80}, {"port": 81, "targetPrt": 8081}],
            "selectr": {"a": "b"},
            "selector": {"a": "b"},
        },
    }
    decoded = decode("Service", "v1", body)
    assert decoded.unknown == ["metadata.labelz", "spec.ports[1].targetPrt", "spec.selectr"]
    assert decoded.error is None
    assert decoded.obj == {
        "metadata": {"name": "web"},
        "spec": {"ports": [{"port": 80}, {"port": 81}], "selector": {"a": "b"}},
    }


@pytest.mark.parametrize(
    ("kind", "body", "error"),
    [
        (
            PC,
            {"value": "high"},
            "json: cannot unmarshal string into Go struct field PriorityClass.value of type int32",
        ),
        (
            PC,
            {"value": 3000000000},
            "json: cannot unmarshal number 3000000000 into Go struct field PriorityClass.value "
            "of type int32",
        ),
        (
            ("Service", "v1"),
            {"spec": {"ports": [{"port": 80, "targetPort": {"a": 1}}]}},
            "json: cannot unmarshal object into Go struct field ServicePort.spec.ports.targetPort"
            " of type int32",
        ),
        (
            ("ConfigMap", "v1"),
            {"data": {"a": 1}},
            "json: cannot unmarshal number into Go struct field ConfigMap.data of type string",
        ),
        (
            ("NetworkPolicy", "networking.k8s.io/v1"),
            {"spec": {"podSelector": "all"}},
            "json: cannot unmarshal string into Go struct field NetworkPolicySpec.spec.podSelector"
            " of type v1.LabelSelector",
        ),
        (
            ("Pod", "v1"),
            {"spec": {"containers": [{"name": "a", "resources": {"limits": {"cpu": "lots"}}}]}},
            "quantities must match the regular expression "
            "'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'",
        ),
    ],
)
def test_a_value_of_the_wrong_type_is_go_s_decode_error(
    kind: tuple[str, str], body: dict, error: str
) -> None:
    assert decode(*kind, {"metadata": {"name": "x"}, **body}).error == error


def test_strict_refuses_unknown_fields_of_a_create_as_kube_apiserver_does() -> None:
    body = {"apiVersion": PC[1], "kind": PC[0], "metadata": {"name": "x"}, "valeu": 1, "foo": 2}
    with serving():
        begin_write("POST", {"fieldValidation": "Strict"})
        with pytest.raises(ApiError) as refused:
            check_body(*PC, body)
    assert refused.value.status["code"] == 400
    assert refused.value.status["reason"] == "BadRequest"
    assert refused.value.status["message"] == (
        'PriorityClass in version "v1" cannot be handled as a PriorityClass: strict decoding '
        'error: unknown field "valeu", unknown field "foo"'
    )
    with pytest.raises(ApiError, match="strict decoding error"):  # the harness: Strict
        check_body(*PC, body)


def test_warn_drops_unknown_fields_with_a_warning_and_ignore_silently() -> None:
    body = {"metadata": {"name": "x"}, "value": 1, "valeu": 1}
    for query in ({}, {"fieldValidation": "Warn"}):  # Warn is the default
        with serving():
            begin_write("PUT", query)
            assert check_body(*PC, body) == {"metadata": {"name": "x"}, "value": 1}
            assert warnings() == ['unknown field "valeu"']
    with serving():
        begin_write("POST", {"fieldValidation": "Ignore"})
        assert check_body(*PC, body) == {"metadata": {"name": "x"}, "value": 1}
        assert warnings() == []
        with pytest.raises(ApiError, match="cannot unmarshal string"):  # refused in every mode
            check_body(*PC, {**body, "value": "1"})
    assert warning_header('unknown field "a\\b"') == '299 - "unknown field \\"a\\\\b\\""'


def test_an_unknown_directive_is_refused_as_the_options_are() -> None:
    with serving(), pytest.raises(ApiError) as refused:
        begin_write("PATCH", {"fieldValidation": "strict"})
    assert refused.value.status["code"] == 422
    assert refused.value.status["message"] == (
        'PatchOptions.meta.k8s.io "" is invalid: fieldValidation: Unsupported value: "strict": '
        'supported values: "", "Ignore", "Strict", "Warn"'
    )


def test_a_patch_result_is_refused_about_the_patch() -> None:
    patch = {"spec": {"selectr": {"a": "b"}, "type": "ClusterIP"}}
    patched = {"metadata": {"name": "web"}, **patch}
    with pytest.raises(ApiError) as refused:
        check_patched("Service", "v1", patched, patch, strategic=True)
    assert refused.value.status["code"] == 422
    assert refused.value.status["message"] == (
        ' "" is invalid: patch: Invalid value: "map[spec:map[selectr:map[a:b] type:ClusterIP]]":'
        ' strict decoding error: unknown field "spec.selectr"'
    )
    with pytest.raises(ApiError) as refused:
        check_patched("Service", "v1", patched, patch, strategic=False)
    shown = json.dumps(json.dumps(patched, separators=(",", ":")))
    assert f"patch: Invalid value: {shown}: strict" in refused.value.status["message"]


def test_server_side_apply_of_an_undeclared_field_is_the_500_of_structured_merge_diff() -> None:
    body = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"}, "spec": {"x": 1}}
    for query in ({"fieldValidation": "Ignore"}, {}):
        with serving():
            begin_write("PATCH", query)
            with pytest.raises(ApiError) as refused:
                check_applied("Service", "v1", "ns", "web", body)
        assert refused.value.status["code"] == 500
        assert "reason" not in refused.value.status
        assert refused.value.status["message"] == (
            "failed to create typed patch object (ns/web; /v1, Kind=Service): .spec.x: field "
            "not declared in schema"
        )


def test_the_server_sends_the_warnings_of_a_write() -> None:
    with FakeKubernetes(validate_pods=False) as k8s:
        body = json.dumps({"metadata": {"name": "cm"}, "data": {"a": "1"}, "dta": {}}).encode()
        request = urllib.request.Request(
            f"{k8s.url}/api/v1/namespaces/default/configmaps?fieldValidation=Warn",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.headers.get_all("Warning") == ['299 - "unknown field \\"dta\\""']
            assert "dta" not in json.loads(response.read())
        strict = urllib.request.Request(
            f"{k8s.url}/api/v1/namespaces/default/configmaps?fieldValidation=Strict",
            data=body.replace(b'"cm"', b'"cm2"'),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(strict, timeout=10)
        assert refused.value.code == 400
        assert "dta" not in k8s.get_object("configmaps", "default", "cm")
