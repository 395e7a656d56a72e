"""Serving beside training on the test cluster: a serving deployment scaled by traffic and an
elastic training job that fills the rest.

    python -m benchmarks scheduling exp2            # 8 slots, serving 2 -> 6 -> 2, ~5 min
    python -m benchmarks scheduling exp2 --quick    # 3 slots, serving 1 -> 2 -> 1

The cluster: ``--slots`` slots (nodes of up to 4 ``nvidia.com/gpu``; every pod here asks for
one). The serving deployment is a ReplicaSet (``testing/cluster/replica_set.py``) of pods of
priority 0 (no PriorityClass: above the workers' -3 and -5) that run
``benchmarks/scheduling/serving_app.py``, a real HTTP server. A traffic script sends GET
requests to the serving pods' ports (each pod writes its port to a shared directory: a Service's
endpoints) at the rate a request-rate curve gives over time, and an HPA stand-in sets the
replicas every ``--hpa-period`` seconds to :func:`desired_replicas` of that rate. The training
job is the compiled pipeline's ``elastic-train`` task on the test cluster (``TrainingRun``:
master pod, etcd with TLS, the production settings), min ``--min-workers``, max ``--slots``
workers of one slot each, training the paced model definition
(``cluster_jobs.write_model_def``: each step as long as ImageNet's at a global batch of 256 on
the world's GPUs, sleeping: the 2 cores stay free). It fills what serving
leaves: when serving scales up, the scheduler preempts opportunistic workers (SIGTERM: they
snapshot, nothing is lost); when it scales down, the Pending workers the master keeps run and
the world grows back.

Measured (``benchmarks/scheduling/occupancy.py``: a pod holds its slot from binding until it has
terminated): who holds the slots over time (training: the job's run id; serving: its ``app``
label), the utilization outside and inside reaction windows, and per scale event how long the
new serving pods waited for room (created -> bound, and -> running) and how long the training
world took to change (scale event -> first committed step of a world of the new size). A
*reaction window* runs from a scale event until the cluster has settled: every serving pod of
the new count runs (those scaled away are gone) and the training job committed a step in a world
of ``slots - serving`` workers (the job's max is the cluster). The measured span starts once the
job first committed in its full world beside the first serving replicas, and ends with the
curve.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import logging
import math
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    RESULTS,
    export_checkout_to_children,
    git_commit,
    parse_options,
    run_in_work_dir,
    suite_parser,
    write_result,
)
from benchmarks.scheduling.cluster_jobs import write_model_def
from benchmarks.scheduling.occupancy import (
    OccupancySampler,
    Sample,
    owner_of,
    plot_slots,
    slot_seconds,
)

log = logging.getLogger("benchmarks.scheduling.exp2")

SLOT_RESOURCE = "nvidia.com/gpu"
GPUS_PER_NODE = 4
SERVING_APP = "serving"  # the deployment's app label: its owner in the occupancy figure
ENDPOINTS_CLAIM = "serving-endpoints"  # the claim the serving pods write their ports to
# Kubernetes' --horizontal-pod-autoscaler-sync-period; the experiment compresses it (--hpa-period)
HPA_SYNC_PERIOD_S = 15.0
SERVING_GRACE_S = 5  # the serving pods' terminationGracePeriodSeconds (they stop in ~0.1 s)
REQUEST_TIMEOUT_S = 2.0
UTILIZATION_GOAL = 0.95  # total, outside reaction windows
ROOM_GOAL_S = 2.0  # a new serving pod waits at most this long for room (created -> bound)
# A world that made no commit for this long is paused (it commits every step of < 1.2 s)
WORLD_GAP_S = 2.0


# -- pure parts -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """``seconds`` of traffic at ``rate`` requests per second."""

    seconds: float
    rate: float


def desired_replicas(
    rate: float, per_replica_capacity: float, min_replicas: int, max_replicas: int
) -> int:
    """Replicas for ``rate`` requests per second when one replica takes
    ``per_replica_capacity``: ``ceil(rate / per_replica_capacity)`` within [min, max].

    This is the HPA's ``ceil(current * metric / target)`` for a per-pod metric with an average
    target (requests per second per pod, target = capacity): the metric is ``rate / current``,
    so the current count cancels. The HPA's 10 % tolerance and its scale-down stabilization
    window are not applied (the curve changes in steps)."""
    if per_replica_capacity <= 0:
        raise ValueError(f"per_replica_capacity must be > 0, got {per_replica_capacity}")
    if not 0 <= min_replicas <= max_replicas:
        raise ValueError(f"need 0 <= min <= max, got min={min_replicas} max={max_replicas}")
    wanted = math.ceil(max(0.0, rate) / per_replica_capacity - 1e-9)
    return min(max_replicas, max(min_replicas, wanted))


def rate_at(curve: Sequence[Phase], t: float) -> float:
    """The curve's rate ``t`` seconds after it began (its first before, its last after it)."""
    if not curve:
        raise ValueError("the curve has no phase")
    elapsed = 0.0
    for phase in curve:
        elapsed += phase.seconds
        if t < elapsed:
            return phase.rate
    return curve[-1].rate


