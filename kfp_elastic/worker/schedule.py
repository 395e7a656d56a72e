"""When the ranks sync and when rank 0 snapshots: pure decisions, no I/O.

Two rhythms, deliberately apart:

* **Syncs** are one small allreduce that agrees on "stop" (a SIGTERM on any rank), carries the
  steps' losses and rank 0's decisions. They come about every ``SYNC_TARGET_S`` of training
  (rank 0 picks the next sync step from the measured step time and announces it in the sync
  itself), at every epoch end, and at every multiple of an explicit ``--snapshot-every``. So a
  preemption notice is acted on within about half a second whatever the snapshot interval.
* **Snapshots** happen at syncs, decided by rank 0 (only rank 0 writes them; the others learn it
  from the sync). With ``--snapshot-every N`` at every N-th step and every epoch end. With
  ``auto`` (the default) whenever the training time since the last one is at least the last
  snapshot's cost divided by ``--snapshot-overhead`` (1 %), as CheckFreq (FAST '21) does, and
  at the latest every ``--snapshot-max-interval`` seconds. Losing a node costs a survivor
  nothing thanks to rescues (``worker/rescue.py``); the interval only bounds what losing *every*
  node costs, so the runtime spends a fixed small share of time on it instead of a fixed
  number of steps that is too often for small steps and too rare for big ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kfp_elastic.job_env import DEFAULT_SNAPSHOT_MAX_INTERVAL_S, DEFAULT_SNAPSHOT_OVERHEAD

SYNC_TARGET_S = 0.5  # seconds of training between syncs (the SIGTERM reaction time)
FIRST_SYNC_GAP = 10  # steps to the first sync after a (re)start: no step time known yet
MAX_SYNC_GAP = 1000
FIRST_SNAPSHOT_AFTER_S = 2.0  # auto: the first snapshot measures what one costs


def next_sync_step(step: int, step_time_s: float | None, every: int | None) -> int:
    """The step after which the next sync happens (epoch ends are syncs anyway)."""
    if step_time_s is None or step_time_s <= 0:
        gap = FIRST_SYNC_GAP
    else:
        gap = min(MAX_SYNC_GAP, max(1, round(SYNC_TARGET_S / step_time_s)))
    following = step + gap
    if every is not None:
        following = min(following, (step // every + 1) * every)
    return following


@dataclass(frozen=True)
class SnapshotPolicy:
    every: int | None = None  # explicit steps between snapshots; None = auto
    overhead: float = DEFAULT_SNAPSHOT_OVERHEAD  # auto: share of training time snapshots may cost
    max_interval_s: float = DEFAULT_SNAPSHOT_MAX_INTERVAL_S  # auto: never longer between them

    def due(self, step: int, epoch_end: bool, trained_s: float, last_cost_s: float | None) -> bool:
        """Should rank 0 snapshot at this sync (after ``step``, ``trained_s`` seconds of
        training since the last snapshot)?"""
        if self.every is not None:
            return epoch_end or step % self.every == 0
        if last_cost_s is None:
            wait = FIRST_SNAPSHOT_AFTER_S
        else:
            wait = last_cost_s / self.overhead
        return trained_s >= min(wait, self.max_interval_s)

    def describe(self) -> str:
        if self.every is not None:
            return f"every {self.every} steps"
        limit = (
            "" if math.isinf(self.max_interval_s) else f", at most {self.max_interval_s:g} s apart"
        )
        return f"auto ({self.overhead:.1%} of training time{limit})"
