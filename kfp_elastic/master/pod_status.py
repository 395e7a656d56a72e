"""What a worker pod's state means for the master: Kubernetes pod -> :class:`WorkerStatus` (pure).

Pod phase, container states, the DisruptionTarget condition (and Kueue's TerminationTarget) and
pod-level reasons decide whether a worker is pending, running, done, failed, or was taken away
(preempted, evicted, node lost); :mod:`master.k8s_launcher` reports every change of that verdict
as a worker event.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kfp_elastic.master.launcher import Reason, WorkerPhase
from kfp_elastic.master.launcher import WorkerStatus as Status
from kfp_elastic.master.pod_spec import ATTEMPT_LABEL, CONTAINER_NAME, INDEX_LABEL
from kfp_elastic.rendezvous.orphan import ORPHANED_EXIT_CODE

# DisruptionTarget condition reasons (Kubernetes >= 1.26; the scheduler's was renamed in 1.31).
_DISRUPTION_REASONS = {
    "PreemptionByScheduler": Reason.PREEMPTED,
    "PreemptionByKubeScheduler": Reason.PREEMPTED,
    "EvictionByEvictionAPI": Reason.EVICTED,
    "TerminationByKubelet": Reason.EVICTED,  # node-pressure eviction, graceful node shutdown
    "DeletionByTaintManager": Reason.NODE_LOST,  # NoExecute taint, e.g. node not ready
    "DeletionByPodGC": Reason.NODE_LOST,  # pod of a deleted node
}
# Kueue stops a plain pod it evicts (its pod integration) with this condition, then deletes it
# gracefully; the reason is "WorkloadEvictedDueTo<why>" ("WorkloadEvicted" in older versions).
KUEUE_STOP_CONDITION = "TerminationTarget"
KUEUE_PREEMPTED_REASON = "WorkloadEvictedDueToPreempted"
# Pod-level status.reason values the kubelet and node lifecycle set.
_POD_REASONS = {
    "Evicted": Reason.EVICTED,
    "Preempting": Reason.PREEMPTED,  # kubelet made room for a critical pod
    "NodeLost": Reason.NODE_LOST,
    "Terminated": Reason.NODE_LOST,  # graceful node shutdown
    "Shutdown": Reason.NODE_LOST,
    "NodeShutdown": Reason.NODE_LOST,
}
_START_ERRORS = {
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "CreateContainerConfigError",
    "CreateContainerError",
}
_PHASES = {p.value: p for p in WorkerPhase}


def classify(
    pod: Mapping[str, Any],
    *,
    deleted: bool = False,
    deleted_by_us: bool = False,
    previous: Status | None = None,
) -> Status:
    """A worker's status from its pod, as a JSON dict (a watch event's raw object).

    ``deleted``: the pod is gone (a DELETED event). ``previous``: what was reported before, so
    that a pod that had already ended keeps why it ended when it is deleted afterwards.
    """
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status") or {}
    labels = meta.get("labels") or {}
    phase = _PHASES.get(status.get("phase", "Pending"), WorkerPhase.RUNNING)  # "Unknown"
    exit_code, term_reason, waiting = _container_state(status)
    disruption = next(
        (
            c
            for c in status.get("conditions") or []
            if c.get("type") == "DisruptionTarget" and c.get("status") == "True"
        ),
        None,
    )
    stopped_by_kueue = next(
        (
            c
            for c in status.get("conditions") or []
            if c.get("type") == KUEUE_STOP_CONDITION and c.get("status") == "True"
        ),
        None,
    )
    terminating = deleted or bool(meta.get("deletionTimestamp"))
    reason: Reason | None = None
    message = ""
    if disruption is not None:
        reason = _DISRUPTION_REASONS.get(disruption.get("reason", ""), Reason.EVICTED)
        message = f"{disruption.get('reason')}: {disruption.get('message', '')}"
    elif stopped_by_kueue is not None:
        # Evicted by Kueue: preempted for a higher-priority workload, or stopped for another
        # reason of its own (deactivated, admission check, ...): a disruption either way.
        kueue_reason = stopped_by_kueue.get("reason", "")
        reason = Reason.PREEMPTED if kueue_reason == KUEUE_PREEMPTED_REASON else Reason.EVICTED
        message = f"Kueue {kueue_reason}: {stopped_by_kueue.get('message', '')}"
    elif status.get("reason") in _POD_REASONS:
        reason, message = _POD_REASONS[status["reason"]], status.get("message", "")
    elif status.get("reason") == "DeadlineExceeded":  # the pod's own activeDeadlineSeconds
        reason, message = Reason.ERROR, status.get("message", "DeadlineExceeded")
    elif phase == WorkerPhase.FAILED and status.get("reason") and exit_code is None:
        # The kubelet refused the pod before starting it (OutOfcpu, NodeAffinity, ...).
        reason, message = Reason.REJECTED, f"{status['reason']}: {status.get('message', '')}"
    elif previous is not None and previous.phase in (WorkerPhase.SUCCEEDED, WorkerPhase.FAILED):
        reason, message, exit_code = previous.reason, previous.message, previous.exit_code
    elif phase == WorkerPhase.SUCCEEDED:  # exit code 0: finished, whatever happened after
        reason = Reason.COMPLETED
    elif terminating:
        # A running pod that is deleted ends Failed with 137/143: not the worker's fault.
        reason = Reason.DELETED if deleted_by_us else Reason.DELETED_EXTERNALLY
        message = "deleted by the launcher" if deleted_by_us else "deleted (no reason given)"
    elif phase == WorkerPhase.FAILED and exit_code == ORPHANED_EXIT_CODE:
        reason = Reason.ORPHANED
        message = f"exit code {exit_code}: stopped itself after a snapshot, its run had no master"
    elif phase == WorkerPhase.FAILED:
        reason, message = Reason.ERROR, f"exit code {exit_code} ({term_reason or 'Error'})"
    elif phase == WorkerPhase.PENDING and waiting in _START_ERRORS:
        reason, message = Reason.START_ERROR, waiting or ""
    elif phase == WorkerPhase.PENDING:
        unscheduled = next(
            (
                c
                for c in status.get("conditions") or []
                if c.get("type") == "PodScheduled" and c.get("status") == "False"
            ),
            None,
        )
        if unscheduled is not None and unscheduled.get("reason") == "Unschedulable":
            reason, message = Reason.UNSCHEDULABLE, unscheduled.get("message", "")
    return Status(
        name=meta.get("name", ""),
        phase=WorkerPhase.DELETED if deleted else phase,
        reason=reason,
        message=message,
        exit_code=exit_code,
        worker_index=_int(labels.get(INDEX_LABEL)),
        attempt=_int(labels.get(ATTEMPT_LABEL)),
        node=spec.get("nodeName"),
    )


def _container_state(status: Mapping[str, Any]) -> tuple[int | None, str | None, str | None]:
    """(exit code, terminated reason, waiting reason) of the worker container."""
    statuses = status.get("containerStatuses") or []
    ours = next((s for s in statuses if s.get("name") == CONTAINER_NAME), None)
    state = (ours or (statuses[0] if statuses else {})).get("state") or {}
    terminated = state.get("terminated") or {}
    waiting = state.get("waiting") or {}
    return terminated.get("exitCode"), terminated.get("reason"), waiting.get("reason")


def _int(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None