def node_gpus(slots: int, per_node: int = GPUS_PER_NODE) -> list[int]:
    """The nodes' GPU counts for ``slots`` slots: full nodes of ``per_node``, the rest on one."""
    full, rest = divmod(slots, per_node)
    return [per_node] * full + ([rest] if rest else [])


def parse_curve(text: str) -> list[Phase]:
    """``"40:8,60:28,60:8"`` (seconds:rate, ...) as phases."""
    try:
        phases = [
            Phase(float(s), float(r))
            for s, r in (item.split(":") for item in text.split(",") if item.strip())
        ]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected seconds:rate,... (e.g. 40:8,60:28,60:8), got {text!r}"
        ) from None
    if not phases or any(p.seconds <= 0 or p.rate < 0 for p in phases):
        raise argparse.ArgumentTypeError(f"phases need seconds > 0 and rate >= 0: {text!r}")
    return phases


def complement(
    windows: Sequence[tuple[float, float]], start: float, end: float
) -> list[tuple[float, float]]:
    """The parts of [start, end] outside every window (windows may overlap)."""
    out: list[tuple[float, float]] = []
    at = start
    for lo, hi in sorted(windows):
        if hi <= at:
            continue
        if lo > at:
            out.append((at, min(lo, end)))
        at = max(at, hi)
        if at >= end:
            break
    if at < end:
        out.append((at, end))
    return [(lo, hi) for lo, hi in out if hi > lo]


def utilization_over(
    samples: Sequence[Sample],
    slots: int,
    intervals: Sequence[tuple[float, float]],
    owners: Sequence[str] | None = None,
) -> float | None:
    """Busy slot-seconds over all slot-seconds of ``intervals`` (None: they are empty)."""
    span = sum(hi - lo for lo, hi in intervals)
    if span <= 0:
        return None
    held = sum(slot_seconds(samples, lo, hi, owners) for lo, hi in intervals)
    return held / (slots * span)


WORLD = "world"  # the owner of world_samples' slots


def world_samples(commits: Sequence[tuple[float, int]], gap_s: float) -> list[Sample]:
    """Slots in a training world over time from the job's ``commits`` ((seconds, world size)):
    a commit's world counts until the next commit, at most ``gap_s`` (a world that stopped
    committing is paused: it trains on none of its slots)."""
    ordered = sorted(commits)
    out: list[Sample] = []
    for i, (t, world) in enumerate(ordered):
        out.append(Sample(t, {WORLD: world}))
        following = ordered[i + 1][0] if i + 1 < len(ordered) else math.inf
        if following - t > gap_s:
            out.append(Sample(t + gap_s, {}))
    return out


def first_after(times: Sequence[float], after: float) -> float | None:
    later = [t for t in times if t >= after]
    return min(later) if later else None


