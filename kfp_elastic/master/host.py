"""The one host of a master: ``plan`` makes a ``JobSpec`` a ``LaunchPlan``, ``Host`` applies it.

``kfp-elastic master``, the ``elastic_train`` component and the benchmarks all host their master
here, in two steps (like TorchX's ``submit_dryrun`` and ``schedule``):

1. :func:`plan` validates the job once and resolves everything a start needs (paths, the
   workers' environment, command and flags, the worker pod template or the local process
   commands, the etcd mode, what a signal does) into a frozen, printable :class:`LaunchPlan`.
   It starts nothing and reads only local files (a manifest, the GPUs, this pod's namespace);
   ``kfp-elastic master --dry-run`` prints it.
2. :class:`Host` applies a plan: it starts an embedded etcd (when the plan says so), connects,
   and runs the master (``ElasticJob``) with the plan's signal handling and its launcher: the
   master asks whether the run id may start, then the host's checks before any worker starts
   run (``master/preflight.py``), then the job.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import yaml
from pyetcd.client import MultiEndpointEtcd3Client

from kfp_elastic.contract.prices import Prices
from kfp_elastic.etcd.settings import EtcdSettings
from kfp_elastic.gpus import require_gpus, visible_gpus
from kfp_elastic.job_env import SNAPSHOT_DIR_ENV, JobEnv
from kfp_elastic.job_spec import JobSpec, is_file_reference
from kfp_elastic.master.job import ElasticJob, JobResult
from kfp_elastic.master.launcher import Launcher, next_attempts
from kfp_elastic.master.local_launcher import MONITOR_INTERVAL_S, absolute_script, worker_agent
from kfp_elastic.master.own_pod import REASON as OWN_POD_REASON
from kfp_elastic.master.own_pod import OwnPodWatch, own_pod_name, own_pod_uid, watch_own_pod
from kfp_elastic.master.pod_spec import WorkerPodSpec, build_pod
from kfp_elastic.master.preflight import (
    DeferredCheck,
    PreflightError,
    WorkerSide,
    check,
    ladder_classes_problem,
)
from kfp_elastic.master.state import MasterState
from kfp_elastic.master.wiring import (
    PriorityClassesUnreadable,
    cluster_priority_value,
    job_env,
    load_kubernetes_config,
    worker_pod_template,
)

if TYPE_CHECKING:
    from kfp_elastic.master.k8s_events import EventRecorder

log = logging.getLogger(__name__)

K8S_LAUNCHER_MODULE = "kfp_elastic.master.k8s_launcher"
EMBEDDED = "embedded"
EXTERNAL = "external"
CANCEL = "cancel"  # fail the job and stop its workers
STEP_DOWN = "step-down"  # leave the workers running for the next master
EMBEDDED_ETCD_DIR = "etcd"  # under the job's work directory; its log (etcd.log) stays
_EMBEDDED_ENDPOINT = "<the embedded etcd's 127.0.0.1:PORT, chosen when it starts>"


# -- the plan (pure) ----------------------------------------------------------------------------


@dataclass(frozen=True)
class EtcdPlan:
    """Where the job's state lives: an ``embedded`` etcd this master starts (and stops), or an
    ``external`` one it connects to."""

    mode: str  # EMBEDDED | EXTERNAL
    endpoints: str = ""  # external: its endpoints; embedded: chosen when it starts
    data_dir: str = ""  # embedded: its data, removed when it stops


@dataclass(frozen=True)
class SignalPolicy:
    """What SIGINT and SIGTERM do to the master; this master's pod being deleted acts as
    SIGTERM (``master/own_pod.py``: KFP's launcher does not pass SIGTERM on)."""

    sigint: str
    sigterm: str

    @property
    def term_cancels(self) -> bool:
        return self.sigterm == CANCEL


def signal_policy(etcd_mode: str, kind: str) -> SignalPolicy:
    """The one SIGTERM rule: cancel where nobody can take over (an embedded etcd dies with this
    master; local workers belong to this master's machine and session), step down where a
    successor can adopt the workers (external etcd and worker pods: a KFP retry of the task).
    SIGINT (Ctrl-C) always cancels."""
    adoptable = etcd_mode == EXTERNAL and kind == "kubernetes"
    return SignalPolicy(sigint=CANCEL, sigterm=STEP_DOWN if adoptable else CANCEL)


@dataclass(frozen=True)
class LocalProcesses:
    """The local launcher's workers: one torchrun agent process each, on this machine."""

    entry: tuple[str, ...]  # what torchrun runs (a relative script made absolute)
    env: Mapping[str, str]  # the job's settings, on top of this process's environment
    gpus: tuple[str, ...]  # the GPUs to share out
    device: str | None  # the built-in runtime's --device (None: a command of the user's)


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a start of ``spec`` will do, resolved; nothing started. ``Host`` applies it."""

    spec: JobSpec  # validated; a local model definition file's path made absolute
    origin: str | None  # who starts it (master.state.start_refusal): the KFP run, or None
    etcd: EtcdPlan
    signals: SignalPolicy
    prices: Prices  # of the cost metrics: the job's, else the ConfigMap's
    workdir: Path  # local workers' logs and exit records (workers/), an embedded etcd's data
    cwd: Path  # where the checks and local workers resolve relative paths
    files_here: bool  # the checks may read files and load the model definition here
    local: LocalProcesses | None = None
    pod: WorkerPodSpec | None = None  # every worker pod is made from it (kubernetes)
    env: Mapping[str, str] = field(default_factory=dict, repr=False)  # this process's, for checks

    @property
    def kind(self) -> str:
        return self.spec.launch.kind

    def with_etcd(self, settings: EtcdSettings) -> LaunchPlan:
        """The plan once its embedded etcd runs at ``settings``."""
        etcd = replace(self.etcd, endpoints=settings.endpoint_text)
        return replace(self, spec=replace(self.spec, etcd=settings), etcd=etcd)

    def worker_env(self) -> dict[str, str]:
        """What every local worker gets on top of this process's environment: the etcd
        connection (the very same settings: local workers share this machine's files) and the
        job's settings."""
        assert self.local is not None
        etcd = self.spec.etcd
        connection = etcd.to_env() if etcd is not None else {}
        return {**connection, **self.local.env}

    def local_agent_commands(self) -> dict[str, list[str]]:
        """The command of each local worker's first attempt, by worker name."""
        assert self.local is not None
        spec, local = self.spec, self.local
        endpoint = spec.etcd.endpoint_text if spec.etcd is not None else _EMBEDDED_ENDPOINT
        commands = {}
        for index in range(spec.size.max_workers):
            name = f"worker-{index}-0"
            agent, _ = worker_agent(
                name=name,
                index=index,
                run_id=spec.run_id,
                endpoint=endpoint,
                nnodes=f"{spec.size.min_workers}:{spec.size.max_workers}",
                entry=local.entry,
                nproc_per_worker=spec.size.nproc_per_worker,
                max_restarts=spec.launch.worker_max_restarts,
                monitor_interval_s=MONITOR_INTERVAL_S,
                rdzv_conf=spec.worker_rdzv_conf(),
                env={},
                gpus=local.gpus,
                workdir=self.workdir,
                cwd=self.cwd,
            )
            commands[name] = agent.command
        return commands

    def pods(self) -> list[dict[str, Any]]:
        """The first pod of each tier: worker 0 (guaranteed) and, with more slots than
        ``min_workers``, worker ``min_workers`` (opportunistic)."""
        assert self.pod is not None
        size = self.spec.size
        indexes = [0] + ([size.min_workers] if size.max_workers > size.min_workers else [])
        return [build_pod(replace(self.pod, worker_index=i)) for i in indexes]

    def summary(self) -> dict[str, Any]:
        """The plan as plain values (what ``describe`` prints first)."""
        spec = self.spec
        etcd: dict[str, Any] = {"mode": self.etcd.mode}
        if self.etcd.mode == EMBEDDED:
            etcd.update(endpoints=_EMBEDDED_ENDPOINT, data_dir=self.etcd.data_dir)
        else:
            etcd["endpoints"] = self.etcd.endpoints
        etcd["key_prefix"] = spec.key_prefix
        out: dict[str, Any] = {
            "run_id": spec.run_id,
            "origin": self.origin or "-",
            "launcher": self.kind,
            "workers": f"{spec.size.min_workers}..{spec.size.max_workers} "
            f"x {spec.size.nproc_per_worker} processes",
            "etcd": etcd,
            "signals": {
                "SIGINT": self.signals.sigint,
                "SIGTERM": self.signals.sigterm,
                "own pod deleted": self.signals.sigterm,
            },
            "prices": {"on_demand": self.prices.on_demand, "spot": self.prices.spot},
            "worker_argv": list(spec.worker_argv()),
            "rdzv_conf": spec.worker_rdzv_conf(),
        }
        if self.local is not None:
            env = self.worker_env()
            if spec.etcd is None:
                env = {"KFP_ELASTIC_ETCD_ENDPOINTS": _EMBEDDED_ENDPOINT, **env}
            out["local"] = {
                "workdir": str(self.workdir),
                "cwd": str(self.cwd),
                "capacity": spec.launch.local.capacity,
                "gpus": list(self.local.gpus),
                "environment": dict(sorted(env.items())),
                "commands": self.local_agent_commands(),
            }
        return out

    def describe(self) -> str:
        """The plan as YAML: its summary, then (Kubernetes) the first worker pod of each tier,
        each a document ``kubectl apply --dry-run=client -f -`` reads."""
        documents: list[Any] = [self.summary()]
        if self.pod is not None:
            documents += self.pods()
        return yaml.safe_dump_all(documents, sort_keys=False, default_flow_style=False)


def default_workdir(run_id: str) -> Path:
    """The job's work directory when none is given: one per run id, so that a restarted master
    finds its workers' logs and exit records."""
    return Path(tempfile.gettempdir()) / f"kfp-elastic-{run_id}"


def plan(
    spec: JobSpec,
    *,
    origin: str | None = None,
    files_here: bool = False,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> LaunchPlan:
    """The launch plan of ``spec``: the job validated (the one ``JobSpec.validate`` of a start)
    and resolved; ``ValueError`` names the field at fault. ``spec.etcd`` None: an embedded etcd
    (local workers only). ``files_here``: worker pods see this process's files and Python
    packages (the component runs in the worker image with the same volumes); local workers
    always do. ``env``/``cwd``: this process's by default."""
    env = dict(os.environ if env is None else env)
    cwd = (cwd or Path.cwd()).resolve()
    spec.validate()
    prices = spec.launch.kubernetes.prices(env)  # a bad price variable fails here
    kind = spec.launch.kind
    workdir = Path(spec.launch.local.workdir or default_workdir(spec.run_id)).resolve()
    if spec.etcd is None:
        if kind == "kubernetes":
            raise ValueError(
                "etcd: worker pods cannot reach an etcd embedded in the master; give the "
                "endpoints of an etcd they reach (--etcd HOST:PORT / etcd_endpoint, manifests/)"
            )
        etcd = EtcdPlan(EMBEDDED, data_dir=str(workdir / EMBEDDED_ETCD_DIR))
    else:
        etcd = EtcdPlan(EXTERNAL, endpoints=spec.etcd.endpoint_text)
    signals = signal_policy(etcd.mode, kind)
    if kind == "kubernetes":
        pod = worker_pod_template(spec, env)
        return LaunchPlan(
            spec, origin, etcd, signals, prices, workdir, cwd, files_here, pod=pod, env=env
        )
    local_settings = replace(spec.launch.local, workdir=str(workdir))
    spec = replace(spec, launch=replace(spec.launch, local=local_settings))
    model_def = spec.entry.model_def
    if model_def and is_file_reference(model_def):  # a restarted master may run elsewhere
        spec = replace(spec, entry=replace(spec.entry, model_def=str((cwd / model_def).resolve())))
    snapshot_dir = spec.snapshot_dir or env.get(SNAPSHOT_DIR_ENV) or workdir / "snapshots"
    device = spec.training.device if spec.entry.model_def else None
    gpus = visible_gpus(env)
    require_gpus(device, spec.size.max_workers * spec.size.nproc_per_worker, gpus)
    local = LocalProcesses(
        entry=tuple(absolute_script(list(spec.worker_argv()), cwd)),
        env=JobEnv.of(spec, str(snapshot_dir)).to_env(),
        gpus=gpus,
        device=device,
    )
    return LaunchPlan(spec, origin, etcd, signals, prices, workdir, cwd, True, local=local, env=env)


# -- applying it ----------------------------------------------------------------------------------


def prestart_checks(launch: LaunchPlan, adopting: bool = False) -> DeferredCheck | None:
    """The checks before any worker starts (``master/preflight.py``); ``PreflightError`` (a
    ``ValueError``) lists the problems. ``adopting``: the run has workers already (a restarted
    or retried master): only the cheap checks run again, not the model definition's and the
    dataset's load, which the running job has passed. Worker pods: the model definition's
    load (seconds: it imports torch) is returned as a ``DeferredCheck`` that runs while the
    master creates the pods (a failure fails the job and deletes them); local workers wait
    for it (they would compete with it for this machine's CPUs)."""
    spec = launch.spec
    assert spec.etcd is not None, "the etcd of the plan must run before the checks"
    argv = spec.worker_argv()
    if launch.local is not None:
        env = {**launch.env, **launch.worker_env()}
        side = WorkerSide(argv, env, launch.cwd, files_here=not adopting, workdir=launch.workdir)
        check(spec, side)
        return None
    env = {**launch.env, **spec.etcd.to_env(), **job_env(spec)}
    worker = WorkerSide(argv, env, launch.cwd, files_here=launch.files_here and not adopting)
    # The Kubernetes client's import (≈ 1 s) is on the way from submission to the first worker
    # pod: import while the cheap checks run. The model definition's check (a subprocess that
    # imports torch, ≈ 2 s) runs on while the pods are created.
    importing = threading.Thread(
        target=importlib.import_module, args=(K8S_LAUNCHER_MODULE,), daemon=True
    )
    importing.start()
    deferred = check(spec, worker, defer_entry=True)
    importing.join()
    if spec.launch.kubernetes.ladder_levels():
        try:
            problem = ladder_classes_problem(
                spec.launch.kubernetes.resolved(launch.env), cluster_priority_value
            )
        except PriorityClassesUnreadable:
            problem = None  # said: the job runs, its ladder unchecked
        if problem:
            raise PreflightError([problem])
    return deferred


def make_launcher(launch: LaunchPlan, state: MasterState | None) -> Launcher:
    """The plan's launcher, adopting the workers in ``state``'s table (what ``ElasticJob`` calls
    once it leads the run)."""
    spec = launch.spec
    assert spec.etcd is not None
    if launch.local is not None:
        from kfp_elastic.master.local_launcher import LocalLauncher

        local = launch.local
        return LocalLauncher(
            run_id=spec.run_id,
            endpoint=spec.etcd.endpoint_text,
            min_workers=spec.size.min_workers,
            max_workers=spec.size.max_workers,
            entry=local.entry,
            workdir=launch.workdir,
            nproc_per_worker=spec.size.nproc_per_worker,
            rdzv_conf=spec.worker_rdzv_conf(),
            env=launch.worker_env(),
            registry=state,
            capacity=spec.launch.local.capacity,
            max_restarts=spec.launch.worker_max_restarts,
            gpus=local.gpus,
            device=local.device,
            cwd=launch.cwd,
        )
    from kubernetes import client

    from kfp_elastic.master.k8s_launcher import KubernetesLauncher

    template = launch.pod
    assert template is not None
    # Read the credentials when the master starts the launcher, not at import time.
    load_kubernetes_config()
    recorder = event_recorder(launch, state, template.namespace or "default")

    class OwnClientLauncher(KubernetesLauncher):
        """Closes the API client it was made with (one per launcher), and the recorder of the
        master's Events after the job's last one."""

        def __init__(self, api: Any, first_attempts: Mapping[int, int]) -> None:
            super().__init__(template, template.namespace, api, first_attempts=first_attempts)
            self._api = api

        def close(self) -> None:
            super().close()
            self._api.close()
            if recorder is not None:
                recorder.close()
                recorder.api_client.close()

    attempts = next_attempts(state.workers()) if state is not None else {}
    return OwnClientLauncher(client.ApiClient(), attempts)


def event_recorder(
    launch: LaunchPlan, state: MasterState | None, namespace: str
) -> EventRecorder | None:
    """The recorder of the master's decisions as Kubernetes Events (``master/k8s_events.py``),
    fed by ``state``'s timeline from now on, after what the timeline holds already; None
    without a state."""
    if state is None:
        return None
    from kubernetes import client

    from kfp_elastic.master.k8s_events import EventRecorder
    from kfp_elastic.master.pod_events import Seen, seen_after
    from kfp_elastic.master.timeline import read_timeline

    try:
        seen = seen_after(
            read_timeline(state.client, state.keys.run_prefix),
            Seen(max_failures=launch.spec.policy.max_failures),
        )
        recorder = EventRecorder(
            namespace,
            client.ApiClient(),
            own_pod=own_pod_name(os.environ),
            own_uid=own_pod_uid(os.environ),
            instance=state.identity,
            seen=seen,
        ).start()
    except Exception as error:  # noqa: BLE001 - Events are for people: never fail the job
        log.warning("kubernetes events not recorded error=%r", error)
        return None
    state.add_listener(recorder.record)
    return recorder


class Host:
    """A launch plan applied: ``start()`` (the embedded etcd of the plan, the etcd client, the
    master), ``run()`` (the master with the plan's signal handling: the run id's check, the
    checks before any worker starts, the job), ``close()``.

    ``run`` returns the master's result (``refused`` for a run id that may not start) and
    raises ``PreflightError`` (a ``ValueError``) for a job that cannot start."""

    def __init__(
        self,
        launch: LaunchPlan,
        *,
        metrics_port: int | None = None,
        metrics_host: str = "0.0.0.0",
    ) -> None:
        self.plan = launch
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.embedded: Any = None  # etcd.embedded.EmbeddedEtcd, while it runs
        self.client: MultiEndpointEtcd3Client | None = None
        self.job: ElasticJob | None = None

    def start(self) -> Host:
        from kfp_elastic.etcd.client import connect

        launch = self.plan
        if launch.etcd.mode == EMBEDDED:
            from kfp_elastic.etcd.embedded import EmbeddedEtcd

            data_dir = Path(launch.etcd.data_dir)
            data_dir.parent.mkdir(parents=True, exist_ok=True)
            self.embedded = EmbeddedEtcd(data_dir=data_dir).start()
            launch = self.plan = launch.with_etcd(self.embedded.client_settings())
            log.warning(
                "embedded etcd endpoint=%s: it stops with this master, so a restarted "
                "master cannot recover this run",
                self.embedded.endpoint,
            )
        assert launch.spec.etcd is not None
        self.client = connect(launch.spec.etcd)
        self.job = ElasticJob(
            launch.spec,
            self.client,
            lambda state: make_launcher(launch, state),
            metrics_port=self.metrics_port,
            metrics_host=self.metrics_host,
            origin=launch.origin,
            prices=launch.prices,
            # After the run id's check (an etcd read), the checks that take seconds.
            prepare=lambda state: prestart_checks(launch, adopting=bool(state.workers())),
        )
        return self

    def run(self) -> JobResult:
        """The master's run to its end; in the main thread, with the plan's signal handling."""
        job = self.job
        assert job is not None, "start() first"
        cancel = self.plan.signals.term_cancels
        restore: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            restore = {
                sig: signal.signal(sig, handler)
                for sig, handler in (
                    (signal.SIGINT, lambda *_: job.request_stop(cancel=True, reason="SIGINT")),
                    (signal.SIGTERM, lambda *_: job.request_stop(cancel=cancel)),
                )
            }
        # In a pod, its deletion acts as SIGTERM, which may not reach this process.
        own_pod: OwnPodWatch | None = watch_own_pod(
            lambda: job.request_stop(cancel=cancel, reason=OWN_POD_REASON)
        )
        try:
            return job.run()
        finally:
            if own_pod is not None:
                own_pod.stop()
            for sig, handler in restore.items():
                signal.signal(sig, handler)

    def close(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except Exception:  # noqa: BLE001 - closing after etcd went away
                log.debug("etcd client close failed", exc_info=True)
            self.client = None
        if self.embedded is not None:
            self.embedded.stop()
            shutil.rmtree(self.plan.etcd.data_dir, ignore_errors=True)  # its log stays
            self.embedded = None

    def __enter__(self) -> Host:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()
