"""Several training jobs on one test cluster, submitted at given times: what the scheduling
experiments on the test cluster share (``exp1``, ``admission``).

Each job is a :class:`~kfp_elastic.testing.cluster.training_run.TrainingRun` (a KFP run of the
compiled ``elastic-train`` task with the production settings); the first one owns the cluster
and etcd, the others share them (``TrainingRun(..., share=first)``) as further runs in the same
namespace. The cluster has one node with ``slots`` ``nvidia.com/gpu`` and each worker asks one:
a *slot* is a GPU.

The jobs train the timed model definition (``benchmarks/timed_model_def.py``) over
``counted_blobs``: every optimizer step sleeps what ``job_type`` takes for ``global_batch``
samples on the current world's GPUs (``throughput.step_seconds``); the pods, etcd rendezvous,
master, preemption, snapshots and data plan are real. The worker pods get no environment of
ours, so the settings travel in a generated model-definition file (:func:`write_model_def`).
Every job's batch policy scales from its ``max_workers`` (its etcd ``base_world_size`` is set
before its master starts): a job has the same steps, of the same samples, at any world size, as
the seed's jobs have.

What is recorded, all in seconds since the experiment's start:

- per job: submission (its master pod created), first step and every later one (rank 0's lines
  of the job's ``timed_steps.jsonl``: time, global step number, world, process), end (its
  master pod Succeeded), and when each of its worker pods was bound, told to stop and gone;
- the slots each job *holds* over time (:class:`~benchmarks.scheduling.occupancy.
  OccupancySampler` over the API server's pods: bound and not terminated) and the slots it
  *trains* on (:func:`training_samples`: its world between two consecutive steps of the same
  processes); the two differ where pods are bound but wait (starting, a gang not complete, a
  new world forming).
- steps lost (:func:`steps_lost`): optimizer steps done again after a restart from an older
  snapshot.
"""

from __future__ import annotations

import contextlib
import json
import logging
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.scheduling.occupancy import OccupancySampler, Sample, owner_of, utilization
from benchmarks.scheduling.throughput import step_seconds
from kfp_elastic.contract.data_plan import steps_left
from kfp_elastic.master.pod_spec import run_selector

log = logging.getLogger(__name__)

INNER_MODEL_DEF = "kfp_elastic.testing.model_defs.counted_blobs"
SAMPLES = 240  # counted_blobs' training samples
STEPS_FILE = "timed_steps.jsonl"  # benchmarks/timed_model_def.py: STEPS_FILE_NAME
SNAPSHOT_CLAIM = "kfp-elastic-snapshots"  # training_run.SNAPSHOT_CLAIM
PER_WORKER_BATCH = 2  # real samples per worker at the base world size (the pacing is separate)
NODE = {"cpu": "64", "memory": "256Gi"}  # room for masters; the workers ask GPUs only

MODEL_DEF_TEMPLATE = '''"""Written by benchmarks/scheduling/cluster_jobs.py: the timed model
definition with this experiment's settings (worker pods get no environment of the benchmark's)."""

import importlib.util
import os
from pathlib import Path

import benchmarks

_SETTINGS = {settings!r}
_saved = {{key: os.environ.get(key) for key in _SETTINGS}}
os.environ.update(_SETTINGS)
try:  # a private copy: a host process that imported the module before keeps its own
    _spec = importlib.util.spec_from_file_location(
        "_cluster_jobs_timed", Path(benchmarks.__file__).parent / "timed_model_def.py"
    )
    _timed = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_timed)
finally:
    for _key, _value in _saved.items():
        if _value is None:
            os.environ.pop(_key, None)
        else:
            os.environ[_key] = _value
globals().update({{k: v for k, v in vars(_timed).items() if not k.startswith("_")}})
'''