@dataclass
class ScaleEvent:
    """One change of the serving replicas and what followed (seconds on the experiment's clock,
    ``*_s`` counted from ``t``)."""

    t: float
    replicas_from: int
    replicas_to: int
    training_world: int  # the world the job should reach: slots - serving
    created: list[str] = field(default_factory=list)  # serving pods created for it
    deleted: list[str] = field(default_factory=list)  # serving pods scaled away
    room_s: list[float] = field(default_factory=list)  # per created pod: created -> bound
    # per created pod that never got room: created -> deleted (scaled away while it waited)
    no_room_s: list[float] = field(default_factory=list)
    running_s: list[float] = field(default_factory=list)  # per created pod: created -> running
    # training pods told to go while serving made room (preempted): deletion -> gone, seconds
    victims: dict[str, float | None] = field(default_factory=dict)
    serving_settled_s: float | None = None  # new pods running, removed ones gone
    training_first_step_s: float | None = None  # first committed step of the new world
    training_pause_s: float | None = None  # the job's last commit before that -> that
    settled_s: float | None = None  # the reaction window's length (None: not within the run)


def settle(
    event: ScaleEvent,
    times: Mapping[str, Mapping[str, float]],
    commits: Sequence[tuple[float, int]],
    training: Sequence[str] = (),
) -> ScaleEvent:
    """Fill ``event``'s measures from pod ``times`` (name -> {"created", "deleting", "bound",
    "running", "gone": seconds}) and the job's ``commits`` ((seconds, world size), any order);
    ``training``: the job's pods, whose deletions while serving waited for room are its
    victims."""
    ready: list[float] = []
    event.room_s, event.running_s, event.no_room_s = [], [], []
    for name in event.created:
        pod = times.get(name, {})
        created = pod.get("created")
        if created is None:
            continue
        if "bound" in pod:
            event.room_s.append(round(pod["bound"] - created, 3))
        elif "deleting" in pod:
            event.no_room_s.append(round(pod["deleting"] - created, 3))
        if "running" in pod:
            event.running_s.append(round(pod["running"] - created, 3))
        ready.append(pod.get("running", math.inf))
    ready += [times.get(name, {}).get("gone", math.inf) for name in event.deleted]
    done = max(ready, default=event.t)
    event.serving_settled_s = None if math.isinf(done) else round(done - event.t, 3)
    if event.created:
        until = max((times.get(n, {}).get("bound", math.inf) for n in event.created), default=0)
        event.victims = {
            name: round(times[name]["gone"] - times[name]["deleting"], 3)
            if "gone" in times[name]
            else None
            for name in training
            if event.t <= times.get(name, {}).get("deleting", -1.0) <= until
        }
    step = first_after([t for t, world in commits if world == event.training_world], event.t)
    event.training_first_step_s = None if step is None else round(step - event.t, 3)
    before = [t for t, _ in commits if step is not None and t < step]
    event.training_pause_s = round(step - max(before), 3) if step is not None and before else None
    if event.serving_settled_s is not None and event.training_first_step_s is not None:
        event.settled_s = max(event.serving_settled_s, event.training_first_step_s)
    return event


def reaction_windows(events: Sequence[ScaleEvent], end: float) -> list[tuple[float, float]]:
    """Each event's window: from it until it settled (until ``end`` when it did not)."""
    return [(e.t, e.t + e.settled_s if e.settled_s is not None else end) for e in events]


# -- the cluster side ------------------------------------------------------------------------


class PodTimes:
    """When each pod of a namespace was first seen created, deleting, bound, running and gone,
    on the experiment's clock (``clock()``), from every change of the API server (no polling)."""

    def __init__(self, api: Any, ns: str, clock: Callable[[], float]) -> None:
        self.api, self.ns, self.clock = api, ns, clock
        self.times: dict[str, dict[str, float]] = {}
        self.owners: dict[str, str | None] = {}  # occupancy.owner_of: whose slot it holds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="pod-times")
        self._thread.start()

    def _loop(self) -> None:
        seen = 0
        while not self._stop.is_set():
            seen = self.api.wait_for_change(seen, timeout=0.5)
            self.observe(self.api.pods_snapshot())

    def observe(self, pods: Sequence[Mapping[str, Any]]) -> None:
        now = self.clock()
        present = set()
        for pod in pods:
            if pod["metadata"]["namespace"] != self.ns:
                continue
            name = pod["metadata"]["name"]
            present.add(name)
            mine = self.times.setdefault(name, {"created": now})
            self.owners.setdefault(name, owner_of(pod))
            if pod["metadata"].get("deletionTimestamp"):
                mine.setdefault("deleting", now)
            if pod["spec"].get("nodeName"):
                mine.setdefault("bound", now)
            if pod["status"].get("phase") == "Running":
                mine.setdefault("running", now)
        for name, mine in self.times.items():
            if name not in present:
                mine.setdefault("gone", now)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def endpoint_ports(endpoints: Path) -> list[int]:
    """The ports the serving pods listen on: one file per pod (``serving_app.py``)."""
    ports = []
    for path in sorted(endpoints.glob("[!.]*")):
        with contextlib.suppress(OSError, ValueError):
            ports.append(int(path.read_text()))
    return ports


