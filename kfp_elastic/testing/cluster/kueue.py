"""The test cluster's Kueue stand-in: one LocalQueue of plain pods, each pod its own workload.

What it models of Kueue's pod integration ("plain pods"), and nothing else:
- the webhook: a pod created with the label ``kueue.x-k8s.io/queue-name`` gets the scheduling
  gate ``kueue.x-k8s.io/admission`` (and the label ``kueue.x-k8s.io/managed: "true"``), so the
  scheduler leaves it alone (``FakeKubernetes.pod_mutators``);
- admission (:func:`admit`, pure): the ClusterQueue's nominal quota (``cpu``, ``memory``,
  ``nvidia.com/gpu``) is given to pending workloads highest priority first, then oldest
  (BestEffortFIFO: one that does not fit does not hold back the ones after it); priority is the
  value of the WorkloadPriorityClass the label ``kueue.x-k8s.io/priority-class`` names, else the
  pod's own priority. An admitted pod's gate is removed;
- preemption (``withinClusterQueue: LowerPriority``): a pending workload that does not fit
  evicts admitted ones of strictly lower priority, lowest priority first, then the most
  recently admitted, reprieving any it does not need; while evicted workloads are terminating
  it waits for them instead of evicting more. An evicted pod gets the condition
  ``TerminationTarget`` (reason ``WorkloadEvictedDueToPreempted``) and is deleted gracefully,
  as Kueue stops a plain pod; its quota is held until the pod is gone (Kueue without
  ``PodIntegrationFastQuotaRelease``).

Not modelled: Workload objects, cohorts and borrowing, flavors (one flavor covers every node),
pod groups, admission checks, Kueue's finalizer on its pods, StrictFIFO, ``waitForPodsReady``.
The queue is a :class:`KueueQueue` given in Python, or read from stored Kueue objects
(:meth:`KueueQueue.from_api`, once :func:`install_kueue_crds` made their kinds served).
:func:`admit` decides over a snapshot; :class:`Kueue` runs it on every change in the API server
and applies what it decided, as :class:`~kfp_elastic.testing.cluster.scheduler.Scheduler` does.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kfp_elastic.testing.api_server import FakeKubernetes
from kfp_elastic.testing.api_wire import ApiError, now_timestamp
from kfp_elastic.testing.cluster.controller import ControlLoop
from kfp_elastic.testing.cluster.scheduler import (
    RESOURCES,
    PodKey,
    Resources,
    parse_quantity,
    pod_requests,
)

log = logging.getLogger(__name__)

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_CLASS_LABEL = "kueue.x-k8s.io/priority-class"
MANAGED_LABEL = "kueue.x-k8s.io/managed"
ADMISSION_GATE = "kueue.x-k8s.io/admission"
STOP_CONDITION = "TerminationTarget"
PREEMPTED_REASON = "WorkloadEvictedDueToPreempted"

# name -> value of the WorkloadPriorityClasses manifests/kueue installs.
WORKLOAD_PRIORITY_CLASSES: dict[str, int] = {
    obj["metadata"]["name"]: obj["value"]
    for obj in yaml.safe_load_all(
        (
            Path(__file__).resolve().parents[3]
            / "manifests"
            / "kueue"
            / "workloadpriorityclasses.yaml"
        ).read_text()
    )
    if obj and obj.get("kind") == "WorkloadPriorityClass"
}

# Kueue's own CustomResourceDefinitions of the kinds manifests/kueue creates (its README says
# which release): what :func:`install_kueue_crds` installs.
KUEUE_CRDS = Path(__file__).parent / "kueue_crds"


def install_kueue_crds(api: FakeKubernetes) -> list[str]:
    """Store Kueue's CRDs (:data:`KUEUE_CRDS`) in ``api``, as installing Kueue does, so that
    its kinds are served (``kubectl apply -k manifests/kueue``); their names."""
    names = []
    for path in sorted(KUEUE_CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        names.append(api.create_object("customresourcedefinitions", "", crd)["metadata"]["name"])
    return names


@dataclass(frozen=True)
class KueueQueue:
    """A LocalQueue ``name`` (in the cluster's namespace) and its ClusterQueue: ``quota`` is the
    nominal quota of ``cpu``, ``memory`` and ``nvidia.com/gpu`` (``gpu`` for short); a
    resource not given is not covered, so a pod that requests it is never admitted.
    ``preemption``: ``LowerPriority`` or ``Never`` (``withinClusterQueue``)."""

    quota: Mapping[str, str | int | float]
    name: str = "kfp-elastic"
    priority_classes: Mapping[str, int] = field(
        default_factory=lambda: dict(WORKLOAD_PRIORITY_CLASSES)
    )
    preemption: str = "LowerPriority"

    @classmethod
    def from_api(cls, api: FakeKubernetes, namespace: str, name: str = "kfp-elastic") -> KueueQueue:
        """The queue as the Kueue objects stored in ``api`` describe it (what ``kubectl apply -k
        manifests/kueue`` created, Kueue's CRDs installed): the LocalQueue ``name`` in
        ``namespace``, its ClusterQueue's nominal quota (summed over its flavors: the stand-in
        models one flavor) and ``preemption.withinClusterQueue`` (Kueue's default ``Never``),
        and every WorkloadPriorityClass' value."""
        local = api.get_object("localqueues", namespace, name)
        queue = api.get_object("clusterqueues", "", local["spec"]["clusterQueue"])
        quota: dict[str, int] = {}
        for group in queue["spec"].get("resourceGroups") or []:
            for flavor in group.get("flavors") or []:
                for resource in flavor.get("resources") or []:
                    amount = parse_quantity(resource["nominalQuota"])
                    quota[resource["name"]] = quota.get(resource["name"], 0) + amount
        classes = api.list_objects("workloadpriorityclasses", "")["items"]
        return cls(
            quota={r: q for r, q in quota.items() if r in RESOURCES},
            name=name,
            priority_classes={c["metadata"]["name"]: c["value"] for c in classes},
            preemption=(queue["spec"].get("preemption") or {}).get("withinClusterQueue") or "Never",
        )

    def nominal(self) -> Resources:
        given = {("nvidia.com/gpu" if k == "gpu" else k): v for k, v in self.quota.items()}
        return {r: parse_quantity(given.get(r, 0)) for r in RESOURCES}


@dataclass(frozen=True)
class Workload:
    """One pod as Kueue sees it. ``order``: creation order; ``admitted_order``: when it was
    admitted (None: pending); ``evicted``: admitted, evicted, its pod still terminating."""

    key: PodKey
    priority: int
    order: int
    requests: Resources
    admitted_order: int | None = None
    evicted: bool = False

    @property
    def admitted(self) -> bool:
        return self.admitted_order is not None


@dataclass
class Admission:
    """What one pass decided: workloads to admit (ungate) and to evict."""

    admit: list[PodKey] = field(default_factory=list)
    evict: list[PodKey] = field(default_factory=list)


def _fits(need: Resources, free: Resources) -> bool:
    return all(need[r] <= free[r] + 1e-9 for r in RESOURCES)


def _add(a: Resources, b: Resources, sign: int = 1) -> Resources:
    return {r: a[r] + sign * b[r] for r in RESOURCES}


def admit(
    quota: Resources, workloads: list[Workload], preemption: str = "LowerPriority"
) -> Admission:
    """One pass of admission over every workload of the ClusterQueue (see the module)."""
    out = Admission()
    free = dict(quota)
    evicting = dict.fromkeys(RESOURCES, 0.0)
    admitted = []
    for w in workloads:
        if w.admitted:
            free = _add(free, w.requests, -1)
            if w.evicted:
                evicting = _add(evicting, w.requests)
            else:
                admitted.append(w)
    pending = sorted((w for w in workloads if not w.admitted), key=lambda w: (-w.priority, w.order))
    for w in pending:
        if _fits(w.requests, free):
            out.admit.append(w.key)
            free = _add(free, w.requests, -1)
            continue
        if preemption != "LowerPriority":
            continue
        if _fits(w.requests, _add(free, evicting)):
            free = _add(free, w.requests, -1)  # waits for the terminating ones: room kept for it
            continue
        victims = _victims(w, free, evicting, admitted)
        if victims is None:
            continue  # inadmissible for now; BestEffortFIFO goes on with the next one
        for victim in victims:
            out.evict.append(victim.key)
            admitted.remove(victim)
            evicting = _add(evicting, victim.requests)
        free = _add(free, w.requests, -1)
    return out


def _victims(
    preemptor: Workload, free: Resources, evicting: Resources, admitted: list[Workload]
) -> list[Workload] | None:
    """Kueue's candidate order within a ClusterQueue: lower priority first, then the most
    recently admitted; the fewest that make room, or None."""
    candidates = sorted(
        (w for w in admitted if w.priority < preemptor.priority),
        key=lambda w: (w.priority, -(w.admitted_order or 0)),
    )
    room = _add(free, evicting)
    chosen: list[Workload] = []
    for w in candidates:
        if _fits(preemptor.requests, room):
            break
        chosen.append(w)
        room = _add(room, w.requests)
    if not _fits(preemptor.requests, room):
        return None
    for w in reversed(list(chosen)):  # reprieve the most important ones it can do without
        without = _add(room, w.requests, -1)
        if _fits(preemptor.requests, without):
            chosen.remove(w)
            room = without
    return chosen


def gate(ns: str, pod: dict[str, Any]) -> None:
    """Kueue's pod webhook: a pod that names a queue is gated until admitted."""
    labels = pod.setdefault("metadata", {}).setdefault("labels", {})
    if not labels.get(QUEUE_LABEL):
        return
    labels[MANAGED_LABEL] = "true"
    gates = pod.setdefault("spec", {}).setdefault("schedulingGates", [])
    if not any(g.get("name") == ADMISSION_GATE for g in gates):
        gates.append({"name": ADMISSION_GATE})


def stop_pod(api: FakeKubernetes, ns: str, name: str) -> None:
    """How Kueue stops a plain pod it evicts for a higher-priority workload: the
    ``TerminationTarget`` condition, then a graceful delete."""
    condition = {
        "type": STOP_CONDITION,
        "status": "True",
        "reason": PREEMPTED_REASON,
        "message": "Preempted to accommodate a workload due to prioritization in the ClusterQueue",
        "lastTransitionTime": now_timestamp(),
    }
    api.update_status(ns, name, {"conditions": [condition]})
    api.delete(ns, name)


def _gated(pod: dict[str, Any]) -> bool:
    return any(g.get("name") == ADMISSION_GATE for g in pod["spec"].get("schedulingGates") or [])


class Kueue:
    """Gates the pods that name a queue at creation and admits those of ``queue`` (in
    ``namespace``) on every change in ``api``, until :meth:`stop`. Pods of other queues stay
    gated, as for a LocalQueue that does not exist."""

    def __init__(self, api: FakeKubernetes, queue: KueueQueue, namespace: str) -> None:
        self.api = api
        self.queue = queue
        self.namespace = namespace
        self._lock = threading.Lock()
        self._admitted: dict[str, int] = {}  # pod uid -> admission order
        # pod uid -> creation order (a Workload's creation time): first seen, oldest version
        # first. Not the resourceVersion, which every later write to the pod changes.
        self._created: dict[str, int] = {}
        self._count = itertools.count(1)
        api.pod_mutators.append(gate)
        self._loop = ControlLoop(api, "test-cluster-kueue", self.admit_once)

    def workloads(self, pods: list[dict[str, Any]]) -> tuple[list[Workload], dict[PodKey, str]]:
        """The queue's workloads among ``pods`` (finished pods release their quota), and each
        one's pod uid."""
        out, uids = [], {}
        for pod in sorted(pods, key=lambda p: int(p["metadata"].get("resourceVersion") or 0)):
            self._created.setdefault(pod["metadata"]["uid"], next(self._count))
        for pod in pods:
            meta = pod["metadata"]
            labels = meta.get("labels") or {}
            if (
                meta.get("namespace") != self.namespace
                or labels.get(QUEUE_LABEL) != self.queue.name
            ):
                continue
            if pod["status"].get("phase") in ("Succeeded", "Failed"):
                continue
            priority_class = labels.get(PRIORITY_CLASS_LABEL)
            if priority_class and priority_class not in self.queue.priority_classes:
                continue  # Kueue makes no workload for an unknown WorkloadPriorityClass
            key = (meta["namespace"], meta["name"])
            admitted = None
            if not _gated(pod):
                admitted = self._admitted.setdefault(meta["uid"], next(self._count))
            out.append(
                Workload(
                    key=key,
                    priority=(
                        self.queue.priority_classes[priority_class]
                        if priority_class
                        else int(pod["spec"].get("priority") or 0)
                    ),
                    order=self._created[meta["uid"]],
                    requests=pod_requests(pod),
                    admitted_order=admitted,
                    evicted=admitted is not None and bool(meta.get("deletionTimestamp")),
                )
            )
            uids[key] = meta["uid"]
        return out, uids

    def admit_once(self) -> Admission:
        """One pass: decide over a snapshot, then ungate and evict."""
        with self._lock:
            pods = self.api.pods_snapshot()
            by_key = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in pods}
            workloads, uids = self.workloads(pods)
            decided = admit(self.queue.nominal(), workloads, self.queue.preemption)
            for ns, name in decided.admit:
                gates = [
                    g
                    for g in by_key[(ns, name)]["spec"].get("schedulingGates") or []
                    if g.get("name") != ADMISSION_GATE
                ]
                if self._apply(
                    self.api.patch,
                    ns,
                    name,
                    {"spec": {"schedulingGates": gates or None}},
                    "application/merge-patch+json",
                ):
                    self._admitted[uids[(ns, name)]] = next(self._count)
                    log.info("event=kueue_admitted pod=%s/%s queue=%s", ns, name, self.queue.name)
            for ns, name in decided.evict:
                log.info("event=kueue_evicted pod=%s/%s queue=%s", ns, name, self.queue.name)
                self._apply(stop_pod, self.api, ns, name)
            live = {p["metadata"]["uid"] for p in pods}
            for known in (self._admitted, self._created):
                for uid in [u for u in known if u not in live]:
                    del known[uid]
            return decided

    @staticmethod
    def _apply(action: Any, *args: Any) -> bool:
        try:
            action(*args)
        except ApiError as exc:  # the pod changed or went since the snapshot: next pass
            log.info("event=kueue_skipped reason=%s", exc.status["reason"])
            return False
        return True

    def stop(self) -> None:
        self._loop.stop()
        if gate in self.api.pod_mutators:
            self.api.pod_mutators.remove(gate)
