"""The numbers and series of one job, folded from the master's event timeline (pure).

Definitions (also in docs/pipelines.md):

- ``steps``: the last committed optimizer step (the steps that reached the final model);
- ``restarts``: rendezvous rounds formed after the first (every membership change restarts
  all workers from the last commit);
- ``lost_steps``: steps trained and then thrown away by those restarts
  (``master.metrics.TimelineStats``, from the workers' commit and round records: the same
  across a master retry; docs/master.md, "Metrics");
- ``goodput``: ``steps / (steps + lost_steps)``, the share of the training work that reached
  the final model (1.0: nothing was redone);
- ``final_loss``: the mean training loss of the last committed step (0.0 if none was recorded);
- ``slot_seconds_guaranteed``/``_opportunistic``, ``cost``, ``fixed_size_cost``,
  ``cost_saving``: what the job used and cost (``master.cost``, the fold ``/metrics`` uses;
  docs/scheduling.md, "What it costs"); the money ones only with prices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kfp_elastic.contract.failure_budget import CountedFailure
from kfp_elastic.contract.prices import GUARANTEED, NO_PRICES, OPPORTUNISTIC, Prices
from kfp_elastic.master.cost import Cost, SlotUsage, cost_of
from kfp_elastic.master.launcher import DISRUPTIONS as DISRUPTION_REASONS
from kfp_elastic.master.metrics import TimelineStats
from kfp_elastic.master.scaling import CAUSES
from kfp_elastic.master.timeline import (
    Committed,
    EpochEnd,
    Event,
    FailureCounted,
    FaultInjected,
    JobDone,
    JobFailed,
    LaunchFailed,
    MasterRecovered,
    MasterStarted,
    MasterSteppedDown,
    RoundFormed,
    WorkerCompleted,
    WorkerLaunched,
    WorkerLost,
)

# The causes of master.scaling that do not count as failures (a worker taken away).
DISRUPTIONS = frozenset(CAUSES[reason] for reason in DISRUPTION_REASONS)


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
    failures: int = 0  # counted against the job's failure budget (in-place restarts included)
    epochs_done: int = 0
    max_world_size: int = 0
    final_world_size: int = 0
    duration_s: float = 0.0
    world_size: tuple[tuple[float, int], ...] = ()  # (seconds since start, world size)
    losses: tuple[tuple[int, float], ...] = ()  # (step, loss), in the order trained
    restart_rows: tuple[Restart, ...] = ()  # causes: what happened since the previous round
    lost_rows: tuple[tuple[float, str, str, str], ...] = ()  # (t, worker, cause, message)
    # (t, worker, where: node, rank, round, error) of each counted failure
    failure_rows: tuple[tuple[float, str, str, str], ...] = ()
    end_state: str = ""
    end_message: str = ""
    cost: Cost = field(default_factory=Cost)
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
            **self.cost_metrics(),
        }

    def cost_metrics(self) -> dict[str, float]:
        cost = self.cost
        numbers = {
            "slot_seconds_guaranteed": round(cost.slot_seconds.get(GUARANTEED, 0.0), 1),
            "slot_seconds_opportunistic": round(cost.slot_seconds.get(OPPORTUNISTIC, 0.0), 1),
        }
        money = {"cost": cost.total, "fixed_size_cost": cost.fixed_cost, "cost_saving": cost.saving}
        numbers.update({k: round(v, 4) for k, v in money.items() if v is not None})
        return numbers


def summarize(
    events: Sequence[Event],
    end_t: float | None = None,
    injected: Sequence[tuple[float, str, str]] = (),
    prices: Prices = NO_PRICES,
    usage: SlotUsage | None = None,
) -> Summary:
    """Fold ``events`` (oldest first, as ``master.timeline.read_timeline`` returns them).

    ``injected``: faults injected by this component, (unix time, action, worker name); they
    show among the events before the restart they caused. ``prices``: per slot-hour, for the
    cost; ``usage``: the slot fold to add the events to, with the job's size (default: the
    size on the timeline's ``master_started``)."""
    if not events:
        return Summary()
    faults = [FaultInjected(t=t, action=action, name=name) for t, action, name in injected]
    events = sorted([*events, *faults], key=lambda e: e.t)
    start = events[0].t
    last_t = events[-1].t if end_t is None else end_t
    stats = TimelineStats(usage=usage or SlotUsage()).add_all(events)
    world = 0
    world_series: list[tuple[float, int]] = [(0.0, 0)]
    losses: list[tuple[int, float]] = []
    restarts: list[Restart] = []
    lost_rows: list[tuple[float, str, str, str]] = []
    failure_rows: list[tuple[float, str, str, str]] = []
    causes: list[str] = []
    rounds_seen = 0
    steps, final_loss, epochs = 0, 0.0, 0
    counts = {"lost": 0, "disruptions": 0, "failures": 0}
    end_state, end_message = "", ""
    for event in events:
        t = event.t - start
        if isinstance(event, RoundFormed):
            t = (event.formed_at or event.t) - start  # when it formed, even if no master saw it
            if rounds_seen:
                restarts.append(
                    Restart(
                        round(t, 2),
                        event.round,
                        world,
                        event.world_size,
                        tuple(causes) or ("(no worker event)",),
                    )
                )
            rounds_seen += 1
            causes, world = [], event.world_size
            world_series.append((t, event.world_size))
        elif isinstance(event, Committed):
            first = event.step - len(event.losses) + 1
            losses.extend((first + i, value) for i, value in enumerate(event.losses))
            steps = event.step
            if event.losses:
                final_loss = event.losses[-1]
        elif isinstance(event, EpochEnd):
            epochs = max(epochs, event.epoch + 1)
        elif isinstance(event, WorkerLost):
            cause = event.cause or "lost"
            name = event.name or "?"
            counts["lost"] += 1
            counts["disruptions"] += cause in DISRUPTIONS
            causes.append(f"{name} lost ({cause})")
            lost_rows.append((round(t, 2), name, cause, event.message))
        elif isinstance(event, FailureCounted):
            counts["failures"] += 1
            where = CountedFailure(
                event.incident,
                event.source,
                event.error,
                node=event.node,
                rank=event.rank,
                round=event.round,
            ).where()
            failure_rows.append((round(t, 2), event.worker or "?", where, event.error))
            causes.append(f"{event.worker or '?'} failed")
        elif isinstance(event, WorkerLaunched) and rounds_seen:
            causes.append(f"{event.name or '?'} launched")
        elif isinstance(event, FaultInjected):
            causes.append(f"{event.action} {event.name} injected")
        elif isinstance(event, (JobDone, JobFailed)):
            end_state = "succeeded" if isinstance(event, JobDone) else "failed"
            end_message = event.message
    world_series.append((max(last_t - start, world_series[-1][0]), world))
    lost = stats.lost_steps
    return Summary(
        steps=steps,
        final_loss=final_loss,
        restarts=stats.restarts,
        lost_steps=lost,
        goodput=stats.goodput(),
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
        failure_rows=tuple(failure_rows),
        end_state=end_state,
        end_message=end_message,
        cost=cost_of(stats.usage, prices, at=last_t),
    )


