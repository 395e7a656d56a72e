"""Prometheus metrics of one job: numbers kept by the master, served on ``/metrics`` by
prometheus-client (a custom collector over the master's snapshot of the timeline and its state).

Everything derived from the event timeline (restarts, steps, rates, lost steps) is computed by
:class:`TimelineStats`, a pure fold over timeline events that uses the workers' own times (a
commit's ``at``, a round's ``formed_at``) and rounds, never the time a master saw them. The
observer puts every commit and round on the timeline from the workers' records, also those made
while no master watched, so a master that was away for a while (a crash, a KFP retry) reports
the same numbers as one that never left. The definitions are in docs/master.md ("Metrics").
Slot-seconds and cost come from the same fold (``TimelineStats.usage``: ``master.cost``).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, generate_latest, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kfp_elastic.contract.prices import TIERS
from kfp_elastic.master.cost import Cost, SlotUsage
from kfp_elastic.master.timeline import Committed, Event, RoundFormed

log = logging.getLogger(__name__)

# Committed steps per second are averaged over this long: part of what the
# ``kfp_elastic_steps_per_second`` and lost-steps metrics mean (docs/master.md, "Metrics"), so
# a constant, not a setting.
RATE_WINDOW_S = 60.0


@dataclass(frozen=True)
class _Commit:
    step: int
    at: float
    rescued: bool
    stopping: bool


@dataclass
class _Round:
    formed_at: float | None
    commits: list[_Commit] = field(default_factory=list)


def _rate(window: Iterable[tuple[float, int]], end: float, window_s: float) -> float:
    recent = [(t, s) for t, s in window if end - window_s <= t <= end]
    if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
        return 0.0
    return max(0.0, (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0]))


def lost_steps_of(rounds: Iterable[_Round]) -> int:
    """Lost steps of the worlds ``rounds`` (in round order, each with its commits in commit
    order): committed steps going backwards, plus the estimated uncommitted tail of every world
    that ended without a stopping commit and was not rescued (docs/master.md, "Metrics")."""
    lost = pending = max_gap = 0
    last_step: int | None = None
    last_at: float | None = None
    window: deque[tuple[float, int]] = deque(maxlen=256)
    previous: _Round | None = None
    for current in rounds:
        formed_at = current.formed_at
        if formed_at is None:  # known from its commits only
            formed_at = current.commits[0].at if current.commits else None
        if previous is not None and last_at is not None and formed_at is not None:
            stopped = bool(previous.commits) and previous.commits[-1].stopping
            if not stopped:
                began = previous.formed_at if previous.formed_at is not None else last_at
                estimate = int(
                    _rate(window, last_at, RATE_WINDOW_S)
                    * max(0.0, formed_at - max(last_at, began))
                )
                if max_gap:
                    estimate = min(estimate, max_gap)
                lost += estimate
                pending += estimate
        for commit in current.commits:
            if commit.rescued:  # the survivors kept what they had trained
                lost -= pending
            pending = 0
            if last_step is not None:
                if commit.step < last_step:
                    lost += last_step - commit.step
                    window.clear()
                else:
                    max_gap = max(max_gap, commit.step - last_step)
            window.append((commit.at, commit.step))
            last_step, last_at = commit.step, commit.at
        previous = current
    return lost


@dataclass
class TimelineStats:
    """Fold of timeline events (``add`` them oldest first)."""

    rounds: int = 0
    last_round: int | None = None
    world_size: int = 0
    steps_total: int = 0
    last_commit: tuple[int, float] | None = None  # (step, at) of the last commit on the timeline
    commits: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=256))
    # Worlds by (numbering, round): a smaller round number than the last one means the run's
    # rendezvous keys expired and the numbering started again.
    _worlds: dict[tuple[int, int], _Round] = field(default_factory=dict)
    _numbering: int = 0
    _lost: int | None = None
    usage: SlotUsage = field(default_factory=SlotUsage)  # slot-seconds per tier (master.cost)

    @property
    def restarts(self) -> int:
        return max(0, self.rounds - 1)

    @property
    def lost_steps(self) -> int:
        if self._lost is None:
            self._lost = lost_steps_of(self._worlds[k] for k in sorted(self._worlds))
        return self._lost

    def goodput(self) -> float:
        """``steps / (steps + lost_steps)``; 0.0 before the first commit."""
        steps = self.steps_total
        return steps / (steps + self.lost_steps) if steps else 0.0

    def add_all(self, events: Iterable[Event]) -> TimelineStats:
        for event in events:
            self.add(event)
        return self

    def add(self, event: Event) -> None:
        self.usage.add(event)
        if isinstance(event, RoundFormed):
            self._round(event.round, event.formed_at or event.t, event.world_size)
        elif isinstance(event, Committed):
            self._commit(event)

    def _round(self, number: int, formed_at: float, world_size: int) -> None:
        # Rounds formed while no master watched and not put on the timeline show as a jump.
        jump = number - self.last_round if self.last_round is not None else 1
        self.rounds += jump if jump > 0 else 1
        if jump <= 0 and self.last_round is not None:
            self._numbering += 1
        world = self._worlds.setdefault((self._numbering, number), _Round(formed_at))
        world.formed_at = formed_at
        self.last_round, self.world_size = number, world_size
        self._lost = None

    def _commit(self, event: Committed) -> None:
        at = event.at or event.t
        number = event.round or self.last_round or 0  # an older writer: the latest round
        world = self._worlds.setdefault((self._numbering, number), _Round(None))
        # A world that completed the training trains nothing after it: like a stop.
        stopping = event.stopping or event.complete
        world.commits.append(_Commit(event.step, at, event.rescued, stopping))
        if self.commits and event.step < self.commits[-1][1]:
            self.commits.clear()
        self.commits.append((at, event.step))
        self.steps_total = event.step
        self.last_commit = (event.step, at)
        self._lost = None

    def rate(self, at: float | None = None, window_s: float = RATE_WINDOW_S) -> float:
        """Committed steps per second over the last ``window_s`` seconds of commits."""
        if not self.commits:
            return 0.0
        return _rate(self.commits, self.commits[-1][0] if at is None else at, window_s)


@dataclass(frozen=True)
class Snapshot:
    world_size: int = 0
    workers: Mapping[str, int] = field(default_factory=dict)  # phase -> count
    restarts: int = 0
    shard_queue: Mapping[tuple[int, str], int] = field(default_factory=dict)  # (epoch, state)
    committed_step: int = 0
    steps_per_second: float = 0.0
    lost_steps: int = 0
    failures: int = 0
    cost: Cost = field(default_factory=Cost)
    ladder_level: int | None = None  # None: the job has no ladder
    attained_gpu_seconds: float = 0.0


PHASES = ("Pending", "Running", "Succeeded", "Failed")


class SnapshotCollector(Collector):
    """The job's metrics, read from the master's latest :class:`Snapshot` at each scrape.

    Counters only for numbers that never go down: the committed step goes back after a
    restore and the lost-steps estimate is taken back by a rescued commit, so both are gauges.
    """

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snapshot = self._snapshot()
        yield GaugeMetricFamily(
            "kfp_elastic_world_size",
            "Processes in the current rendezvous round.",
            value=snapshot.world_size,
        )
        if snapshot.ladder_level is not None:
            yield GaugeMetricFamily(
                "kfp_elastic_ladder_level",
                "The job's level on the least-attained-service ladder (0: highest priority).",
                value=snapshot.ladder_level,
            )
            yield GaugeMetricFamily(
                "kfp_elastic_attained_gpu_seconds",
                "GPU-seconds the job's workers have held: the ladder's attained service.",
                value=snapshot.attained_gpu_seconds,
            )
        workers = GaugeMetricFamily(
            "kfp_elastic_workers", "Workers (torchrun agents) by phase.", labels=["phase"]
        )
        for phase in sorted(set(PHASES) | set(snapshot.workers)):
            workers.add_metric([phase], snapshot.workers.get(phase, 0))
        yield workers
        yield CounterMetricFamily(
            "kfp_elastic_restarts",
            "Rendezvous rounds formed after the first.",
            value=snapshot.restarts,
        )
        queues = GaugeMetricFamily(
            "kfp_elastic_shard_queue",
            "Dataset shards per epoch and queue state.",
            labels=["epoch", "state"],
        )
        for (epoch, state), count in sorted(snapshot.shard_queue.items()):
            queues.add_metric([str(epoch), state], count)
        yield queues
        yield GaugeMetricFamily(
            "kfp_elastic_committed_step",
            "Last committed optimizer step.",
            value=snapshot.committed_step,
        )
        yield GaugeMetricFamily(
            "kfp_elastic_steps_per_second",
            "Committed steps per second (last minute).",
            value=snapshot.steps_per_second,
        )
        yield GaugeMetricFamily(
            "kfp_elastic_lost_steps",
            "Steps trained again after rollbacks (estimate).",
            value=snapshot.lost_steps,
        )
        yield CounterMetricFamily(
            "kfp_elastic_worker_failures",
            "Failures counted against the job's failure budget (in-place restarts included).",
            value=snapshot.failures,
        )
        yield from _cost_metrics(snapshot.cost)


def _cost_metrics(cost: Cost) -> Iterator[Metric]:
    """Slot-seconds per tier; with prices, the cost per tier and against a fixed-size job."""
    held = CounterMetricFamily(
        "kfp_elastic_slot_seconds",
        "Seconds worker slots (pods) were held, by tier: guaranteed (index < min_workers), "
        "opportunistic.",
        labels=["tier"],
    )
    for tier in TIERS:
        held.add_metric([tier], cost.slot_seconds.get(tier, 0.0))
    yield held
    if cost.cost is None:  # no prices given: no money series rather than zeros
        return
    money = GaugeMetricFamily(
        "kfp_elastic_cost",
        "Cost so far by tier (slot-hours x price: guaranteed on-demand, opportunistic spot).",
        labels=["tier"],
    )
    for tier in TIERS:
        money.add_metric([tier], cost.cost[tier])
    yield money
    if cost.fixed_cost is None:
        return
    yield GaugeMetricFamily(
        "kfp_elastic_fixed_size_cost",
        "Cost of the committed steps at max_workers on on-demand nodes (estimate).",
        value=cost.fixed_cost,
    )
    yield GaugeMetricFamily(
        "kfp_elastic_cost_saving",
        "kfp_elastic_fixed_size_cost minus the job's cost (negative: the job cost more).",
        value=cost.saving,
    )


def render(snapshot: Snapshot) -> str:
    """The Prometheus text exposition of ``snapshot`` (what ``/metrics`` serves)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snapshot))
    return generate_latest(registry).decode()


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - wsgiref's name
        log.debug("metrics request " + format, *args)


