"""``kubectl explain`` on the test cluster: kubectl reads the schemas of the OpenAPI v3
documents (built-in kinds from kubernetes-validate's schemas, custom kinds from their CRD) and
prints them as it does against kube-apiserver."""

from __future__ import annotations

import yaml

from kfp_elastic.testing.cluster import TestCluster
from tests.helpers import run_kubectl

GADGETS = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "gadgets.example.com"},
    "spec": {
        "group": "example.com",
        "scope": "Namespaced",
        "names": {"plural": "gadgets", "singular": "gadget", "kind": "Gadget"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "description": "Gadget is a thing with a size.",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "description": "What the gadget should be.",
                                "required": ["size"],
                                "properties": {
                                    "size": {
                                        "type": "integer",
                                        "description": "How big the gadget is.",
                                    },
                                    "colour": {"type": "string", "enum": ["red", "blue"]},
                                },
                            },
                        },
                    }
                },
            }
        ],
    },
}


def explain(cluster: TestCluster, *args: str) -> str:
    done = run_kubectl(cluster, "explain", *args)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_kubectl_explain_of_built_in_kinds(test_cluster: TestCluster) -> None:
    cluster = test_cluster
    pods = explain(cluster, "pods")
    assert pods.startswith("KIND:       Pod\nVERSION:    v1\n\nDESCRIPTION:\n")
    assert "    Pod is a collection of containers that can run on a host." in pods
    fields = pods.partition("FIELDS:\n")[2]
    assert [line.split("\t") for line in fields.splitlines() if "\t" in line] == [
        ["  apiVersion", "<string>"],
        ["  kind", "<string>"],
        ["  metadata", "<ObjectMeta>"],
        ["  spec", "<PodSpec>"],
        ["  status", "<PodStatus>"],
    ]
    resources = explain(cluster, "pods.spec.containers.resources")
    assert "FIELD: resources <ResourceRequirements>" in resources
    assert "  limits\t<map[string]Quantity>" in resources
    assert "  requests\t<map[string]Quantity>" in resources
    value = explain(cluster, "priorityclasses.value")
    assert value.startswith("GROUP:      scheduling.k8s.io\nKIND:       PriorityClass\n")
    assert "FIELD: value <integer>" in value
    assert "value represents the integer value of this priority class." in value
    recursive = explain(cluster, "priorityclasses", "--recursive")
    assert "  value\t<integer>\n" in recursive
    assert "    ownerReferences\t<[]OwnerReference>\n" in recursive
    assert "      uid\t<string> -required-\n" in recursive
    unknown = run_kubectl(cluster, "explain", "pods.spec.nope")
    assert unknown.returncode == 1
    assert unknown.stderr.strip() == 'error: field "nope" does not exist'


def test_kubectl_explain_of_a_custom_kind(test_cluster: TestCluster) -> None:
    cluster = test_cluster
    missing = run_kubectl(cluster, "explain", "gadgets")
    assert missing.returncode == 1
    assert 'the server doesn\'t have a resource type "gadgets"' in missing.stderr
    created = run_kubectl(cluster, "apply", "-f", "-", stdin=yaml.safe_dump(GADGETS))
    assert created.returncode == 0, created.stderr
    gadgets = explain(cluster, "gadgets")
    assert gadgets.startswith("GROUP:      example.com\nKIND:       Gadget\nVERSION:    v1\n")
    assert "    Gadget is a thing with a size." in gadgets
    assert "  metadata\t<ObjectMeta>" in gadgets
    assert "  spec\t<Object>\n    What the gadget should be." in gadgets
    spec = explain(cluster, "gadgets.spec")
    assert "  size\t<integer> -required-\n    How big the gadget is." in spec
    assert "  colour\t<string>\n  enum: red, blue" in spec
    name = explain(cluster, "gadgets.metadata.name")  # the server's ObjectMeta
    assert "FIELD: name <string>" in name and "Name must be unique within a namespace." in name
