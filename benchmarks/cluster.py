"""The cluster path's overhead: a preemption and freed capacity, test cluster against local.

The same two events on the test cluster and with local processes, in one run.

Both paths run the same job (``benchmarks.timed_model_def`` over the digits model-def, 1..3
workers, the same batch, step time and snapshot interval) against the same embedded etcd with
mutual TLS, and measure from the event to the first optimizer step of the new world (the
``timed_steps.jsonl`` lines every worker process appends, ``benchmarks/timed_model_def.py``):

- **shrink** (preemption → first step of the 2-worker world). Cluster: a serving pod of priority
  0 (the workers' PriorityClass is below it) arrives on a node full with 3 workers; the scheduler
  preempts one worker (``DisruptionTarget``, graceful deletion: SIGTERM, snapshot, exit), the
  master records the loss and creates a replacement pod that stays Pending. Local: the launcher's
  capacity drops to 2 (the serving pod's slot) and the launcher SIGTERMs one worker tree, as a
  kubelet does (``LocalLauncher.preempt``); the master's replacement waits for a slot.
- **grow** (capacity freed → first step of the 3-worker world). Cluster: the serving pod is
  deleted; the scheduler binds the Pending worker, the kubelet starts it. Local: the launcher's
  capacity goes back to 3 and it starts the waiting worker.

Each repeat does shrink then grow on the same running job (a job per repeat would spend most of
the time starting masters), after the world has made ``--settle-steps`` steps.

The cluster master is the compiled pipeline's ``elastic-train`` task as a pod
(``testing/cluster/kfp_task.py``: command and args as compiled, the production overlay's
ConfigMap, the etcd client certificate from a mounted Secret), exactly what
``tests/e2e/test_cluster_job.py`` runs: the production path, and no harder to set up here than a
local master with the Kubernetes launcher. The local master is hosted as ``kfp-elastic master``
hosts it (``master/host.py``), with the local launcher, in this process (a thread), because the
growth event changes the launcher's ``capacity`` while the job runs.

Besides the seconds to the first step, each event records when the master saw it on the timeline
(``lost_s``: the worker recorded lost; ``round_s``: the new world's round formed) and, for grow,
when the new worker's processes were first seen (``started_s``: the platform's part — scheduler
and kubelet, or the launcher's tick); what follows is the same on both paths (torchrun and
``import torch`` in the new worker, the round, every worker restarting and restoring).

Every process (pods, local workers, etcd) is killed on exit, error, Ctrl-C or SIGTERM.

    python -m benchmarks cluster                 # 3 repeats, ~5 min
    python -m benchmarks cluster --quick         # 1 repeat
    python -m benchmarks cluster --dry-run       # the plan, nothing started
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from benchmarks.harness import (
    add_common_options,
    comma_list,
    export_checkout_to_children,
    first_after,
    parse_options,
    run_in_work_dir,
    start_etcd,
    write_result,
)

TIMED = "benchmarks.timed_model_def"  # wraps the digits model-def (its default)
STEPS_FILE = "timed_steps.jsonl"  # benchmarks/timed_model_def.py: STEPS_FILE_NAME
SHARDS = 12
WORKER_CPU = 1  # a node of 3 CPUs holds 3 workers; the serving pod takes one worker's place
EVENTS = ("shrink", "grow")
PATHS = ("cluster", "local")
TARGET_WORLD = {"shrink": 2, "grow": 3}
log = logging.getLogger("benchmarks.cluster")


# -- pure parts ---------------------------------------------------------------------------------


@dataclass
class Measured:
    """One event on one path."""

    path: str  # cluster | local
    event: str  # shrink | grow
    repeat: int
    t: float = 0.0  # time.time() of the event
    seconds: float | None = None  # event -> first step of the target world
    lost_s: float | None = None  # shrink: event -> the master recorded the worker lost
    round_s: float | None = None  # event -> the master saw the target world's round formed
    # grow: event -> the new worker's processes seen running (polled every ~50 ms)
    started_s: float | None = None
    victim: str = ""  # shrink: the worker taken away
    victim_rank: int | None = None  # its rank in the world before
    error: str | None = None


def step_times(steps: Iterable[Mapping[str, Any]], world: int) -> list[float]:
    """Times of the step lines written by processes of a ``world``-sized world."""
    return [s["t"] for s in steps if s.get("world") == world]


def steps_since(steps: Iterable[Mapping[str, Any]], world: int, after: float) -> int:
    """Steps rank 0 of a ``world``-sized world finished after ``after``."""
    return sum(
        1 for s in steps if s.get("world") == world and s.get("rank") == 0 and s["t"] > after
    )


def new_processes(before: Mapping[str, set[int]], now: Mapping[str, set[int]]) -> set[str]:
    """Workers that run processes now and ran none before (a Pending worker that started)."""
    return {name for name, pids in now.items() if pids and not before.get(name)}


def rank_of(steps: Iterable[Mapping[str, Any]], pids: set[int], before: float) -> int | None:
    """The rank the processes ``pids`` last stepped as before ``before``."""
    mine = [s for s in steps if s.get("pid") in pids and s["t"] <= before]
    return max(mine, key=lambda s: s["t"])["rank"] if mine else None


def _median(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def summarize(runs: Sequence[Measured]) -> dict[str, Any]:
    """Per event: each path's median (and range) over its measured runs, and cluster / local."""
    out: dict[str, Any] = {}
    for event in EVENTS:
        row: dict[str, Any] = {}
        for path in PATHS:
            mine = [r for r in runs if r.path == path and r.event == event]
            seconds = [r.seconds for r in mine if r.seconds is not None]
            row[path] = {
                "median_s": _median(seconds),
                "min_s": min(seconds) if seconds else None,
                "max_s": max(seconds) if seconds else None,
                "median_lost_s": _median([r.lost_s for r in mine if r.lost_s is not None]),
                "median_round_s": _median([r.round_s for r in mine if r.round_s is not None]),
                "median_started_s": _median([r.started_s for r in mine if r.started_s is not None]),
                "measured": len(seconds),
                "runs": len(mine),
            }
        cluster, local = row["cluster"]["median_s"], row["local"]["median_s"]
        row["ratio_cluster_local"] = round(cluster / local, 2) if cluster and local else None
        out[event] = row
    return out


