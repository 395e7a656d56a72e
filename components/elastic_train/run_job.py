"""Runs one elastic job through the master, in this process: the only module of the components
that knows the master's Python API (``master.job``, ``master.state``, the launchers).

The master (``ElasticJob``) runs in-process rather than as ``kfp-elastic master`` so that the
fault injector can reach the launcher it created, and so that etcd (embedded when no endpoint is
given) outlives the master: the timeline is read after the job for the report. While the job
runs, a thread tails the timeline, prints one line per event and fires due faults.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kfp_elastic.components import BASE_IMAGE
from kfp_elastic.components.common import (
    in_cluster,
    load_kubernetes_config,
    pod_namespace,
    reap_local_processes,
)
from kfp_elastic.components.elastic_train.faults import Fault, FaultInjector, Injected, parse_faults
from kfp_elastic.components.elastic_train.summary import describe
from kfp_elastic.components.shard_dataset.shard import read_manifest
from kfp_elastic.etcd import settings as etcd_settings
from kfp_elastic.etcd.settings import EtcdSettings
from kfp_elastic.master.timeline import Event, TimelineTail, read_timeline

ENDPOINTS_ENV = etcd_settings.BY_NAME["endpoints"].env

LAUNCHERS = ("local", "kubernetes")
POLL_S = 0.5
Say = Callable[[str], None]
Factory = Callable[[Any], Any]  # MasterState -> Launcher (what ElasticJob calls)
Act = Callable[[str, str], None]  # (fault action, worker name)


@dataclass(frozen=True)
class TrainRequest:
    run_id: str
    model_def: str
    manifest_path: str
    min_workers: int = 1
    max_workers: int = 2
    nproc_per_worker: int = 1
    epochs: int = 1
    batch_size: int = 32
    learning_rate: float = 0.1
    batch_policy: str = "fixed-global-batch"
    snapshot_every: int = 0  # 0 = auto
    step_time: float = 0.0
    seed: int = 0
    launcher: str = "auto"  # auto: kubernetes inside a pod, local elsewhere
    # empty: $KFP_ELASTIC_ETCD_ENDPOINTS, else embedded (local launcher only); TLS, user and
    # password file come from the other KFP_ELASTIC_ETCD_* variables (kfp_elastic.etcd.settings)
    etcd_endpoint: str = ""
    workdir: str = ""  # local launcher: worker logs; default: a temporary directory
    snapshot_dir: str = ""  # root; the job uses {snapshot_dir}/{run_id}
    inject_faults: str = ""
    max_wait_s: float = 600.0
    max_failures: int = 3
    finish_grace_s: float = 30.0
    # kubernetes launcher
    image: str = ""
    namespace: str = ""
    priority_class: str = ""
    service_account: str = ""
    worker_cpu: str = ""
    worker_memory: str = ""
    worker_gpus: int = 0
    pod_overrides: Mapping[str, Any] = field(default_factory=dict)  # tolerations, volumes, ...
    owner_reference: Mapping[str, Any] | None = None

    def etcd_settings(self, env: Mapping[str, str] | None = None) -> EtcdSettings | None:
        """How to reach etcd (``etcd_endpoint`` over the environment); None: embed one."""
        env = os.environ if env is None else env
        if not (self.etcd_endpoint or env.get(ENDPOINTS_ENV)):
            return None
        return etcd_settings.from_sources(
            {"endpoints": self.etcd_endpoint}, env, {"endpoints": "etcd_endpoint"}
        )

    def resolved_launcher(self) -> str:
        if self.launcher == "auto":
            return "kubernetes" if in_cluster() else "local"
        return self.launcher


@dataclass
class TrainResult:
    state: str  # succeeded | failed | stepped_down
    message: str
    events: list[Event]
    model_path: Path | None
    workdir: Path
    snapshot_dir: Path
    injected: list[Injected]
    end_t: float


def validate(request: TrainRequest) -> tuple[Fault, ...]:
    """Check every input before anything starts; ``ValueError`` names the input at fault."""
    from kfp_elastic.worker.policy import BatchPolicy

    if request.min_workers < 1:
        raise ValueError(f"min_workers must be >= 1, got {request.min_workers}")
    if request.min_workers > request.max_workers:
        raise ValueError(
            f"min_workers={request.min_workers} is more than max_workers={request.max_workers}"
        )
    for name in ("nproc_per_worker", "epochs", "batch_size"):
        if getattr(request, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(request, name)}")
    if request.snapshot_every < 0:
        raise ValueError(
            f"snapshot_every must be >= 1, or 0 for auto; got {request.snapshot_every}"
        )
    if request.learning_rate <= 0 or request.step_time < 0 or request.max_wait_s <= 0:
        raise ValueError("learning_rate and max_wait_s must be > 0 and step_time >= 0")
    if request.max_failures < 0 or request.worker_gpus < 0:
        raise ValueError("max_failures and worker_gpus must be >= 0")
    BatchPolicy.parse(request.batch_policy)
    if request.launcher not in ("auto", *LAUNCHERS):
        raise ValueError(f"launcher must be auto, local or kubernetes, got {request.launcher!r}")
    etcd = request.etcd_settings()  # ConfigError (a ValueError) names the bad setting
    if request.resolved_launcher() == "kubernetes":
        if etcd is None:
            raise ValueError(
                "the kubernetes launcher needs etcd_endpoint (worker pods cannot "
                "reach an embedded etcd); deploy manifests/ and use its "
                f"kfp-elastic-config ConfigMap ({ENDPOINTS_ENV}), or pass etcd_endpoint"
            )
        if not request.snapshot_dir:
            raise ValueError(
                "the kubernetes launcher needs a snapshot_dir on a volume that "
                "every worker pod mounts (mount a ReadWriteMany PVC on the task)"
            )
    return parse_faults(request.inject_faults, request.max_workers)


def preflight(request: TrainRequest) -> int:
    """The model definition loads and its train split matches the manifest; returns the
    number of samples."""
    from kfp_elastic.worker.model_def import load_model_def

    shards, document = read_manifest(request.manifest_path)
    total = sum(s.size for s in shards)
    model_def = load_model_def(request.model_def)
    length = len(model_def.dataset("train"))
    if length != total:
        raise ValueError(
            f"the shard manifest covers {total} samples (source "
            f"{document.get('source', '?')}) but dataset('train') of "
            f"{request.model_def} has {length}: shard the dataset the model "
            "definition trains on"
        )
    return total


def worker_entry(request: TrainRequest, snapshot_dir: Path) -> list[str]:
    return [
        "-m",
        "kfp_elastic.worker",
        "--model-def",
        request.model_def,
        "--epochs",
        str(request.epochs),
        "--batch-size",
        str(request.batch_size),
        "--lr",
        str(request.learning_rate),
        "--policy",
        request.batch_policy,
        "--seed",
        str(request.seed),
        "--snapshot-every",
        str(request.snapshot_every),
        "--snapshot-dir",
        str(snapshot_dir),
        "--output",
        str(snapshot_dir / "model.pt"),
        "--step-time",
        str(request.step_time),
    ]


class LauncherHolder:
    """The launcher the master created (the factory runs inside ``ElasticJob.run``)."""

    launcher: Any = None


def local_factory(
    request: TrainRequest,
    etcd: EtcdSettings,
    entry: Sequence[str],
    workdir: Path,
    holder: LauncherHolder,
) -> tuple[Factory, Act]:
    from kfp_elastic.master.local_launcher import LocalLauncher

    # Local workers share this machine's files: they get the very same etcd settings.
    env = {**etcd.to_env(), "KFP_ELASTIC_RUN_ID": request.run_id}

    def factory(state: Any) -> Any:
        holder.launcher = LocalLauncher(
            run_id=request.run_id,
            endpoint=etcd.endpoint_text,
            min_workers=request.min_workers,
            max_workers=request.max_workers,
            entry=entry,
            workdir=workdir,
            nproc_per_worker=request.nproc_per_worker,
            env=env,
            registry=state,
        )
        return holder.launcher

    def act(action: str, name: str) -> None:
        (holder.launcher.kill if action == "kill" else holder.launcher.preempt)(name)

    return factory, act


def kubernetes_factory(
    request: TrainRequest, etcd: EtcdSettings, entry: Sequence[str], holder: LauncherHolder
) -> tuple[Factory, Act]:
    from kubernetes import client

    from kfp_elastic.master.k8s_launcher import KubernetesLauncher
    from kfp_elastic.master.pod_spec import (
        PASSWORD_SECRET_ENV,
        TLS_SECRET_ENV,
        WorkerPodSpec,
        etcd_pod_fields,
    )

    load_kubernetes_config()
    namespace = pod_namespace(request.namespace)
    overrides = dict(request.pod_overrides)
    optional = {
        k: v
        for k, v in {
            "priority_class": request.priority_class,
            "service_account": request.service_account,
            "cpu": request.worker_cpu or None,
            "memory": request.worker_memory or None,
        }.items()
        if v
    }
    template = WorkerPodSpec(
        job_name=request.run_id,
        run_id=request.run_id,
        image=request.image or os.environ.get("KFP_ELASTIC_WORKER_IMAGE") or BASE_IMAGE,
        entrypoint="worker",
        module=True,
        entrypoint_args=tuple(entry[2:]),
        rdzv_endpoint=etcd.endpoint_text,
        min_nodes=request.min_workers,
        max_nodes=request.max_workers,
        nproc_per_node=request.nproc_per_worker,
        max_restarts=100,
        gpu=request.worker_gpus,
        **etcd_pod_fields(
            etcd,
            os.environ.get(TLS_SECRET_ENV) or None,
            os.environ.get(PASSWORD_SECRET_ENV) or None,
        ),
        namespace=namespace,
        owner_reference=request.owner_reference,
        tolerations=tuple(overrides.get("tolerations") or ()),
        node_selector=dict(overrides.get("node_selector") or {}),
        affinity=overrides.get("affinity") or None,
        volumes=tuple(overrides.get("volumes") or ()),
        volume_mounts=tuple(overrides.get("volume_mounts") or ()),
        **optional,
    )
    api = client.ApiClient()
    core = client.CoreV1Api(api)

    def factory(state: Any) -> Any:
        holder.launcher = KubernetesLauncher(template, namespace, api)
        return holder.launcher

    def act(action: str, name: str) -> None:  # a pod deleted by "someone else", like eviction
        core.delete_namespaced_pod(
            name, namespace, grace_period_seconds=0 if action == "kill" else None
        )

    return factory, act


def _watch(tail: TimelineTail, injector: FaultInjector, stop: threading.Event, say: Say) -> None:
    start: float | None = None
    while True:
        finished = stop.is_set()
        try:
            for event in tail.read():
                start = event.t if start is None else start
                line = describe(event, start)
                if line:
                    say(line)
            for record in injector.poll(tail.events):
                offset = record.t - (start or record.t)
                say(
                    f"[{offset:7.1f}s] fault injected: {record.fault.action} {record.target} "
                    f"({record.fault.text})"
                )
        except Exception as error:  # noqa: BLE001 - progress must never break the job
            say(f"(progress: {error!r})")
        if finished:
            tail.close()
            return
        tail.wait(POLL_S)  # wakes at a new event, or after POLL_S for time-based faults


def run(request: TrainRequest, say: Say = print) -> TrainResult:
    """Run the job to its end; returns the result (the caller decides what a failure means)."""
    from kfp_elastic.etcd.client import connect
    from kfp_elastic.master.job import ElasticJob, JobSpec
    from kfp_elastic.rendezvous.embedded_etcd import EmbeddedEtcd

    say = _safe(say)
    faults = validate(request)
    preflight(request)
    launcher = request.resolved_launcher()
    workdir = Path(request.workdir or f"/tmp/kfp-elastic-{request.run_id}").resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    snapshot_dir = Path(request.snapshot_dir or workdir / "snapshots") / request.run_id
    entry = worker_entry(request, snapshot_dir)
    etcd = request.etcd_settings()
    embedded = EmbeddedEtcd(data_dir=workdir / "etcd").start() if etcd is None else None
    stop = threading.Event()
    holder = LauncherHolder()
    client = None
    watcher: threading.Thread | None = None
    restore: dict[int, Any] = {}
    injector: FaultInjector | None = None
    try:
        if embedded:
            etcd = embedded.client_settings()
            say(f"embedded etcd at {embedded.endpoint} (stops with this job)")
        assert etcd is not None
        run_prefix = etcd.run_prefix(request.run_id)
        client = connect(etcd)
        if launcher == "local":
            factory, act = local_factory(request, etcd, entry, workdir, holder)
        else:
            factory, act = kubernetes_factory(request, etcd, entry, holder)
        spec = JobSpec(
            run_id=request.run_id,
            min_workers=request.min_workers,
            max_workers=request.max_workers,
            nproc_per_worker=request.nproc_per_worker,
            epochs=request.epochs,
            max_wait_s=request.max_wait_s,
            max_failures=request.max_failures,
            shard_manifest=request.manifest_path,
            seed=request.seed,
            entry=tuple(entry),
            key_prefix=etcd.key_prefix,
            launcher=launcher,
            finish_grace_s=request.finish_grace_s,
            extra={"workdir": str(workdir), "component": "elastic_train"},
        )
        job = ElasticJob(spec, client, factory)
        injector = FaultInjector(
            faults, lambda: holder.launcher.list_workers() if holder.launcher else [], act
        )
        watcher = threading.Thread(
            target=_watch,
            name="timeline",
            args=(TimelineTail(client, run_prefix), injector, stop, say),
            daemon=True,
        )
        watcher.start()
        if threading.current_thread() is threading.main_thread():
            # Embedded etcd dies with us: nobody could take over, so any signal cancels.
            # Otherwise SIGTERM steps down (a KFP retry of this task adopts the workers).
            term = embedded is not None or launcher == "local"
            restore = {
                sig: signal.signal(sig, handler)
                for sig, handler in (
                    (signal.SIGINT, lambda *_: job.request_stop(cancel=True)),
                    (signal.SIGTERM, lambda *_: job.request_stop(cancel=term)),
                )
            }
        result = job.run()
        stop.set()
        watcher.join(10)
        events = read_timeline(client, run_prefix)
        model_path = (
            _final_model(client, run_prefix, snapshot_dir) if result.state == "succeeded" else None
        )
        return TrainResult(
            result.state,
            result.message,
            events,
            model_path,
            workdir,
            snapshot_dir,
            list(injector.done),
            time.time(),
        )
    finally:
        stop.set()
        if watcher is not None:
            watcher.join(10)
        for sig, handler in restore.items():
            signal.signal(sig, handler)
        if launcher == "local":
            left = reap_local_processes(request.run_id)
            if left:
                say(f"stopped {len(left)} leftover worker processes of {request.run_id}")
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
        if embedded is not None:
            embedded.stop()
            shutil.rmtree(workdir / "etcd", ignore_errors=True)  # its log stays: etcd.log


def _safe(say: Say) -> Say:
    """Progress output must never break the job (e.g. a closed pipe after Ctrl-C)."""

    def safe(line: str) -> None:
        with contextlib.suppress(Exception):
            say(line)

    return safe


def _final_model(client: Any, run_prefix: str, snapshot_dir: Path) -> Path | None:
    """The model rank 0 wrote at the end, or else the final committed snapshot's weights."""
    written = snapshot_dir / "model.pt"
    deadline = time.monotonic() + 5.0
    while not written.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    if written.exists():
        return written
    import torch

    from kfp_elastic.worker.progress import Progress
    from kfp_elastic.worker.snapshot import Snapshotter

    committed, _ = Progress(client, run_prefix).committed_record()
    if committed is None or not committed.snapshot:
        return None
    state = Snapshotter(snapshot_dir).load(committed.snapshot)
    torch.save(state["model"], written)
    return written


def export_model(result: TrainResult, destination: str) -> None:
    if result.model_path is None:
        raise RuntimeError("the job succeeded but left no model file")
    shutil.copyfile(result.model_path, destination)


def quiet_logs(level: str) -> None:
    """The master's own logs (stderr) at ``level``; progress lines are printed anyway."""
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for name in ("master", "rendezvous", "worker"):
        logging.getLogger(name).setLevel(level.upper())
