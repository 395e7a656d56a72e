"""The test cluster's scheduler: binds Pending pods without scheduling gates to nodes that fit
their resource requests and whose taints they tolerate, marks the others
``PodScheduled=False``/``Unschedulable``, and preempts lower-priority pods the way
kube-scheduler does (``DisruptionTarget``, then a graceful delete the kubelet carries out),
keeping the room it freed for the pod it nominated. Gated pods keep the ``SchedulingGated``
condition the API server gave them at creation. It records kube-scheduler's events on the pods
(``Scheduled``, ``FailedScheduling``, ``Preempted``).

:func:`plan` is the pure decision over a snapshot of nodes and pods; :class:`Scheduler` runs it
whenever anything in the API server changed and applies what it decided.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kfp_elastic.contract.kubernetes_syntax import parse_quantity as kubernetes_quantity
from kfp_elastic.testing.api_server import FakeKubernetes
from kfp_elastic.testing.api_wire import ApiError
from kfp_elastic.testing.cluster.controller import ControlLoop

log = logging.getLogger(__name__)

SCHEDULER_NAME = "default-scheduler"
RESOURCES = ("cpu", "memory", "nvidia.com/gpu")
PodKey = tuple[str, str]  # (namespace, name)
Resources = dict[str, float]


def parse_quantity(text: str | int | float) -> float:
    """A Kubernetes quantity ("500m", "2", "4Gi") as a number of units (the contract's parser:
    ``kfp_elastic/contract/kubernetes_syntax.py``)."""
    return float(kubernetes_quantity(text))


def pod_requests(pod: dict[str, Any]) -> Resources:
    """What the pod asks for: the sum of its containers' requests (limits where a container
    gives no request, as the API server defaults them)."""
    total = dict.fromkeys(RESOURCES, 0.0)
    for container in pod["spec"].get("containers") or []:
        resources = container.get("resources") or {}
        asked = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        for name in RESOURCES:
            if name in asked:
                total[name] += parse_quantity(asked[name])
    return total


def node_capacity(node: dict[str, Any]) -> Resources:
    status = node.get("status") or {}
    given = status.get("allocatable") or status.get("capacity") or {}
    return {name: parse_quantity(given.get(name, 0)) for name in RESOURCES}


def _fits(need: Resources, free: Resources) -> bool:
    return all(need[r] <= free[r] + 1e-9 for r in RESOURCES)


def _minus(a: Resources, b: Resources) -> Resources:
    return {r: a[r] - b[r] for r in RESOURCES}


def _plus(a: Resources, b: Resources) -> Resources:
    return {r: a[r] + b[r] for r in RESOURCES}


def _key(pod: dict[str, Any]) -> PodKey:
    return pod["metadata"]["namespace"], pod["metadata"]["name"]


def _priority(pod: dict[str, Any]) -> int:
    return int(pod["spec"].get("priority") or 0)


@dataclass
class Plan:
    """What one scheduling pass decided."""

    binds: list[tuple[PodKey, str]] = field(default_factory=list)
    unschedulable: list[tuple[PodKey, str]] = field(default_factory=list)
    # preemptor -> the node whose victims are (or will be) terminating for it
    nominated: list[tuple[PodKey, str]] = field(default_factory=list)
    victims: list[PodKey] = field(default_factory=list)
    # pending pods with scheduling gates: never bound, nominated or counted as Unschedulable
    gated: list[PodKey] = field(default_factory=list)


def _selects(pod: dict[str, Any], node_labels: dict[str, str]) -> bool:
    """Whether the pod's ``nodeSelector`` allows a node with these labels."""
    wanted = pod["spec"].get("nodeSelector") or {}
    return all(node_labels.get(key) == value for key, value in wanted.items())


# -- taints and tolerations -----------------------------------------------------------------

# The effects that keep a pod off a node (PreferNoSchedule is only a preference).
REPELLING_EFFECTS = ("NoSchedule", "NoExecute")


def tolerates(toleration: dict[str, Any], taint: dict[str, Any]) -> bool:
    """Kubernetes' ``Toleration.ToleratesTaint``: an empty effect matches every effect, an empty
    key with ``Exists`` every key; ``Equal`` (the default operator) also compares the value."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    key = toleration.get("key") or ""
    if key and key != taint.get("key"):
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return True
    return (
        bool(key)
        and operator == "Equal"
        and (toleration.get("value") or "") == (taint.get("value") or "")
    )


def untolerated(
    pod: dict[str, Any], taints: list[dict[str, Any]], effects: tuple[str, ...] = REPELLING_EFFECTS
) -> list[dict[str, Any]]:
    """The taints with one of ``effects`` that none of the pod's tolerations tolerates."""
    tolerations = pod["spec"].get("tolerations") or []
    return [
        taint
        for taint in taints
        if taint.get("effect") in effects and not any(tolerates(t, taint) for t in tolerations)
    ]


