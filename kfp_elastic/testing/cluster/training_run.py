"""One training job on the test cluster, run as a KFP run with the production settings runs.

:class:`TrainingRun` sets up what ``tests/e2e/test_cluster_job.py``, the chaos test and
``python -m benchmarks chaos`` share: etcd with mutual TLS (the embedded etcd stands in for the
StatefulSet), the production overlay's ConfigMap and the client Secret it names, the shard
manifest (written by the shard task's own code), and the compiled ``elastic-train`` task as the
master pod (``kfp_task.py``). It then exposes what a test or a disruption needs: the committed
step and world, the workers and their nodes, a high-priority pod that preempts a chosen worker
(and its release), SIGKILL of a pod's processes, deleting the master pod and running the task
again (a KFP retry), restarting etcd, the job's end, the exit handler, the exactly-once check,
the final accuracy and metrics, and what was left behind.

:func:`undisturbed_accuracy` trains the same model definition in a static local torchrun job
(one process, the job's shard manifest, seed and global batch): the reference a disturbed run
is compared with.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from kubernetes import client
from kubernetes.client.rest import ApiException

from kfp_elastic.components.common import normalize_run_id, run_pids
from kfp_elastic.components.shard_dataset.shard import build_manifest
from kfp_elastic.contract.data_plan import steps_left
from kfp_elastic.etcd.client import connect
from kfp_elastic.etcd.embedded import EmbeddedEtcd
from kfp_elastic.etcd.keys import RunKeys, run_prefix_of
from kfp_elastic.etcd.pki import generate_test_pki
from kfp_elastic.master.pod_spec import run_selector
from kfp_elastic.master.timeline import Event, read_timeline
from kfp_elastic.rendezvous.handler import node_id_pid
from kfp_elastic.rendezvous.round_formation import NO_ROUND, RoundRecord
from kfp_elastic.testing.cluster import FAST_NODE_LIFECYCLE, TestCluster
from kfp_elastic.testing.cluster.kfp_task import (
    CompiledPipeline,
    TaskPod,
    production_config,
    task_pod,
    tls_secret,
)
from kfp_elastic.testing.cluster.kubelet import POD_UID_ENV
from kfp_elastic.testing.nodes import Agent, free_port, new_run_id, wait_for
from kfp_elastic.worker.evaluate import evaluate
from kfp_elastic.worker.progress import Committed, Progress

log = logging.getLogger(__name__)

KEY_PREFIX = "/kfp-elastic"  # the production ConfigMap's (KFP_ELASTIC_ETCD_PREFIX default)
TLS_SECRET = "kfp-elastic-etcd-client-tls"  # the production overlay's name (its ConfigMap says)
SNAPSHOT_CLAIM = "kfp-elastic-snapshots"
MASTER_TASK = "elastic-train"
FINISHED = ("Succeeded", "Failed")


def serving_pod(name: str, node: str, cpu: str) -> dict[str, Any]:
    """A pod of priority 0 (above the workers' PriorityClass) that wants ``cpu`` on ``node``:
    where that node is full, the scheduler preempts lower-priority pods there."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {"kubernetes.io/hostname": node},
            "containers": [
                {
                    "name": "main",
                    "image": "serving:1",
                    "command": ["python", "-c", "import time; time.sleep(600)"],
                    "resources": {"requests": {"cpu": cpu}},
                }
            ],
        },
    }


