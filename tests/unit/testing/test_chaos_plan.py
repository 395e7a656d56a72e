"""The chaos plan: reproducible, keeps the job able to finish, covers every kind, reaches the
whole run; and the pure parts of checking a chaos run."""

from __future__ import annotations

import pytest

from kfp_elastic.rendezvous.handler import new_node_id, node_id_pid
from kfp_elastic.testing.cluster.chaos import (
    ChaosEvent,
    ChaosKind,
    ChaosOutcome,
    accuracy_check,
    choose_target,
    event_steps,
    events_check,
    plan_chaos,
    recovery_by_kind,
)

STEPS = 400  # a run's length in committed steps


def plan(seed: int, count: int, nodes: int = 3, min_nodes: int = 2, **kw: object) -> list:
    return plan_chaos(seed, count, nodes=nodes, min_nodes=min_nodes, total_steps=STEPS, **kw)


def test_a_seed_gives_the_same_plan() -> None:
    assert plan(7, 20) == plan(7, 20)
    assert plan(7, 20) != plan(8, 20)


@pytest.mark.parametrize("seed", range(50))
def test_never_fewer_nodes_than_the_minimum(seed: int) -> None:
    present = 3
    for event in plan(seed, 20):
        present += {ChaosKind.REMOVE_NODE: -1, ChaosKind.ADD_CAPACITY: 1}.get(event.kind, 0)
        assert present >= 2
    assert plan(seed, 20)[-1].kind is not ChaosKind.REMOVE_NODE


@pytest.mark.parametrize("seed", range(20))
def test_every_kind_appears_when_there_is_room(seed: int) -> None:
    kinds = {event.kind for event in plan(seed, 8)}
    assert kinds == set(ChaosKind)


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5, 7, 23])
def test_events_are_spread_over_the_whole_run(seed: int) -> None:
    events = plan(seed, 20, first_step=3)
    steps = [event.at_step for event in events]
    assert steps == sorted(steps)
    assert 3 <= steps[0] and steps[-1] <= 0.9 * STEPS
    # One in each twentieth of [3, 360]: every part of the run is disturbed, none is crowded.
    width = (360 - 3 + 1) / 20
    for i, step in enumerate(steps):
        assert 3 + int(i * width) <= step <= 3 + int((i + 1) * width), (i, steps)
    assert steps[-1] > 0.8 * STEPS and steps[0] < 0.1 * STEPS


def test_the_steps_do_not_change_which_kinds_a_seed_fires() -> None:
    short = plan_chaos(4, 10, nodes=3, min_nodes=1, total_steps=40)
    long = plan_chaos(4, 10, nodes=3, min_nodes=1, total_steps=4000)
    assert [(e.kind, e.pick) for e in short] == [(e.kind, e.pick) for e in long]
    assert short[-1].at_step <= 36 < long[-1].at_step


def test_more_events_than_steps_share_steps() -> None:
    assert event_steps(1, 5, first=2, last=3) == sorted(event_steps(1, 5, first=2, last=3))
    assert set(event_steps(1, 5, first=2, last=3)) <= {2, 3}


def test_a_run_too_short_for_its_events_is_refused() -> None:
    with pytest.raises(ValueError, match="train longer"):
        plan_chaos(1, 5, nodes=3, min_nodes=1, total_steps=10, first_step=10)


def test_five_events_are_five_different_kinds() -> None:
    only = (ChaosKind.PREEMPT_WORKER, ChaosKind.KILL_WORKER, ChaosKind.DELETE_MASTER)
    events = plan(1, 3, nodes=2, min_nodes=1, kinds=only)
    assert {event.kind for event in events} == set(only)


def test_a_cluster_below_the_minimum_is_refused() -> None:
    with pytest.raises(ValueError, match="minimum 3"):
        plan(1, 5, nodes=2, min_nodes=3)


def test_the_target_is_pick_modulo_the_sorted_candidates() -> None:
    event = ChaosEvent(index=0, kind=ChaosKind.KILL_WORKER, pick=4)
    assert choose_target(event, ["w-c", "w-a", "w-b"], "workers") == "w-b"  # 4 % 3 = 1
    with pytest.raises(AssertionError, match="no workers"):
        choose_target(event, [], "workers")


def test_a_round_participant_names_its_agents_pid() -> None:
    assert node_id_pid("host-a-b-4242-9f3c1e") == 4242  # host names may hold dashes
    assert node_id_pid(new_node_id()) is not None
    assert node_id_pid("not-an-id") is None and node_id_pid("x") is None


def outcome(index: int, kind: ChaosKind, recovery_s: float, ok: bool = True) -> ChaosOutcome:
    return ChaosOutcome(
        index=index,
        kind=kind,
        target="node-2",
        at_step=10 * index,
        step=10 * index,
        world_before=3,
        world_after=2,
        recovery_s=recovery_s,
        new_world=True,
        members=("host-12-ab12cd",),
        expected="a round after 4 without 1 participant(s) of node-2, then a commit",
        seen="step 9 world 3; round 4 of 3",
        ok=ok,
    )


def test_recovery_per_kind_counts_recovered_events_only() -> None:
    outcomes = [
        outcome(0, ChaosKind.REMOVE_NODE, 1.0),
        outcome(1, ChaosKind.REMOVE_NODE, 3.0),
        outcome(2, ChaosKind.REMOVE_NODE, 8.0),
        outcome(3, ChaosKind.RESTART_ETCD, 2.5),
        outcome(4, ChaosKind.KILL_WORKER, 180.0, ok=False),
    ]
    assert recovery_by_kind(outcomes) == {
        "remove_node": {"count": 3, "median_s": 3.0, "max_s": 8.0},
        "restart_etcd": {"count": 1, "median_s": 2.5, "max_s": 2.5},
    }


def test_the_events_check_says_what_was_expected_and_seen() -> None:
    events = plan(1, 3)
    recovered = [outcome(i, e.kind, 1.0) for i, e in enumerate(events)]
    assert events_check(events, recovered).ok

    stuck = events_check(events, [*recovered[:1], outcome(1, events[1].kind, 180.0, ok=False)])
    assert not stuck.ok
    assert "1 of 3 events" in stuck.detail
    assert "expected a round after 4 without" in stuck.detail and "seen step 9" in stuck.detail

    ended = events_check(events, recovered[:2])
    assert not ended.ok and "event 2" in ended.detail and "never fired" in ended.detail


def test_accuracy_within_one_point() -> None:
    assert accuracy_check(0.755, 0.76).ok
    assert not accuracy_check(0.74, 0.76).ok
    missing = accuracy_check(None, 0.76)
    assert not missing.ok and "not measured" in missing.detail


def test_commit_counts_name_the_steps_a_restore_took_back() -> None:
    from kfp_elastic.master.timeline import Committed
    from kfp_elastic.testing.cluster.chaos import commit_counts

    steps = [1, 2, 3, 4, 2, 3, 4, 5, 6]  # a restore from the snapshot at step 2
    commits = [Committed(step=s) for s in steps]
    assert commit_counts(commits) == {"commits": 9, "last_step": 6, "steps_taken_back": 2}
    assert commit_counts([]) == {"commits": 0, "last_step": 0, "steps_taken_back": 0}
