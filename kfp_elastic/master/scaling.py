"""How many workers to ask for, which to replace, when to give up: pure decisions, no I/O.

The policy, as :func:`decide` applies it on every reconcile of the master:

- **Ask for MAX, always exactly MAX.** Worker slots are the indexes ``0 .. max-1``. A slot is
  taken by a worker that is Pending or Running and not being taken away; every free slot gets
  a new worker. Pending workers (no room in the cluster yet, or still starting) keep their slot:
  they join the job when capacity frees, and the master never adds pods beyond MAX to "try
  harder" (they would only queue behind the Pending ones).
- **Replace what ended.** A worker that was preempted, evicted, lost with its node or deleted by
  someone else is replaced, and is no failure (a *disruption*). A worker that exited non-zero
  is replaced too, and is a failure (:attr:`Outcome.failure`): the caller counts it in the
  job's failure budget unless its agent counted its failures already
  (``kfp_elastic/contract/failure_budget.py`` decides when failures end the job).
- **Give up** when fewer than MIN workers have been Running for longer than ``max_wait_s``
  (measured on the caller's monotonic clock).
- **Finishing.** Once the job is complete (a worker exited 0 or the committed progress says so)
  nothing is launched, the below-MIN clock stops and workers that end with an error are no
  failures (a late replacement finds the finished run closed and exits 1). Workers
  still Pending are deleted at once: they can no longer train, and left alone they would bind
  to the slots the finishing workers free and keep them from other jobs.

Ended workers are reported in :attr:`Decision.ended` exactly once (the caller records them and
passes their names back in ``recorded``) and listed in :attr:`Decision.delete` until they are
gone, so finished pods do not linger.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kfp_elastic.job_spec import ScalingPolicy
from kfp_elastic.master.launcher import Reason, WorkerPhase, WorkerStatus

#: ``cause`` of an ended worker, as the timeline records it.
CAUSES = {
    Reason.COMPLETED: "completed",
    Reason.PREEMPTED: "preempted",
    Reason.EVICTED: "evicted",
    Reason.NODE_LOST: "node_lost",
    Reason.REJECTED: "rejected",
    Reason.DELETED_EXTERNALLY: "deleted_externally",
    Reason.ORPHANED: "orphaned",
    Reason.DELETED: "deleted",
    Reason.ERROR: "failed",
    Reason.UNKNOWN: "unknown",
}


@dataclass(frozen=True)
class Outcome:
    """How one worker ended."""

    name: str
    worker_index: int | None
    cause: str  # a value of CAUSES
    failure: bool  # ended with an error: a failure for the job's budget
    exit_code: int | None
    message: str

    @property
    def completed(self) -> bool:
        return self.cause == "completed"


@dataclass(frozen=True)
class Decision:
    launch: tuple[int, ...]  # worker indexes to start a new worker for
    delete: tuple[str, ...]  # ended workers to remove (after recording them); when finishing,
    # the Pending ones too
    ended: tuple[Outcome, ...]  # newly ended workers, to record once
    below_min_since: float | None  # monotonic time since when fewer than MIN run, or None
    give_up: str | None  # why the job must fail now, or None
    running: int
    pending: int

    @property
    def completed(self) -> bool:
        """A worker of this decision exited 0: the training is over."""
        return any(o.completed for o in self.ended)


def replaced_worker(
    index: int,
    table: Mapping[str, Mapping[str, Any]],
    statuses: Mapping[str, WorkerStatus],
) -> tuple[str, str] | None:
    """The worker a new one for ``index`` takes the place of (the master's table's latest
    attempt of that index) and why it went (a value of CAUSES): its recorded end, else the
    reason its status gives (a pod still being taken away), else ``unknown``. None: the
    index's first worker."""
    attempts = [
        (int(record.get("attempt") or 0), name)
        for name, record in table.items()
        if record.get("index") == index
    ]
    if not attempts:
        return None
    _, name = max(attempts)
    ended = table[name].get("ended")
    if ended:
        return name, str(ended)
    status = statuses.get(name)
    if status is not None and (status.reason in CAUSES or status.ended):
        return name, outcome_of(status).cause
    return name, "unknown"


def outcome_of(status: WorkerStatus) -> Outcome:
    """Classify an ended worker: cause and whether it counts as a failure."""
    if status.reason is not None and status.reason in CAUSES:
        cause = CAUSES[status.reason]
    elif status.phase == WorkerPhase.SUCCEEDED:
        cause = "completed"
    elif status.phase == WorkerPhase.FAILED:
        cause = "failed"  # ended with an error and no disruption was reported
    else:
        cause = "deleted_externally"  # vanished without a reason: not the worker's fault
    message = status.message or (
        f"exit code {status.exit_code}" if status.exit_code is not None else cause
    )
    return Outcome(
        status.name,
        status.worker_index,
        cause,
        cause == "failed",
        status.exit_code,
        message,
    )


def is_active(status: WorkerStatus) -> bool:
    """Holds its slot: Pending or Running and not being taken away."""
    return not status.ended and not status.is_disruption


def decide(
    policy: ScalingPolicy,
    workers: Sequence[WorkerStatus],
    recorded: Collection[str],
    below_min_since: float | None,
    now: float,
    finishing: bool = False,
) -> Decision:
    """One reconcile step. ``workers``: every worker the launcher still has or that the caller
    has not recorded as ended yet; ``recorded``: names whose end is already recorded."""
    ended = tuple(outcome_of(w) for w in workers if w.ended and w.name not in recorded)
    finishing = finishing or any(o.completed for o in ended)
    if finishing:  # e.g. a late replacement that found the finished run closed: not a failure
        ended = tuple(replace(o, failure=False) for o in ended)
    delete = tuple(w.name for w in workers if w.ended and w.phase != WorkerPhase.DELETED)
    active = [w for w in workers if is_active(w)]
    running = [w for w in active if w.phase == WorkerPhase.RUNNING]
    pending = [w for w in active if w.phase == WorkerPhase.PENDING]

    give_up: str | None = None
    if finishing or len(running) >= policy.min_workers:
        below_min_since = None
    else:
        below_min_since = now if below_min_since is None else below_min_since
        waited = now - below_min_since
        if waited >= policy.max_wait_s:
            give_up = (
                f"only {len(running)} of --min-workers={policy.min_workers} workers ran "
                f"for {waited:.1f}s, longer than --max-wait={policy.max_wait_s:g}s"
                + _describe_pending(pending)
            )

    if finishing:  # a Pending worker cannot train any more: free its place now
        delete += tuple(w.name for w in pending if w.name not in delete)
    launch: tuple[int, ...] = ()
    if give_up is None and not finishing:
        taken = {w.worker_index for w in active}
        free = [i for i in range(policy.max_workers) if i not in taken]
        launch = tuple(free[: max(0, policy.max_workers - len(active))])
    return Decision(launch, delete, ended, below_min_since, give_up, len(running), len(pending))


def _describe_pending(pending: Sequence[WorkerStatus]) -> str:
    if not pending:
        return ""
    shown = []
    for w in pending[:5]:
        why = w.reason.value if w.reason is not None else "starting"
        shown.append(f"{w.name} ({why}{': ' + w.message if w.message else ''})")
    more = f" and {len(pending) - 5} more" if len(pending) > 5 else ""
    return f"; pending: {', '.join(shown)}{more}"
