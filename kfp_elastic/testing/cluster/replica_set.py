"""A ReplicaSet stand-in for the test cluster: keeps ``replicas`` pods of a template running and
deletes the newest on scale-down, as a Deployment's ReplicaSet controller does.

It is a controller of the harness (admin, like the scheduler) for an ``apps/v1`` ReplicaSet
object it stores in the API server: ``ReplicaSet(api, name, template)`` creates (or takes over)
the object and runs it; the object's ``spec.replicas`` is the size, which :meth:`ReplicaSet.scale`
changes as ``kubectl scale replicaset <name> --replicas=N`` (the ``scale`` subresource) or an
autoscaler does; its ``status`` counts the pods. Its pods name it as their controller
(ownerReferences): deleting the object garbage-collects them.

:func:`reconcile` is the pure decision over the pods its selector matches; :class:`ReplicaSet`
runs it whenever anything in the API server changed (a pod failed or was deleted: it is replaced)
and at every :meth:`~ReplicaSet.scale`.

Which pods go on scale-down follows kube-controller-manager's ranking (``ActivePodsWithRanks``),
the parts that apply here: unscheduled before scheduled, Pending before Running, then the newest
first. "Newest" is the order this controller created them in (the API server's
``creationTimestamp`` has a resolution of one second).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kfp_elastic.testing.api_server import FakeKubernetes
from kfp_elastic.testing.api_wire import MERGE_PATCH, ApiError
from kfp_elastic.testing.cluster.controller import ControlLoop

log = logging.getLogger(__name__)

TERMINAL = ("Succeeded", "Failed")


@dataclass(frozen=True)
class Decision:
    """What one pass decided: how many pods to create and which to delete."""

    create: int = 0
    delete: tuple[str, ...] = ()


def is_active(pod: Mapping[str, Any]) -> bool:
    """Counts towards the replicas: not terminal and not being deleted."""
    return (pod.get("status") or {}).get("phase") not in TERMINAL and not (
        pod.get("metadata") or {}
    ).get("deletionTimestamp")


def scale_down_order(
    pods: Sequence[Mapping[str, Any]], created: Mapping[str, float]
) -> list[Mapping[str, Any]]:
    """``pods`` in the order a scale-down deletes them: unscheduled, then Pending, then the
    newest by ``created`` (name -> when this controller created it; pods it did not create
    count as the oldest)."""

    def rank(pod: Mapping[str, Any]) -> tuple[bool, bool, bool, float]:
        name = (pod.get("metadata") or {}).get("name", "")
        running = (pod.get("status") or {}).get("phase") == "Running"
        return (
            bool((pod.get("spec") or {}).get("nodeName")),
            running,
            name not in created,
            -created.get(name, 0.0),
        )

    return sorted(pods, key=rank)


def reconcile(
    replicas: int, pods: Sequence[Mapping[str, Any]], created: Mapping[str, float]
) -> Decision:
    """Create the missing pods or delete the surplus among the active ones (``is_active``)."""
    if replicas < 0:
        raise ValueError(f"replicas must be >= 0, got {replicas}")
    active = [p for p in pods if is_active(p)]
    if len(active) < replicas:
        return Decision(create=replicas - len(active))
    surplus = scale_down_order(active, created)[: len(active) - replicas]
    return Decision(delete=tuple(p["metadata"]["name"] for p in surplus))


def selects(selector: Mapping[str, str], pod: Mapping[str, Any]) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def replica_set_object(name: str, template: Mapping[str, Any], replicas: int) -> dict[str, Any]:
    """The ``apps/v1`` ReplicaSet that stands for a set of ``template``'s pods: its selector is
    the template's labels."""
    labels = dict((template.get("metadata") or {}).get("labels") or {})
    return {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": copy.deepcopy(dict(template.get("metadata") or {})),
                "spec": copy.deepcopy(dict(template.get("spec") or {})),
            },
        },
    }


def replica_set_status(pods: Sequence[Mapping[str, Any]], generation: int) -> dict[str, Any]:
    """A ReplicaSet's ``status`` from its pods, as the controller counts them: the active ones
    (``replicas``, ``fullyLabeledReplicas``), those Ready (``readyReplicas``,
    ``availableReplicas``: minReadySeconds 0), the generation it acted on."""
    active = [p for p in pods if is_active(p)]
    ready = sum(
        1
        for p in active
        if any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in (p.get("status") or {}).get("conditions") or ()
        )
    )
    return {
        "replicas": len(active),
        "fullyLabeledReplicas": len(active),
        "readyReplicas": ready,
        "availableReplicas": ready,
        "observedGeneration": generation,
    }


