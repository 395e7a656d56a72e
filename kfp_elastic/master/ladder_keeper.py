"""The master's side of the least-attained-service ladder: it keeps the job's
:class:`~kfp_elastic.master.ladder.LadderState` in etcd, asks ``decide_level`` on every
reconcile, and after a move says which workers to re-create in the new level's class.

The decision is ``master/ladder.py``'s (pure, shared with the simulator); this module is its
I/O: the state record (``MasterKeys.ladder``), the launcher's class for new guaranteed workers,
the timeline event, the log line. The ladder's clock is the wall clock (``time.time()``), so
that a new master (a crash, a KFP retry) goes on from the stored last move.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kfp_elastic.master.ladder import (
    GuaranteedWorker,
    LadderAction,
    LadderPolicy,
    LadderState,
    LevelDecision,
    decide_level,
    workers_to_move,
)
from kfp_elastic.master.launcher import Launcher, WorkerStatus
from kfp_elastic.master.scaling import is_active
from kfp_elastic.master.state import MasterState
from kfp_elastic.master.timeline import Event, LadderMoved

log = logging.getLogger(__name__)


class LadderKeeper:
    """One job's ladder. ``start`` once the master leads (reads or creates the stored state and
    sets the launcher's class), then ``reconcile`` every loop."""

    def __init__(
        self,
        policy: LadderPolicy,
        state: MasterState,
        run_id: str,
        min_workers: int,
        gpus_per_worker: int,
        append: Callable[[Event], None],
    ) -> None:
        self.policy = policy
        self.master_state = state
        self.run_id = run_id
        self.min_workers = min_workers
        # A worker pod without a GPU counts as one slot: a CPU job climbs the ladder too.
        self.gpus_per_worker = max(1, gpus_per_worker)
        self.append = append
        self.state = LadderState()
        self.last: LevelDecision | None = None
        self.attained: float = 0.0  # GPU-seconds at the last reconcile (the metrics show it)
        self._held_back: int | None = None  # the due level last logged as rate limited

    @property
    def level(self) -> int:
        return self.state.level

    @property
    def priority_class(self) -> str:
        return self.policy.priority_class(self.state.level)

    def start(self, launcher: Launcher, now: float) -> None:
        """The stored state (a new master goes on from it), else level 0 from ``now``."""
        record = self.master_state.ladder()
        if record is None:
            self.state = LadderState.start(now)
            self.master_state.save_ladder(self.state.to_record())
        else:
            try:
                self.state = LadderState.from_record(record, self.policy.last_level)
            except ValueError as error:
                log.warning("ladder state unreadable, starting at level 0 error=%s", error)
                self.state = LadderState.start(now)
                self.master_state.save_ladder(self.state.to_record())
        launcher.set_guaranteed_priority_class(self.priority_class)
        log.info(
            "ladder run=%s level=%d class=%s levels=%s",
            self.run_id,
            self.level,
            self.priority_class,
            ",".join(self.policy.priority_classes),
        )

    def attained_gpu_s(self, slot_seconds: Mapping[str, float]) -> float:
        """The job's attained service: its workers' slot-seconds (both tiers) in GPU-seconds."""
        return sum(slot_seconds.values()) * self.gpus_per_worker

    def reconcile(
        self,
        launcher: Launcher,
        attained_gpu_s: float,
        below_min_for_s: float,
        now: float,
        workers: Sequence[WorkerStatus],
        table: Mapping[str, Mapping[str, Any]],
    ) -> tuple[str, ...]:
        """One ladder step; returns the workers to delete now (their replacements come in the
        new level's class)."""
        decision = decide_level(self.policy, self.state, attained_gpu_s, below_min_for_s, now)
        self.last = decision
        self.attained = attained_gpu_s
        if decision.move:
            self._move(launcher, decision, attained_gpu_s)
        elif decision.action == LadderAction.RATE_LIMITED:
            if self._held_back != decision.due_level:
                self._held_back = decision.due_level
                log.info("ladder move held back run=%s %s", self.run_id, decision.reason)
        live = [
            GuaranteedWorker(w.name, w.worker_index, table.get(w.name, {}).get("level"))
            for w in workers
            if is_active(w) and w.worker_index is not None
        ]
        return workers_to_move(live, self.level, self.min_workers)

    def _move(self, launcher: Launcher, decision: LevelDecision, attained_gpu_s: float) -> None:
        before = self.state.level
        self.state = decision.state
        self._held_back = None
        self.master_state.save_ladder(self.state.to_record())
        launcher.set_guaranteed_priority_class(self.priority_class)
        self.append(
            LadderMoved(
                from_level=before,
                level=decision.level,
                priority_class=self.priority_class,
                action=decision.action.value,
                attained_gpu_s=round(attained_gpu_s, 3),
                service_gpu_s=round(decision.service_gpu_s, 3),
                reason=decision.reason,
            )
        )
        log.warning(
            "ladder move run=%s level=%d->%d class=%s action=%s attained_gpu_s=%.1f reason=%s",
            self.run_id,
            before,
            decision.level,
            self.priority_class,
            decision.action.value,
            attained_gpu_s,
            decision.reason,
        )