def describe(event: Event, start: float) -> str | None:
    """One progress line for an event (None: not worth a line, or a kind unknown here)."""
    text = _line(event)
    return f"[{event.t - start:7.1f}s] {text}" if text else None


def _line(event: Event) -> str | None:  # noqa: PLR0911 - one return per event type
    if isinstance(event, MasterStarted):
        return (
            f"master started: {event.min_workers}..{event.max_workers} workers x "
            f"{event.nproc_per_worker} processes, launcher {event.launcher}"
        )
    if isinstance(event, MasterRecovered):
        return f"master recovered, adopted {list(event.workers)}"
    if isinstance(event, MasterSteppedDown):
        return f"master stepped down ({event.reason}), workers left running"
    if isinstance(event, WorkerLaunched):
        return f"{event.name} launched"
    if isinstance(event, WorkerLost):
        detail = f" ({event.message})" if event.message else ""
        return f"{event.name} lost: {event.cause}{detail}"
    if isinstance(event, WorkerCompleted):
        return f"{event.name} completed"
    if isinstance(event, FailureCounted):
        what = "fatal failure" if event.fatal else "failure"
        return f"{what} {event.count} counted: {event.worker or '?'}: {event.error}"
    if isinstance(event, LaunchFailed):
        return f"launch of worker {event.index} failed: {event.message}"
    if isinstance(event, RoundFormed):
        return f"round {event.round} formed: world size {event.world_size} ({event.nodes} workers)"
    if isinstance(event, Committed):
        loss = f", loss {event.losses[-1]:.4f}" if event.losses else ""
        return f"step {event.step} committed (epoch {event.epoch}, world {event.world_size}{loss})"
    if isinstance(event, EpochEnd):
        return f"epoch {event.epoch} done at step {event.step}"
    if isinstance(event, JobDone):
        return f"job succeeded: {event.message}"
    if isinstance(event, JobFailed):
        return f"job failed: {event.message}"
    return None
