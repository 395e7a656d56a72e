"""The test cluster's KFP task pods (testing/cluster/kfp_task.py) are the compiled task: the
container command and args as compiled (under the emissary and launcher stand-ins), the executor
input as the KFP launcher builds it."""

from __future__ import annotations

import json
from pathlib import Path

from kfp_elastic.master.pod_spec_checks import MASTER_POD_LABELS
from kfp_elastic.testing.cluster import kfp_launcher
from kfp_elastic.testing.cluster.kfp_task import CompiledPipeline, task_pod

RUN_UUID = "3c639d2a-d58d-4561-b6e6-0919a33ee348"


def test_elastic_train_pod_is_the_compiled_task(tmp_path: Path) -> None:
    pipeline = CompiledPipeline.load()
    claim = tmp_path / "claims" / "kfp-elastic-snapshots"
    pod = task_pod(
        pipeline,
        "elastic-train",
        pod_name="elastic-train",
        run_uuid=RUN_UUID,
        task_root=tmp_path / "out" / "elastic-train",
        params={"min_workers": 2, "max_workers": 3, "worker_cpu": "1"},
        input_artifacts={"shard_manifest": tmp_path / "manifest"},
        claim_paths={"kfp-elastic-snapshots": claim},
    )
    _, compiled, _ = pipeline.executor("elastic-train")
    container = pod.manifest["spec"]["containers"][0]
    assert container["command"] == kfp_launcher.wrap(compiled["command"])  # under PID 1 + launcher
    assert container["args"][0] == "--executor_input" and container["args"][2:] == [
        "--function_to_execute",
        "elastic_train",
    ]
    executor_input = json.loads(container["args"][1])
    values = executor_input["inputs"]["parameterValues"]
    assert (values["min_workers"], values["max_workers"], values["worker_cpu"]) == (2, 3, "1")
    assert values["epochs"] == 1  # the pipeline's default
    assert values["run_id"] == RUN_UUID  # {{$.pipeline_job_uuid}}
    assert values["task_config"]["volumeMounts"] == [{"name": "pvc-0", "mountPath": str(claim)}]
    assert values["task_config"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    # The NetworkPolicy lets the master reach etcd by these labels.
    assert MASTER_POD_LABELS.items() <= pod.manifest["metadata"]["labels"].items()
    manifest = executor_input["inputs"]["artifacts"]["shard_manifest"]["artifacts"][0]
    assert manifest["uri"] == str(tmp_path / "manifest")
    model = executor_input["outputs"]["artifacts"]["model"]["artifacts"][0]
    assert model["uri"] == str(pod.output("model"))
    env = {e["name"]: e for e in container["env"]}
    ref = env["KFP_ELASTIC_ETCD_CACERT"]["valueFrom"]["configMapKeyRef"]
    assert ref == {"name": "kfp-elastic-config", "key": "KFP_ELASTIC_ETCD_CACERT", "optional": True}
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/etc/kfp-elastic/etcd-tls", "/etc/kfp-elastic/etcd-auth", str(claim)} == mounts
