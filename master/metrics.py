"""Prometheus metrics of one job: numbers kept by the master, served as text on ``/metrics``.

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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

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
    commits: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=256))

    @property
    def restarts(self) -> int:
        return max(0, self.rounds - 1)

    def add_all(self, events: Iterable[Mapping[str, Any]]) -> TimelineStats:
        for event in events:
            self.add(event)
        return self

    def add(self, event: Mapping[str, Any]) -> None:
        kind, t = event.get("kind"), float(event.get("t", 0.0))
        if kind == "round_formed":
            self._round(int(event.get("round", 0)), t, int(event.get("world_size", 0)))
        elif kind == "committed":
            self._commit(int(event.get("step", 0)), t, bool(event.get("rescued", False)))

    def _round(self, number: int, t: float, world_size: int) -> None:
        # Rounds formed while no master watched show as a jump of the round number; a smaller
        # number means the run's rendezvous keys expired and counting started again.
        jump = number - self.last_round if self.last_round is not None else 1
        self.rounds += jump if jump > 0 else 1
        if self.last_round is not None and self.commits:
            since = max(x for x in (self.last_commit_t, self.last_round_t) if x is not None)
            rate = self.rate(at=self.commits[-1][0])
            lost = int(rate * max(0.0, t - since))
            if self.max_commit_gap:
                lost = min(lost, self.max_commit_gap)
            self.lost_steps += lost
            self.unconfirmed_lost += lost
        self.last_round, self.last_round_t, self.world_size = number, t, world_size

    def _commit(self, step: int, t: float, rescued: bool = False) -> None:
        if rescued:  # survivors kept what they had trained: the rounds' estimate did not happen
            self.lost_steps -= self.unconfirmed_lost
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
    steps_total: int = 0
    steps_per_second: float = 0.0
    lost_steps: int = 0
    failures: int = 0


_HELP = {
    "kfp_elastic_world_size": ("gauge", "Processes in the current rendezvous round."),
    "kfp_elastic_workers": ("gauge", "Workers (torchrun agents) by phase."),
    "kfp_elastic_restarts_total": ("counter", "Rendezvous rounds formed after the first."),
    "kfp_elastic_shard_queue": ("gauge", "Dataset shards per epoch and queue state."),
    "kfp_elastic_steps_total": ("counter", "Last committed optimizer step."),
    "kfp_elastic_steps_per_second": ("gauge", "Committed steps per second (last minute)."),
    "kfp_elastic_lost_steps_total": ("counter", "Steps trained again after rollbacks."),
    "kfp_elastic_worker_failures_total": ("counter", "Workers that exited with an error."),
}
PHASES = ("Pending", "Running", "Succeeded", "Failed")


def render(snapshot: Snapshot) -> str:
    """The Prometheus text exposition (format 0.0.4) of ``snapshot``."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {name: [] for name in _HELP}
    samples["kfp_elastic_world_size"].append(({}, snapshot.world_size))
    for phase in sorted(set(PHASES) | set(snapshot.workers)):
        samples["kfp_elastic_workers"].append(({"phase": phase}, snapshot.workers.get(phase, 0)))
    samples["kfp_elastic_restarts_total"].append(({}, snapshot.restarts))
    for (epoch, state), count in sorted(snapshot.shard_queue.items()):
        samples["kfp_elastic_shard_queue"].append(({"epoch": str(epoch), "state": state}, count))
    samples["kfp_elastic_steps_total"].append(({}, snapshot.steps_total))
    samples["kfp_elastic_steps_per_second"].append(({}, snapshot.steps_per_second))
    samples["kfp_elastic_lost_steps_total"].append(({}, snapshot.lost_steps))
    samples["kfp_elastic_worker_failures_total"].append(({}, snapshot.failures))
    lines = []
    for name, (kind, text) in _HELP.items():
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        for labels, value in samples[name]:
            shown = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            lines.append(
                f"{name}{{{shown}}} {_number(value)}" if shown else f"{name} {_number(value)}"
            )
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class Metrics:
    """The current snapshot (updated by the master) and the HTTP server that shows it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snapshot = Snapshot()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def snapshot(self) -> Snapshot:
        with self._lock:
            return self._snapshot

    def update(self, **fields: Any) -> None:
        with self._lock:
            self._snapshot = replace(self._snapshot, **fields)

    def serve(self, port: int = 0, host: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` from a daemon thread; ``port`` 0 takes a free one. Returns it."""
        metrics = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.split("?")[0] not in ("/metrics", "/healthz"):
                    self.send_error(404, "only /metrics and /healthz")
                    return
                body = (
                    render(metrics.snapshot) if self.path.startswith("/metrics") else "ok\n"
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                log.debug("metrics request " + format, *args)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
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
