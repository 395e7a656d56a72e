"""elastic_train's and stop_workers' Kubernetes side against testing/api_server.py (real client,
real HTTP): the worker pods carry what the task forwarded, faults delete pods, the exit
handler deletes a run's pods. No pod runs here: training in pods needs a cluster.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kfp_elastic.components.common import delete_run_pods
from kfp_elastic.components.elastic_train.run_job import (
    fault_action,
    job_spec,
    plan_job,
    run,
)
from kfp_elastic.job_spec import JobSpec
from kfp_elastic.master.host import make_launcher
from kfp_elastic.master.wiring import worker_pod_template
from kfp_elastic.testing.api_server import FakeKubernetes

NS = "ml"
RUN = "kfp-1234abcd"
MOUNT = {"name": "snapshots", "mountPath": "/mnt/kfp-elastic"}
VOLUME = {"name": "snapshots", "persistentVolumeClaim": {"claimName": "kfp-elastic-snapshots"}}
TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}

# The default model definition (digits) trains on this many samples: the master checks it.
DIGITS_TRAIN = 1437


@pytest.fixture
def k8s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeKubernetes]:
    """The fake API server, reached through a kubeconfig (as outside a cluster)."""
    with FakeKubernetes(namespace=NS) as fake:
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": fake.url}}],
            "users": [{"name": "fake", "user": {}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        }
        path = tmp_path / "kubeconfig"
        path.write_text(yaml.safe_dump(kubeconfig))
        monkeypatch.setenv("KUBECONFIG", str(path))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield fake


def manifest_file(tmp_path: Path) -> str:
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"shards": [[0, 0, DIGITS_TRAIN]]}))
    return str(path)


def request(env: dict[str, str] | None = None, **changes: Any) -> JobSpec:
    params: dict[str, Any] = {
        "model_def": "kfp_elastic.worker.examples.digits",
        "shard_manifest": "unused",
        "min_workers": 1,
        "max_workers": 3,
        "namespace": NS,
        "worker_cpu": "1",
        "worker_memory": "2Gi",
        "opportunistic_priority_class": "kfp-elastic-worker-low",  # not the default
        "service_account": "kfp-elastic-worker",
        "image": "registry.example/worker:1",
    }
    return job_spec(
        {**params, **changes},
        run_id=RUN,
        launcher="kubernetes",
        etcd_endpoint="etcd:2379",
        snapshot_dir="/mnt/kfp-elastic/snapshots",
        env=env or {},
        pod_overrides={
            "tolerations": [TOLERATION],
            "volumes": [VOLUME],
            "volume_mounts": [MOUNT],
            "node_selector": {"pool": "gpu"},
        },
    )


def test_worker_pods_carry_the_forwarded_task_settings(k8s: FakeKubernetes, tmp_path: Path) -> None:
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"shards": [[0, 0, DIGITS_TRAIN]]}))
    req = request(shard_manifest=str(manifest))
    launch, faults = plan_job(req, "kill:worker-1@step3")
    assert faults[0].action == "kill"
    launcher = make_launcher(launch, None)
    act = fault_action(launch, lambda: launcher)
    name = launcher.launch(1).name
    pod = k8s.pod(name)
    spec, container = pod["spec"], pod["spec"]["containers"][0]
    assert pod["metadata"]["labels"]["kfp-elastic.io/run-id"] == RUN
    assert "ownerReferences" not in pod["metadata"]  # a retried master must find them alive
    assert spec["tolerations"][0] == TOLERATION and spec["nodeSelector"] == {"pool": "gpu"}
    # ...and the job's node-loss tolerations (a lost node's worker replaced after 10 s)
    assert {(t["key"], t["tolerationSeconds"]) for t in spec["tolerations"][1:]} == {
        ("node.kubernetes.io/not-ready", 10),
        ("node.kubernetes.io/unreachable", 10),
    }
    assert spec["volumes"] == [VOLUME] and container["volumeMounts"] == [MOUNT]
    assert spec["priorityClassName"] == "kfp-elastic-worker-low"  # worker 1 of min_workers=1
    assert container["image"] == "registry.example/worker:1"
    assert container["resources"]["requests"] == {"cpu": "1", "memory": "2Gi"}
    args = container["args"]
    assert "--nnodes=1:3" in args and "--rdzv-endpoint=etcd:2379" in args
    assert args[args.index("-m") + 1] == "kfp_elastic.worker" and "--max-restarts=100" in args
    env = {e["name"]: e.get("value") for e in container["env"]}  # the job's settings
    assert env["KFP_ELASTIC_SNAPSHOT_DIR"] == f"/mnt/kfp-elastic/snapshots/{RUN}"
    assert env["KFP_ELASTIC_OUTPUT"] == f"/mnt/kfp-elastic/snapshots/{RUN}/model.pt"

    act("kill", name)  # a fault: the pod is deleted by "someone else" (grace 0)
    assert name not in {s.name for s in launcher.list_workers()}
    second, third = launcher.launch(2).name, launcher.launch(0).name
    assert sorted(delete_run_pods(RUN, NS)) == sorted([second, third])  # the exit handler
    assert launcher.list_workers() == []


def test_the_snapshot_buffer_and_shm_parameters_size_the_worker_pods(
    k8s: FakeKubernetes, tmp_path: Path
) -> None:
    req = request(
        shard_manifest=manifest_file(tmp_path),
        nproc_per_worker=2,
        worker_snapshot_buffer="9Gi",
        worker_shm_size="3Gi",
    )
    launch, _ = plan_job(req)
    assert worker_pod_template(req).snapshot_buffer == "9Gi"
    pod = k8s.pod(make_launcher(launch, None).launch(0).name)
    resources = pod["spec"]["containers"][0]["resources"]
    # worker_memory (2Gi), one 9Gi buffer per process and the 3Gi /dev/shm, requested and limited
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == "23Gi"
    shm = {v["name"]: v for v in pod["spec"]["volumes"]}["dshm"]["emptyDir"]
    assert shm == {"medium": "Memory", "sizeLimit": "3Gi"}


@pytest.mark.parametrize(
    ("param", "value"), [("worker_snapshot_buffer", "9 GB"), ("worker_shm_size", "-1Gi")]
)
def test_a_bad_size_is_refused_naming_its_parameter_before_any_worker_starts(
    k8s: FakeKubernetes, tmp_path: Path, param: str, value: str
) -> None:
    req = request(shard_manifest=manifest_file(tmp_path), **{param: value})
    with pytest.raises(ValueError, match=f" / {param}\\) "):
        run(req, say=lambda line: None)
    assert k8s.pods_snapshot() == []


def test_worker_pods_get_the_tasks_etcd_tls_and_password_through_secrets(
    k8s: FakeKubernetes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "ca.crt").write_text("PEM")
    (tmp_path / "password").write_text("hunter2")
    env = {
        "KFP_ELASTIC_ETCD_CACERT": str(tmp_path / "ca.crt"),
        "KFP_ELASTIC_ETCD_USER": "trainer",
        "KFP_ELASTIC_ETCD_PASSWORD_FILE": str(tmp_path / "password"),
    }
    req = request(env, shard_manifest=manifest_file(tmp_path))
    with pytest.raises(ValueError, match="KFP_ELASTIC_ETCD_CLIENT_TLS_SECRET"):
        plan_job(req)
    monkeypatch.setenv("KFP_ELASTIC_ETCD_CLIENT_TLS_SECRET", "etcd-client-tls")
    monkeypatch.setenv("KFP_ELASTIC_ETCD_PASSWORD_SECRET", "etcd-password")
    pod = k8s.pod(make_launcher(plan_job(req)[0], None).launch(0).name)
    container = pod["spec"]["containers"][0]
    secrets = {v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v}
    assert secrets == {"etcd-client-tls", "etcd-password"}
    values = {e["name"]: e.get("value") for e in container["env"]}
    assert values["KFP_ELASTIC_ETCD_ENDPOINTS"] == "etcd:2379"
    assert values["KFP_ELASTIC_ETCD_USER"] == "trainer"
    assert values["KFP_ELASTIC_ETCD_CACERT"] == "/etc/kfp-elastic/etcd-tls/ca.crt"
    assert values["KFP_ELASTIC_ETCD_PASSWORD_FILE"] == "/etc/kfp-elastic/etcd-auth/password"
    assert "hunter2" not in str(pod) and str(tmp_path) not in str(pod)
