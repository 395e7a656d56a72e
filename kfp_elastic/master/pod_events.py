"""The master's decisions as Kubernetes Events, without I/O: which timeline event
(``master/timeline.py``) becomes which Event, about which pod, with which reason and message.

:func:`pod_event` is the one mapping. A few Events name what came before (the size a world
had, whether the failure budget was already spent), so it takes what the earlier timeline
events said (:class:`Seen`) and returns it updated; the recorder (``master/k8s_events.py``)
feeds it every event the master puts on its timeline, after the timeline it found when it
took the run over (:func:`seen_after`).

Reasons are CamelCase and the type ``Normal`` or ``Warning``, as client-go's ``EventRecorder``
wants them. A worker's Events are about its pod; the job's (a resize, a ladder move, the
failure budget, the job's end) are about the master's own pod (``pod`` None here).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from kfp_elastic.master.timeline import (
    Event,
    FailureCounted,
    JobDone,
    JobFailed,
    LadderMoved,
    LaunchFailed,
    RoundFormed,
    WorkerLaunched,
    WorkerLost,
)

#: ``source.component`` and ``reportingComponent`` of every Event the master records
#: (``kubectl get events --field-selector source=kfp-elastic-master``).
COMPONENT = "kfp-elastic-master"
NORMAL = "Normal"
WARNING = "Warning"

# The reasons, one per decision (docs/kubernetes-launcher.md, "Events").
CREATED = "SuccessfulCreate"  # as the ReplicaSet controller names a pod it created
REPLACED = "WorkerReplaced"
FAILED_CREATE = "FailedCreate"  # as the ReplicaSet controller names a refused create
LOST = "WorkerLost"
FAILED = "WorkerFailed"
RESIZED = "WorldResized"
DEMOTED = "LadderDemoted"
PROMOTED = "LadderPromoted"
FAILURE_COUNTED = "FailureCounted"
BUDGET_EXCEEDED = "FailureBudgetExceeded"
SUCCEEDED = "JobSucceeded"
JOB_FAILED = "JobFailed"

#: The longest message an Event gets (events.k8s.io/v1 refuses a note over 1 kB).
MAX_MESSAGE = 1024


@dataclass(frozen=True)
class PodEvent:
    """An Event to record: about pod ``pod`` (None: the master's own pod)."""

    pod: str | None
    reason: str
    type: str
    message: str


@dataclass(frozen=True)
class Seen:
    """What the earlier timeline events said that a later one's Event names.
    ``max_failures``: the job's failure budget (None: no budget)."""

    max_failures: int | None = None
    nodes: int = 0  # the last round's workers (0: none formed yet)
    budget_spent: bool = False


def pod_event(event: Event, seen: Seen) -> tuple[PodEvent | None, Seen]:
    """The Event of timeline event ``event`` (None: it records none) and what has been seen
    once it happened."""
    if isinstance(event, WorkerLaunched):
        what = f"worker pod {event.name} (worker {event.index}, attempt {event.attempt})"
        if not event.replaces:
            return PodEvent(event.name, CREATED, NORMAL, f"Created {what}"), seen
        cause = f" ({event.replaces_cause})" if event.replaces_cause else ""
        message = f"Created {what} to replace {event.replaces}{cause}"
        return PodEvent(event.name, REPLACED, NORMAL, message), seen
    if isinstance(event, WorkerLost):
        what = f"Worker pod {event.name} (worker {_index(event.index)})"
        if event.failure:
            code = "" if event.exit_code is None else f", exit code {event.exit_code}"
            message = f"{what} failed{code}: {event.message}"
            return PodEvent(event.name, FAILED, WARNING, message), seen
        message = f"{what} lost ({event.cause}): {event.message}"
        return PodEvent(event.name, LOST, NORMAL, message), seen
    if isinstance(event, LaunchFailed):
        return (
            PodEvent(
                None,
                FAILED_CREATE,
                WARNING,
                f"Error creating worker pod for worker {event.index}: {event.message}",
            ),
            seen,
        )
    if isinstance(event, RoundFormed):
        if event.nodes == seen.nodes:
            return None, seen
        out = PodEvent(
            None,
            RESIZED,
            NORMAL,
            f"Round {event.round} formed a world of {_workers(event.nodes)} (world size "
            f"{event.world_size}), from {_workers(seen.nodes)}",
        )
        return out, replace(seen, nodes=event.nodes)
    if isinstance(event, LadderMoved):
        demoted = event.level > event.from_level
        why = f": {event.reason}" if event.reason else ""
        out = PodEvent(
            None,
            DEMOTED if demoted else PROMOTED,
            NORMAL,
            f"{'Demoted' if demoted else 'Promoted'} from ladder level {event.from_level} to "
            f"{event.level}: guaranteed workers are re-created in PriorityClass "
            f"{event.priority_class} (attained {event.attained_gpu_s:g} GPU-s){why}",
        )
        return out, seen
    if isinstance(event, FailureCounted):
        where = ", ".join(
            part
            for part in (
                f"rank {event.rank}" if event.rank is not None else "",
                f"round {event.round}" if event.round is not None else "",
                f"node {event.node}" if event.node else "",
            )
            if part
        )
        where = f" ({where})" if where else ""
        limit = "" if seen.max_failures is None else f" of max_failures={seen.max_failures}"
        spent = event.fatal or (seen.max_failures is not None and event.count > seen.max_failures)
        if spent and not seen.budget_spent:
            kind = "a fatal failure" if event.fatal else f"failure {event.count}{limit}"
            out = PodEvent(
                None,
                BUDGET_EXCEEDED,
                WARNING,
                f"Failure budget spent by {kind}: {event.worker or 'the master'}{where}: "
                f"{event.error}",
            )
            return out, replace(seen, budget_spent=True)
        out = PodEvent(
            event.worker or None,
            FAILURE_COUNTED,
            WARNING,
            f"Failure {event.count}{limit} counted: {event.worker or 'the master'}{where}: "
            f"{event.error}",
        )
        return out, seen
    if isinstance(event, JobDone):
        message = f"Job succeeded: {event.message} ({_failures(event.failures)} counted)"
        return PodEvent(None, SUCCEEDED, NORMAL, message), seen
    if isinstance(event, JobFailed):
        message = f"Job failed: {event.message} ({_failures(event.failures)} counted)"
        return PodEvent(None, JOB_FAILED, WARNING, message), seen
    return None, seen


def seen_after(events: Iterable[Event], seen: Seen) -> Seen:
    """What ``events`` (a timeline, oldest first) leave seen: a new master starts from the
    timeline it found, so that its first replacement still names the pod it replaces."""
    for event in events:
        _, seen = pod_event(event, seen)
    return seen


def clip(message: str) -> str:
    """``message`` within :data:`MAX_MESSAGE` characters."""
    return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 3] + "..."


def _index(index: int | None) -> str:
    return "?" if index is None else str(index)


def _workers(count: int) -> str:
    return f"{count} worker{'' if count == 1 else 's'}"


def _failures(count: int) -> str:
    return f"{count} failure{'' if count == 1 else 's'}"
