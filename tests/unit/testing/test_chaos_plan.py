"""The chaos plan: reproducible, keeps the job able to finish, covers every kind."""

from __future__ import annotations

import pytest

from kfp_elastic.testing.cluster.chaos import ChaosEvent, ChaosKind, choose_target, plan_chaos


def test_a_seed_gives_the_same_plan() -> None:
    assert plan_chaos(7, 20, nodes=3, min_nodes=2) == plan_chaos(7, 20, nodes=3, min_nodes=2)
    assert plan_chaos(7, 20, nodes=3, min_nodes=2) != plan_chaos(8, 20, nodes=3, min_nodes=2)


@pytest.mark.parametrize("seed", range(50))
def test_never_fewer_nodes_than_the_minimum(seed: int) -> None:
    present = 3
    for event in plan_chaos(seed, 20, nodes=3, min_nodes=2):
        present += {ChaosKind.REMOVE_NODE: -1, ChaosKind.ADD_CAPACITY: 1}.get(event.kind, 0)
        assert present >= 2
    assert plan_chaos(seed, 20, nodes=3, min_nodes=2)[-1].kind is not ChaosKind.REMOVE_NODE


@pytest.mark.parametrize("seed", range(20))
def test_every_kind_appears_when_there_is_room(seed: int) -> None:
    kinds = {event.kind for event in plan_chaos(seed, 8, nodes=3, min_nodes=2)}
    assert kinds == set(ChaosKind)


def test_five_events_are_five_different_kinds() -> None:
    only = (ChaosKind.PREEMPT_WORKER, ChaosKind.KILL_WORKER, ChaosKind.DELETE_MASTER)
    events = plan_chaos(1, 3, nodes=2, min_nodes=1, kinds=only)
    assert {event.kind for event in events} == set(only)


def test_a_cluster_below_the_minimum_is_refused() -> None:
    with pytest.raises(ValueError, match="minimum 3"):
        plan_chaos(1, 5, nodes=2, min_nodes=3)


def test_the_target_is_pick_modulo_the_sorted_candidates() -> None:
    event = ChaosEvent(index=0, kind=ChaosKind.KILL_WORKER, pick=4)
    assert choose_target(event, ["w-c", "w-a", "w-b"], "workers") == "w-b"  # 4 % 3 = 1
    with pytest.raises(AssertionError, match="no workers"):
        choose_target(event, [], "workers")
