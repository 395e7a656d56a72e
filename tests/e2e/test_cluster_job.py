"""One training job on the test cluster, as a KFP run with the production settings would go.

The compiled pipeline's ``elastic-train`` task and its exit handler run as pods (command and
args as compiled, executor input as the KFP launcher builds it; ``tests/fakes/cluster/kfp_task.py``)
with the production overlay's ConfigMap and etcd with mutual TLS through a mounted Secret. The
master (the ``elastic-train`` pod) creates worker pods that run ``torchrun
--rdzv-backend=elastic-etcd``. Then: capacity for 2 of 3 workers → it trains with 2, the third
Pending; a serving pod preempts one worker (SIGTERM, no step lost); the serving pod goes and a node
comes → the world grows to 3; the master's pod is deleted and created again (a KFP retry) → the
new master adopts the running workers; the job completes with every sample of every epoch counted
once, writes model, metrics and report; the exit handler's pod finds nothing left to delete.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from kubernetes import client
from kubernetes.client.rest import ApiException

from kfp_elastic.components.common import normalize_run_id
from kfp_elastic.components.shard_dataset.shard import build_manifest
from kfp_elastic.etcd.client import connect
from kfp_elastic.etcd.keys import run_prefix_of
from kfp_elastic.master.pod_spec import run_selector
from kfp_elastic.master.timeline import EventKind, MasterRecovered, WorkerLost, read_timeline
from kfp_elastic.rendezvous.embedded_etcd import EmbeddedEtcd
from kfp_elastic.rendezvous.testing_pki import generate_test_pki
from kfp_elastic.worker.progress import Progress
from tests.fakes.cluster import TestCluster
from tests.fakes.cluster.kfp_task import CompiledPipeline, production_config, task_pod, tls_secret
from tests.helpers import REPO_ROOT, wait_for

# Long enough (8 epochs of 15 steps of >= 0.4 s) that the retried master, which takes 10-15 s
# to start on a loaded 2-core machine, finds the workers still training; each phase below moves
# on at the first commit of the new world so that training time is not spent waiting.
EPOCHS, SAMPLES, SHARDS = 8, 240, 12  # tests/model_defs/counting.py: 240 samples
PARAMS = {
    "model_def": "tests.model_defs.counting",
    "num_shards": SHARDS,
    "min_workers": 1,
    "max_workers": 3,
    "epochs": EPOCHS,
    "batch_size": 8,
    "snapshot_every": 3,
    "step_time": 0.4,
    "worker_cpu": "1",
    "max_wait_s": 120.0,
}
TLS_SECRET = "kfp-elastic-etcd-client-tls"  # the production overlay's name (its ConfigMap says)


def phase(core: client.CoreV1Api, name: str, ns: str) -> str | None:
    try:
        return core.read_namespaced_pod(name, ns).status.phase
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def test_training_task_as_master_pod_through_preemption_growth_and_a_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pods get the host's PYTHONPATH: the counting model definition lives under tests/.
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    pki = generate_test_pki(tmp_path / "etcd-pki")
    pipeline = CompiledPipeline.load()
    run_uuid = str(uuid.uuid4())
    run_prefix = run_prefix_of("/kfp-elastic", normalize_run_id(run_uuid))
    with (
        EmbeddedEtcd(data_dir=tmp_path / "etcd", tls=pki.server) as etcd,
        TestCluster(
            tmp_path / "cluster",
            nodes={"node-1": {"cpu": "2", "memory": "8Gi"}},
            namespace="kfp-elastic",
        ) as cluster,
    ):
        ns = cluster.namespace
        api_client = cluster.client()
        core = client.CoreV1Api(api_client)
        etcd_client = connect(
            etcd.client_settings(cert=str(pki.client_cert), key=str(pki.client_key))
        )
        try:
            config = production_config(etcd.endpoint)
            assert config["metadata"]["namespace"] == ns
            assert config["data"]["KFP_ELASTIC_ETCD_CLIENT_TLS_SECRET"] == TLS_SECRET
            core.create_namespaced_config_map(ns, config)
            core.create_namespaced_secret(
                ns, tls_secret(TLS_SECRET, pki.ca, pki.client_cert, pki.client_key)
            )
            claims = {"kfp-elastic-snapshots": cluster.claim_path("kfp-elastic-snapshots")}
            outputs = tmp_path / "outputs"

            def run_task(task: str, pod_name: str, **kwargs: Any) -> Any:
                pod = task_pod(
                    pipeline,
                    task,
                    pod_name=pod_name,
                    run_uuid=run_uuid,
                    task_root=outputs / task,
                    params=PARAMS,
                    claim_paths=claims,
                    **kwargs,
                )
                core.create_namespaced_pod(ns, pod.manifest)
                return pod

            def finished(name: str, timeout: float) -> str:
                return wait_for(
                    lambda: phase(core, name, ns) in ("Succeeded", "Failed"),
                    timeout,
                    0.2,
                    f"pod {name} finished",
                ) and str(phase(core, name, ns))

            # What the shard-dataset task writes (its own code; not a pod: that would add ~8 s)
            manifest = outputs / "shard-dataset" / "manifest"
            manifest.parent.mkdir(parents=True)
            document = build_manifest("", PARAMS["model_def"], "train", SHARDS, 0)
            manifest.write_text(json.dumps(document))
            train_input = {"shard_manifest": manifest}
            train = run_task("elastic-train", "elastic-train", input_artifacts=train_input)
            progress = Progress(etcd_client, run_prefix)

            def committed(at_least: int, world: int | None = None) -> bool:
                record, _ = progress.committed_record()
                return bool(
                    record
                    and record.step >= at_least
                    and (world is None or record.world_size == world)
                )

            def step() -> int:
                record, _ = progress.committed_record()
                return record.step if record else 0

            def workers() -> dict[str, str]:
                pods = core.list_namespaced_pod(ns, label_selector=run_selector(rid())).items
                return {p.metadata.name: p.status.phase for p in pods}

            def rid() -> str:
                return normalize_run_id(run_uuid)

            def log_tail() -> str:
                return "\n".join(
                    f"--- {name}\n{cluster.log(name, ns=ns)[-3000:]}"
                    for name in ("elastic-train", "elastic-train-retry-1")
                )

            # 1. capacity for 2 of 3 workers: trains with 2, the third waits Pending
            wait_for(lambda: committed(3, world=2), 90, 0.2, "training with 2 workers")
            assert sorted(workers().values()) == ["Pending", "Running", "Running"], log_tail()

            # 2. a serving pod (priority 0 > the workers' -5) preempts one worker gracefully
            serving = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "serving"},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "main",
                            "image": "serving:1",
                            "command": ["python", "-c", "import time; time.sleep(600)"],
                            "resources": {"requests": {"cpu": "1"}},
                        }
                    ],
                },
            }
            core.create_namespaced_pod(ns, serving)
            before = step()
            wait_for(lambda: committed(before + 1, world=1), 60, 0.2, "training with 1 worker")

            # 3. the serving pod goes and a node comes: the Pending workers run, the world is 3
            core.delete_namespaced_pod("serving", ns, grace_period_seconds=0)
            cluster.add_node("node-2", cpu="1", memory="8Gi")
            before = step()
            wait_for(lambda: committed(before + 1, world=3), 90, 0.2, "training with 3 workers")
            running = {n for n, p in workers().items() if p == "Running"}
            assert len(running) == 3

            # 4. the master's pod is deleted (its node drained, the task retried): a new pod of
            # the same task (same executor input, as a KFP retry) adopts the running workers
            step_at_retry = step()
            core.delete_namespaced_pod("elastic-train", ns)
            wait_for(lambda: phase(core, "elastic-train", ns) is None, 40, 0.2, "master pod gone")
            assert {n for n, p in workers().items() if p == "Running"} == running
            run_task("elastic-train", "elastic-train-retry-1", input_artifacts=train_input)
            wait_for(
                lambda: any(
                    isinstance(e, MasterRecovered) for e in read_timeline(etcd_client, run_prefix)
                ),
                60,
                0.3,
                "the new master recovered",
            )
            adopted = workers()
            assert {n for n, p in adopted.items() if p == "Running"} == running, (
                f"master deleted at step {step_at_retry}, recovered at {step()} of "
                f"{EPOCHS * SAMPLES // 16}",
                adopted,
                running,
                log_tail(),
            )
            before = step()
            print(f"master deleted at step {step_at_retry}, the retry adopted at step {before}")
            wait_for(lambda: committed(before + 1, world=3), 60, 0.2, "training under the retry")
            assert finished("elastic-train-retry-1", 180) == "Succeeded", log_tail()

            # the job: complete, exactly once, nothing lost to the preemption
            counts = torch.load(train.output("model"))["counts"]
            assert torch.equal(counts, torch.full((SAMPLES,), float(EPOCHS), dtype=torch.float64))
            for epoch in range(EPOCHS):
                assert progress.queue_counts(epoch) == {"todo": 0, "doing": 0, "done": SHARDS}
            events = read_timeline(etcd_client, run_prefix)
            recovered = [e for e in events if isinstance(e, MasterRecovered)]
            assert len(recovered) == 1 and set(running) <= set(recovered[0].workers)
            after_retry = events[events.index(recovered[0]) :]
            assert not [e for e in after_retry if e.kind is EventKind.WORKER_LAUNCHED]
            lost = [e for e in events if isinstance(e, WorkerLost)]
            assert [e.cause for e in lost] == ["preempted"], lost
            # The preemption cost no step: the world stopped at the step it had just committed
            # (SIGTERM -> agreed stop -> snapshot), and the smaller world went on from there.
            stopped_at = _commit_before_shrink(events)
            assert f"step={stopped_at} (snapshot committed)" in cluster.log(lost[0].name, ns=ns)
            assert events[-1].kind is EventKind.JOB_DONE
            metrics = train.executor_output()["artifacts"]["metrics"]["artifacts"][0]["metadata"]
            assert metrics["max_world_size"] == 3 and metrics["disruptions"] == 1, metrics
            assert "<html" in train.output("report").read_text().lower()

            # cleanup: the master deleted its workers; the exit handler finds none left
            assert workers() == {}
            status = {"state": "SUCCEEDED", "pipelineTaskName": "exit-handler-1", "error": {}}
            run_task("stop-workers", "stop-workers", extra_arguments={"status": status})
            assert finished("stop-workers", 60) == "Succeeded", cluster.log("stop-workers", ns=ns)
            assert "deleted 0 worker pods" in cluster.log("stop-workers", ns=ns)
        finally:
            with contextlib.suppress(Exception):
                etcd_client.close()
            api_client.close()
    assert not cluster.leftover_processes()


def _timeline_text(events: list[Any]) -> str:
    """The timeline in short, one event a line (for failure messages)."""
    start = events[0].t if events else 0.0
    keep = ("round", "step", "world_size", "rescued", "name", "cause", "workers")
    return "\n".join(
        f"{e.t - start:7.2f} {e.kind.value} "
        + " ".join(f"{k}={getattr(e, k)}" for k in keep if hasattr(e, k))
        for e in events
    )


def _commit_before_shrink(events: list[Any]) -> int:
    """The step of the last commit before the first round that formed a smaller world."""
    world, step = 0, -1
    for event in events:
        if event.kind is EventKind.COMMITTED:
            step = event.step
        elif event.kind is EventKind.ROUND_FORMED:
            if world and event.world_size < world:
                return step
            world = event.world_size
    raise AssertionError(f"no smaller world formed:\n{_timeline_text(events)}")
