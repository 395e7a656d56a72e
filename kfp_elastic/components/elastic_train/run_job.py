"""Runs one elastic job through the master, in this process: the only module of the components
that knows the master's Python API (``master.job``, ``master.state``, the launchers).

The master runs in-process, hosted as ``kfp-elastic master`` hosts it (``master/host.py``: one
launch plan, one SIGTERM rule), rather than as a child process, so that the fault injector can
reach the launcher it created, and so that etcd (embedded when no endpoint is given) outlives
the master: the timeline is read after the job for the report. While the job
runs, a thread tails the timeline, prints one line per event and fires due faults.
"""

from __future__ import annotations

import contextlib
import html
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kfp_elastic.components.common import ENDPOINTS_ENV, etcd_from, in_cluster, reap_local_processes
from kfp_elastic.components.elastic_train.faults import Fault, FaultInjector, Injected, parse_faults
from kfp_elastic.components.elastic_train.summary import describe
from kfp_elastic.contract.prices import Prices
from kfp_elastic.job_spec import (
    DEFAULT_MODEL_DEF,
    FINAL_MODEL_FILE,
    JobSpec,
    parse_command,
    spec_from_params,
)
from kfp_elastic.master.host import Host, LaunchPlan, default_workdir, plan
from kfp_elastic.master.timeline import Event, TimelineTail, read_timeline

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
    workdir = str(Path(workdir or default_workdir(run_id)).resolve())
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
    state: str  # succeeded | failed | refused | stepped_down
    message: str
    events: list[Event]
    model_path: Path | None
    workdir: Path
    snapshot_dir: Path
    injected: list[Injected]
    end_t: float
    prices: Prices
    failures: int = 0  # counted against the job's failure budget (the message names the last)


def kfp_origin(run_id: str) -> str:
    """Who starts a job from the component: the KFP run the run id comes from."""
    return f"kfp-run:{run_id}"


def plan_job(spec: JobSpec, inject_faults: str = "") -> tuple[LaunchPlan, tuple[Fault, ...]]:
    """The job's launch plan (``master/host.py``: the contract validated once, everything
    resolved, nothing started) and its faults; ``ValueError`` names the input at fault."""
    # The task runs in the worker image: the checks see what worker pods see.
    launch = plan(spec, origin=kfp_origin(spec.run_id), files_here=True)
    return launch, parse_faults(inject_faults, spec.size.max_workers)


def fault_action(launch: LaunchPlan, launcher: Callable[[], Any]) -> Act:
    """How a fault acts on a worker of ``launcher()`` (the launcher the master made)."""
    if launch.kind == "local":

        def act(action: str, name: str) -> None:
            (launcher().kill if action == "kill" else launcher().preempt)(name)

        return act

    def delete_pod(action: str, name: str) -> None:  # by "someone else", like an eviction
        from kubernetes import client

        client.CoreV1Api().delete_namespaced_pod(
            name, launcher().namespace, grace_period_seconds=0 if action == "kill" else None
        )

    return delete_pod


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
    say = _safe(say)
    launch, faults = plan_job(spec, inject_faults)
    workdir = launch.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    assert spec.snapshot_dir is not None  # validated: kubernetes needs one, local has a default
    snapshot_dir = spec.snapshot_dir
    stop = threading.Event()
    watcher: threading.Thread | None = None
    injector: FaultInjector | None = None
    host = Host(launch)
    try:
        host.start()
        if host.embedded is not None:
            say(f"embedded etcd at {host.embedded.endpoint} (stops with this job)")
        # The run id is the KFP run's (the pipeline passes it): a start under it is that
        # run's task again, a KFP retry, which adopts the job or returns its stored result.
        job, client = host.job, host.client
        assert job is not None and client is not None
        run_prefix = job.spec.run_prefix
        injector = FaultInjector(
            faults,
            lambda: job.launcher.list_workers() if job.launcher else [],
            fault_action(launch, lambda: job.launcher),
        )
        watcher = threading.Thread(
            target=_watch,
            name="timeline",
            args=(TimelineTail(client, run_prefix), injector, stop, say),
            daemon=True,
        )
        watcher.start()
        result = host.run()
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
            launch.prices,
            result.failures,
        )
    finally:
        stop.set()
        if watcher is not None:
            watcher.join(10)
        if launch.kind == "local":
            left = reap_local_processes(spec.run_id)
            if left:
                say(f"stopped {len(left)} leftover worker processes of {spec.run_id}")
        host.close()


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


def plan_page(run_id: str, plan_text: str) -> str:
    """The report of a dry run: the launch plan, as printed."""
    return (
        f"<html><head><meta charset='utf-8'><title>Launch plan {html.escape(run_id)}</title>"
        f"</head><body><h1>Launch plan of {html.escape(run_id)} (dry run: nothing started)</h1>"
        f"<pre>{html.escape(plan_text)}</pre></body></html>\n"
    )


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