class Traffic:
    """Sends GET requests round-robin to the serving pods listed in ``endpoints`` (a file per
    pod holding its port) at ``rate(t)`` per second from a thread; counts the answers per
    second of the experiment's clock."""

    def __init__(self, endpoints: Path, rate: Callable[[float], float], clock: Callable[[], float]):
        self.endpoints, self.rate, self.clock = endpoints, rate, clock
        self.per_second: dict[int, list[int]] = {}  # second -> [sent, answered]
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="traffic")
        self._next = 0

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def ports(self) -> list[int]:
        return endpoint_ports(self.endpoints)

    def _send(self, port: int) -> bool:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
        try:
            connection.request("GET", "/")
            response = connection.getresponse()
            response.read()
            return response.status == 200
        except OSError:
            return False
        finally:
            connection.close()

    def _loop(self) -> None:
        due = self.clock()
        while not self._stop.is_set():
            now = self.clock()
            if now < due:
                self._stop.wait(due - now)
                continue
            rate = self.rate(now)
            due = max(due + (1.0 / rate if rate > 0 else 0.1), now - 1.0)  # no burst to catch up
            if rate <= 0:
                continue
            ports = self.ports()
            counts = self.per_second.setdefault(int(now), [0, 0])
            counts[0] += 1
            if ports:
                self._next = (self._next + 1) % len(ports)
                if self._send(ports[self._next]):
                    counts[1] += 1
                    continue
            self.failed += 1


