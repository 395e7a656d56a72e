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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kfp_elastic.components.common import ENDPOINTS_ENV, etcd_from, in_cluster, reap_local_processes
from kfp_elastic.components.elastic_train.faults import Fault, FaultInjector, Injected, parse_faults
from kfp_elastic.components.elastic_train.summary import describe
from kfp_elastic.job_spec import (
    DEFAULT_MODEL_DEF,
    FINAL_MODEL_FILE,
    JobSpec,
    parse_command,
    spec_from_params,
)
from kfp_elastic.master.job import LauncherFactory
from kfp_elastic.master.own_pod import REASON as OWN_POD_REASON
from kfp_elastic.master.own_pod import OwnPodWatch, watch_own_pod
from kfp_elastic.master.state import MasterState
from kfp_elastic.master.timeline import Event, TimelineTail, read_timeline
from kfp_elastic.master.wiring import launcher_factory

POLL_S = 0.5
Say = Callable[[str], None]
Act = Callable[[str, str], None]  # (fault action, worker name)


def resolve_launcher(launcher: str) -> str:
    """``auto``: kubernetes inside a pod, local elsewhere."""
    if launcher == "auto":
        return "kubernetes" if in_cluster() else "local"
    return launcher


def job_spec(
    params: Mapping[str, Any],
    *,
    run_id: str,
    launcher: str = "auto",
    etcd_endpoint: str = "",
    snapshot_dir: str = "",
    workdir: str = "",
    env: Mapping[str, str] | None = None,
    **values: Any,
) -> JobSpec:
    """The job of the component's contract parameters ``params`` (by parameter name) and the
    settings it works out itself; ``ValueError`` names the input at fault."""
    kind = resolve_launcher(launcher)
    if kind not in ("local", "kubernetes"):
        raise ValueError(f"launcher must be auto, local or kubernetes, got {launcher!r}")
    etcd = etcd_from(etcd_endpoint, env)  # ConfigError (a ValueError) names the bad setting
    if kind == "kubernetes" and etcd is None:
        raise ValueError(
            "the kubernetes launcher needs etcd_endpoint (worker pods cannot "
            "reach an embedded etcd); deploy manifests/ and use its "
            f"kfp-elastic-config ConfigMap ({ENDPOINTS_ENV}), or pass etcd_endpoint"
        )
    params = dict(params)
    if isinstance(params.get("command"), str):
        params["command"] = parse_command(params["command"])
        # A command replaces the example model the component trains by default.
        if params["command"] and params.get("model_def") == DEFAULT_MODEL_DEF:
            params["model_def"] = ""
    workdir = str(Path(workdir or f"/tmp/kfp-elastic-{run_id}").resolve())
    # Snapshots of this run under the given root (a volume every pod mounts); the local
    # launcher's default root is the work directory, kubernetes has none (validate says so).
    root = snapshot_dir or (os.path.join(workdir, "snapshots") if kind == "local" else "")
    return spec_from_params(
        params,
        run_id=run_id,
        etcd=etcd,
        kind=kind,
        workdir=workdir,
        snapshot_dir=os.path.join(root, run_id) if root else "",
        **values,
    )


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
    failures: int = 0  # counted against the job's failure budget (the message names the last)


def validate(spec: JobSpec, inject_faults: str = "") -> tuple[Fault, ...]:
    """Check every input before anything starts; ``ValueError`` names the input at fault."""
    spec.validate()
    spec.launch.kubernetes.prices(os.environ)  # a bad price variable fails here
    return parse_faults(inject_faults, spec.size.max_workers)


def kfp_origin(run_id: str) -> str:
    """Who starts a job from the component: the KFP run the run id comes from."""
    return f"kfp-run:{run_id}"


class LauncherHolder:
    """The launcher the master created (the factory runs inside ``ElasticJob.run``)."""

    launcher: Any = None


def launcher_and_faults(
    spec: JobSpec, holder: LauncherHolder, adopting: bool = False
) -> tuple[LauncherFactory, Act]:
    """The job's launcher factory (``master.wiring``, as ``kfp-elastic master`` makes it),
    keeping the launcher in ``holder``, and how a fault acts on one of its workers."""
    # The task runs in the worker image; a retry adopting the job skips the costly checks.
    make = launcher_factory(spec, files_here=True, adopting=adopting)

    def factory(state: Any) -> Any:
        holder.launcher = make(state)
        return holder.launcher

    if spec.launch.kind == "local":

        def act(action: str, name: str) -> None:
            (holder.launcher.kill if action == "kill" else holder.launcher.preempt)(name)

        return factory, act

    def delete_pod(action: str, name: str) -> None:  # by "someone else", like an eviction
        from kubernetes import client

        client.CoreV1Api().delete_namespaced_pod(
            name, holder.launcher.namespace, grace_period_seconds=0 if action == "kill" else None
        )

    return factory, delete_pod


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


def run(spec: JobSpec, inject_faults: str = "", say: Say = print) -> TrainResult:
    """Run the job to its end; returns the result (the caller decides what a failure means).
    ``spec.etcd`` None: an embedded etcd (local launcher only)."""
    from kfp_elastic.etcd.client import connect
    from kfp_elastic.master.job import ElasticJob
    from kfp_elastic.rendezvous.embedded_etcd import EmbeddedEtcd

    say = _safe(say)
    faults = validate(spec, inject_faults)
    launcher = spec.launch.kind
    workdir = Path(spec.launch.local.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    assert spec.snapshot_dir is not None  # validate: kubernetes needs one, local has a default
    snapshot_dir = spec.snapshot_dir
    embedded = EmbeddedEtcd(data_dir=workdir / "etcd").start() if spec.etcd is None else None
    stop = threading.Event()
    holder = LauncherHolder()
    client = None
    watcher: threading.Thread | None = None
    restore: dict[int, Any] = {}
    injector: FaultInjector | None = None
    own_pod: OwnPodWatch | None = None
    try:
        if embedded:
            spec = replace(spec, etcd=embedded.client_settings())
            say(f"embedded etcd at {embedded.endpoint} (stops with this job)")
        assert spec.etcd is not None
        run_prefix = spec.run_prefix
        client = connect(spec.etcd)
        adopting = bool(MasterState(client, run_prefix).workers())  # a KFP retry
        factory, act = launcher_and_faults(spec, holder, adopting)
        # The run id is the KFP run's (the pipeline passes it): a start under it is that
        # run's task again, a KFP retry, which adopts the job or returns its stored result.
        job = ElasticJob(spec, client, factory, origin=kfp_origin(spec.run_id))
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
            # The task's pod being deleted acts as SIGTERM, which KFP's launcher does not
            # pass on (master/own_pod.py).
            own_pod = watch_own_pod(lambda: job.request_stop(cancel=term, reason=OWN_POD_REASON))
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
            result.failures,
        )
    finally:
        stop.set()
        if own_pod is not None:
            own_pod.stop()
        if watcher is not None:
            watcher.join(10)
        for sig, handler in restore.items():
            signal.signal(sig, handler)
        if launcher == "local":
            left = reap_local_processes(spec.run_id)
            if left:
                say(f"stopped {len(left)} leftover worker processes of {spec.run_id}")
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
    written = snapshot_dir / FINAL_MODEL_FILE
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