def table(summary: Mapping[str, Any]) -> str:
    """The summary as the lines the benchmark prints."""
    lines = [
        f"{'median seconds':<46}{'cluster':>9}{'local':>9}{'cluster/local':>15}",
    ]
    names = {
        "shrink": "preemption -> first step of the smaller world",
        "grow": "capacity freed -> first step of the bigger world",
    }
    for event in EVENTS:
        row = summary[event]

        def shown(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f}"

        lines.append(
            f"{names[event]:<46}{shown(row['cluster']['median_s']):>9}"
            f"{shown(row['local']['median_s']):>9}{shown(row['ratio_cluster_local']):>15}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """``python -m benchmarks cluster``'s options."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks cluster",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--repeats", type=int, default=3, help="shrink + grow cycles per path")
    add_common_options(p, "one repeat")
    p.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")
    p.add_argument("--paths", default=",".join(PATHS), help="cluster,local or one of them")
    p.add_argument("--step-time", type=float, default=0.1, help="minimum seconds per step")
    p.add_argument("--settle-steps", type=int, default=5, help="steps of a world before an event")
    p.add_argument("--cap", type=float, default=120.0, help="seconds an event may take at most")
    p.add_argument(
        "--local-rdzv-conf",
        default="",
        help="extra --rdzv-conf of the local path's workers, e.g. warm_start_preload= (empty: "
        "no preload of the runtime and model definition, to measure what it saves)",
    )
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options, checked, with ``--quick`` applied."""
    p = build_parser()
    args = parse_options(p, argv)
    if args.quick:
        args.repeats = 1
    args.paths = tuple(comma_list(args.paths))
    unknown = set(args.paths) - set(PATHS)
    if unknown or not args.paths:
        p.error(f"--paths: {','.join(sorted(unknown)) or 'empty'}; choose from {PATHS}")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def job_params(args: argparse.Namespace) -> dict[str, Any]:
    """The job both paths run (the elastic_train component's parameter names)."""
    return {
        "model_def": TIMED,
        "num_shards": SHARDS,
        "min_workers": 1,
        "max_workers": 3,
        # Long enough for every event of every repeat (the job is stopped once measured):
        # ~60 steps an epoch at 3 workers, >= step_time each.
        "epochs": 20 + 15 * args.repeats,
        "batch_size": 8,
        "snapshot_every": 5,
        "step_time": args.step_time,
        "worker_cpu": str(WORKER_CPU),
        "max_wait_s": 120.0,
    }


# -- the two paths ------------------------------------------------------------------------------


class TrainingPath(Protocol):
    name: str

    def steps(self) -> list[dict[str, Any]]: ...
    def timeline(self) -> list[Any]: ...
    def worker_pids(self) -> dict[str, set[int]]: ...
    def pending(self) -> int: ...
    def check(self) -> None: ...
    def shrink(self, repeat: int) -> float: ...
    def grow(self, repeat: int) -> float: ...
    def leftovers(self) -> set[int]: ...


def wait_until(
    predicate: Callable[[], object], timeout: float, what: str, job: TrainingPath
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        job.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{job.name}: {what} not reached within {timeout:.0f} s")
        time.sleep(0.05)


def measure(job: TrainingPath, args: argparse.Namespace) -> list[Measured]:
    from kfp_elastic.master.timeline import RoundFormed, WorkerLost

    runs: list[Measured] = []
    wait_until(
        lambda: {s["rank"] for s in job.steps() if s.get("world") == 3} == {0, 1, 2},
        300,
        "a step of every rank of the 3-worker world",
        job,
    )
    since = time.time()
    for repeat in range(args.repeats):
        for event in EVENTS:
            world = TARGET_WORLD[event]
            before_world = 3 if event == "shrink" else 2
            run = Measured(job.name, event, repeat)
            runs.append(run)
            try:
                wait_until(
                    lambda: steps_since(job.steps(), before_world, since) >= args.settle_steps,  # noqa: B023
                    args.cap,
                    f"{args.settle_steps} steps of the {before_world}-worker world",
                    job,
                )
                if event == "grow":  # the master's replacement waits for capacity
                    wait_until(lambda: job.pending() >= 1, args.cap, "a Pending worker", job)
                pids = job.worker_pids()
                run.t = job.shrink(repeat) if event == "shrink" else job.grow(repeat)

                def reached(
                    run: Measured = run, world: int = world, pids: dict[str, set[int]] = pids
                ) -> bool:
                    if run.event == "grow" and run.started_s is None:
                        if new_processes(pids, job.worker_pids()):
                            run.started_s = round(time.time() - run.t, 3)
                    return first_after(step_times(job.steps(), world), run.t) is not None

                wait_until(
                    reached,
                    args.cap,
                    f"a step of the {world}-worker world",
                    job,
                )
                steps = job.steps()
                run.seconds = first_after(step_times(steps, world), run.t)
                since = run.t + (run.seconds or 0.0)
                events = job.timeline()
                rounds = [
                    e.t for e in events if isinstance(e, RoundFormed) and e.world_size == world
                ]
                run.round_s = first_after(rounds, run.t)
                lost = [e for e in events if isinstance(e, WorkerLost) and e.t > run.t]
                if event == "shrink" and lost:
                    run.lost_s = first_after([e.t for e in lost], run.t)
                    run.victim = lost[0].name
                    run.victim_rank = rank_of(steps, pids.get(run.victim, set()), run.t)
            except (TimeoutError, RuntimeError) as error:
                run.error = f"{type(error).__name__}: {error}"
            shown = (
                (
                    f"{run.seconds} s (master saw: lost {run.lost_s}, round {run.round_s}; "
                    f"victim {run.victim} rank {run.victim_rank})"
                    if event == "shrink"
                    else f"{run.seconds} s (new worker running {run.started_s}, master saw "
                    f"round {run.round_s})"
                )
                if run.error is None
                else f"FAILED ({run.error})"
            )
            print(f"[{job.name}] {event} {repeat + 1}/{args.repeats}: {shown}", flush=True)
            if run.error is not None:
                return runs  # the job is in an unknown state: this path is done
    return runs


class ClusterPath:
    """The job as a KFP run on the test cluster (see the module docstring)."""

    name = "cluster"

    def __init__(
        self,
        root: Path,
        etcd: Any,
        pki: Any,
        manifest: Path,
        params: Mapping[str, Any],
        stack: contextlib.ExitStack,
    ) -> None:
        from kubernetes import client

        from kfp_elastic.components.common import normalize_run_id
        from kfp_elastic.etcd.client import connect
        from kfp_elastic.etcd.keys import run_prefix_of
        from kfp_elastic.master.pod_spec import run_selector
        from kfp_elastic.testing.cluster import TestCluster
        from kfp_elastic.testing.cluster.kfp_task import (
            CompiledPipeline,
            production_config,
            task_pod,
            tls_secret,
        )

        self.cluster = stack.enter_context(
            TestCluster(
                root / "cluster",
                nodes={"node-1": {"cpu": str(3 * WORKER_CPU), "memory": "8Gi"}},
                namespace="kfp-elastic",
            )
        )
        self.ns = self.cluster.namespace
        api_client = self.cluster.client()
        stack.callback(api_client.close)
        self.core = client.CoreV1Api(api_client)
        self.etcd_client = connect(
            etcd.client_settings(cert=str(pki.client_cert), key=str(pki.client_key))
        )
        stack.callback(self.etcd_client.close)
        run_uuid = str(uuid.uuid4())
        self.run_id = normalize_run_id(run_uuid)
        self.run_prefix = run_prefix_of("/kfp-elastic", self.run_id)
        self.selector = run_selector(self.run_id)
        config = production_config(etcd.endpoint)
        self.core.create_namespaced_config_map(self.ns, config)
        secret = config["data"]["KFP_ELASTIC_ETCD_CLIENT_TLS_SECRET"]
        self.core.create_namespaced_secret(
            self.ns, tls_secret(secret, pki.ca, pki.client_cert, pki.client_key)
        )
        claim = "kfp-elastic-snapshots"
        self.claim_dir = self.cluster.claim_path(claim)
        pod = task_pod(
            CompiledPipeline.load(),
            "elastic-train",
            pod_name="elastic-train",
            run_uuid=run_uuid,
            task_root=root / "outputs" / "elastic-train",
            params=params,
            claim_paths={claim: self.claim_dir},
            input_artifacts={"shard_manifest": manifest},
        )
        self.core.create_namespaced_pod(self.ns, pod.manifest)
        self._steps_file: Path | None = None

    def steps(self) -> list[dict[str, Any]]:
        from kfp_elastic.testing.nodes import read_events

        if self._steps_file is None:  # in the run's snapshot directory on the claim
            found = sorted(self.claim_dir.rglob(STEPS_FILE)) if self.claim_dir.exists() else []
            if not found:
                return []
            self._steps_file = found[0]
        return read_events(self._steps_file)

    def timeline(self) -> list[Any]:
        from kfp_elastic.master.timeline import read_timeline

        return read_timeline(self.etcd_client, self.run_prefix)

    def _workers(self) -> list[Any]:
        return self.core.list_namespaced_pod(self.ns, label_selector=self.selector).items

    def worker_pids(self) -> dict[str, set[int]]:
        from kfp_elastic.components.common import run_pids
        from kfp_elastic.testing.cluster.kubelet import POD_UID_ENV

        return {p.metadata.name: run_pids(p.metadata.uid, POD_UID_ENV) for p in self._workers()}

    def pending(self) -> int:
        return sum(1 for p in self._workers() if p.status.phase == "Pending")

    def check(self) -> None:
        from kubernetes.client.rest import ApiException

        try:
            phase = self.core.read_namespaced_pod("elastic-train", self.ns).status.phase
        except ApiException as exc:
            raise RuntimeError(f"the master pod is gone ({exc.status})") from None
        if phase in ("Succeeded", "Failed"):
            tail = self.cluster.log("elastic-train", ns=self.ns)[-2000:]
            raise RuntimeError(f"the master pod ended ({phase}):\n{tail}")

    def shrink(self, repeat: int) -> float:
        serving = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"serving-{repeat}"},
            "spec": {
                "restartPolicy": "Never",
                "containers": [
                    {
                        "name": "main",
                        "image": "serving:1",
                        "command": ["python", "-c", "import time; time.sleep(600)"],
                        "resources": {"requests": {"cpu": str(WORKER_CPU)}},
                    }
                ],
            },
        }
        t = time.time()
        self.core.create_namespaced_pod(self.ns, serving)
        return t

    def grow(self, repeat: int) -> float:
        t = time.time()
        self.core.delete_namespaced_pod(f"serving-{repeat}", self.ns, grace_period_seconds=0)
        return t

    def leftovers(self) -> set[int]:
        """Pod processes alive after the cluster stopped (none expected); killed."""
        found = self.cluster.leftover_processes()
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return found


class LocalPath:
    """The same job with the master's local launcher, the master in this process."""

    name = "local"

    def __init__(
        self,
        root: Path,
        etcd_settings: Any,
        manifest: Path,
        params: Mapping[str, Any],
        stack: contextlib.ExitStack,
    ) -> None:
        from kfp_elastic.master.cli import build_parser, make_spec
        from kfp_elastic.master.host import Host, plan

        self.run_id = f"clusterbench-local-{uuid.uuid4().hex[:8]}"
        self._left: set[int] = set()
        stack.callback(self._kill_leftovers)
        flags = {
            "run-id": self.run_id,
            "etcd": etcd_settings.endpoint_text,
            "model-def": params["model_def"],
            "min-workers": params["min_workers"],
            "max-workers": params["max_workers"],
            "epochs": params["epochs"],
            "batch-size": params["batch_size"],
            "snapshot-every": params["snapshot_every"],
            "step-time": params["step_time"],
            "max-wait": params["max_wait_s"],
            "shard-manifest": manifest,
            "snapshot-dir": root / "local" / "snapshots",
            "workdir": root / "local" / "work",
            "local-capacity": 3,
        }
        if params.get("local_rdzv_conf"):
            flags["rdzv-conf"] = params["local_rdzv_conf"]
        argv = [str(x) for name, value in flags.items() for x in (f"--{name}", value)]
        spec = make_spec(build_parser().parse_args(argv), [], etcd_settings)
        self.steps_file = Path(spec.snapshot_dir or "") / STEPS_FILE
        # Hosted as `kfp-elastic master` hosts it (master/host.py), in a thread: no signals.
        self.host = Host(plan(spec))
        stack.callback(self.host.close)
        self.host.start()
        assert self.host.job is not None and self.host.client is not None
        self.client, self.job = self.host.client, self.host.job
        self.result: Any = None
        self.thread = threading.Thread(target=self._run, name="local-master", daemon=True)
        self.thread.start()
        stack.callback(self._stop)
        deadline = time.monotonic() + 60
        while self.job.launcher is None:
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError("the local master made no launcher within 60 s")
            time.sleep(0.05)
        self.launcher: Any = self.job.launcher

    def _run(self) -> None:
        self.result = self.host.run()

    def _stop(self) -> None:
        self.job.request_stop(cancel=True)  # fail the job, stop its workers
        self.thread.join(60)

    def _kill_leftovers(self) -> None:
        """After the master stopped its workers: SIGKILL whatever of the run still lives."""
        from kfp_elastic.components.common import run_pids

        self._left = run_pids(self.run_id)
        for pid in self._left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def leftovers(self) -> set[int]:
        """Processes of the run alive after the master stopped the job (none expected)."""
        return self._left

    def steps(self) -> list[dict[str, Any]]:
        from kfp_elastic.testing.nodes import read_events

        return read_events(self.steps_file)

    def timeline(self) -> list[Any]:
        from kfp_elastic.master.timeline import read_timeline

        return read_timeline(self.client, self.job.spec.run_prefix)

    def _running(self) -> list[str]:
        from kfp_elastic.master.launcher import WorkerPhase

        workers = self.launcher.list_workers()
        return sorted(
            w.name for w in workers if w.phase is WorkerPhase.RUNNING and w.reason is None
        )

    def worker_pids(self) -> dict[str, set[int]]:
        return {name: self.launcher.pids(name) for name in self._running()}

    def pending(self) -> int:
        from kfp_elastic.master.launcher import WorkerPhase

        return sum(1 for w in self.launcher.list_workers() if w.phase is WorkerPhase.PENDING)

    def check(self) -> None:
        if not self.thread.is_alive():
            raise RuntimeError(f"the local master ended: {self.result}")

    def shrink(self, repeat: int) -> float:
        # The serving workload takes a slot (capacity 2: the replacement waits), then the
        # launcher SIGTERMs one worker's tree as a kubelet does on preemption. An int
        # assignment: the launcher's poll thread reads it on its next tick.
        self.launcher.capacity = 2
        victim = self._running()[0]
        t = time.time()
        self.launcher.preempt(victim)
        return t

    def grow(self, repeat: int) -> float:
        t = time.time()
        self.launcher.capacity = 3  # the slot is free again: the waiting worker starts
        return t


# -- main ---------------------------------------------------------------------------------------


def run(args: argparse.Namespace, work_dir: Path) -> dict[str, Any]:
    from kfp_elastic.components.shard_dataset.shard import build_manifest
    from kfp_elastic.etcd.pki import generate_test_pki

    export_checkout_to_children()  # pods and local workers import benchmarks.timed_model_def
    params = job_params(args)
    manifest = work_dir / "manifest.json"
    manifest.write_text(json.dumps(build_manifest("", TIMED, "train", SHARDS, 0)))
    pki = generate_test_pki(work_dir / "etcd-pki")
    runs: list[Measured] = []
    leftovers: dict[str, list[int]] = {}
    with contextlib.ExitStack() as stack:
        etcd = start_etcd(stack, work_dir, tls=pki.server)
        settings = etcd.client_settings(cert=str(pki.client_cert), key=str(pki.client_key))
        for name in args.paths:  # one job per path: alternating would double the start-ups
            job: TrainingPath
            with contextlib.ExitStack() as path_stack:
                if name == "cluster":
                    job = ClusterPath(work_dir, etcd, pki, manifest, params, path_stack)
                else:
                    local = {**params, "local_rdzv_conf": args.local_rdzv_conf}
                    job = LocalPath(work_dir, settings, manifest, local, path_stack)
                started = time.monotonic()
                runs += measure(job, args)
                print(f"[{name}] done in {time.monotonic() - started:.0f} s", flush=True)
            leftovers[name] = sorted(job.leftovers())  # after the path's own clean-up
    return {
        "job": params,
        "leftover_pids": leftovers,
        "runs": [asdict(r) for r in runs],
    }


def headline(summary: Mapping[str, Any]) -> dict[str, Any]:
    """Per event each path's median seconds and cluster / local (the table's numbers)."""
    out: dict[str, Any] = {}
    for event, row in summary.items():
        for path in PATHS:
            out[f"{event}.{path}.median_s"] = row[path]["median_s"]
            out[f"{event}.{path}.measured"] = f"{row[path]['measured']}/{row[path]['runs']}"
        out[f"{event}.cluster_over_local"] = row["ratio_cluster_local"]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    params = job_params(args)
    print(
        f"plan: paths={','.join(args.paths)} repeats={args.repeats} (shrink + grow each) "
        f"settle_steps={args.settle_steps} cap={args.cap:.0f}s\n"
        f"job: {json.dumps(params)}",
        flush=True,
    )
    if args.dry_run:
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    began = time.time()
    report: dict[str, Any] = {"job": params, "leftover_pids": {}, "runs": []}
    code, _ = run_in_work_dir(
        "cluster-recovery-", False, lambda work_dir, _stack: report.update(run(args, work_dir))
    )
    summary = summarize([Measured(**r) for r in report["runs"]])
    print(table(summary), flush=True)
    report["events"] = summary
    write_result("cluster", args, began, code == 0, headline(summary), report)
    failed = [r for r in report["runs"] if r["error"]]
    return 1 if code or failed or any(report["leftover_pids"].values()) else 0
