"""Prometheus metrics of one job: numbers kept by the master, served on ``/metrics`` by
prometheus-client (a custom collector over the master's snapshot of the timeline and its state).

Everything derived from the event timeline (restarts, steps, rates, lost steps) is computed by
:class:`TimelineStats`, a pure fold over timeline events, so a recovered master that reads the
timeline again reports the same numbers as the master before it.

Lost steps are steps trained and then thrown away by a rollback:

- a committed step that goes backwards (a restore from an older snapshot): the difference;
- a new round (torchrun restarts every worker and they restore the last commit): the steps
  trained since the last commit, estimated as ``rate * (round formed - last commit or previous
  round)``, capped at the largest gap between two commits (the workers would have committed
  again after that many steps). The workers do not report uncommitted steps, so this is an
  estimate; it is exact when the workers commit every step.
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

from kfp_elastic.master.timeline import Committed, Event, RoundFormed

log = logging.getLogger(__name__)

RATE_WINDOW_S = 60.0


@dataclass
class TimelineStats:
    """Fold of timeline events (``add`` them oldest first)."""

    rounds: int = 0
    last_round: int | None = None
    last_round_t: float | None = None
    world_size: int = 0
    steps_total: int = 0
    lost_steps: int = 0
    max_commit_gap: int = 0
    last_commit_t: float | None = None
    unconfirmed_lost: int = 0  # estimated at rounds since the last commit
    _stopped: bool = False  # the last commit was the current world's stop: nothing to lose
    commits: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=256))

    @property
    def restarts(self) -> int:
        return max(0, self.rounds - 1)

    def add_all(self, events: Iterable[Event]) -> TimelineStats:
        for event in events:
            self.add(event)
        return self

    def add(self, event: Event) -> None:
        if isinstance(event, RoundFormed):
            self._round(event.round, event.t, event.world_size)
        elif isinstance(event, Committed):
            self._commit(event.step, event.t, event.rescued, event.stopping, event.world_size)

    def _round(self, number: int, t: float, world_size: int) -> None:
        # Rounds formed while no master watched show as a jump of the round number; a smaller
        # number means the run's rendezvous keys expired and counting started again.
        jump = number - self.last_round if self.last_round is not None else 1
        self.rounds += jump if jump > 0 else 1
        if self.last_round is not None and self.commits and not self._stopped:
            since = max(x for x in (self.last_commit_t, self.last_round_t) if x is not None)
            rate = self.rate(at=self.commits[-1][0])
            lost = int(rate * max(0.0, t - since))
            if self.max_commit_gap:
                lost = min(lost, self.max_commit_gap)
            self.lost_steps += lost
            self.unconfirmed_lost += lost
        self.last_round, self.last_round_t, self.world_size = number, t, world_size
        self._stopped = False

    def _commit(
        self,
        step: int,
        t: float,
        rescued: bool = False,
        stopping: bool = False,
        world_size: int = 0,
    ) -> None:
        # A rescue (survivors kept what they had trained), or the last commit of the world
        # before the latest round (stopped for a join: every rank finished its step and it was
        # committed): the estimate taken at that round did not happen.
        if rescued or (stopping and world_size != self.world_size):
            self.lost_steps -= self.unconfirmed_lost
        # The current world stopping (SIGTERM): the round it leads to loses nothing.
        self._stopped = stopping and world_size == self.world_size
        self.unconfirmed_lost = 0
        if self.commits:
            previous = self.commits[-1][1]
            if step < previous:
                self.lost_steps += previous - step
                self.commits.clear()
            else:
                self.max_commit_gap = max(self.max_commit_gap, step - previous)
        self.commits.append((t, step))
        self.steps_total = step
        self.last_commit_t = t

    def rate(self, at: float | None = None, window_s: float = RATE_WINDOW_S) -> float:
        """Committed steps per second over the last ``window_s`` seconds of commits."""
        if not self.commits:
            return 0.0
        end = self.commits[-1][0] if at is None else at
        recent = [(t, s) for t, s in self.commits if end - window_s <= t <= end]
        if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
            return 0.0
        return max(0.0, (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0]))


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
            "Workers that exited with an error.",
            value=snapshot.failures,
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
