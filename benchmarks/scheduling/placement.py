"""The simulator's use of the test cluster's scheduler: :func:`schedule` runs
``kfp_elastic.testing.cluster.scheduler.plan`` (the same decision the test cluster applies) over
the simulator's pods, given as the pod manifests ``plan`` reads.

Every simulated worker is a pod asking for one GPU, with no node selector. ``plan`` walks the
pending pods one by one over every node, which is slow for the thousands of pending workers a
busy simulated cluster holds, so :func:`schedule` hands it only the part of the snapshot that can
change its answer, leaving the answer the same:

- **pending pods**: in ``plan``'s own order (priority, then age), the first ``free`` of them
  (those that bind: any free GPU fits a one-GPU pod), and after them only pods that may preempt,
  as many as there are pods they could evict; a pod that neither fits nor may preempt is only
  marked unschedulable;
- **bound pods** are passed only where ``plan`` may choose them as victims: on each node the
  first ``k`` that an included preempting pod outranks (lowest priority first), ``k`` the number
  of included pods that must preempt (a one-GPU pod on a full node evicts one pod); the others'
  GPUs are taken off their node's capacity, which is all ``plan`` uses them for. Terminating
  pods (a victim's graceful stop) are always passed: a preemptor that they make room for waits
  for them (``plan`` nominates it) instead of evicting another pod, so each terminating pod
  counts as one more pending preemptor that can have an outcome.

``tests/unit/benchmarks/test_scheduling.py`` checks that the reduced and the full snapshot give
the same binds and victims.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kfp_elastic.testing.cluster.scheduler import plan

GPU = "nvidia.com/gpu"
NAMESPACE = "sim"
# The worker tiers (the product's PriorityClasses for guaranteed and opportunistic workers):
# both below serving workloads (priority 0); only a guaranteed worker may preempt.
GUARANTEED_PRIORITY = -3
OPPORTUNISTIC_PRIORITY = -5


@dataclass(eq=False)
class SimPod:
    """One simulated worker pod (one GPU)."""

    name: str
    priority: int
    preempting: bool
    version: int  # creation order: plan's age
    node: str | None = None
    owner: Any = None  # the simulator's job
    index: int = 0  # worker index in its job
    running: bool = False  # in its job's training world
    # a deleted pod still holding its GPU during its graceful stop: plan counts it as
    # terminating (a preemptor waits for it instead of choosing another victim)
    terminating: bool = False
    manifest: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        self.manifest = {
            "metadata": {
                "namespace": NAMESPACE,
                "name": self.name,
                "resourceVersion": str(self.version),
            },
            "spec": {
                "priority": self.priority,
                "preemptionPolicy": "PreemptLowerPriority" if self.preempting else "Never",
                "containers": [{"resources": {"limits": {GPU: "1"}}}],
            },
            "status": {"phase": "Pending"},
        }
        if self.terminating:
            self.manifest["metadata"]["deletionTimestamp"] = "stopping"

    def bind(self, node: str) -> None:
        self.node = node
        self.manifest["spec"]["nodeName"] = node


def nodes_of(gpus: int, gpus_per_node: int) -> dict[str, int]:
    """Node name -> GPUs: ``gpus`` in nodes of ``gpus_per_node`` (the last may hold fewer)."""
    if gpus < 1 or gpus_per_node < 1:
        raise ValueError(f"need >= 1 GPU and >= 1 GPU per node, got {gpus}, {gpus_per_node}")
    count = -(-gpus // gpus_per_node)
    width = len(str(count))
    return {
        f"node-{i:0{width}d}": min(gpus_per_node, gpus - i * gpus_per_node) for i in range(count)
    }


def plan_order(pods: Iterable[SimPod]) -> list[SimPod]:
    """Pending pods in the order ``plan`` considers them: highest priority, then oldest."""
    return sorted(pods, key=lambda p: (-p.priority, p.version))


def relevant_pending(ordered: Sequence[SimPod], free: int, evictable: int) -> list[SimPod]:
    """The pending pods (in ``plan_order``) whose outcome can be a bind or a preemption."""
    kept, preemptors = [], 0
    for i, pod in enumerate(ordered):
        if i < free:
            kept.append(pod)
        elif pod.preempting and preemptors < evictable:
            kept.append(pod)
            preemptors += 1
        elif preemptors >= evictable:
            break
    return kept


def candidate_victims(bound: Sequence[SimPod], preemptors: Sequence[SimPod]) -> list[SimPod]:
    """The bound pods ``preemptors`` may evict, in ``bound``'s order: on each node the first
    ``len(preemptors)`` by priority (lowest first, then ``bound``'s order, as ``plan`` sorts
    them). A node with no free GPU gives a one-GPU preemptor exactly one victim, its first such
    pod, so no node loses more than one per preemptor."""
    wanted = [p for p in preemptors if p.preempting]
    if not wanted:
        return []
    top = max(p.priority for p in wanted)
    by_node: dict[str | None, list[SimPod]] = {}
    for pod in bound:
        if pod.priority < top:
            by_node.setdefault(pod.node, []).append(pod)
    keep = {
        id(p)
        for pods in by_node.values()
        for p in sorted(pods, key=lambda p: p.priority)[: len(wanted)]
    }
    return [p for p in bound if id(p) in keep]


@dataclass
class Placement:
    binds: list[tuple[SimPod, str]]
    victims: list[SimPod]


def schedule(
    nodes: dict[str, int], bound: Sequence[SimPod], pending: Sequence[SimPod], reduce: bool = True
) -> Placement:
    """One pass of ``plan`` over ``nodes`` (name -> GPUs), the ``bound`` pods and the
    ``pending`` ones; ``reduce=False`` hands ``plan`` everything (the reference)."""
    ordered = plan_order(pending)
    capacity = dict(nodes)
    passed_bound = list(bound)
    if reduce:
        free = sum(nodes.values()) - len(bound)
        top = max((p.priority for p in ordered[free:] if p.preempting), default=None)
        terminating = [p for p in bound if p.terminating]
        evictable = [p for p in bound if top is not None and p.priority < top and not p.terminating]
        ordered = relevant_pending(ordered, free, len(evictable) + len(terminating))
        passed_bound = (
            candidate_victims([p for p in bound if not p.terminating], ordered[free:]) + terminating
        )
        passed = set(map(id, passed_bound))
        for pod in bound:
            if id(pod) not in passed:
                capacity[pod.node] -= 1
    manifests = [p.manifest for p in passed_bound] + [p.manifest for p in ordered]
    by_name = {p.name: p for p in (*passed_bound, *ordered)}
    decided = plan(
        {name: {"cpu": 0.0, "memory": 0.0, GPU: float(g)} for name, g in capacity.items()},
        manifests,
    )
    return Placement(
        [(by_name[name], node) for (_, name), node in decided.binds],
        [by_name[name] for _, name in decided.victims],
    )