def plan(
    nodes: dict[str, Resources],
    pods: list[dict[str, Any]],
    labels: dict[str, dict[str, str]] | None = None,
    taints: dict[str, list[dict[str, Any]]] | None = None,
) -> Plan:
    """One pass of the scheduler over ``nodes`` (name -> allocatable) and every pod.

    Pods bound to a node use its capacity until they are terminal (terminating ones too, as in
    Kubernetes). A pending pod with scheduling gates is left alone (``gated``): no binding, no
    nomination, no preemption for it, and it is not Unschedulable. A pending pod considers
    only the nodes whose ``labels`` (name -> labels) match its ``nodeSelector`` and whose
    NoSchedule/NoExecute ``taints`` (name -> taints) it tolerates, for binding and for
    preemption alike. Pending pods go highest priority first, then oldest; each binds to the
    first node (by name) it fits on. One that fits nowhere is Unschedulable and, unless its
    ``preemptionPolicy`` is ``Never``, preempts: if pods already terminating would make room it
    waits for them, otherwise it picks the node needing the fewest victims (then the lowest
    highest-victim priority) among pods of lower priority, lowest priority first, and reprieves
    any victim it can do without.

    A nominated pod's requests count as used on its node for every pod considered after it
    (all of them of lower or equal priority), as kube-scheduler's filter does
    (``addNominatedPods``): room freed for a preemptor is not given to a lower-priority pod
    meanwhile, which would be preempted again once the preemptor needs it.
    """
    out = Plan()
    free = dict(nodes)
    terminating: dict[str, Resources] = {n: dict.fromkeys(RESOURCES, 0.0) for n in nodes}
    running: dict[str, list[dict[str, Any]]] = {n: [] for n in nodes}
    pending = []
    for pod in pods:
        node = pod["spec"].get("nodeName")
        if pod["status"].get("phase") in ("Succeeded", "Failed"):
            continue
        if not node:
            if pod["spec"].get("schedulingGates"):
                out.gated.append(_key(pod))  # kube-scheduler's PreEnqueue keeps it out of its queue
            elif not pod["metadata"].get("deletionTimestamp"):
                pending.append(pod)
            continue
        if node not in free:
            continue  # its node is gone; the node lifecycle deals with it
        need = pod_requests(pod)
        free[node] = _minus(free[node], need)
        if pod["metadata"].get("deletionTimestamp"):
            terminating[node] = _plus(terminating[node], need)
        else:
            running[node].append(pod)
    pending.sort(key=lambda p: (-_priority(p), int(p["metadata"].get("resourceVersion") or 0)))
    for pod in pending:
        need = pod_requests(pod)
        allowed = [
            n
            for n in sorted(free)
            if _selects(pod, (labels or {}).get(n, {}))
            and not untolerated(pod, (taints or {}).get(n, []))
        ]
        node = next((n for n in allowed if _fits(need, free[n])), None)
        if node is not None:
            out.binds.append((_key(pod), node))
            free[node] = _minus(free[node], need)
            continue
        out.unschedulable.append((_key(pod), _unschedulable_message(len(nodes), len(allowed))))
        if pod["spec"].get("preemptionPolicy") == "Never":
            continue
        # The node it was nominated to before, if that still works: a nomination is kept.
        earlier = pod["status"].get("nominatedNodeName")
        order = sorted(allowed, key=lambda n: n != earlier)
        waiting = next((n for n in order if _fits(need, _plus(free[n], terminating[n]))), None)
        if waiting is not None:
            out.nominated.append((_key(pod), waiting))
            free[waiting] = _minus(free[waiting], need)  # reserved: addNominatedPods
            continue
        best: tuple[tuple[int, int], str, list[dict[str, Any]]] | None = None
        for node in allowed:
            victims = _victims(need, free[node], terminating[node], running[node], _priority(pod))
            if victims is None:
                continue
            rank = (len(victims), max(_priority(v) for v in victims))
            if best is None or rank < best[0]:
                best = (rank, node, victims)
        if best is None:
            continue
        _, node, victims = best
        out.nominated.append((_key(pod), node))
        for victim in victims:
            out.victims.append(_key(victim))
            running[node].remove(victim)
            terminating[node] = _plus(terminating[node], pod_requests(victim))
        free[node] = _minus(free[node], need)  # reserved: addNominatedPods
    return out


