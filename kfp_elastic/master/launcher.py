"""How the master creates, deletes and watches workers, whatever runs them.

A worker is one torchrun agent (a Kubernetes pod, or later a local process). The master needs
to know not only *that* a worker ended but *why*: a preempted or evicted worker is replaced
without counting against the job's failure budget, a worker that exited with an error counts.
That distinction is the ``reason`` of a :class:`WorkerStatus`.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import TracebackType
from typing import Any


class WorkerPhase(str, Enum):
    """Lifecycle of a worker; the first four are Kubernetes' pod phases."""

    PENDING = "Pending"  # created, waiting for capacity or still starting
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    DELETED = "Deleted"  # gone: no longer listed by the launcher


class Reason(str, Enum):
    """Why a worker is in its phase; ``None`` on a status means "nothing remarkable"."""

    UNSCHEDULABLE = "Unschedulable"  # Pending: no node has room now (the cluster may scale up)
    START_ERROR = "StartError"  # Pending: image pull or container config error, won't heal
    PREEMPTED = "Preempted"  # a higher-priority workload took the capacity
    EVICTED = "Evicted"  # eviction API (drain) or the node ran out of memory/disk
    NODE_LOST = "NodeLost"  # the node died, became unreachable or shut down
    REJECTED = "Rejected"  # the node refused to admit the worker (e.g. OutOfcpu)
    ERROR = "Error"  # the worker exited with a non-zero code
    COMPLETED = "Completed"  # the worker exited with code 0
    DELETED = "Deleted"  # this launcher deleted it
    # Deleted by someone else without saying why. Clusters older than Kubernetes 1.26 preempt
    # and drain this way (no DisruptionTarget condition), so it counts as a disruption.
    DELETED_EXTERNALLY = "DeletedExternally"
    # The worker stopped itself (after a snapshot) because its run had no master for
    # orphan_timeout_s (exit code ORPHANED_EXIT_CODE, rendezvous/orphan.py): not its fault.
    ORPHANED = "Orphaned"
    # Ended while no master watched, and nothing tells why: its pod (or process tree) is gone
    # with its status and the worker left no end record of its own (``contract/worker_end.py``).
    UNKNOWN = "Unknown"


#: Reasons outside the worker's control: replace the worker, do not count a failure.
DISRUPTIONS = frozenset(
    {
        Reason.PREEMPTED,
        Reason.EVICTED,
        Reason.NODE_LOST,
        Reason.REJECTED,
        Reason.DELETED_EXTERNALLY,
        Reason.ORPHANED,
        Reason.UNKNOWN,
    }
)

_ENDED = frozenset({WorkerPhase.SUCCEEDED, WorkerPhase.FAILED, WorkerPhase.DELETED})


class LauncherForbidden(RuntimeError):
    """The cluster refuses the master an action it needs (Kubernetes RBAC's 403): asking again
    cannot help, so the job fails at once with this message, which says what to grant."""


@dataclass(frozen=True)
class WorkerHandle:
    """What :meth:`Launcher.launch` created."""

    name: str
    worker_index: int
    attempt: int


@dataclass(frozen=True)
class WorkerStatus:
    """A worker's state at one moment. A non-``None`` reason on a Running worker means it is
    being taken away (e.g. preempted, terminating) and will end soon."""

    name: str
    phase: WorkerPhase
    reason: Reason | None = None
    message: str = ""
    exit_code: int | None = None
    worker_index: int | None = None
    attempt: int | None = None
    node: str | None = None

    @property
    def ended(self) -> bool:
        return self.phase in _ENDED

    @property
    def is_disruption(self) -> bool:
        """Lost (or being lost) for reasons outside the worker: replace it, no failure."""
        return self.reason in DISRUPTIONS

    @property
    def is_failure(self) -> bool:
        """The worker itself failed: counts against the job's failure budget."""
        return self.reason == Reason.ERROR


@dataclass(frozen=True)
class WorkerEvent(WorkerStatus):
    """A change of a worker's phase, reason or exit code, as the launcher observed it."""

    observed_at: float = field(default_factory=time.time, compare=False)


def next_attempts(records: Mapping[str, Mapping[str, Any]]) -> dict[int, int]:
    """The first unused attempt of every worker index in the master's workers table
    (``MasterState.workers()``): a new master (a KFP retry) must not name a worker after one
    an earlier master launched, even one that is gone, or the table would mix the two."""
    attempts: dict[int, int] = {}
    for record in records.values():
        index, attempt = int(record.get("index", 0)), int(record.get("attempt", 0))
        attempts[index] = max(attempts.get(index, 0), attempt + 1)
    return attempts


class Launcher(ABC):
    """Creates, deletes, lists and watches the workers of one job.

    Implementations must be safe to call from several threads (the master launches from its
    control loop while another thread consumes :meth:`events`).
    """

    @abstractmethod
    def launch(self, worker_index: int) -> WorkerHandle:
        """Start a new worker for ``worker_index`` (a fresh attempt; never reuses a name)."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Stop and remove a worker. Deleting one that is already gone is not an error."""

    @abstractmethod
    def list_workers(self) -> list[WorkerStatus]:
        """Every worker of the job that still exists, ended ones included."""

    @abstractmethod
    def events(self, stop: threading.Event) -> Iterator[WorkerEvent]:
        """Yield the current state of every worker, then each change, until ``stop`` is set.

        Consecutive identical states of a worker are yielded once. A worker that disappears
        while the launcher could not watch (a reconnect) still gets its ``Deleted`` event.
        """

    def watch(self, callback: Callable[[WorkerEvent], None], stop: threading.Event) -> None:
        """Call ``callback`` for every event of :meth:`events` until ``stop`` is set."""
        for event in self.events(stop):
            callback(event)

    def set_guaranteed_priority_class(self, name: str) -> None:
        """Workers launched from now on in guaranteed slots get PriorityClass ``name`` (the
        ladder's level, ``master/ladder.py``). Launchers without priorities refuse it."""
        raise NotImplementedError(f"{type(self).__name__} has no priority classes")

    def job_ended(self) -> None:  # noqa: B027 - optional hook, most launchers hold nothing
        """The job ended and its workers are stopped: release what they left on machines this
        launcher owns (a pod's memory goes with the pod)."""

    def close(self) -> None:  # noqa: B027 - optional hook, most launchers hold nothing
        """Release connections or processes the launcher holds."""

    def __enter__(self) -> Launcher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