class Metrics:
    """The current snapshot (updated by the master) and the HTTP server that shows it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snapshot = Snapshot()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SnapshotCollector(lambda: self.snapshot))
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def snapshot(self) -> Snapshot:
        with self._lock:
            return self._snapshot

    def update(self, **fields: Any) -> None:
        with self._lock:
            self._snapshot = replace(self._snapshot, **fields)

    def serve(self, port: int = 0, host: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` (prometheus-client's WSGI app) and ``/healthz`` from a daemon
        thread; ``port`` 0 takes a free one. Returns the port."""
        metrics_app = make_wsgi_app(self.registry)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            path = environ.get("PATH_INFO", "")
            if path == "/metrics":
                return metrics_app(environ, start_response)
            if path == "/healthz":
                start_response("200 OK", [("Content-Type", "text/plain; charset=utf-8")])
                return [b"ok\n"]
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"only /metrics and /healthz\n"]

        self._server = make_server(
            host, port, app, server_class=_ThreadingWSGIServer, handler_class=_QuietHandler
        )
        self._thread = threading.Thread(
            target=self._server.serve_forever, daemon=True, name="metrics-http"
        )
        self._thread.start()
        return self.port

    @property
    def port(self) -> int:
        return self._server.server_address[1] if self._server else 0

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
