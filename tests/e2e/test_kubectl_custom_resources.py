"""kubectl and CustomResourceDefinitions on the test cluster: a CRD applied through kubectl
serves its kind in every served version (discovery, printer columns, watch, server-side
apply, deprecation warnings, its scope), validated against the version's schema; deleting the
CRD takes its custom resources and the resource type with it."""

from __future__ import annotations

import json

import yaml

from kfp_elastic.testing.cluster import TestCluster
from tests.helpers import kubectl_watch, run_kubectl, wait_for

SCHEMA = {
    "type": "object",
    "properties": {
        "spec": {
            "type": "object",
            "required": ["size"],
            "properties": {
                "size": {"type": "integer", "minimum": 1},
                "colour": {"type": "string", "enum": ["red", "blue"]},
                "extra": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            },
        },
    },
}
CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.example.com"},
    "spec": {
        "group": "example.com",
        "scope": "Namespaced",
        "names": {
            "plural": "widgets",
            "singular": "widget",
            "kind": "Widget",
            "shortNames": ["wg"],
        },
        "versions": [
            {
                "name": "v1alpha1",
                "served": True,
                "storage": False,
                "deprecated": True,
                "schema": {"openAPIV3Schema": SCHEMA},
            },
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": SCHEMA},
                "additionalPrinterColumns": [
                    {"name": "Size", "type": "integer", "jsonPath": ".spec.size"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
            },
        ],
    },
}


def widget(name: str, spec: dict, version: str = "v1") -> str:
    return yaml.safe_dump(
        {
            "apiVersion": f"example.com/{version}",
            "kind": "Widget",
            "metadata": {"name": name},
            "spec": spec,
        }
    )


def test_a_crd_applied_with_kubectl_serves_its_kind(test_cluster: TestCluster) -> None:
    cluster = test_cluster
    created = run_kubectl(cluster, "apply", "-f", "-", stdin=yaml.safe_dump(CRD))
    assert created.returncode == 0, created.stderr
    assert created.stdout.strip() == (
        "customresourcedefinition.apiextensions.k8s.io/widgets.example.com created"
    )
    crd = json.loads(run_kubectl(cluster, "get", "crd", "widgets.example.com", "-o", "json").stdout)
    assert {c["type"]: c["status"] for c in crd["status"]["conditions"]}["Established"] == "True"
    resources = run_kubectl(cluster, "api-resources", "--api-group=example.com").stdout
    assert resources.splitlines()[1].split() == [
        "widgets",
        "wg",
        "example.com/v1",
        "true",
        "Widget",
    ]
    with kubectl_watch(cluster, "widgets", "-o", "name") as watch:
        wait_for(lambda: cluster.api.open_watches > 0, 30, 0.05, "kubectl watches widgets")
        made = run_kubectl(
            cluster,
            "apply",
            "-f",
            "-",
            stdin=widget("small", {"size": 2, "extra": {"anything": [1, 2]}}),
        )
        assert made.stdout.strip() == "widget.example.com/small created", made.stderr
        wait_for(
            lambda: cluster.api.list_objects("widgets", cluster.namespace)["items"],
            30,
            0.05,
            "the widget is stored",
        )
        gone = run_kubectl(cluster, "delete", "wg", "small")
        assert gone.returncode == 0, gone.stderr
    assert watch.out.splitlines()[:1] == ["widget.example.com/small"], (watch.out, watch.err)
    # printer columns, the preserved unknown fields, the namespace
    big = run_kubectl(cluster, "apply", "-f", "-", stdin=widget("big", {"size": 9}))
    assert big.returncode == 0, big.stderr
    extra = widget("odd", {"size": 3, "extra": {"free": {"form": True}}})
    assert run_kubectl(cluster, "create", "-f", "-", stdin=extra).returncode == 0
    table = run_kubectl(cluster, "get", "widgets", "-n", cluster.namespace).stdout.splitlines()
    assert table[0].split() == ["NAME", "SIZE", "AGE"]
    assert [row.split()[:2] for row in table[1:]] == [["big", "9"], ["odd", "3"]]
    odd = json.loads(run_kubectl(cluster, "get", "widget", "odd", "-o", "json").stdout)
    assert odd["spec"]["extra"] == {"free": {"form": True}}
    assert odd["metadata"]["namespace"] == cluster.namespace
    # the schema: required, enum, minimum in kube's words
    bad = run_kubectl(
        cluster, "create", "-f", "-", stdin=widget("bad", {"size": 0, "colour": "green"})
    )
    assert bad.returncode == 1
    lines = bad.stderr.splitlines()
    assert lines[0] == 'The Widget "bad" is invalid: '
    assert sorted(lines[1:]) == [  # in no particular order, as kube-apiserver lists them
        '* spec.colour: Unsupported value: "green": supported values: "red", "blue"',
        "* spec.size: Invalid value: 0: spec.size in body should be greater than or equal to 1",
    ]
    missing = run_kubectl(cluster, "create", "-f", "-", stdin=widget("bare", {}))
    assert missing.stderr == 'The Widget "bare" is invalid: spec.size: Required value\n'
    # server-side apply and a merge patch
    ssa = run_kubectl(
        cluster, "apply", "--server-side", "-f", "-", stdin=widget("big", {"size": 10})
    )
    assert ssa.stdout.strip() == "widget.example.com/big serverside-applied", ssa.stderr
    patched = run_kubectl(
        cluster, "patch", "widget", "big", "--type", "merge", "-p", '{"spec":{"colour":"red"}}'
    )
    assert patched.returncode == 0, patched.stderr
    live = json.loads(run_kubectl(cluster, "get", "widget", "big", "-o", "json").stdout)
    assert live["spec"] == {"size": 10, "colour": "red"}
    # the deprecated version: kube-apiserver's own warning when the CRD gives none
    old = run_kubectl(cluster, "get", "widgets.v1alpha1.example.com", "big", "-o", "json")
    assert json.loads(old.stdout)["apiVersion"] == "example.com/v1alpha1"
    assert "Warning: example.com/v1alpha1 Widget is deprecated; use example.com/v1 Widget" in (
        old.stderr
    )
    # a version the CRD does not serve
    raw = run_kubectl(cluster, "get", "--raw", "/apis/example.com/v2/widgets")
    assert "(NotFound)" in raw.stderr
    # deleting the CRD takes its resources and the resource type
    deleted = run_kubectl(cluster, "delete", "crd", "widgets.example.com")
    assert deleted.returncode == 0, deleted.stderr
    assert not [k for k in cluster.api.object_kinds()[0] if k == "widgets"]
    assert cluster.api.list_objects("namespaces", "")["items"]  # the rest stays
    after = run_kubectl(cluster, "get", "--raw", "/apis/example.com/v1/namespaces/default/widgets")
    assert "(NotFound)" in after.stderr
    groups = json.loads(run_kubectl(cluster, "get", "--raw", "/apis").stdout)["groups"]
    assert "example.com" not in [group["name"] for group in groups]


def test_a_crd_must_be_named_for_its_plural_and_group(test_cluster: TestCluster) -> None:
    misnamed = {**CRD, "metadata": {"name": "gadgets.example.com"}}
    refused = run_kubectl(test_cluster, "create", "-f", "-", stdin=yaml.safe_dump(misnamed))
    assert refused.returncode == 1
    assert (
        'The CustomResourceDefinition "gadgets.example.com" is invalid: metadata.name: Invalid '
        'value: "gadgets.example.com": must be spec.names.plural+"."+spec.group'
    ) in refused.stderr
