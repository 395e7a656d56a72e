"""The numbers and series of one job, folded from the master's event timeline (pure).

Definitions (also in docs/pipelines.md):

- ``steps``: the last committed optimizer step (the steps that reached the final model);
- ``restarts``: rendezvous rounds formed after the first (every membership change restarts
  all workers from the last commit);
- ``lost_steps``: steps trained and then thrown away by those restarts (the master's estimate,
  ``master.metrics.TimelineStats``; exact when workers commit every step);
- ``goodput``: ``steps / (steps + lost_steps)``, the share of the training work that reached
  the final model (1.0: nothing was redone);
- ``final_loss``: the mean training loss of the last committed step (0.0 if none was recorded).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kfp_elastic.master.metrics import TimelineStats

Event = Mapping[str, Any]
DISRUPTIONS = {"preempted", "evicted", "node_lost", "rejected", "deleted_externally"}


@dataclass(frozen=True)
class Restart:
    t: float  # seconds since the job started
    round: int
    world_before: int
    world_after: int
    causes: tuple[str, ...]


@dataclass(frozen=True)
class Summary:
    steps: int = 0
    final_loss: float = 0.0
    restarts: int = 0
    lost_steps: int = 0
    goodput: float = 0.0
    workers_lost: int = 0
    disruptions: int = 0
    failures: int = 0
    epochs_done: int = 0
    max_world_size: int = 0
    final_world_size: int = 0
    duration_s: float = 0.0
    world_size: tuple[tuple[float, int], ...] = ()  # (seconds since start, world size)
    losses: tuple[tuple[int, float], ...] = ()  # (step, loss), in the order trained
    restart_rows: tuple[Restart, ...] = ()  # causes: what happened since the previous round
    lost_rows: tuple[tuple[float, str, str, str], ...] = ()  # (t, worker, cause, message)
    end_state: str = ""
    end_message: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """What the Metrics artifact shows (numbers only)."""
        return {
            "final_loss": round(self.final_loss, 6),
            "steps": self.steps,
            "restarts": self.restarts,
            "lost_steps": self.lost_steps,
            "goodput": round(self.goodput, 4),
            "workers_lost": self.workers_lost,
            "disruptions": self.disruptions,
            "worker_failures": self.failures,
            "epochs": self.epochs_done,
            "max_world_size": self.max_world_size,
            "duration_s": round(self.duration_s, 1),
        }


def summarize(
    events: Sequence[Event],
    end_t: float | None = None,
    injected: Sequence[tuple[float, str, str]] = (),
) -> Summary:
    """Fold ``events`` (oldest first, as ``master.state.read_timeline`` returns them).

    ``injected``: faults injected by this component, (unix time, action, worker name); they
    show among the events before the restart they caused."""
    if not events:
        return Summary()
    faults = [
        {"kind": "fault_injected", "t": t, "action": action, "name": name}
        for t, action, name in injected
    ]
    events = sorted([*events, *faults], key=lambda e: float(e.get("t", 0.0)))
    start = float(events[0].get("t", 0.0))
    last_t = float(events[-1].get("t", start)) if end_t is None else end_t
    stats = TimelineStats().add_all(events)
    world = 0
    world_series: list[tuple[float, int]] = [(0.0, 0)]
    losses: list[tuple[int, float]] = []
    restarts: list[Restart] = []
    lost_rows: list[tuple[float, str, str, str]] = []
    causes: list[str] = []
    rounds_seen = 0
    steps, final_loss, epochs = 0, 0.0, 0
    counts = {"lost": 0, "disruptions": 0, "failures": 0}
    end_state, end_message = "", ""
    for event in events:
        kind, t = event.get("kind"), float(event.get("t", start)) - start
        if kind == "round_formed":
            size = int(event.get("world_size", 0))
            if rounds_seen:
                restarts.append(
                    Restart(
                        round(t, 2),
                        int(event.get("round", 0)),
                        world,
                        size,
                        tuple(causes) or ("(no worker event)",),
                    )
                )
            rounds_seen += 1
            causes, world = [], size
            world_series.append((t, size))
        elif kind == "committed":
            step = int(event.get("step", 0))
            recorded = [float(x) for x in event.get("losses") or ()]
            first = step - len(recorded) + 1
            losses.extend((first + i, value) for i, value in enumerate(recorded))
            steps = step
            if recorded:
                final_loss = recorded[-1]
        elif kind == "epoch_end":
            epochs = max(epochs, int(event.get("epoch", 0)) + 1)
        elif kind == "worker_lost":
            cause = str(event.get("cause", "lost"))
            name = str(event.get("name", "?"))
            counts["lost"] += 1
            counts["disruptions"] += cause in DISRUPTIONS
            counts["failures"] += bool(event.get("failure"))
            causes.append(f"{name} lost ({cause})")
            lost_rows.append((round(t, 2), name, cause, str(event.get("message", ""))))
        elif kind == "worker_launched" and rounds_seen:
            causes.append(f"{event.get('name', '?')} launched")
        elif kind == "fault_injected":
            causes.append(f"{event.get('action')} {event.get('name')} injected")
        elif kind in ("job_done", "job_failed"):
            end_state = "succeeded" if kind == "job_done" else "failed"
            end_message = str(event.get("message", ""))
    world_series.append((max(last_t - start, world_series[-1][0]), world))
    lost = stats.lost_steps
    return Summary(
        steps=steps,
        final_loss=final_loss,
        restarts=stats.restarts,
        lost_steps=lost,
        goodput=steps / (steps + lost) if steps else 0.0,
        workers_lost=counts["lost"],
        disruptions=counts["disruptions"],
        failures=counts["failures"],
        epochs_done=epochs,
        max_world_size=max(size for _, size in world_series),
        final_world_size=world,
        duration_s=max(0.0, last_t - start),
        world_size=tuple(world_series),
        losses=tuple(losses),
        restart_rows=tuple(restarts),
        lost_rows=tuple(lost_rows),
        end_state=end_state,
        end_message=end_message,
    )


def describe(event: Event, start: float) -> str | None:
    """One progress line for an event (None: not worth a line)."""
    kind, t = event.get("kind"), float(event.get("t", start)) - start
    text = {
        "master_started": lambda e: (
            f"master started: {e.get('min_workers')}.."
            f"{e.get('max_workers')} workers x "
            f"{e.get('nproc_per_worker')} processes, launcher "
            f"{e.get('launcher')}"
        ),
        "master_recovered": lambda e: f"master recovered, adopted {e.get('workers')}",
        "worker_launched": lambda e: f"{e.get('name')} launched",
        "worker_lost": lambda e: (
            f"{e.get('name')} lost: {e.get('cause')}"
            + (f" ({e.get('message')})" if e.get("message") else "")
        ),
        "worker_completed": lambda e: f"{e.get('name')} completed",
        "launch_failed": lambda e: f"launch of worker {e.get('index')} failed: {e.get('message')}",
        "round_formed": lambda e: (
            f"round {e.get('round')} formed: world size "
            f"{e.get('world_size')} ({e.get('nodes')} workers)"
        ),
        "committed": lambda e: (
            f"step {e.get('step')} committed (epoch {e.get('epoch')}, "
            f"world {e.get('world_size')}"
            + (f", loss {e['losses'][-1]:.4f}" if e.get("losses") else "")
            + ")"
        ),
        "epoch_end": lambda e: f"epoch {e.get('epoch')} done at step {e.get('step')}",
        "job_done": lambda e: f"job succeeded: {e.get('message')}",
        "job_failed": lambda e: f"job failed: {e.get('message')}",
    }.get(str(kind))
    return f"[{t:7.1f}s] {text(event)}" if text else None