class TrainingRun:
    """``with TrainingRun(tmp_path, params, nodes={...}) as run: run.start(); ...``

    ``params``: pipeline parameters (``model_def``, ``num_shards``, ``epochs``, ...). The run
    needs the model definition importable by the pods, which inherit the host's ``PYTHONPATH``.
    On exit: the etcd client, API client, cluster (every pod process) and etcd are closed.

    Several jobs on one cluster: ``TrainingRun(root2, params2, share=first, master_pod="b")``
    (entered after ``first``, left before it) runs on ``first``'s cluster, etcd and production
    ConfigMap and Secret, as a second KFP run in the same namespace does: its own run id (so
    its own worker pods, etcd keys and snapshot directory) and its master pod named
    ``master_pod``. Leaving it closes only its own clients.
    """

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        root: Path,
        params: Mapping[str, Any],
        nodes: Mapping[str, Mapping[str, str | int]] | None = None,
        namespace: str = "kfp-elastic",
        share: TrainingRun | None = None,
        master_pod: str = MASTER_TASK,
    ) -> None:
        if (nodes is None) == (share is None):
            raise ValueError("give nodes (a cluster of the run's own) or share (another run's)")
        self.root = Path(root)
        self.params = dict(params)
        self._nodes = {name: dict(capacity) for name, capacity in (nodes or {}).items()}
        self._share = share
        self.master_pod = master_pod  # the first master pod's name; retries append to it
        self._namespace = namespace
        self.run_uuid = str(uuid.uuid4())
        self.run_id = normalize_run_id(self.run_uuid)
        self.run_prefix = run_prefix_of(KEY_PREFIX, self.run_id)
        self.outputs = self.root / "outputs"
        self.pipeline = CompiledPipeline.load()
        self.master = master_pod  # the master pod now: a retry has another name
        self.retries = 0
        self.max_retries = 25
        self.train: TaskPod | None = None
        self.serving: set[str] = set()
        self._last_step = 0
        self._stack = contextlib.ExitStack()

    # -- set-up and tear-down ------------------------------------------------------------

    def __enter__(self) -> TrainingRun:
        try:
            self._set_up()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _set_up(self) -> None:
        if self._share is not None:
            self.pki, self.etcd = self._share.pki, self._share.etcd
            self.cluster = self._share.cluster
        else:
            self.pki = generate_test_pki(self.root / "etcd-pki")
            self.etcd = self._stack.enter_context(
                EmbeddedEtcd(data_dir=self.root / "etcd", tls=self.pki.server)
            )
            self.cluster = self._stack.enter_context(
                TestCluster(
                    self.root / "cluster",
                    nodes=self._nodes,
                    namespace=self._namespace,
                    node_lifecycle=FAST_NODE_LIFECYCLE,
                )
            )
        self.ns = self.cluster.namespace
        self.api_client = self.cluster.client()
        self._stack.callback(self.api_client.close)
        self.core = client.CoreV1Api(self.api_client)
        self.etcd_settings = self.etcd.client_settings(
            cert=str(self.pki.client_cert), key=str(self.pki.client_key)
        )
        self.etcd_client = connect(self.etcd_settings)
        self._stack.callback(self._close_etcd_client)
        self.progress = Progress(self.etcd_client, self.run_prefix)
        if self._share is None:  # a shared cluster has the deployment's objects already
            config = production_config(self.etcd.endpoint)
            assert config["metadata"]["namespace"] == self.ns
            assert config["data"]["KFP_ELASTIC_ETCD_CLIENT_TLS_SECRET"] == TLS_SECRET
            self.core.create_namespaced_config_map(self.ns, config)
            secret = tls_secret(TLS_SECRET, self.pki.ca, self.pki.client_cert, self.pki.client_key)
            self.core.create_namespaced_secret(self.ns, secret)
        # What the shard-dataset task writes (its own code; not a pod: that would add ~8 s)
        self.manifest = self.outputs / "shard-dataset" / "manifest"
        self.manifest.parent.mkdir(parents=True)
        document = build_manifest(
            "", self.params["model_def"], "train", self.params["num_shards"], 0
        )
        self.samples = document["num_samples"]
        self.manifest.write_text(json.dumps(document))

    def _close_etcd_client(self) -> None:
        with contextlib.suppress(Exception):
            self.etcd_client.close()

    # -- tasks as pods ---------------------------------------------------------------------

    def run_task(self, task: str, pod_name: str, **kwargs: Any) -> TaskPod:
        """Create the pod of the compiled ``task`` (``kfp_task.task_pod``)."""
        pod = task_pod(
            self.pipeline,
            task,
            pod_name=pod_name,
            run_uuid=self.run_uuid,
            task_root=self.outputs / task,
            params=self.params,
            claim_paths={SNAPSHOT_CLAIM: self.cluster.claim_path(SNAPSHOT_CLAIM)},
            **kwargs,
        )
        self.core.create_namespaced_pod(self.ns, pod.manifest)
        return pod

    def start(self) -> None:
        """The training task's pod: the master."""
        self.train = self._run_master(self.master_pod)

    def _run_master(self, pod_name: str) -> TaskPod:
        self.master = pod_name
        return self.run_task(
            MASTER_TASK, pod_name, input_artifacts={"shard_manifest": self.manifest}
        )

    def phase(self, name: str) -> str | None:
        """The pod's phase, None when it does not exist."""
        try:
            return self.core.read_namespaced_pod(name, self.ns).status.phase
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def wait_finished(self, name: str, timeout: float) -> str:
        wait_for(lambda: self.phase(name) in FINISHED, timeout, 0.2, f"pod {name} finished")
        return str(self.phase(name))

    # -- progress --------------------------------------------------------------------------

    def committed(self) -> Committed | None:
        """The run's committed record; None before the first commit and while etcd is down."""
        try:
            record, _ = self.progress.committed_record()
        except Exception:  # noqa: BLE001 - etcd restarting: the caller asks again
            return None
        if record is not None:
            self._last_step = record.step
        return record

    def step(self) -> int:
        """The committed step (the last one seen while etcd does not answer)."""
        record = self.committed()
        return record.step if record else self._last_step

    def has_committed(self, at_least: int, world: int | None = None) -> bool:
        record = self.committed()
        return bool(
            record and record.step >= at_least and (world is None or record.world_size == world)
        )

    def wait_committed(
        self, at_least: int, world: int | None = None, timeout: float = 90, what: str = ""
    ) -> Committed:
        """Until a commit of step ``at_least`` or later (in a world of ``world``)."""
        self.wait_until(
            lambda: self.has_committed(at_least, world),
            timeout,
            what or f"a commit of step {at_least} (world {world})",
        )
        record = self.committed()
        assert record is not None
        return record

    def wait_until(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        """Until ``predicate()``, running the training task again whenever its pod failed or
        vanished meanwhile, as KFP's retry does."""
        wait_for(lambda: not self.retry_master_if_lost() and predicate(), timeout, 0.1, what)

    def round_record(self) -> RoundRecord | None:
        """The workers' latest rendezvous round (number, participants); ``NO_ROUND`` when there
        is none (before the first, or once the run lease expired); None while etcd is down."""
        try:
            value, _ = self.etcd_client.get(RunKeys(self.run_prefix).round)
        except Exception:  # noqa: BLE001 - etcd restarting: the caller asks again
            return None
        return RoundRecord.from_json(value) if value else NO_ROUND

    def round_members(self, pods: Iterable[str], record: RoundRecord) -> tuple[str, ...]:
        """The participants of ``record`` that are agents of ``pods``: a pod's agent is one of
        its processes, and a participant's identity names its agent's pid
        (``handler.node_id_pid``). A pod whose worker has not joined the round has none."""
        pids = set().union(*(self.pod_pids(pod) for pod in pods))
        return tuple(n for n in record.participants if node_id_pid(n) in pids)

    def total_steps(self) -> int | None:
        """The job's optimizer steps from start to end (``epochs`` times the steps of an epoch
        at the committed global batch); None before the first commit."""
        record = self.committed()
        if record is None or not record.global_batch:
            return None
        return self.params["epochs"] * steps_left(self.samples, 0, record.global_batch)

    def timeline(self) -> list[Event]:
        return read_timeline(self.etcd_client, self.run_prefix)

    # -- pods ------------------------------------------------------------------------------

    def workers(self) -> dict[str, str]:
        """Worker pods of the run: name -> phase."""
        pods = self.core.list_namespaced_pod(self.ns, label_selector=run_selector(self.run_id))
        return {p.metadata.name: p.status.phase for p in pods.items}

    def running_workers(self) -> dict[str, str]:
        """Running worker pods that are not being deleted, on nodes that run: name -> node. (A
        lost node's pods read Running until the taint manager evicts them; their processes
        are gone or stopped.)"""
        pods = self.core.list_namespaced_pod(self.ns, label_selector=run_selector(self.run_id))
        return {
            p.metadata.name: p.spec.node_name
            for p in pods.items
            if p.status.phase == "Running"
            and not p.metadata.deletion_timestamp
            and p.spec.node_name in self.cluster.kubelets
        }

    def pod_pids(self, name: str) -> set[int]:
        """The live processes of pod ``name`` (none when it is gone)."""
        try:
            uid = self.core.read_namespaced_pod(name, self.ns).metadata.uid
        except ApiException as exc:
            if exc.status == 404:
                return set()
            raise
        return run_pids(uid, POD_UID_ENV)

    def nodes(self) -> list[str]:
        return sorted(self.cluster.kubelets)

    def log(self, name: str) -> str:
        return self.cluster.log(name, ns=self.ns)

    def log_tail(self, chars: int = 3000) -> str:
        """The master pods' logs, for failure messages."""
        first = self.master_pod
        masters = [first] + [f"{first}-retry-{i}" for i in range(1, self.retries + 1)]
        return "\n".join(f"--- {name}\n{self.log(name)[-chars:]}" for name in masters)

    # -- disruptions -----------------------------------------------------------------------

    def preempt_worker(self, worker: str) -> str:
        """A serving pod on ``worker``'s node that needs as much CPU as the worker: the scheduler
        preempts a worker there (DisruptionTarget, SIGTERM, grace period): ``worker`` itself
        when it is the only one on its node. Returns the serving pod's name."""
        pod = self.core.read_namespaced_pod(worker, self.ns)
        cpu = pod.spec.containers[0].resources.requests["cpu"]
        name = f"serving-{len(self.serving) + 1}-{uuid.uuid4().hex[:4]}"
        self.core.create_namespaced_pod(self.ns, serving_pod(name, pod.spec.node_name, cpu))
        self.serving.add(name)
        return name

    def release(self, serving: str) -> None:
        """The serving pod goes (at once): its node is free for the job again."""
        with contextlib.suppress(ApiException):
            self.core.delete_namespaced_pod(serving, self.ns, grace_period_seconds=0)
        self.serving.discard(serving)

    def kill_pod(self, name: str) -> int:
        """SIGKILL every process of pod ``name`` (an OOM kill, a crashed runtime): the kubelet
        reports it Failed. Returns how many processes were killed."""
        pids = self.pod_pids(name)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGSTOP)  # none forks away while the others die
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def delete_master(self, timeout: float = 40) -> str:
        """Delete the master's pod (its node drained, the task preempted) and, once it is gone,
        run the task again as KFP's retry does (same executor input). Returns the new pod."""
        deleted = self.master
        with contextlib.suppress(ApiException):
            self.core.delete_namespaced_pod(deleted, self.ns)
        wait_for(lambda: self.phase(deleted) is None, timeout, 0.2, f"master pod {deleted} gone")
        return self.retry_master()

    def retry_master(self) -> str:
        self.retries += 1
        self._run_master(f"{self.master_pod}-retry-{self.retries}")
        return self.master

    def retry_master_if_lost(self) -> bool:
        """Run the task again when the master's pod failed or vanished (its node removed), up
        to ``max_retries`` times (a KFP retry policy's limit)."""
        if self.retries < self.max_retries and self.phase(self.master) in (None, "Failed"):
            log.info("event=master_lost pod=%s retry=%d", self.master, self.retries + 1)
            self.retry_master()
            return True
        return False

    def restart_etcd(self) -> None:
        """etcd stops and starts again on the same data and ports."""
        self.etcd.restart()

    # -- the end ---------------------------------------------------------------------------

    def wait_done(self, timeout: float = 240) -> str:
        """Until the master's pod finished (a lost one run again); its phase."""
        self.wait_until(
            lambda: self.phase(self.master) in FINISHED, timeout, "the training task finished"
        )
        return str(self.phase(self.master))

    def exit_handler(self, timeout: float = 60) -> str:
        """The pipeline's exit handler as a pod; its log."""
        status = {"state": "SUCCEEDED", "pipelineTaskName": "exit-handler-1", "error": {}}
        self.run_task("stop-workers", "stop-workers", extra_arguments={"status": status})
        phase = self.wait_finished("stop-workers", timeout)
        assert phase == "Succeeded", self.log("stop-workers")
        return self.log("stop-workers")

    def model_state(self) -> dict[str, torch.Tensor]:
        assert self.train is not None
        return torch.load(self.train.output("model"))

    def check_exactly_once(self) -> None:
        """Every sample of every epoch reached the final model once (the model definition's
        ``counts``), and the shard queues in etcd say the same."""
        epochs, shards = self.params["epochs"], self.params["num_shards"]
        counts = self.model_state()["counts"]
        expected = torch.full((self.samples,), float(epochs), dtype=counts.dtype)
        wrong = (counts != expected).nonzero().flatten().tolist()
        assert not wrong, (
            f"samples not counted {epochs} times: {wrong[:20]} -> {counts[wrong[:20]]}"
        )
        for epoch in range(epochs):
            queues = self.progress.queue_counts(epoch)
            assert queues == {"todo": 0, "doing": 0, "done": shards}, (epoch, queues)

    def accuracy(self) -> float:
        """The final model's accuracy on the model definition's test split."""
        assert self.train is not None
        return evaluate(self.params["model_def"], self.train.output("model")).accuracy

    def metrics(self) -> dict[str, Any]:
        """The training task's Metrics artifact."""
        assert self.train is not None
        output = self.train.executor_output()
        return output["artifacts"]["metrics"]["artifacts"][0]["metadata"]

    def base_world_size(self) -> int:
        """The world size the job's batch policy scales from (set by its first world)."""
        value, _ = self.etcd_client.get(self.progress.keys.base_world_size)
        return int(value)

    def leftovers(self) -> dict[str, Any]:
        """Pods not finished and processes of the cluster still alive (both empty at the end)."""
        pods = self.core.list_namespaced_pod(self.ns).items
        return {
            "pods": sorted(p.metadata.name for p in pods if p.status.phase not in FINISHED),
            "processes": sorted(self.cluster.leftover_processes()),
        }

    def wait_no_leftovers(self, timeout: float = 30) -> None:
        for serving in list(self.serving):
            self.release(serving)
        wait_for(
            lambda: self.leftovers() == {"pods": [], "processes": []}, timeout, 0.3, "no leftovers"
        )


