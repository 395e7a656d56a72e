"""kubectl's ``--validate`` against the test cluster: every stored kind's fields are checked as
kube-apiserver's decoder checks them (``fieldValidation``: Strict refuses an unknown field,
Warn stores the object without it and warns, Ignore drops it), and a value of the wrong type
is refused whatever kubectl asks."""

from __future__ import annotations

import json

import pytest

from kfp_elastic.testing.cluster import TestCluster
from tests.helpers import run_kubectl

# Each kind with a misspelled field: (manifest, resource/name, the field as kube names it)
MISSPELLED = [
    (
        "apiVersion: scheduling.k8s.io/v1\nkind: PriorityClass\nmetadata:\n  name: typo\n"
        "value: 5\npreemptionPolicy: Never\ndescripton: misspelled\n",
        "priorityclass.scheduling.k8s.io/typo",
        "descripton",
        'PriorityClass in version "v1" cannot be handled as a PriorityClass',
    ),
    (
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: typo\nspec:\n  ports:\n"
        "  - port: 80\n    targetPrt: 8080\n  selector:\n    app: web\n",
        "service/typo",
        "spec.ports[0].targetPrt",
        'Service in version "v1" cannot be handled as a Service',
    ),
    (
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata:\n  name: typo\n"
        "spec:\n  podSelector: {}\n  policyTypez: [Ingress]\n",
        "networkpolicy.networking.k8s.io/typo",
        "spec.policyTypez",
        'NetworkPolicy in version "v1" cannot be handled as a NetworkPolicy',
    ),
]


@pytest.fixture
def cluster(test_cluster: TestCluster) -> TestCluster:
    return test_cluster


def test_kubectl_validate_strict_warn_and_false(cluster: TestCluster) -> None:
    for manifest, name, field, refusal in MISSPELLED:
        refused = run_kubectl(cluster, "apply", "-f", "-", stdin=manifest)
        assert refused.returncode == 1, refused.stdout
        assert refused.stderr.strip() == (
            f'Error from server (BadRequest): error when creating "STDIN": {refusal}: strict '
            f'decoding error: unknown field "{field}"'
        )
        assert run_kubectl(cluster, "get", name).returncode == 1  # nothing stored
        warned = run_kubectl(cluster, "apply", "--validate=warn", "-f", "-", stdin=manifest)
        assert warned.returncode == 0, warned.stderr
        assert warned.stdout.strip() == f"{name} created"
        assert warned.stderr.strip() == f'Warning: unknown field "{field}"'
        stored = json.loads(run_kubectl(cluster, "get", name, "-o", "json").stdout)
        assert field.rpartition(".")[2].partition("[")[0] not in json.dumps(
            {k: v for k, v in stored.items() if k != "metadata"}
        )
        assert run_kubectl(cluster, "delete", name).returncode == 0
        ignored = run_kubectl(cluster, "apply", "--validate=false", "-f", "-", stdin=manifest)
        assert ignored.returncode == 0, ignored.stderr
        assert ignored.stdout.strip() == f"{name} created"
        assert ignored.stderr == ""
        server_side = run_kubectl(cluster, "apply", "--server-side", "-f", "-", stdin=manifest)
        assert server_side.returncode == 1
        assert "failed to create typed patch object" in server_side.stderr
        assert f".{field}: field not declared in schema" in server_side.stderr


def test_kubectl_a_value_of_the_wrong_type_is_refused_in_every_mode(cluster: TestCluster) -> None:
    manifest = (
        "apiVersion: scheduling.k8s.io/v1\nkind: PriorityClass\nmetadata:\n  name: typed\n"
        "value: high\n"
    )
    for validate in ("strict", "warn", "false"):
        refused = run_kubectl(cluster, "apply", f"--validate={validate}", "-f", "-", stdin=manifest)
        assert refused.returncode == 1
        assert refused.stderr.strip() == (
            'Error from server (BadRequest): error when creating "STDIN": PriorityClass in '
            'version "v1" cannot be handled as a PriorityClass: json: cannot unmarshal string '
            "into Go struct field PriorityClass.value of type int32"
        )
    # a patch that leaves an unknown field: kubectl patch asks for no validation (Warn)
    patched = run_kubectl(
        cluster, "patch", "priorityclass", "kfp-elastic-control", "-p", '{"descripton": "x"}'
    )
    assert patched.returncode == 0, patched.stderr
    assert patched.stderr.strip() == 'Warning: unknown field "descripton"'
    assert patched.stdout.strip().endswith("patched (no change)")