def _unschedulable_message(nodes: int, allowed: int) -> str:
    if allowed < nodes:  # kube-scheduler's wording names each reason; one summary suffices
        return (
            f"0/{nodes} nodes are available: {nodes - allowed} node(s) had untolerated taints "
            "or did not match the Pod's node affinity/selector, the others: insufficient "
            "resources."
        )
    return f"0/{nodes} nodes are available: insufficient resources."


def _victims(
    need: Resources,
    free: Resources,
    terminating: Resources,
    running: list[dict[str, Any]],
    priority: int,
) -> list[dict[str, Any]] | None:
    """The fewest lower-priority pods whose removal lets ``need`` fit, or None."""
    room = _plus(free, terminating)
    candidates = sorted((p for p in running if _priority(p) < priority), key=_priority)
    chosen = []
    for pod in candidates:
        if _fits(need, room):
            break
        chosen.append(pod)
        room = _plus(room, pod_requests(pod))
    if not _fits(need, room):
        return None
    for pod in sorted(chosen, key=_priority, reverse=True):  # reprieve the most important
        without = _minus(room, pod_requests(pod))
        if _fits(need, without):
            chosen.remove(pod)
            room = without
    return chosen


class Scheduler:
    """Runs :func:`plan` on every change in ``api`` and applies it, until :meth:`stop`."""

    def __init__(self, api: FakeKubernetes) -> None:
        self.api = api
        self._loop = ControlLoop(api, "test-cluster-scheduler", self.schedule_once)

    def schedule_once(self) -> None:
        schedulable = [
            node
            for node in self.api.list_objects("nodes", "")["items"]
            if not node.get("spec", {}).get("unschedulable")
        ]
        nodes = {node["metadata"]["name"]: node_capacity(node) for node in schedulable}
        labels = {
            node["metadata"]["name"]: node["metadata"].get("labels") or {} for node in schedulable
        }
        taints = {
            node["metadata"]["name"]: (node.get("spec") or {}).get("taints") or []
            for node in schedulable
        }
        pods = self.api.pods_snapshot()
        by_key = {_key(p): p for p in pods}
        decided = plan(nodes, pods, labels, taints)
        for (ns, name), node in decided.binds:
            if self._apply(self.api.bind, ns, name, node):
                self._event(
                    by_key[(ns, name)], "Scheduled", f"Successfully assigned {ns}/{name} to {node}"
                )
            log.info("event=pod_bound pod=%s/%s node=%s", ns, name, node)
        nominated = dict(decided.nominated)
        for (ns, name), message in decided.unschedulable:
            status = by_key[(ns, name)]["status"]
            condition = next(
                (c for c in status.get("conditions") or [] if c["type"] == "PodScheduled"), {}
            )
            node = nominated.get((ns, name))
            if condition.get("reason") == "Unschedulable" and status.get("nominatedNodeName") == (
                node
            ):
                continue  # nothing new to say: no write, so no change to wake anyone
            if self._apply(self.api.mark_unschedulable, ns, name, message, node):
                self._event(by_key[(ns, name)], "FailedScheduling", message, "Warning")
            log.info("event=pod_unschedulable pod=%s/%s nominated=%s", ns, name, node)
        for ns, name in decided.victims:
            log.info("event=pod_preempted pod=%s/%s", ns, name)
            victim = by_key[(ns, name)]
            where = victim["spec"].get("nodeName", "")
            preemptor = next(
                (by_key[key] for key, node in decided.nominated if node == where), None
            )
            if self._apply(self.api.preempt, name, ns=ns):
                uid = "" if preemptor is None else preemptor["metadata"]["uid"]
                self._event(victim, "Preempted", f"Preempted by pod {uid} on node {where}")

    def _event(
        self, pod: dict[str, Any], reason: str, message: str, event_type: str = "Normal"
    ) -> None:
        """kube-scheduler's event about ``pod`` (``kubectl describe pod`` shows it)."""
        self.api.record_event(
            pod,  # as stored: its kind and apiVersion make the reference
            reason,
            message,
            component=SCHEDULER_NAME,
            event_type=event_type,
        )

    @staticmethod
    def _apply(action: Any, *args: Any, **kwargs: Any) -> bool:
        """Whether the write went through."""
        try:
            action(*args, **kwargs)
        except ApiError as exc:  # the pod changed or went since the snapshot: next pass
            log.info("event=schedule_skipped reason=%s", exc.status["reason"])
            return False
        return True

    def stop(self) -> None:
        self._loop.stop()