def serving_template(endpoints_mount: str = "/endpoints") -> dict[str, Any]:
    """The serving deployment's pod template: one slot, priority 0, the HTTP server."""
    return {
        "metadata": {"labels": {"app": SERVING_APP}},
        "spec": {
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": SERVING_GRACE_S,
            "volumes": [
                {"name": "endpoints", "persistentVolumeClaim": {"claimName": ENDPOINTS_CLAIM}}
            ],
            "containers": [
                {
                    "name": "server",
                    "image": "serving:1",
                    "command": ["python", "-m", "benchmarks.scheduling.serving_app"],
                    "args": [endpoints_mount, "$(POD_NAME)"],
                    "env": [
                        {
                            "name": "POD_NAME",
                            "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                        }
                    ],
                    "resources": {
                        "requests": {SLOT_RESOURCE: "1"},
                        "limits": {SLOT_RESOURCE: "1"},
                    },
                    "volumeMounts": [{"name": "endpoints", "mountPath": endpoints_mount}],
                }
            ],
        },
    }


# -- options ---------------------------------------------------------------------------------

FULL = {"slots": 8, "serving": (2, 6), "min_workers": 2, "curve": "40:8,60:28,70:8"}
QUICK = {"slots": 3, "serving": (1, 2), "min_workers": 1, "curve": "1:4,8:9,2:4"}


def _serving(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def build_parser() -> argparse.ArgumentParser:
    """``python -m benchmarks scheduling exp2``'s options."""
    parser = suite_parser(
        "python -m benchmarks scheduling exp2",
        __doc__,
        f"{QUICK['slots']} slots, serving 1 -> 2 -> 1, curve {QUICK['curve']}",
    )
    parser.add_argument("--slots", type=int, default=None, help="slots (GPUs) in the cluster")
    parser.add_argument(
        "--serving", type=_serving, default=None, help="serving replicas MIN:MAX (2:6)"
    )
    parser.add_argument(
        "--min-workers", type=int, default=None, help="the training job's guaranteed workers"
    )
    parser.add_argument(
        "--curve", type=parse_curve, default=None, help="traffic: seconds:rate,... (req/s)"
    )
    parser.add_argument(
        "--capacity", type=float, default=5.0, help="requests per second one replica takes"
    )
    parser.add_argument(
        "--hpa-period",
        type=float,
        default=1.0,
        help=f"seconds between the HPA stand-in's decisions (Kubernetes: {HPA_SYNC_PERIOD_S:g})",
    )
    parser.add_argument(
        "--settle-timeout",
        type=float,
        default=None,
        help="seconds to wait after the curve for the last reaction to settle (60; quick: 0)",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the work directory")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options, checked, with ``--quick``'s or the full run's defaults filled in."""
    parser = build_parser()
    args = parse_options(parser, argv)
    preset = QUICK if args.quick else FULL
    args.slots = args.slots or preset["slots"]
    args.serving = args.serving or preset["serving"]
    args.min_workers = args.min_workers or preset["min_workers"]
    args.curve = args.curve or parse_curve(preset["curve"])
    if args.settle_timeout is None:
        args.settle_timeout = 0.0 if args.quick else 60.0
    if args.slots < 2:
        parser.error("--slots must be >= 2")
    if args.serving[1] >= args.slots:
        parser.error("--serving MAX must leave the training job a slot")
    if not 1 <= args.min_workers <= args.slots - args.serving[1]:
        parser.error("--min-workers must fit beside the most serving replicas")
    if args.capacity <= 0 or args.hpa_period <= 0:
        parser.error("--capacity and --hpa-period must be > 0")
    return args


PACED_JOB_TYPE, PACED_GLOBAL_BATCH = "imagenet", 256  # 1.19 s a step on 1 GPU, 0.32 s on 8


def job_params(args: argparse.Namespace, seconds: float, model_def: Path) -> dict[str, Any]:
    """The training job (the elastic_train component's parameters): long enough for the whole
    curve; it is stopped at the end. ``model_def``: the paced model definition's file
    (:func:`cluster_jobs.write_model_def`)."""
    return {
        "model_def": str(model_def),
        "num_shards": 12,
        "min_workers": args.min_workers,
        "max_workers": args.slots,
        # 240 samples at a global batch of 4 x the first world: ~10 steps an epoch of >= 0.3 s
        "epochs": max(20, int(seconds)),
        "batch_size": 4,
        "snapshot_every": 1,  # every step commits: the world's first step is a committed one
        "worker_gpus": 1,
        "max_wait_s": 300.0,
    }


# -- the run ---------------------------------------------------------------------------------


def run_experiment(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from kfp_elastic.master.metrics import TimelineStats
    from kfp_elastic.master.timeline import Committed, WorkerLost
    from kfp_elastic.testing.cluster.replica_set import ReplicaSet
    from kfp_elastic.testing.cluster.training_run import TrainingRun
    from kfp_elastic.testing.nodes import wait_for

    lo, hi = args.serving
    curve_s = sum(p.seconds for p in args.curve)
    nodes = {
        f"node-{i + 1}": {"gpu": gpus, "cpu": "64", "memory": "256Gi"}
        for i, gpus in enumerate(node_gpus(args.slots))
    }

    def world_beside(serving: int) -> int:  # the job's max is the cluster: it fills the rest
        return args.slots - serving

    with contextlib.ExitStack() as stack:
        model_def = write_model_def(
            root / "model_def" / "paced_job.py", PACED_JOB_TYPE, PACED_GLOBAL_BATCH
        )
        run = stack.enter_context(
            TrainingRun(root / "job", job_params(args, curve_s, model_def), nodes)
        )
        api, ns = run.cluster.api, run.ns
        endpoints = run.cluster.claim_path(ENDPOINTS_CLAIM, ns)
        sampler = OccupancySampler(
            lambda: [p for p in api.pods_snapshot() if p["metadata"]["namespace"] == ns],
            interval_s=0.2,
        )
        stack.enter_context(sampler)
        clock = sampler.now
        wall0 = time.time() - clock()
        pods = PodTimes(api, ns, clock)
        stack.callback(pods.stop)
        rs = stack.enter_context(ReplicaSet(api, SERVING_APP, serving_template(), namespace=ns))

        def serving_running() -> int:
            return sum(
                1
                for p in rs.pods()
                if p["status"].get("phase") == "Running"
                and not p["metadata"].get("deletionTimestamp")
            )

        rs.scale(lo)
        run.start()  # the master pod starts beside the serving pods
        wait_for(
            lambda: serving_running() == lo and len(endpoint_ports(endpoints)) == lo,
            60,
            0.1,
            f"{lo} serving pods listening",
        )
        print(f"[exp2] {clock():.1f} s: {lo} serving pods listen", flush=True)
        run.wait_committed(1, world=world_beside(lo), timeout=300, what="the job's full world")
        start = clock()
        print(
            f"[exp2] training in a world of {world_beside(lo)} at {start:.1f} s; traffic starts",
            flush=True,
        )
        events: list[ScaleEvent] = []
        replicas = lo
        traffic = Traffic(endpoints, lambda t: rate_at(args.curve, t - start), clock)
        with traffic:
            while clock() - start < curve_s:
                rate = rate_at(args.curve, clock() - start)
                wanted = desired_replicas(rate, args.capacity, lo, hi)
                if wanted != replicas:
                    before = set(rs.created_at)
                    t = clock()
                    decision = rs.scale(wanted)
                    event = ScaleEvent(
                        t=round(t, 3),
                        replicas_from=replicas,
                        replicas_to=wanted,
                        training_world=world_beside(wanted),
                        created=sorted(set(rs.created_at) - before),
                        deleted=list(decision.delete),
                    )
                    events.append(event)
                    print(
                        f"[exp2] {t:.1f} s: {rate:g} req/s -> serving {replicas} -> {wanted}",
                        flush=True,
                    )
                    replicas = wanted
                time.sleep(args.hpa_period)
            end = clock()
            if events:
                last = events[-1]
                with contextlib.suppress(TimeoutError):
                    wait_for(
                        lambda: (
                            run.has_committed(0, world=last.training_world)
                            and serving_running() == last.replicas_to
                        ),
                        args.settle_timeout,
                        0.2,
                        "the last reaction settled",
                    )
        sampler.stop()
        pods.stop()
        timeline = run.timeline()
        commits = [
            (e.at - wall0 if e.at else e.t - wall0, e.world_size)
            for e in timeline
            if isinstance(e, Committed)
        ]
        training = [n for n, who in pods.owners.items() if who == run.run_id]
        for event in events:
            settle(event, pods.times, commits, training)
        lost = [
            {"name": e.name, "cause": e.cause, "t": round(e.t - wall0, 3)}
            for e in timeline
            if isinstance(e, WorkerLost)
        ]
        stats = TimelineStats().add_all(timeline)
        samples = list(sampler.samples)
        run_id = run.run_id
    return {
        "samples": samples,
        "start": start,
        "end": end,
        "events": events,
        "run_id": run_id,
        "lost_steps": stats.lost_steps,
        "steps": stats.steps_total,
        "workers_lost": lost,
        "commits": commits,
        "traffic": {
            "per_second": {str(k): v for k, v in sorted(traffic.per_second.items())},
            "sent": sum(v[0] for v in traffic.per_second.values()),
            "answered": sum(v[1] for v in traffic.per_second.values()),
            "failed": traffic.failed,
        },
    }


def report(args: argparse.Namespace, measured: Mapping[str, Any]) -> tuple[dict, dict]:
    """(summary, the result's body) of a run's measurements."""
    samples, start, end = measured["samples"], measured["start"], measured["end"]
    events: list[ScaleEvent] = measured["events"]
    training, serving = [measured["run_id"]], [SERVING_APP]
    windows = reaction_windows(events, end)
    outside = complement(windows, start, end)
    inside = [(max(lo, start), min(hi, end)) for lo, hi in windows if min(hi, end) > max(lo, start)]

    worlds = world_samples(measured["commits"], WORLD_GAP_S)

    def util(intervals: Sequence[tuple[float, float]]) -> dict[str, float | None]:
        values = {
            "training": utilization_over(samples, args.slots, intervals, training),
            "serving": utilization_over(samples, args.slots, intervals, serving),
            "total": utilization_over(samples, args.slots, intervals),
            "training_in_world": utilization_over(worlds, args.slots, intervals, [WORLD]),
        }
        return {k: None if v is None else round(v, 4) for k, v in values.items()}

    rooms = [s for e in events for s in e.room_s]
    no_room = [s for e in events for s in e.no_room_s]  # waited at least that long
    utilization = {
        "all": util([(start, end)]),
        "outside_windows": util(outside),
        "inside_windows": util(inside),
    }
    goals = {
        "utilization_outside_windows": {
            "goal": f">= {UTILIZATION_GOAL:.0%}",
            "measured": utilization["outside_windows"]["total"],
            "pass": (utilization["outside_windows"]["total"] or 0) >= UTILIZATION_GOAL,
        },
        "serving_room_wait": {
            "goal": f"<= {ROOM_GOAL_S:g} s",
            # a pod scaled away before it had room counts with its wait so far (a lower bound)
            "measured": max(rooms + no_room, default=None),
            "never_had_room": len(no_room),
            "pass": bool(rooms)
            and len(rooms) == sum(len(e.created) for e in events)
            and max(rooms) <= ROOM_GOAL_S,
        },
    }
    summary: dict[str, Any] = {
        "utilization_outside_windows": utilization["outside_windows"],
        "utilization_all": utilization["all"],
        "events": {
            f"{i + 1}_{e.replicas_from}to{e.replicas_to}": {
                "room_max_s": max(e.room_s + e.no_room_s, default=None),
                "running_max_s": max(e.running_s, default=None),
                "victim_stop_max_s": max(
                    (v for v in e.victims.values() if v is not None), default=None
                ),
                "training_world_s": e.training_first_step_s,
                "training_pause_s": e.training_pause_s,
                "window_s": e.settled_s,
            }
            for i, e in enumerate(events)
        },
        "lost_steps": measured["lost_steps"],
        "goals": {name: "PASS" if g["pass"] else "FAIL" for name, g in goals.items()},
    }
    body = {
        "slots": args.slots,
        "measured_span": [round(start, 3), round(end, 3)],
        "reaction_windows": [[round(lo, 3), round(hi, 3)] for lo, hi in windows],
        "utilization": utilization,
        "goals": goals,
        "scale_events": [asdict(e) for e in events],
        "lost_steps": measured["lost_steps"],
        "steps": measured["steps"],
        "workers_lost": measured["workers_lost"],
        "traffic": measured["traffic"],
        "owners": {"training": measured["run_id"], "serving": SERVING_APP},
        "timeline": [
            [round(s.t, 2), s.held.get(measured["run_id"], 0), s.held.get(SERVING_APP, 0)]
            for s in samples
        ],
        "timeline_columns": ["t", "training", "serving"],
    }
    return summary, body


def figure(args: argparse.Namespace, measured: Mapping[str, Any], path: Path) -> Path:
    marks = [(e.t, f"serving {e.replicas_from}->{e.replicas_to}") for e in measured["events"]]
    marks.insert(0, (measured["start"], "measured from"))
    panel = f"serving beside training: {args.slots} slots"
    return plot_slots(
        {panel: measured["samples"]},
        args.slots,
        path,
        "slots held: training (elastic job) and serving (scaled by traffic); total = the stack",
        labels={measured["run_id"]: "training", SERVING_APP: "serving"},
        marks={panel: marks},
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.time()
    export_checkout_to_children()  # the pods import benchmarks.* from this checkout
    measured: dict[str, Any] = {}

    def body(work_dir: Path, stack: contextlib.ExitStack) -> None:
        measured.update(run_experiment(args, work_dir))

    code, work_dir = run_in_work_dir("scheduling-exp2-", args.keep_logs, body)
    if code != 0 or not measured:
        print(f"exp2 failed (exit {code}); work directory {work_dir}", flush=True)
        return code or 1
    summary, body_ = report(args, measured)
    if args.out is None:  # benchmarks/results/scheduling/exp2-<date>-<commit>.json
        root = Path(tempfile.mkdtemp(prefix="benchmarks-quick-")) if args.quick else RESULTS
        day = datetime.now(timezone.utc).strftime("%Y-%m-%d")
        args.out = root / "scheduling" / f"exp2-{day}-{git_commit()[0]}.json"
    out = write_result("scheduling", args, began, True, summary, body_)
    print(f"figure {figure(args, measured, out.with_suffix('.png'))}", flush=True)
    for name, goal in body_["goals"].items():
        print(
            f"{'PASS' if goal['pass'] else 'FAIL'} {name}: {goal['measured']} (goal {goal['goal']})"
        )
    return 0