def write_model_def(path: Path, job_type: str, global_batch: float) -> Path:
    """A model-definition file: the timed model definition over ``counted_blobs`` pacing each
    step as ``job_type`` at ``global_batch`` samples."""
    settings = {
        "TIMED_MODEL_DEF": INNER_MODEL_DEF,
        "TIMED_JOB_TYPE": job_type,
        "TIMED_GLOBAL_BATCH": str(global_batch),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(MODEL_DEF_TEMPLATE.format(settings=settings))
    return path


def steps_of(epochs: int, max_workers: int, per_worker_batch: int = PER_WORKER_BATCH) -> int:
    """Optimizer steps of a job of ``epochs`` whose batch scales from ``max_workers``."""
    return epochs * steps_left(SAMPLES, 0, per_worker_batch * max_workers)


def epochs_for(steps: int, max_workers: int, per_worker_batch: int = PER_WORKER_BATCH) -> int:
    """The fewest epochs of at least ``steps`` steps (at least 1)."""
    per_epoch = steps_left(SAMPLES, 0, per_worker_batch * max_workers)
    return max(1, -(-steps // per_epoch))


def batch_for(steps: int, max_workers: int) -> int:
    """Real samples per worker: ``PER_WORKER_BATCH``, or where one epoch at it takes more than
    ``steps`` steps (a job shorter than an epoch, as the ``--quick`` runs are) the larger batch
    whose one epoch comes closest to ``steps``, so that such a job is not several times longer
    than asked."""
    if steps >= steps_of(1, max_workers):
        return PER_WORKER_BATCH
    largest = -(-SAMPLES // max_workers)  # one step an epoch
    batches = range(PER_WORKER_BATCH, largest + 1)
    return min(batches, key=lambda b: (abs(steps_of(1, max_workers, b) - steps), b))


@dataclass(frozen=True)
class JobSize:
    """A paced job's length: whole epochs of steps that last ``step_s`` at its full size."""

    step_s: float  # the paced step at the job's full size
    epochs: int
    steps: int
    per_worker_batch: int = PER_WORKER_BATCH  # real samples (the pacing is separate)

    @property
    def solo_s(self) -> float:
        """Its training alone at its full size, by the curve."""
        return self.steps * self.step_s


def job_size(job_type: str, workers: int, global_batch: float, solo_s: float) -> JobSize:
    """The job that trains about ``solo_s`` seconds alone on ``workers`` (whole epochs, at least
    one), paced as ``job_type`` at ``global_batch``."""
    step_s = step_seconds(job_type, workers, global_batch)
    wanted = round(solo_s / step_s)
    batch = batch_for(wanted, workers)
    # a raised batch makes one epoch of at most the steps wanted: that epoch is the job
    epochs = epochs_for(wanted, workers) if batch == PER_WORKER_BATCH else 1
    return JobSize(step_s, epochs, steps_of(epochs, workers, batch), batch)


# -- steps: pure ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    t: float  # seconds since the experiment's start
    step: int | None  # the runtime's global step number
    world: int
    pid: int


def parse_steps(text: str, t0_wall: float) -> list[Step]:
    """Rank 0's lines of a ``timed_steps.jsonl`` (one per optimizer step of the job), in time
    order; a torn last line (being written) is skipped."""
    steps = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("rank") == 0:
            steps.append(
                Step(record["t"] - t0_wall, record.get("step"), record["world"], record["pid"])
            )
    return sorted(steps, key=lambda s: s.t)


def steps_lost(steps: Sequence[Step]) -> int:
    """Optimizer steps done more than once (the job restarted from an older snapshot and did
    them again): rank 0's steps minus the distinct step numbers."""
    numbered = [s.step for s in steps if s.step is not None]
    return len(numbered) - len(set(numbered))


def training_intervals(steps: Sequence[Step]) -> list[tuple[float, float, int]]:
    """(start, end, world) spans in which the job trained: between two consecutive steps of the
    same process at the same world. The pause of a new world (processes restarted) is not in."""
    return [
        (a.t, b.t, b.world)
        for a, b in zip(steps, steps[1:], strict=False)
        if a.pid == b.pid and a.world == b.world
    ]


def training_samples(intervals: Mapping[str, Sequence[tuple[float, float, int]]]) -> list[Sample]:
    """Slots each job trains on over time, as occupancy samples (a step function): at each
    boundary of any job's interval, every job's world if an interval of it covers the moment."""
    bounds = sorted({t for spans in intervals.values() for a, b, _ in spans for t in (a, b)})
    samples = []
    for t in bounds:
        held = {}
        for job, spans in intervals.items():
            world = next((w for a, b, w in spans if a <= t < b), 0)
            if world:
                held[job] = world
        samples.append(Sample(t, held))
    return samples


def step_seconds_by_world(steps: Sequence[Step]) -> dict[int, float]:
    """Median seconds per optimizer step at each world size the job trained at."""
    by_world: dict[int, list[float]] = {}
    for a, b, world in training_intervals(steps):
        by_world.setdefault(world, []).append(b - a)
    return {w: round(statistics.median(d), 4) for w, d in sorted(by_world.items())}


def first_step_after(
    steps: Sequence[Step], after: float, world: Callable[[int], bool] = lambda w: True
) -> Step | None:
    """The first step later than ``after`` in a world ``world`` accepts."""
    return next((s for s in steps if s.t > after and world(s.world)), None)


def first_world_change_after(steps: Sequence[Step], after: float) -> Step | None:
    """The first step after ``after`` whose world differs from the step before it."""
    for a, b in zip(steps, steps[1:], strict=False):
        if b.t > after and b.world != a.world:
            return b
    return None


def window_utilization(
    samples: Sequence[Sample], slots: int, start: float | None, end: float | None
) -> float | None:
    """``utilization`` between ``start`` and ``end``; None when the window is empty."""
    if start is None or end is None or end <= start:
        return None
    return round(utilization(samples, slots, start, end), 4)


# -- pods: pure --------------------------------------------------------------------------------


@dataclass
class PodTimes:
    owner: str
    created_s: float  # first seen
    bound_s: float | None = None  # first seen with a node
    stopping_s: float | None = None  # first seen told to stop (deletionTimestamp, preempted)
    gone_s: float | None = None  # first seen terminated or gone


def track_pods(
    pods: dict[str, PodTimes],
    listing: Iterable[Mapping[str, Any]],
    t: float,
    owner: Callable[[Mapping[str, Any]], str | None] = owner_of,
) -> None:
    """Update ``pods`` (pod name -> times) from one listing of the API server's pods at ``t``."""
    seen = set()
    for pod in listing:
        who = owner(pod)
        if who is None:
            continue
        name = pod["metadata"]["name"]
        seen.add(name)
        times = pods.setdefault(name, PodTimes(who, t))
        if times.bound_s is None and (pod.get("spec") or {}).get("nodeName"):
            times.bound_s = t
        conditions = (pod.get("status") or {}).get("conditions") or []
        stopping = pod["metadata"].get("deletionTimestamp") or any(
            c.get("type") == "DisruptionTarget" and c.get("status") == "True" for c in conditions
        )
        if times.stopping_s is None and stopping:
            times.stopping_s = t
        if times.gone_s is None and (pod.get("status") or {}).get("phase") in (
            "Succeeded",
            "Failed",
        ):
            times.gone_s = t
    for name, times in pods.items():
        if name not in seen and times.gone_s is None:
            times.gone_s = t


# -- the jobs ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobPlan:
    name: str
    submit_s: float  # not before every earlier job's first step (see ClusterJobs.run)
    min_workers: int
    max_workers: int
    after_first_step: bool = False  # submit_s counts from the earlier jobs' first step
    # True: submit_s counts from the first job's first step only, whether or not the jobs
    # between have started (jobs that arrive on a clock, not one after another's start)
    after_first_job_only: bool = False
    size: JobSize | None = None  # its own length (None: the experiment's epochs and batch)
    params: Mapping[str, Any] = field(default_factory=dict)  # more task parameters (a ladder)


@dataclass
class JobRecord:
    plan: JobPlan
    run_id: str = ""
    submit_s: float | None = None
    end_s: float | None = None
    steps: list[Step] = field(default_factory=list)
    evictions: list[float] = field(default_factory=list)  # whole-job evictions
    resubmissions: list[float] = field(default_factory=list)

    @property
    def first_step_s(self) -> float | None:
        return self.steps[0].t if self.steps else None

    def as_dict(self, pods: Mapping[str, PodTimes]) -> dict[str, Any]:
        def r(v: float | None) -> float | None:
            return None if v is None else round(v, 3)

        mine = {n: p for n, p in pods.items() if p.owner == self.run_id}
        return {
            "name": self.plan.name,
            "min_workers": self.plan.min_workers,
            "max_workers": self.plan.max_workers,
            "planned_submit_s": r(self.plan.submit_s),
            "submit_s": r(self.submit_s),
            "first_step_s": r(self.first_step_s),
            "end_s": r(self.end_s),
            "pending_s": r(
                None if self.first_step_s is None else self.first_step_s - (self.submit_s or 0)
            ),
            "jct_s": r(None if self.end_s is None else self.end_s - (self.submit_s or 0)),
            "steps_done": len(self.steps),
            "steps_lost": steps_lost(self.steps),
            "last_step": max((s.step or 0 for s in self.steps), default=0),
            "step_s_by_world": step_seconds_by_world(self.steps),
            "worlds": world_changes(self.steps),
            # rank 0's steps: [time, global step number, world, process id]
            "step_log": [[round(s.t, 3), s.step, s.world, s.pid] for s in self.steps],
            "evictions_s": [r(t) for t in self.evictions],
            "resubmissions_s": [r(t) for t in self.resubmissions],
            "pods": {
                n: {
                    "created_s": r(p.created_s),
                    "bound_s": r(p.bound_s),
                    "stopping_s": r(p.stopping_s),
                    "gone_s": r(p.gone_s),
                }
                for n, p in sorted(mine.items())
            },
        }


def world_changes(steps: Sequence[Step]) -> list[tuple[float, int]]:
    """(time of the first step, world) each time the world changed (the first included)."""
    changes = []
    for i, s in enumerate(steps):
        if i == 0 or s.world != steps[i - 1].world:
            changes.append((round(s.t, 3), s.world))
    return changes


Tick = Callable[["ClusterJobs", float], None]


class ClusterJobs:
    """``with ClusterJobs(root, plans, slots=6, ...) as jobs: jobs.run()`` then
    :meth:`result`. ``plans`` in submission order."""

    def __init__(
        self,
        root: Path,
        plans: Sequence[JobPlan],
        slots: int,
        job_type: str,
        global_batch: float,
        epochs: int,
        interval_s: float = 0.25,
        max_wait_s: float = 900.0,
        per_worker_batch: int = PER_WORKER_BATCH,
    ) -> None:
        if not plans:
            raise ValueError("no jobs to run")
        if any(p.min_workers < 1 or p.max_workers < p.min_workers for p in plans):
            raise ValueError(f"need 1 <= min_workers <= max_workers: {plans}")
        if any(p.max_workers > slots for p in plans):
            raise ValueError(f"a job asks more than the cluster's {slots} slots: {plans}")
        self.root = Path(root)
        self.plans = list(plans)
        self.slots = slots
        self.job_type = job_type
        self.global_batch = global_batch
        self.epochs = epochs
        self.per_worker_batch = per_worker_batch
        self.interval_s = interval_s
        self.max_wait_s = max_wait_s
        self.records = [JobRecord(p) for p in plans]
        self.pods: dict[str, PodTimes] = {}
        self._stack = contextlib.ExitStack()
        self.runs: list[Any] = []

    def params(self, plan: JobPlan, model_def: Path) -> dict[str, Any]:
        return {
            "model_def": str(model_def),
            "num_shards": 12,
            "min_workers": plan.min_workers,
            "max_workers": plan.max_workers,
            "epochs": plan.size.epochs if plan.size else self.epochs,
            "batch_size": plan.size.per_worker_batch if plan.size else self.per_worker_batch,
            "step_time": 0.0,
            "worker_gpus": 1,
            "max_wait_s": self.max_wait_s,  # a gang job waits for a whole other job
            "max_failures": 20,  # stopped whole and restarted (eviction) counts some
            **plan.params,
        }

    def __enter__(self) -> ClusterJobs:
        from kfp_elastic.testing.cluster.training_run import TrainingRun

        try:
            model_def = write_model_def(
                self.root / "model_def" / "timed_job.py", self.job_type, self.global_batch
            )
            nodes = {"node-1": {**NODE, "gpu": self.slots}}
            for i, plan in enumerate(self.plans):
                share = self.runs[0] if self.runs else None
                run = self._stack.enter_context(
                    TrainingRun(
                        self.root / plan.name,
                        self.params(plan, model_def),
                        nodes=None if share else nodes,
                        share=share,
                        master_pod=f"train-{plan.name.lower()}",  # a DNS label
                    )
                )
                # The batch scales from max_workers whatever the first world (see module doc)
                run.progress.base_world_size(plan.max_workers)
                self.runs.append(run)
                self.records[i].run_id = run.run_id
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    # -- what is seen ------------------------------------------------------------------------

    @property
    def cluster(self) -> Any:
        return self.runs[0].cluster

    def _listing(self) -> list[dict[str, Any]]:
        pods = self.cluster.api.list(self.cluster.namespace)["items"]
        track_pods(self.pods, pods, self.sampler.now())
        return pods

    def _steps_file(self, i: int) -> Path:
        claim = self.cluster.claim_path(SNAPSHOT_CLAIM)
        return claim / "snapshots" / self.records[i].run_id / STEPS_FILE

    def refresh_steps(self, i: int) -> list[Step]:
        path = self._steps_file(i)
        if path.exists():
            self.records[i].steps = parse_steps(path.read_text(), self.t0_wall)
        return self.records[i].steps

    def now(self) -> float:
        return self.sampler.now()

    # -- what is done ------------------------------------------------------------------------

    def submit(self, i: int) -> None:
        self.runs[i].start()
        self.records[i].submit_s = self.now()
        log.info("event=job_submitted job=%s t=%.2f", self.plans[i].name, self.now())

    def evict(self, i: int) -> None:
        """The whole job goes, as Kueue evicts a workload: its master pod and every worker pod
        deleted (the default grace period: SIGTERM first)."""
        self.records[i].evictions.append(self.now())  # when it began: the deletions take a while
        run = self.runs[i]
        core = run.core
        with contextlib.suppress(Exception):
            core.delete_namespaced_pod(run.master, run.ns)
        for pod in core.list_namespaced_pod(run.ns, label_selector=run_selector(run.run_id)).items:
            with contextlib.suppress(Exception):
                core.delete_namespaced_pod(pod.metadata.name, run.ns)
        log.info("event=job_evicted job=%s t=%.2f", self.plans[i].name, self.now())

    def resubmit(self, i: int) -> None:
        """The evicted job again: its task's pod once more (same run, as a KFP retry); it
        resumes from its last snapshot."""
        run = self.runs[i]
        wait_for_gone = time.monotonic() + 60
        while run.phase(run.master) not in (None, "Succeeded", "Failed"):
            if time.monotonic() > wait_for_gone:
                raise TimeoutError(f"{run.master} did not go")
            time.sleep(0.2)
        run.retry_master()
        self.records[i].resubmissions.append(self.now())
        log.info("event=job_resubmitted job=%s t=%.2f", self.plans[i].name, self.now())

    def ended(self, i: int) -> bool:
        return self.records[i].end_s is not None

    def evicted(self, i: int) -> bool:
        rec = self.records[i]
        return len(rec.evictions) > len(rec.resubmissions)

    def run(self, tick: Tick | None = None, timeout_s: float = 1800.0) -> None:
        """Submit each job at its ``submit_s`` (after the earlier jobs' first step where its
        plan says so), but not before every earlier job took its first step (a job arrives at
        a cluster that runs the ones before it; with ``after_first_job_only``, the first job
        only, and in plan order); until every job ended. ``tick(self, now)``
        acts each round (evictions)."""
        self.t0_wall = time.time()
        self.sampler = OccupancySampler(self._listing, interval_s=self.interval_s)
        with self.sampler:
            self.t0_wall = time.time() - self.sampler.now()
            deadline = time.monotonic() + timeout_s
            while not all(self.ended(i) for i in range(len(self.plans))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"jobs not done in {timeout_s} s: {self.summary()}")
                now = self.now()
                for i, rec in enumerate(self.records):
                    if rec.submit_s is None:
                        earlier = self.records[:1] if rec.plan.after_first_job_only else None
                        firsts = [r.first_step_s for r in earlier or self.records[:i]]
                        if all(t is not None for t in firsts):
                            base = max(firsts, default=0.0) if rec.plan.after_first_step else 0
                            if now >= base + rec.plan.submit_s:
                                self.submit(i)
                        break
                for i, rec in enumerate(self.records):
                    if rec.submit_s is None or rec.end_s is not None:
                        continue
                    self.refresh_steps(i)
                    run = self.runs[i]
                    phase = run.phase(run.master)
                    if phase == "Succeeded":
                        rec.end_s = self.now()
                        log.info("event=job_ended job=%s t=%.2f", rec.plan.name, rec.end_s)
                    elif phase in ("Failed", None) and not self.evicted(i):
                        raise RuntimeError(
                            f"job {rec.plan.name}'s master {run.master}: {phase}\n" + run.log_tail()
                        )
                if tick is not None:
                    tick(self, now)
                time.sleep(self.interval_s)
        for i in range(len(self.plans)):
            self.refresh_steps(i)

    def summary(self) -> str:
        return ", ".join(
            f"{r.plan.name}: submit={r.submit_s} first={r.first_step_s} end={r.end_s}"
            for r in self.records
        )

    # -- the result --------------------------------------------------------------------------

    def training(self) -> list[Sample]:
        return training_samples(
            {r.run_id: training_intervals(r.steps) for r in self.records if r.steps}
        )

    def result(self) -> dict[str, Any]:
        """The policy's numbers: jobs, makespan, utilizations (held and training), the
        samples."""
        held, training = self.sampler.samples, self.training()
        start = min(r.submit_s for r in self.records if r.submit_s is not None)
        end = max(r.end_s for r in self.records if r.end_s is not None)
        return {
            "jobs": [r.as_dict(self.pods) for r in self.records],
            "makespan_s": round(end - start, 3),
            "utilization": window_utilization(training, self.slots, start, end),
            "utilization_held": window_utilization(held, self.slots, start, end),
            "owners": {r.run_id: r.plan.name for r in self.records},
            "held_samples": [[round(s.t, 3), dict(s.held)] for s in held],
            "training_samples": [[round(s.t, 3), dict(s.held)] for s in training],
        }


def result_out(args: Any, name: str) -> None:
    """Point ``args.out`` at ``benchmarks/results/scheduling/<name>-<date>-<commit>.json``
    unless given or ``--quick`` (the harness's writer names a file after the suite only)."""
    if args.out is None and not args.quick:
        from datetime import datetime, timezone

        from benchmarks.harness import RESULTS, git_commit

        date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
        # the code that ran: the checkout when the run started (a commit may come meanwhile)
        commit = getattr(args, "_checkout_at_start", None) or git_commit()
        args.out = RESULTS / "scheduling" / f"{name}-{date}-{commit[0]}.json"


def plot_policies(
    path: Path, policies: Mapping[str, Mapping[str, Any]], slots: int, title: str
) -> Path:
    """The figure of a result's policies, top to bottom in their order: per policy the slots
    each job holds and the slots it trains on, submissions and ends marked."""
    from benchmarks.scheduling.occupancy import plot_slots

    panels, marks = {}, {}
    for policy, r in policies.items():
        m = [(j["submit_s"], f"{j['name']} submitted") for j in r["jobs"]]
        m += [(t, f"{j['name']} evicted") for j in r["jobs"] for t in j.get("evictions_s", ())]
        m += [(j["end_s"], f"{j['name']} ends") for j in r["jobs"]]
        for kind in ("held", "training"):
            name = f"{policy}: slots {kind}"
            # owners by job name: the same job has the same colour in every panel
            panels[name] = [
                Sample(s.t, {r["owners"].get(k, k): n for k, n in s.held.items()})
                for s in samples_from(r[f"{kind}_samples"])
            ]
            marks[name] = m
    return plot_slots(panels, slots, path, title, marks=marks)


def samples_from(rows: Sequence[Sequence[Any]]) -> list[Sample]:
    """The samples a result holds (``[[t, {owner: slots}], ...]``) back as samples."""
    return [Sample(float(t), dict(held)) for t, held in rows]