def undisturbed_accuracy(
    root: Path,
    run: TrainingRun,
    base_world_size: int,
    timeout: float = 120,
) -> float:
    """The test accuracy of ``run``'s model definition trained without disturbance.

    A static local job (plain torchrun, c10d, one process) of the same runtime with the job's
    epochs, per-worker batch and base world size (``fixed-global-batch``: the same global batch
    of the same samples at every step) on the job's own shard manifest and seed, copied from
    etcd; no step time.
    """
    assert run.params.get("batch_policy", "fixed-global-batch") == "fixed-global-batch"
    manifest = run.progress.manifest()
    assert manifest is not None, "the job has not published its shard manifest yet"
    run_id = new_run_id("undisturbed")
    Progress(run.etcd_client, run.etcd_settings.run_prefix(run_id)).publish_manifest(manifest)
    agent = Agent(
        backend="c10d",
        endpoint=f"127.0.0.1:{free_port()}",
        run_id=run_id,
        nnodes="1:1",
        script="-m",
        script_args=[
            "kfp_elastic.worker",
            "--model-def",
            run.params["model_def"],
            "--epochs",
            str(run.params["epochs"]),
            "--batch-size",
            str(run.params["batch_size"]),
            "--base-world-size",
            str(base_world_size),
            "--snapshot-dir",
            str(root / "snapshots"),
            "--output",
            str(root / "model.pt"),
        ],
        env=run.etcd_settings.to_env(),
        log_path=root / "undisturbed.log",
        max_restarts=0,
    )
    try:
        agent.start()
        code = agent.wait(timeout)
    finally:
        agent.sigkill_tree()
    assert code == 0, (root / "undisturbed.log").read_text()[-3000:]
    return evaluate(run.params["model_def"], root / "model.pt").accuracy
