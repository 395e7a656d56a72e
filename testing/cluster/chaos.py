"""Seeded chaos for one job on the test cluster: which disruptions, in which order.

:func:`plan_chaos` is the pure decision (a seed gives the same plan on every machine, so a failing
seed can be replayed); :class:`ChaosExecutor` applies it to a running job
(``training_run.TrainingRun``), one event after the job made progress since the previous one,
for the chaos test (``tests/e2e/test_chaos.py``) and ``python -m benchmarks chaos``.

The plan keeps the job able to finish: the cluster never has fewer nodes than the job's minimum
(so it always ends with enough for the minimum world), and a node is never the last event's
victim. Every kind appears at least once when the plan is long enough to hold them all.
"""

from __future__ import annotations

import enum
import logging
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kfp_elastic.testing.nodes import wait_for

if TYPE_CHECKING:
    from kfp_elastic.testing.cluster.training_run import TrainingRun
    from kfp_elastic.worker.progress import Committed

log = logging.getLogger(__name__)


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


# -- applying a plan to a running job (I/O) ----------------------------------------------------


@dataclass(frozen=True)
class ChaosOutcome:
    """One applied event: what it hit, and how the job went on."""

    index: int
    kind: ChaosKind
    target: str
    step: int  # the committed step when it fired
    world_before: int
    world_after: int  # the world of the first commit after it
    # event -> the first commit of a later step; for an event that took a worker, of a step
    # committed after a new rendezvous round formed (the next world's first step)
    recovery_s: float
    new_world: bool  # whether recovery waited for the next world


class ChaosExecutor:
    """Applies a :func:`plan_chaos` plan to ``run`` (a :class:`TrainingRun` that trains).

    Each event fires once the job committed a step after the previous event's (so the job
    always moves), on the target ``pick % len(candidates)`` of the candidates sorted by name:
    running workers (preempt, kill), nodes (remove); the master pod, etcd and a new node are
    single targets. A serving pod that preempted a worker leaves once the worker is gone, and
    a master pod that is lost (deleted, or on a removed node) is run again as KFP's retry
    does. Logs ``event=chaos index=.. kind=.. target=..`` before each event.
    """

    def __init__(self, run: TrainingRun, node_capacity: dict[str, str], timeout_s: float = 120):
        self.run = run
        self.node_capacity = node_capacity  # what an added node holds
        self.timeout_s = timeout_s
        self.added = 0

    def apply(self, plan: list[ChaosEvent]) -> list[ChaosOutcome]:
        """Fire ``plan``; the outcomes of the events fired (fewer when the job ended first)."""
        outcomes: list[ChaosOutcome] = []
        for event in plan:
            before = self._progress(outcomes[-1].step + 1 if outcomes else 1, f"before {event}")
            if before is None or before.complete:
                log.info("event=chaos_stopped index=%d reason=job_complete", event.index)
                break
            round_before = self._round()
            workers = self.run.running_workers()
            fired = time.monotonic()
            target = self._fire(event)
            # A worker taken (itself or with its node) always ends the round: wait for the next.
            new_world = target in workers or target in workers.values()
            if new_world:
                self._round_after(round_before, f"after {event}")
            after = self._progress(before.step + 1, f"after {event}")
            outcome = ChaosOutcome(
                index=event.index,
                kind=event.kind,
                target=target,
                step=before.step,
                world_before=before.world_size,
                world_after=after.world_size if after else 0,
                recovery_s=round(time.monotonic() - fired, 2),
                new_world=new_world,
            )
            log.info(
                "event=chaos_recovered index=%d kind=%s target=%s step=%d world=%d->%d "
                "recovery_s=%.2f new_world=%s",
                outcome.index,
                outcome.kind.value,
                outcome.target,
                outcome.step,
                outcome.world_before,
                outcome.world_after,
                outcome.recovery_s,
                outcome.new_world,
            )
            outcomes.append(outcome)
        return outcomes

    def _round(self) -> int:
        """The workers' latest rendezvous round (waiting out an etcd restart)."""
        self._round_after(-1, "now")
        return self.run.rendezvous_round() or 0

    def _round_after(self, number: int, what: str) -> None:
        def formed() -> bool:
            now = self.run.rendezvous_round()
            return now is not None and now > number

        self.run.wait_until(formed, self.timeout_s, f"a rendezvous round after {number} {what}")

    def _progress(self, at_least: int, what: str) -> Committed | None:
        """The first commit of step ``at_least`` or later, or the job's last one if it
        completed before; a lost master pod is run again meanwhile (``wait_committed``)."""

        def moved() -> bool:
            record = self.run.committed()
            return record is not None and (record.step >= at_least or record.complete)

        self.run.wait_until(moved, self.timeout_s, f"progress to step {at_least} {what}")
        record = self.run.committed()
        return record if record is not None and record.step >= at_least else None

    def _fire(self, event: ChaosEvent) -> str:
        run, kind = self.run, event.kind
        if kind in (ChaosKind.PREEMPT_WORKER, ChaosKind.KILL_WORKER):
            target = choose_target(event, list(run.running_workers()), "running workers")
        elif kind is ChaosKind.REMOVE_NODE:
            target = choose_target(event, run.nodes(), "nodes")
        elif kind is ChaosKind.DELETE_MASTER:
            target = run.master
        elif kind is ChaosKind.RESTART_ETCD:
            target = "etcd"
        else:
            self.added += 1
            target = f"chaos-node-{self.added}"
        log.info("event=chaos index=%d kind=%s target=%s", event.index, kind.value, target)
        if kind is ChaosKind.PREEMPT_WORKER:
            # A burst of serving: it holds the node until the worker is gone, then leaves
            # (holding it longer could stall a job whose only worker it took).
            serving = run.preempt_worker(target)
            wait_for(lambda: run.phase(target) is None, self.timeout_s, 0.2, f"{target} gone")
            run.release(serving)
        elif kind is ChaosKind.KILL_WORKER:
            run.kill_pod(target)
        elif kind is ChaosKind.REMOVE_NODE:
            run.cluster.remove_node(target)
        elif kind is ChaosKind.DELETE_MASTER:
            run.delete_master()
        elif kind is ChaosKind.RESTART_ETCD:
            run.restart_etcd()
        else:
            run.cluster.add_node(target, **self.node_capacity)
        return target


def choose_target(event: ChaosEvent, candidates: list[str], what: str) -> str:
    """The event's target among ``candidates`` (pure): sorted, so a seed replays the same."""
    if not candidates:
        raise AssertionError(f"chaos event {event}: no {what} to choose from")
    return sorted(candidates)[event.pick % len(candidates)]
