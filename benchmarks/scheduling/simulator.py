"""A discrete-event simulation of a shared GPU cluster running training jobs, gang-scheduled or
elastic, with the master's own scaling decision and the test cluster scheduler's own placement
and preemption.

**The cluster**: ``gpus`` GPUs in nodes of ``gpus_per_node``; every worker is a pod of one GPU.
**A job** (:class:`benchmarks.scheduling.trace.Job`) asks for ``gpus`` workers and has ``work``
GPU-seconds to do (the trace's duration × num_gpus): at world ``w`` it does
``speed(w)`` GPU-seconds of it per second, ``speed(gpus) = gpus`` so that at its own size it runs
for the trace's duration. ``linear`` scaling: ``speed(w) = w``; ``pollux`` scaling: the job's
type's measured curve at a fixed global batch (``gpus`` × the type's median measured per-GPU
batch), ``speed(w) = gpus × step(gpus) / step(w)`` (``benchmarks/scheduling/throughput.py``).

**Policies**:

- ``gang``: MIN = MAX = the job's GPUs; a job is admitted first-in first-out with backfill (the
  queue is walked in submission order and every job whose GPUs are free now starts; no
  reservation for the head of the queue), then its master asks for its workers. All its
  workers are guaranteed (nothing can preempt them; they preempt nothing: only lower priorities
  are preempted). ``gang_queue=False`` drops the admission queue, as on the test cluster: the
  master runs from the submission and asks for all its workers at once, those that fit bind
  and wait for the others.
- ``elastic``: MIN = ``min_workers`` (default 1; ``"half"``: ``ceil(gpus / 2)``; at most the
  job's GPUs), MAX = the job's GPUs;
  every job's master runs from its submission. Workers ``0 .. MIN-1`` are *guaranteed*
  (priority -3, may preempt), the others *opportunistic* (priority -5, never preempt): a new
  job's guaranteed workers take GPUs from other jobs' opportunistic workers; opportunistic
  workers fill whatever is free, oldest first.

- ``elastic-ladder``: ``elastic`` with the least-attained-service ladder: a job's guaranteed
  workers get its level's priority (the manifests' ``kfp-elastic-worker-level-*`` values), and
  its master runs the product's ``kfp_elastic.master.ladder.decide_level`` at each reconcile
  and when its next threshold, rate limit or starvation time falls due (attained service: the
  GPU-seconds of its ready workers). A move re-creates the guaranteed workers of another level:
  each is stopped as a victim is (``stop_s``), and replaced in its slot at the new priority.
- ``tiresias`` (the baseline, Tiresias' discretized LAS): gang jobs (MIN = MAX) with the same
  ladder and the same ``decide_level``, admitted by a central queue in level order (then
  submission, with backfill); a waiting job that does not fit preempts whole running jobs of
  lower levels (the lowest, the latest first) when that frees enough. A preempted job keeps
  its progress (a checkpoint on preemption) and pays ``restart_s`` when it starts again; its
  time waiting counts towards its starvation promotion.

**Each reconcile** (after every event): the gang queue admits what fits; the master of every job
whose workers changed runs ``kfp_elastic.master.scaling.decide`` (ask for MAX, replace what was
preempted; ``max_wait_s`` infinite: a queued job waits); then the scheduler's ``plan``
(:mod:`benchmarks.scheduling.placement`) binds pending pods and picks victims; victims leave at
once with ``stop_s`` 0, which may let the preemptors bind on the next pass; with ``stop_s`` > 0
each victim is terminating for that long, and a preemptor waits for it (nominated) rather than
evicting another pod.

**A job trains** on its ready workers once there are at least MIN of them (the rendezvous waits
for MIN): at world ``w`` with ``w >= MIN``, none below.

**Costs** (seconds; defaults from ``docs/benchmarks.md``, "The cluster path", worker pods,
``benchmarks/results/cluster/cluster-2026-11-23-94db901.json``):

- ``join_s`` = 4.91, "capacity freed → first step of the bigger world": a worker bound while
  its job trains holds its GPU that long before it trains (pod start, agent, rendezvous);
  meanwhile the job's current world keeps training (the old members train until the round
  forms), except for the last ``join_pause_s`` (default 0), when it stands still.
- ``start_s`` (default ``join_s``): the same for a worker bound while its job does not train
  (its first workers; a job below MIN).
- ``shrink_s`` = 1.29, "preemption → first step of the smaller world": a job that loses a
  training worker stops training that long. Work is not lost beyond that pause: a preempted
  worker is SIGTERMed and the job commits a snapshot first (``docs/benchmarks.md``: steps lost
  to a SIGTERM 0).

- ``stop_s`` (default 0 here, ``STOP_S`` = 1.2 in ``steady``): a preempted or re-created
  worker's graceful stop (experiment 2's victim stop, quiet): its GPU stays held that long.
- ``restart_s`` = 21.5 (``tiresias``): a job preempted whole, admitted again → it trains
  (the admission experiment's whole-job eviction restart).

**Metrics** per policy: ``avg_jct_s``/``p99_jct_s`` (finish - submission), ``makespan_s`` (first
submission to last finish), ``mean_pending_s`` (submission to the first step), ``utilization``
(GPU-seconds held by a worker pod / GPU-seconds from the first submission to the last finish),
``idle_while_waiting`` (free GPU-seconds while at least one job holds fewer GPUs than it asks for,
/ all GPU-seconds of that span), ``resizes`` (world changes after a job's first step),
``lost_work_s`` (GPU-seconds held by workers of a job paused by a shrink), ``preemptions``;
the average JCT and mean pending time of the 1-GPU jobs and of the others apart.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.scheduling import throughput
from benchmarks.scheduling.placement import (
    GUARANTEED_PRIORITY,
    OPPORTUNISTIC_PRIORITY,
    SimPod,
    nodes_of,
    schedule,
)
from benchmarks.scheduling.trace import Job
from kfp_elastic.master.ladder import LadderAction, LadderPolicy, LadderState, decide_level
from kfp_elastic.master.launcher import Reason, WorkerPhase, WorkerStatus
from kfp_elastic.master.scaling import ScalingPolicy, decide
from kfp_elastic.testing.api_server import PRIORITY_CLASSES

POLICIES = ("gang", "elastic")
# The least-attained-service ladder (kfp_elastic/master/ladder.py) and its baseline: run when
# asked (``--policies``), not by default.
LADDER_POLICIES = ("elastic-ladder", "tiresias")
ALL_POLICIES = POLICIES + LADDER_POLICIES
STOPPING_PRIORITY = 10**9  # a stopping worker's GPU: never a victim
STOP_S = 1.2  # docs/scheduling.md, experiment 2: a preempted worker's deletion -> gone, quiet
# docs/scheduling.md, "Admission into a full cluster": an evicted job's resubmission -> its first
# step again (its master, workers, rendezvous and restore)
RESTART_S = 21.5
SCALINGS = ("linear", "pollux")
JOIN_S = 4.91  # docs/benchmarks.md: capacity freed -> first step of the bigger world (pods)
SHRINK_S = 1.29  # docs/benchmarks.md: preemption -> first step of the smaller world (pods)
GPUS_PER_NODE = 8
_EPS = 1e-9


@dataclass(frozen=True)
class Costs:
    """Seconds a job pays around a change of its world (see the module's model)."""

    join_s: float = JOIN_S  # a worker bound while its job trains: bound -> it trains
    shrink_s: float = SHRINK_S  # a training worker lost: the smaller world's pause
    start_s: float | None = None  # a worker bound while its job does not train (None: join_s)
    join_pause_s: float = 0.0  # the running world's pause when a worker joins it
    # a preempted or re-created worker's graceful stop: its GPU stays held that long (0: gone
    # at once, as the first model had it)
    stop_s: float = 0.0
    restart_s: float = RESTART_S  # tiresias: a job preempted whole, admitted again -> it trains

    def __post_init__(self) -> None:
        values = (
            self.join_s,
            self.shrink_s,
            self.join_pause_s,
            self.start_s or 0.0,
            self.stop_s,
            self.restart_s,
        )
        if min(values) < 0:
            raise ValueError(f"costs must be >= 0, got {self}")
        if self.join_pause_s > self.join_s:
            raise ValueError(f"join_pause_s {self.join_pause_s} is part of join_s {self.join_s}")

    @property
    def first_start_s(self) -> float:
        return self.join_s if self.start_s is None else self.start_s


MIN_RULES = ("one", "half")


def min_workers_of(gpus: int, rule: str | int) -> int:
    """An elastic job's MIN for a job asking ``gpus``: ``one`` (1), ``half``
    (``ceil(gpus / 2)``), or a number (at most ``gpus``)."""
    if rule == "one":
        return 1
    if rule == "half":
        return -(-gpus // 2)
    if isinstance(rule, int) and rule >= 1:
        return min(rule, gpus)
    raise ValueError(f"unknown MIN rule {rule!r}; known: {', '.join(MIN_RULES)} or a number >= 1")


@dataclass(eq=False)
class _JobState:
    job: Job
    policy: ScalingPolicy
    speed: Any  # world -> GPU-seconds of work per second
    remaining: float
    pods: dict[str, SimPod] = field(default_factory=dict)  # not ended
    ended: list[WorkerStatus] = field(default_factory=list)  # ended, not yet recorded
    recorded: set[str] = field(default_factory=set)
    below_min_since: float | None = None
    attempts: int = 0
    world: int = 0  # workers ready (started and in the rendezvous)
    held: int = 0  # GPUs bound to its pods
    last: float = 0.0  # progress is accounted up to here
    paused_until: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    version: int = 0  # invalidates stale finish events
    resizes: int = 0
    resized_at: float | None = None
    counted_wanting: bool = False
    trains_since: float | None = None  # when its current training began from a stop
    ladder: LadderState = field(default_factory=LadderState)
    attained: float = 0.0  # GPU-seconds its ready workers held, up to attained_at
    attained_at: float = 0.0
    ladder_version: int = 0  # invalidates stale ladder wake-ups
    ladder_wake_at: float | None = None  # the pending wake-up
    moves: int = 0
    moved: list[tuple[float, int]] = field(default_factory=list)  # (time, new level) per move
    stopped_at: float | None = None  # tiresias: preempted whole (or arrived) and waiting since
    restarting: bool = False  # tiresias: its next start pays restart_s

    @property
    def wanting(self) -> bool:
        return self.finished_at is None and self.held < self.job.gpus

    @property
    def training(self) -> int:
        """The world that trains: the ready workers once they are at least MIN (the rendezvous
        waits for MIN), else none."""
        return self.world if self.world >= self.policy.min_workers else 0


@dataclass(frozen=True)
class Result:
    avg_jct_s: float
    p99_jct_s: float
    makespan_s: float
    mean_pending_s: float
    utilization: float
    idle_while_waiting: float
    resizes: int
    lost_work_s: float
    preemptions: int
    jobs: int
    ladder_moves: int = 0  # elastic-ladder, tiresias: level changes
    # the same split by the GPUs a job asks for: 1 against more (elasticity can only change
    # how a 1-GPU job waits through the others)
    jobs_1gpu: int = 0
    avg_jct_1gpu_s: float = 0.0
    mean_pending_1gpu_s: float = 0.0
    avg_jct_multi_s: float = 0.0
    mean_pending_multi_s: float = 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in vars(self).items()}


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile, linear between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def speed_function(job: Job, scaling: str) -> Any:
    """``world -> GPU-seconds of work per second`` for ``job`` (see the module's model)."""
    if scaling == "linear":
        return lambda world: float(min(world, job.gpus))
    if scaling != "pollux":
        raise ValueError(f"unknown scaling {scaling!r}; known: {', '.join(SCALINGS)}")
    if job.job_type is None:
        raise ValueError(f"{job.name}: pollux scaling needs a job type")
    batch = job.global_batch or job.gpus * throughput.curve(job.job_type).reference_batch
    base = throughput.step_seconds(job.job_type, job.gpus, batch)
    cache: dict[int, float] = {}

    def speed(world: int) -> float:
        if world not in cache:
            cache[world] = job.gpus * base / throughput.step_seconds(job.job_type, world, batch)
        return cache[world]

    return speed


class Simulation:
    """One policy over one workload; :meth:`run` returns its :class:`Result`."""

    def __init__(
        self,
        jobs: Sequence[Job],
        gpus: int,
        policy: str,
        costs: Costs = Costs(),
        scaling: str = "linear",
        min_workers: int | str = 1,
        gpus_per_node: int = GPUS_PER_NODE,
        gang_queue: bool = True,
        record: bool = False,
        ladder: LadderPolicy | None = None,
        window: tuple[float, float] | None = None,
    ) -> None:
        """``ladder``: the ladder of ``elastic-ladder`` and ``tiresias`` (default: the
        product's, ``LadderPolicy()``). ``window``: utilization and idle GPUs are integrated
        over this span of time only (a steady load's measurement window; None: all of it)."""
        if policy not in ALL_POLICIES:
            raise ValueError(f"unknown policy {policy!r}; known: {', '.join(ALL_POLICIES)}")
        too_big = [j.name for j in jobs if j.gpus > gpus or j.gpus < 1]
        if too_big:
            raise ValueError(f"jobs asking for 0 or more than {gpus} GPUs: {too_big[:5]}")
        self.policy = policy
        self.tiresias = policy == "tiresias"
        self.ladder = (ladder or LadderPolicy()) if policy in LADDER_POLICIES else None
        # each level's priority: the manifests' PriorityClass values (api_server.PRIORITY_CLASSES
        # is checked against manifests/base), else one below the other under the guaranteed one
        self.level_priority = [
            PRIORITY_CLASSES.get(name, (GUARANTEED_PRIORITY + 1 - level, ""))[0]
            for level, name in enumerate(self.ladder.priority_classes if self.ladder else ())
        ]
        self.window = window
        self.gang = policy in ("gang", "tiresias")
        self.gang_queue = policy == "gang" and gang_queue
        self.admitted: dict[int, _JobState] = {}  # tiresias: jobs whose master runs
        self.costs = costs
        self.gpus = gpus
        self.nodes = nodes_of(gpus, gpus_per_node)
        self.jobs = [
            _JobState(
                job,
                ScalingPolicy(
                    job.gpus if self.gang else min_workers_of(job.gpus, min_workers),
                    job.gpus,
                    max_wait_s=math.inf,
                ),
                speed_function(job, scaling),
                job.work,
            )
            for job in jobs
        ]
        self.events: list[tuple[float, int, str, Any, int]] = []
        self.seq = 0
        self.versions = 0
        self.dirty: dict[int, _JobState] = {}  # jobs whose master must reconcile, by id
        self.queue: list[_JobState] = []  # gang: submitted, not admitted, in submission order
        self.bound: dict[int, SimPod] = {}  # id -> pod
        self.pending: dict[int, SimPod] = {}
        self.bound_priorities: dict[int, int] = {}  # priority -> bound pods of it
        self.wanting = 0  # jobs holding fewer GPUs than they ask for
        self.now = 0.0
        self.began: float | None = None
        self.held_s = 0.0
        self.idle_waiting_s = 0.0
        self.lost_s = 0.0
        self.preemptions = 0
        # (time, job, GPUs it holds) at every change, when recording (figures)
        self.holdings: list[tuple[float, str, int]] | None = [] if record else None
        # job -> (submission, first step, finish), once run
        self.job_times: dict[str, tuple[float, float | None, float | None]] = {}

    # ------------------------------------------------------------------ events

    def _push(self, when: float, kind: str, what: Any, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, kind, what, version))

    def run(self) -> Result:
        for state in self.jobs:
            self._push(state.job.submit_s, "arrive", state)
        while self.events:
            when = self.events[0][0]
            self._account(when)
            while self.events and self.events[0][0] <= when:
                _, _, kind, what, version = heapq.heappop(self.events)
                getattr(self, f"_on_{kind}")(what, version)
            self._reconcile()
        return self._result()

    def _account(self, when: float) -> None:
        """Integrate the cluster's metrics from the previous event to ``when``."""
        if self.began is not None and when > self.now:
            start, end = self.now, when
            if self.window is not None:
                start, end = max(start, self.window[0]), min(end, self.window[1])
            span = max(0.0, end - start)
            held = len(self.bound)
            self.held_s += held * span
            if self.wanting:
                self.idle_waiting_s += (self.gpus - held) * span
        self.now = when

    def _on_arrive(self, state: _JobState, _: int) -> None:
        if self.began is None:
            self.began = self.now
        state.last = state.attained_at = self.now
        state.ladder = LadderState.start(self.now)
        self._set_held(state, 0)
        if self.gang_queue or self.tiresias:
            state.stopped_at = self.now
            self.queue.append(state)
            if self.tiresias:
                self._ladder_step(state, state.stopped_at)  # its starvation wake-up
        else:
            self._mark(state)  # its master starts now

    def _on_ready(self, pod: SimPod, _: int) -> None:
        state: _JobState = pod.owner
        if state.finished_at is not None or state.pods.get(pod.name) is not pod:
            return  # preempted while starting, or the job finished meanwhile
        self._progress(state)
        self._attain(state)
        before = state.training
        state.world += 1
        pod.running = True
        after = state.training
        if after:
            state.restarting = False
            if state.started_at is None:
                state.started_at = self.now
            if not before:
                state.trains_since = self.now  # a first round: no one to pause
            elif state.trains_since != self.now:
                # the running world re-forms its round with the newcomer
                state.paused_until = max(state.paused_until, self.now + self.costs.join_pause_s)
        if after != before:
            self._resized(state)
        self._mark(state)
        self._reschedule(state)

    def _on_finish(self, state: _JobState, version: int) -> None:
        if version != state.version or state.finished_at is not None:
            return
        self._progress(state)
        self._attain(state)
        state.remaining = 0.0
        state.finished_at = self.now
        self.admitted.pop(id(state), None)
        for pod in list(state.pods.values()):
            self._remove(pod)
        state.pods.clear()
        state.world = 0
        self._set_held(state, -state.held)

    # ------------------------------------------------------------------ jobs

    def _progress(self, state: _JobState) -> None:
        """Account the job's training from ``state.last`` to now."""
        world = state.training
        if world > 0 and self.now > state.last:
            paused = max(0.0, min(self.now, state.paused_until) - state.last)
            self.lost_s += paused * world
            trained = self.now - state.last - paused
            state.remaining -= trained * state.speed(world)
        state.last = self.now

    def _reschedule(self, state: _JobState) -> None:
        state.version += 1
        if state.training > 0:
            rate = state.speed(state.training)
            start = max(self.now, state.paused_until)
            self._push(start + max(0.0, state.remaining) / rate, "finish", state, state.version)

    def _mark(self, state: _JobState) -> None:
        self.dirty[id(state)] = state

    def _resized(self, state: _JobState) -> None:
        """Count a world change of a started job (changes at one instant count once)."""
        if state.started_at != self.now and state.resized_at != self.now:
            state.resizes += 1
            state.resized_at = self.now

    def _set_held(self, state: _JobState, delta: int) -> None:
        """Change the GPUs ``state`` holds and keep the count of jobs wanting more."""
        state.held += delta
        if self.holdings is not None and delta:
            self.holdings.append((self.now, state.job.name, state.held))
        if state.wanting != state.counted_wanting:
            self.wanting += 1 if state.wanting else -1
            state.counted_wanting = state.wanting

    def _remove(self, pod: SimPod) -> None:
        if id(pod) in self.bound:
            del self.bound[id(pod)]
            self.bound_priorities[pod.priority] -= 1
        self.pending.pop(id(pod), None)

    def _bind(self, pod: SimPod) -> None:
        self.bound[id(pod)] = pod
        self.bound_priorities[pod.priority] = self.bound_priorities.get(pod.priority, 0) + 1

    def _can_preempt(self) -> bool:
        """Whether a pending pod may preempt a bound one (a lower priority is bound)."""
        top = max((p.priority for p in self.pending.values() if p.preempting), default=None)
        return top is not None and any(
            n and prio < top for prio, n in self.bound_priorities.items()
        )

    def _stopping(self, pod: SimPod) -> None:
        """A bound worker leaving: its GPU stays held for its graceful stop (``stop_s``) by a
        terminating stand-in (no one preempts it; a preemptor it makes room for waits for it,
        as kube-scheduler's nominated pod does, instead of choosing another victim)."""
        if self.costs.stop_s <= 0 or pod.node is None:
            return
        self.versions += 1
        stand_in = SimPod(
            f"{pod.name}-stopping", STOPPING_PRIORITY, False, self.versions, terminating=True
        )
        stand_in.bind(pod.node)
        self._bind(stand_in)
        self._push(self.now + self.costs.stop_s, "release", stand_in)

    def _on_release(self, stand_in: SimPod, _: int) -> None:
        self._remove(stand_in)

    # ------------------------------------------------------------------ the ladder

    def _attain(self, state: _JobState) -> None:
        """Account the job's attained service (GPU-seconds of its ready workers) up to now."""
        state.attained += state.world * max(0.0, self.now - state.attained_at)
        state.attained_at = self.now

    def _ladder_step(self, state: _JobState, below_since: float | None) -> bool:
        """``decide_level`` for the job now (the product's rule), ``below_since`` the time it
        went below its MIN (tiresias: stopped), None while it is served; whether it moved.
        Schedules the next time the rule could move it: its next threshold at its present
        world, the end of a rate limit, its starvation time."""
        assert self.ladder is not None
        self._attain(state)
        below_min_for_s = 0.0 if below_since is None else self.now - below_since
        d = decide_level(self.ladder, state.ladder, state.attained, below_min_for_s, self.now)
        state.ladder = d.state
        if d.move:
            state.moves += 1
            state.moved.append((self.now, d.level))
        wake = []
        if d.action == LadderAction.RATE_LIMITED and d.move_allowed_at is not None:
            wake.append(d.move_allowed_at)
        to_go = d.service_to_demotion_gpu_s
        # a due move held back wakes at the end of the limit, not at its (reached) threshold
        held_back = d.action == LadderAction.RATE_LIMITED
        if to_go is not None and state.world > 0 and below_since is None and not held_back:
            wake.append(self.now + max(to_go, _EPS) / state.world)
        if d.level > 0 and below_since is not None:
            wake.append(below_since + self.ladder.starvation_s)
        at = max(min(wake), self.now + _EPS) if wake else None
        if at != state.ladder_wake_at:  # a reconcile that changes nothing pushes nothing
            state.ladder_version += 1
            state.ladder_wake_at = at
            if at is not None:
                self._push(at, "ladder", state, state.ladder_version)
        return d.move

    def _on_ladder(self, state: _JobState, version: int) -> None:
        if version == state.ladder_version and state.finished_at is None:
            state.ladder_wake_at = None
            if self.tiresias:  # the scheduler's order changes; no pod is re-created
                self._ladder_step(state, state.stopped_at)
            else:
                self._mark(state)

    def _ladder_move(self, state: _JobState) -> None:
        """elastic-ladder: the rule for the job now; a move re-creates its guaranteed workers
        of another level (each stopped gracefully; ``decide`` replaces them)."""
        if self._ladder_step(state, state.below_min_since):
            level = self._guaranteed_priority(state)
            for pod in list(state.pods.values()):
                if pod.index < state.policy.min_workers and pod.priority != level:
                    self._evict(pod, Reason.DELETED)

    def _guaranteed_priority(self, state: _JobState) -> int:
        if self.ladder is None or self.tiresias:
            return GUARANTEED_PRIORITY
        return self.level_priority[state.ladder.level]

    def _statuses(self, state: _JobState) -> list[WorkerStatus]:
        return [
            WorkerStatus(
                p.name,
                WorkerPhase.RUNNING if p.running else WorkerPhase.PENDING,
                worker_index=p.index,
            )
            for p in state.pods.values()
        ] + state.ended

    def _master(self, state: _JobState) -> None:
        """One reconcile of the job's master: the ladder's step (a move re-creates the
        guaranteed workers of another level, each stopped gracefully), ``decide``, then create
        the pods it launches."""
        laddered = self.ladder is not None and not self.tiresias
        if laddered:
            self._ladder_move(state)
        elif self.tiresias:  # admitted: its next threshold at its present world
            self._ladder_step(state, None)
        decision = decide(
            state.policy,
            self._statuses(state),
            state.recorded,
            state.below_min_since,
            self.now,
        )
        changed = decision.below_min_since != state.below_min_since
        state.below_min_since = decision.below_min_since
        if laddered and changed:
            # it went below MIN (its starvation time) or reached it (its next threshold) in
            # this reconcile: the rule again, for the wake-up that goes with it
            self._ladder_move(state)
        state.recorded.update(o.name for o in decision.ended)
        state.ended = [s for s in state.ended if s.name not in state.recorded]
        for index in decision.launch:
            state.attempts += 1
            guaranteed = index < state.policy.min_workers
            self.versions += 1
            pod = SimPod(
                f"{state.job.name}-w{index}-{state.attempts}",
                self._guaranteed_priority(state) if guaranteed else OPPORTUNISTIC_PRIORITY,
                guaranteed and not self.tiresias,  # tiresias: its scheduler preempts whole jobs
                self.versions,
                owner=state,
                index=index,
            )
            state.pods[pod.name] = pod
            self.pending[id(pod)] = pod

    # ------------------------------------------------------------------ cluster

    def _admit(self) -> None:
        """Gang's admission: first-in first-out with backfill over the GPUs free now."""
        free = self.gpus - len(self.bound) - len(self.pending)
        if free <= 0 or not self.queue:
            return
        waiting = []
        for state in self.queue:
            if free > 0 and state.job.gpus <= free:
                free -= state.job.gpus
                self._mark(state)  # admitted: its master starts
            else:
                waiting.append(state)
        self.queue = waiting

    def _admit_tiresias(self) -> None:
        """Tiresias' scheduler: waiting jobs by level (then submission), each started whole
        where its GPUs are free, else by preempting whole jobs of lower levels (the lowest, the
        latest first) when that frees enough; others may start behind one that cannot."""
        if not self.queue:
            return
        free = self.gpus - len(self.bound) - len(self.pending)
        waiting = []
        for state in sorted(self.queue, key=lambda s: (s.ladder.level, s.job.submit_s)):
            need = state.job.gpus
            if need > free:
                lower = sorted(
                    (r for r in self.admitted.values() if r.ladder.level > state.ladder.level),
                    key=lambda r: (-r.ladder.level, -r.job.submit_s),
                )
                victims, got = [], free
                for other in lower:
                    if got >= need:
                        break
                    victims.append(other)
                    got += len(other.pods)
                if got < need:
                    waiting.append(state)
                    continue
                for other in victims:
                    self._preempt_job(other)
                    waiting.append(other)
                free = got
            free -= need
            state.stopped_at = None
            self.admitted[id(state)] = state
            self._mark(state)  # admitted: its master starts (again)
        self.queue = [s for s in waiting if id(s) not in self.admitted]

    def _preempt_job(self, state: _JobState) -> None:
        """Tiresias: the whole job stops (checkpoint on preemption: no work lost) and waits to
        be admitted again, when it pays ``restart_s`` before it trains."""
        self._progress(state)
        self._attain(state)
        self.preemptions += 1
        for pod in list(state.pods.values()):
            if id(pod) in self.bound:
                self._stopping(pod)
            self._remove(pod)
        state.pods.clear()
        self._set_held(state, -state.held)
        if state.training:
            self._resized(state)
        state.world = 0
        state.trains_since = None
        state.restarting = True
        state.stopped_at = self.now
        self.admitted.pop(id(state), None)
        self._reschedule(state)  # no finish while stopped
        self._ladder_step(state, state.stopped_at)  # its starvation wake-up

    def _reconcile(self) -> None:
        for _ in range(10_000):
            if self.gang_queue:
                self._admit()
            elif self.tiresias:
                self._admit_tiresias()
            dirty, self.dirty = self.dirty, {}
            for state in dirty.values():
                if state.finished_at is None:
                    self._master(state)
            if not self._place():
                return
        raise RuntimeError("the simulation did not settle within 10000 passes")

    def _place(self) -> bool:
        """One scheduler pass; whether it changed anything."""
        if not self.pending:
            return False
        free = self.gpus - len(self.bound)
        if free <= 0 and not self._can_preempt():
            return False
        placed = schedule(self.nodes, list(self.bound.values()), list(self.pending.values()))
        for pod, node in placed.binds:
            pod.bind(node)
            del self.pending[id(pod)]
            self._bind(pod)
            state: _JobState = pod.owner
            self._set_held(state, +1)
            if state.training:  # joins a running world
                delay = self.costs.join_s - self.costs.join_pause_s
            elif state.restarting:  # tiresias: the whole job again, from its checkpoint
                delay = self.costs.restart_s
            else:
                delay = self.costs.first_start_s
            self._push(self.now + delay, "ready", pod)
        for pod in placed.victims:
            self._evict(pod)
        return bool(placed.binds or placed.victims)

    def _evict(self, pod: SimPod, reason: Reason = Reason.PREEMPTED) -> None:
        """A worker taken away: preempted by the scheduler, or re-created by its master in
        another ladder level (``Reason.DELETED``); it stops gracefully."""
        state: _JobState = pod.owner
        if reason == Reason.PREEMPTED:
            self.preemptions += 1
        if id(pod) in self.bound:
            self._set_held(state, -1)
            self._stopping(pod)
        self._remove(pod)
        del state.pods[pod.name]
        state.ended.append(
            WorkerStatus(pod.name, WorkerPhase.DELETED, reason, worker_index=pod.index)
        )
        self._mark(state)
        if pod.running:
            self._progress(state)
            self._attain(state)
            before = state.training
            state.world -= 1
            after = state.training
            if after != before:
                self._resized(state)
            if after and before:
                state.paused_until = max(state.paused_until, self.now + self.costs.shrink_s)
            elif not after:
                state.trains_since = None  # below MIN: the rendezvous waits
            self._reschedule(state)

    # ------------------------------------------------------------------ result

    def _result(self) -> Result:
        unfinished = [s.job.name for s in self.jobs if s.finished_at is None]
        if unfinished:
            raise RuntimeError(f"jobs never finished: {unfinished[:5]}")
        jct = [s.finished_at - s.job.submit_s for s in self.jobs]  # type: ignore[operator]
        pending = [s.started_at - s.job.submit_s for s in self.jobs]  # type: ignore[operator]
        first = min(s.job.submit_s for s in self.jobs)
        last = max(s.finished_at for s in self.jobs)  # type: ignore[type-var]
        span = (last - first) * self.gpus
        one = [i for i, s in enumerate(self.jobs) if s.job.gpus == 1]
        multi = [i for i, s in enumerate(self.jobs) if s.job.gpus > 1]

        def mean(values: Sequence[float], which: Sequence[int]) -> float:
            return sum(values[i] for i in which) / len(which) if which else 0.0

        self.job_times = {
            s.job.name: (s.job.submit_s, s.started_at, s.finished_at) for s in self.jobs
        }
        return Result(
            avg_jct_s=sum(jct) / len(jct),
            p99_jct_s=percentile(jct, 99),
            makespan_s=last - first,
            mean_pending_s=sum(pending) / len(pending),
            utilization=self.held_s / span if span > 0 else 0.0,
            idle_while_waiting=self.idle_waiting_s / span if span > 0 else 0.0,
            resizes=sum(s.resizes for s in self.jobs),
            lost_work_s=self.lost_s,
            preemptions=self.preemptions,
            jobs=len(self.jobs),
            ladder_moves=sum(s.moves for s in self.jobs),
            jobs_1gpu=len(one),
            avg_jct_1gpu_s=mean(jct, one),
            mean_pending_1gpu_s=mean(pending, one),
            avg_jct_multi_s=mean(jct, multi),
            mean_pending_multi_s=mean(pending, multi),
        )


def simulate(
    jobs: Sequence[Job],
    gpus: int,
    policy: str,
    costs: Costs = Costs(),
    scaling: str = "linear",
    min_workers: int | str = 1,
    gpus_per_node: int = GPUS_PER_NODE,
    gang_queue: bool = True,
) -> Result:
    """Run ``policy`` over ``jobs`` on ``gpus`` GPUs (see the module's model)."""
    return Simulation(
        jobs, gpus, policy, costs, scaling, min_workers, gpus_per_node, gang_queue
    ).run()
