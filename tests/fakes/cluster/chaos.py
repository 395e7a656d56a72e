"""Seeded chaos for one job on the test cluster: which disruptions, in which order.

:func:`plan_chaos` is the pure decision (a seed gives the same plan on every machine, so a failing
seed can be replayed); the chaos test and ``benchmarks/cluster_chaos.py`` apply the plan to a
running job, one event after the job made progress since the previous one.

The plan keeps the job able to finish: the cluster never has fewer nodes than the job's minimum
(so it always ends with enough for the minimum world), and a node is never the last event's
victim. Every kind appears at least once when the plan is long enough to hold them all.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass


class ChaosKind(enum.Enum):
    PREEMPT_WORKER = "preempt_worker"  # a higher-priority pod takes one worker's node
    KILL_WORKER = "kill_worker"  # SIGKILL every process of one worker pod
    DELETE_MASTER = "delete_master"  # the master pod deleted, then created again (KFP retry)
    RESTART_ETCD = "restart_etcd"  # etcd stops and starts on the same data
    REMOVE_NODE = "remove_node"  # a node (and every pod on it) is gone at once
    ADD_CAPACITY = "add_capacity"  # a new node joins


@dataclass(frozen=True)
class ChaosEvent:
    index: int
    kind: ChaosKind
    # Which worker/node, as a choice among those present when the event fires (the executor
    # takes ``pick % len(candidates)``): the plan cannot know pod names in advance.
    pick: int


def plan_chaos(
    seed: int,
    count: int,
    nodes: int,
    min_nodes: int,
    kinds: tuple[ChaosKind, ...] = tuple(ChaosKind),
) -> list[ChaosEvent]:
    """``count`` events for a job that needs ``min_nodes`` of the cluster's ``nodes`` nodes."""
    if count < 0 or nodes < min_nodes or min_nodes < 1:
        raise ValueError(f"cannot plan {count} events for {nodes} nodes, minimum {min_nodes}")
    rng = random.Random(seed)
    wanted = list(kinds)
    rng.shuffle(wanted)
    events: list[ChaosEvent] = []
    present = nodes
    for index in range(count):
        remaining = count - index
        allowed = [kind for kind in kinds if _allowed(kind, present, min_nodes, remaining)]
        # A node cannot be the last event's victim: when kinds are forced in, it goes first.
        unseen = sorted(
            (kind for kind in wanted if kind in allowed),
            key=lambda kind: kind is not ChaosKind.REMOVE_NODE,
        )
        # The last chances to show every kind (a node removal needs a later event after it).
        if unseen and len(wanted) + (ChaosKind.REMOVE_NODE in wanted) >= remaining:
            kind = unseen[0]
        else:
            kind = rng.choice(allowed)
        if kind in wanted:
            wanted.remove(kind)
        present += {ChaosKind.REMOVE_NODE: -1, ChaosKind.ADD_CAPACITY: 1}.get(kind, 0)
        events.append(ChaosEvent(index=index, kind=kind, pick=rng.randrange(1 << 16)))
    return events


def _allowed(kind: ChaosKind, present: int, min_nodes: int, remaining: int) -> bool:
    if kind is ChaosKind.REMOVE_NODE:
        # Never below the minimum, and leave a later event to add capacity back if needed.
        return present - 1 >= min_nodes and remaining > 1
    return True
