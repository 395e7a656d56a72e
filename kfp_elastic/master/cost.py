"""What a job costs: slot-seconds per worker tier and their price, folded from the timeline (pure).

A *slot* is one worker pod (``nproc_per_worker`` processes and their GPUs). A worker holds its
slot from the master first seeing its pod Running (``WorkerRunning``) until the master records
its end (``WorkerLost``, ``WorkerCompleted``) or the job's end (``JobDone``, ``JobFailed``: the
master stops every worker before it writes them). Time spent Pending (unscheduled, pulling its
image) is not counted: no node runs the worker yet. A worker never seen Running counts nothing.

Tiers follow the priority class rule (``master.pod_spec.is_guaranteed``): worker indexes below
``min_workers`` are *guaranteed*, the others *opportunistic*. Prices are per slot-hour:
guaranteed workers at the on-demand price, opportunistic ones at the spot price (the on-demand
price when no spot price is given).

The comparison ("same work at a fixed size"): the job's committed steps trained by
``max_workers`` workers on on-demand nodes, never preempted, at the job's throughput at that
size: measured from consecutive commits of rounds that ran at ``max_workers``; if no round
trained at that size, the best measured size's throughput scaled linearly to it (real scaling
is at most linear, so the fixed job is estimated no slower than it would be, and the saving is
not overstated). The master's ``/metrics`` and the elastic_train component's report both use
this fold, over the same timeline. docs/scheduling.md, "What it costs".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kfp_elastic.contract.prices import GUARANTEED, OPPORTUNISTIC, TIERS, Prices
from kfp_elastic.master.pod_spec import is_guaranteed
from kfp_elastic.master.timeline import (
    Committed,
    Event,
    JobDone,
    JobFailed,
    MasterStarted,
    WorkerCompleted,
    WorkerLaunched,
    WorkerLost,
    WorkerRunning,
)


def tier_of(worker_index: int, min_workers: int) -> str:
    """The tier of worker slot ``worker_index`` (its PriorityClass: ``pod_spec``)."""
    return GUARANTEED if is_guaranteed(worker_index, min_workers) else OPPORTUNISTIC


@dataclass(frozen=True)
class Cost:
    """What the job used and cost so far. Money fields are None without prices; the fixed-size
    fields are None before two commits of one round measured a throughput."""

    slot_seconds: Mapping[str, float] = field(default_factory=lambda: dict.fromkeys(TIERS, 0.0))
    cost: Mapping[str, float] | None = None  # tier -> money
    steps: int = 0
    fixed_workers: int = 0
    steps_per_second: float | None = None  # at fixed_workers, measured or scaled
    throughput_measured: bool = False  # measured at fixed_workers (else scaled linearly)
    fixed_slot_seconds: float | None = None
    fixed_cost: float | None = None

    @property
    def total(self) -> float | None:
        return None if self.cost is None else sum(self.cost.values())

    @property
    def saving(self) -> float | None:
        """``fixed_cost - total`` (negative: the elastic job cost more)."""
        if self.fixed_cost is None or self.total is None:
            return None
        return self.fixed_cost - self.total


@dataclass
class SlotUsage:
    """Fold of timeline events (``add`` them oldest first): slot-seconds per tier and the
    throughput at each world size. ``min_workers``/``max_workers``/``nproc_per_worker``: the
    job's (0: the first ``MasterStarted`` event's)."""

    min_workers: int = 0
    max_workers: int = 0
    nproc_per_worker: int = 0
    steps: int = 0
    _closed: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIERS, 0.0))
    _index: dict[str, int] = field(default_factory=dict)  # worker name -> slot
    _running: dict[str, tuple[int, float]] = field(default_factory=dict)  # name -> (slot, since)
    _last_commit: tuple[int, int, int, float] | None = None  # (round, world, step, at)
    _trained: dict[int, tuple[int, float]] = field(default_factory=dict)  # world -> (steps, s)

    def add_all(self, events: Iterable[Event]) -> SlotUsage:
        for event in events:
            self.add(event)
        return self

    def add(self, event: Event) -> None:
        if isinstance(event, MasterStarted):
            self.min_workers = self.min_workers or event.min_workers
            self.max_workers = self.max_workers or event.max_workers
            self.nproc_per_worker = self.nproc_per_worker or event.nproc_per_worker
        elif isinstance(event, WorkerLaunched):
            self._index[event.name] = event.index
        elif isinstance(event, WorkerRunning):
            index = event.index if event.index is not None else self._index.get(event.name, 0)
            self._running.setdefault(event.name, (index, event.t))
        elif isinstance(event, WorkerLost | WorkerCompleted):
            self._close(event.name, event.t)
        elif isinstance(event, JobDone | JobFailed):
            for name in list(self._running):
                self._close(name, event.t)
        elif isinstance(event, Committed):
            self._commit(event)

    def _close(self, name: str, t: float) -> None:
        if name in self._running:
            index, since = self._running.pop(name)
            self._closed[tier_of(index, self.min_workers)] += max(0.0, t - since)

    def _commit(self, event: Committed) -> None:
        at = event.at or event.t
        last = self._last_commit
        if last is not None:
            same_world = (last[0], last[1]) == (event.round, event.world_size)
            if same_world and event.round and event.step > last[2] and at > last[3]:
                steps, seconds = self._trained.get(event.world_size, (0, 0.0))
                self._trained[event.world_size] = (
                    steps + event.step - last[2],
                    seconds + at - last[3],
                )
        self._last_commit = (event.round, event.world_size, event.step, at)
        self.steps = event.step

    def slot_seconds(self, at: float | None = None) -> dict[str, float]:
        """Seconds each tier's slots were held; workers still running count until ``at`` (None:
        only what ended)."""
        held = dict(self._closed)
        if at is not None:
            for index, since in self._running.values():
                held[tier_of(index, self.min_workers)] += max(0.0, at - since)
        return held

    def throughput(self, workers: int) -> tuple[float | None, bool]:
        """Committed steps per second at ``workers`` workers, and whether it was measured at
        that size (else scaled linearly from the largest measured size; None: none measured)."""
        nproc = self.nproc_per_worker or 1
        rates = {world: s / t for world, (s, t) in self._trained.items() if t > 0}
        if workers * nproc in rates:
            return rates[workers * nproc], True
        if not rates:
            return None, False
        world = max(rates)
        return rates[world] * workers * nproc / world, False


def cost_of(usage: SlotUsage, prices: Prices, at: float | None = None) -> Cost:
    """What ``usage`` costs at ``prices`` (module docstring), workers still running counted
    until ``at``."""
    held = usage.slot_seconds(at)
    workers = usage.max_workers
    rate, measured = usage.throughput(workers) if workers else (None, False)
    fixed_s = workers * usage.steps / rate if rate else None
    if not prices.given:
        return Cost(held, None, usage.steps, workers, rate, measured, fixed_s)
    money = {tier: held[tier] / 3600 * prices.of(tier) for tier in TIERS}
    fixed = fixed_s / 3600 * prices.on_demand if fixed_s is not None else None
    return Cost(held, money, usage.steps, workers, rate, measured, fixed_s, fixed)