@dataclass
class ReplicaSet:
    """``with ReplicaSet(cluster.api, "web", template, namespace="ns") as rs: rs.scale(3)``

    ``template``: a pod's ``metadata`` (its ``labels`` are the selector; they must not be
    empty) and ``spec``. Pods are named ``<name>-<5 hex>``. ``created_at`` keeps when each pod
    was created (``time.time()``), ``deleted_at`` when it was told to go. Stop it before the
    cluster (a ``with`` inside the cluster's): a controller outliving its kubelets would replace
    pods that no node runs.
    """

    api: FakeKubernetes
    name: str
    template: Mapping[str, Any]
    replicas: int = 0
    namespace: str | None = None
    created_at: dict[str, float] = field(default_factory=dict)
    deleted_at: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.selector = dict((self.template.get("metadata") or {}).get("labels") or {})
        if not self.selector:
            raise ValueError(f"replica set {self.name!r}: the template has no labels to select")
        if self.replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {self.replicas}")
        self.ns = self.namespace or self.api.namespace
        # Re-entrant: scale() holds it from its patch through its own pass, so the control
        # loop (woken by the patch) cannot act first and leave scale() nothing to report.
        self._lock = threading.RLock()
        self._order: dict[str, float] = {}  # name -> monotonic creation time: "newest"
        obj = replica_set_object(self.name, self.template, self.replicas)
        try:
            stored = self.api.create_object("replicasets", self.ns, obj)
        except ApiError as error:
            if error.status["code"] != 409:
                raise
            stored = self.api.replace_object("replicasets", self.ns, obj)
        self.uid = stored["metadata"]["uid"]
        self._loop = ControlLoop(self.api, f"rs-{self.name}", self.reconcile_once)

    def __enter__(self) -> ReplicaSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def pods(self) -> list[dict[str, Any]]:
        """Every pod of the set (those being deleted too)."""
        return [
            p
            for p in self.api.pods_snapshot()
            if p["metadata"]["namespace"] == self.ns and selects(self.selector, p)
        ]

    def scale(self, replicas: int) -> Decision:
        """Set the desired replicas and act on it now; what was done."""
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        with self._lock:
            log.info(
                "event=replicas_scaled set=%s from=%d to=%d", self.name, self.replicas, replicas
            )
            self.api.patch_object(
                "replicasets", self.ns, self.name, {"spec": {"replicas": replicas}}, MERGE_PATCH
            )
            return self.reconcile_once()

    def reconcile_once(self) -> Decision:
        """One pass: the stored object's ``spec.replicas`` against the pods; the object's
        status updated. Nothing is done once the object is gone (its pods go with it)."""
        with self._lock:
            try:
                obj = self.api.get_object("replicasets", self.ns, self.name)
            except ApiError:
                return Decision()
            if obj["metadata"]["uid"] != self.uid:  # deleted and made again by someone else
                return Decision()
            self.replicas = int(obj["spec"].get("replicas", 1))
            decision = reconcile(self.replicas, self.pods(), self._order)
            for _ in range(decision.create):
                self._create()
            for name in decision.delete:
                self._delete(name)
            status = replica_set_status(self.pods(), obj["metadata"].get("generation", 1))
            if status != obj.get("status"):
                self.api.replace_object("replicasets", self.ns, {**obj, "status": status})
            return decision

    def _create(self) -> None:
        meta = copy.deepcopy(dict(self.template.get("metadata") or {}))
        name = f"{self.name}-{uuid.uuid4().hex[:5]}"
        meta.update(name=name, namespace=self.ns)
        meta["ownerReferences"] = [
            {
                "apiVersion": "apps/v1",
                "kind": "ReplicaSet",
                "name": self.name,
                "uid": self.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": meta,
            "spec": copy.deepcopy(dict(self.template["spec"])),
        }
        self._order[name] = time.monotonic()
        self.created_at[name] = time.time()
        try:
            self.api.create(self.ns, pod)
        except ApiError as error:  # refused (admission): logged, tried again on the next pass
            self._order.pop(name, None)
            self.created_at.pop(name, None)
            log.warning("event=replica_create_failed set=%s reason=%s", self.name, error)
            return
        log.info("event=replica_created set=%s pod=%s", self.name, name)

    def _delete(self, name: str) -> None:
        self.deleted_at[name] = time.time()
        try:
            self.api.delete(self.ns, name)  # graceful: the pod's own grace period
        except ApiError as error:  # gone meanwhile: nothing to do
            log.info("event=replica_delete_skipped set=%s pod=%s reason=%s", self.name, name, error)
            return
        log.info("event=replica_deleted set=%s pod=%s", self.name, name)

    def stop(self) -> None:
        """Stop reconciling (the pods stay)."""
        self._loop.stop()
