"""What the chaos executor waits for after an event: what it did to the rendezvous round.

A stand-in for ``TrainingRun`` (no cluster): a job that commits a step each time it is asked,
three workers of which two are in the round, and a cluster that may or may not form a new round
once a participant's node is removed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kfp_elastic.rendezvous.round_formation import RoundRecord
from kfp_elastic.testing.cluster.chaos import ChaosEvent, ChaosExecutor, ChaosKind
from kfp_elastic.testing.nodes import wait_for
from kfp_elastic.worker.progress import Committed

# w-2 runs on node-3 but has not joined a round yet (its pod is Running all the same).
WORKERS = {"w-0": "node-1", "w-1": "node-2", "w-2": "node-3"}
AGENTS = {"w-0": "host-10-aa", "w-1": "host-11-bb", "w-2": "host-12-cc"}


@dataclass
class FakeCluster:
    run: FakeRun

    def remove_node(self, node: str) -> None:
        self.run.removed.append(node)
        gone = {AGENTS[pod] for pod, on in WORKERS.items() if on == node}
        left = tuple(p for p in self.run.round.participants if p not in gone)
        if left != self.run.round.participants and self.run.reforms:
            self.run.round = RoundRecord(self.run.round.number + 1, left)


@dataclass
class FakeRun:
    reforms: bool = True  # whether a round without a lost participant forms
    step_now: int = 0
    round: RoundRecord = RoundRecord(3, (AGENTS["w-0"], AGENTS["w-1"]))
    removed: list[str] = field(default_factory=list)
    master: str = "elastic-train"

    def __post_init__(self) -> None:
        self.cluster = FakeCluster(self)

    def committed(self) -> Committed:
        self.step_now += 1  # the job trains while it is watched
        return Committed(step=self.step_now, epoch=0, position=0, world_size=2)

    def step(self) -> int:
        return self.step_now

    def round_record(self) -> RoundRecord:
        return self.round

    def running_workers(self) -> dict[str, str]:
        return dict(WORKERS)

    def workers(self) -> dict[str, str]:
        return dict.fromkeys(WORKERS, "Running")

    def nodes(self) -> list[str]:
        return sorted(set(WORKERS.values()) - set(self.removed))

    def round_members(self, pods: list[str], record: RoundRecord) -> tuple[str, ...]:
        agents = {AGENTS[pod] for pod in pods}
        return tuple(p for p in record.participants if p in agents)

    def wait_until(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        wait_for(predicate, timeout, 0.01, what)


def remove(pick: int, at_step: int = 5) -> ChaosEvent:
    return ChaosEvent(index=0, kind=ChaosKind.REMOVE_NODE, pick=pick, at_step=at_step)


def test_a_worker_that_had_not_joined_leaves_the_round_as_it_was() -> None:
    run = FakeRun(reforms=False)
    [outcome] = ChaosExecutor(run, {}, timeout_s=0.5).apply([remove(pick=2)])  # node-3
    assert outcome.ok and outcome.target == "node-3"
    assert outcome.members == () and not outcome.new_world
    assert "round 3 as it was" in outcome.expected
    assert run.round.number == 3


def test_a_participant_taken_waits_for_a_round_without_it() -> None:
    run = FakeRun(reforms=True)
    [outcome] = ChaosExecutor(run, {}, timeout_s=0.5).apply([remove(pick=0)])  # node-1
    assert outcome.ok and outcome.new_world and outcome.members == (AGENTS["w-0"],)
    assert run.round.number == 4


def test_a_round_without_the_participant_counts_whatever_its_number() -> None:
    # The only worker lost: the run lease expires with the round key, and the next round,
    # once a replacement joins, is numbered from 1 again.
    run = FakeRun(reforms=False)
    run.round = RoundRecord(7, (AGENTS["w-0"],))
    run.cluster.remove_node = lambda node: setattr(run, "round", RoundRecord(1, ("host-13-dd",)))
    [outcome] = ChaosExecutor(run, {}, timeout_s=0.5).apply([remove(pick=0)])
    assert outcome.ok and outcome.new_world and outcome.members == (AGENTS["w-0"],)


def test_no_new_round_is_a_failed_outcome_with_what_was_seen_and_no_later_event() -> None:
    run = FakeRun(reforms=False)
    later = ChaosEvent(index=1, kind=ChaosKind.RESTART_ETCD, pick=0, at_step=9)
    outcomes = ChaosExecutor(run, {}, timeout_s=0.3).apply([remove(pick=0), later])
    assert len(outcomes) == 1  # the job did not recover: nothing more fires
    [outcome] = outcomes
    assert not outcome.ok and outcome.new_world
    assert outcome.expected.startswith("a round after 3 without 1 participant(s) of node-1")
    assert "round 3 of 2" in outcome.seen


def test_an_event_fires_at_its_planned_step() -> None:
    run = FakeRun(reforms=False)
    [outcome] = ChaosExecutor(run, {}, timeout_s=0.5).apply([remove(pick=2, at_step=40)])
    assert outcome.step >= 40
