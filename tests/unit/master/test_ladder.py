"""master.ladder: the least-attained-service ladder, a pure decision (no I/O)."""

from __future__ import annotations

import re

import pytest

from kfp_elastic.job_spec import (
    DEFAULT_LADDER_PRIORITY_CLASSES,
    DEFAULT_LADDER_THRESHOLDS_GPU_H,
    KubernetesSettings,
)
from kfp_elastic.master.ladder import (
    GuaranteedWorker,
    LadderAction,
    LadderPolicy,
    LadderState,
    check_priority_values,
    decide_level,
    workers_to_move,
)

H = 3600.0  # GPU-seconds in a GPU-hour
# Three levels: leave level 0 at 1 GPU-hour, level 1 at 10.
POLICY = LadderPolicy(
    ("l0", "l1", "l2"), (1 * H, 10 * H), starvation_s=300.0, min_move_interval_s=100.0
)
LONG_AGO = -1000.0  # a last move the rate limit no longer holds against


def at(level: int, base: float = 0.0, moved: float | None = LONG_AGO) -> LadderState:
    return LadderState(level, moved, base)


# ------------------------------------------------------------------ demotion


@pytest.mark.parametrize(
    ("attained_h", "level"),
    [(0.0, 0), (0.99, 0), (1.0, 1), (9.99, 1), (10.0, 2), (500.0, 2)],
)
def test_the_level_due_is_the_number_of_thresholds_reached(attained_h: float, level: int) -> None:
    assert POLICY.level_for(attained_h * H) == level
    d = decide_level(POLICY, at(0), attained_h * H, 0.0, now=0.0)
    assert (d.level, d.move) == (level, level > 0)
    assert d.action == (LadderAction.DEMOTE if level else LadderAction.STAY)


def test_a_job_is_demoted_at_its_threshold_and_not_below_it() -> None:
    below = decide_level(POLICY, at(0), 1 * H - 1, 0.0, now=0.0)
    assert (below.level, below.move, below.action) == (0, False, LadderAction.STAY)
    assert below.state == at(0)  # nothing changes
    assert below.service_to_demotion_gpu_s == 1
    d = decide_level(POLICY, at(0), 1 * H, 0.0, now=5.0)
    assert (d.level, d.move, d.action) == (1, True, LadderAction.DEMOTE)
    assert d.state == LadderState(1, 5.0, 0.0)
    assert d.reason == "1.00 GPU-hours of service reached 1: level 0 -> 1"
    assert d.next_threshold_gpu_s == 10 * H and d.service_to_demotion_gpu_s == 9 * H
    assert POLICY.priority_class(d.level) == "l1"


def test_a_job_at_level_1_is_demoted_at_the_second_threshold_only() -> None:
    assert not decide_level(POLICY, at(1), 9.5 * H, 0.0, now=0.0).move
    d = decide_level(POLICY, at(1), 10 * H, 0.0, now=0.0)
    assert (d.level, d.action, d.next_threshold_gpu_s) == (2, LadderAction.DEMOTE, None)


def test_the_last_level_is_the_floor() -> None:
    d = decide_level(POLICY, at(2), 10_000 * H, 0.0, now=0.0)
    assert (d.level, d.move, d.action, d.due_level) == (2, False, LadderAction.STAY, 2)
    assert d.next_threshold_gpu_s is None and d.service_to_demotion_gpu_s is None


def test_a_job_that_passed_two_thresholds_moves_down_both_at_once() -> None:
    """E.g. after the rate limit held it back: one re-creation of its workers, not two."""
    d = decide_level(POLICY, at(0), 12 * H, 0.0, now=0.0)
    assert (d.level, d.move) == (2, True)


def test_service_counts_from_the_last_entry_into_level_0() -> None:
    state = at(0, base=50 * H)  # promoted when it had 50 GPU-hours
    assert decide_level(POLICY, state, 50.5 * H, 0.0, now=0.0).level == 0
    d = decide_level(POLICY, state, 51 * H, 0.0, now=0.0)
    assert (d.level, d.service_gpu_s) == (1, 1 * H)
    # a base above what the caller now reports (e.g. a restarted count) is no negative service
    assert decide_level(POLICY, state, 0.0, 0.0, now=0.0).service_gpu_s == 0.0


def test_a_job_below_min_workers_is_not_demoted() -> None:
    """Below MIN it trains nothing: it is waiting, not being served."""
    d = decide_level(POLICY, at(0), 5 * H, below_min_for_s=10.0, now=0.0)
    assert (d.level, d.move, d.action) == (0, False, LadderAction.STAY)
    assert d.reason == "below min_workers for 10s: waiting, not demoted"


# ------------------------------------------------------------------ starvation


def test_a_starving_job_goes_back_to_level_0_and_earns_its_way_down_again() -> None:
    d = decide_level(POLICY, at(2), 30 * H, below_min_for_s=300.0, now=1000.0)
    assert (d.level, d.move, d.action, d.due_level) == (0, True, LadderAction.PROMOTE_STARVED, 0)
    assert d.state == LadderState(0, 1000.0, 30 * H)  # its service counts from here
    assert d.service_gpu_s == 0.0 and d.next_threshold_gpu_s == 1 * H
    assert d.reason == "below min_workers for 300s (starvation_s 300): back to level 0"
    # once running again it stays at level 0 until it has had 1 GPU-hour more
    later = decide_level(POLICY, d.state, 30.9 * H, 0.0, now=2000.0)
    assert (later.level, later.move) == (0, False)
    assert decide_level(POLICY, d.state, 31 * H, 0.0, now=2000.0).level == 1


def test_no_promotion_before_starvation_s() -> None:
    d = decide_level(POLICY, at(1), 2 * H, below_min_for_s=299.9, now=0.0)
    assert (d.level, d.move, d.action) == (1, False, LadderAction.STAY)


def test_a_job_at_level_0_is_never_promoted() -> None:
    """Level 0 is the top: a job there waits below MIN as any job does (max_wait_s)."""
    d = decide_level(POLICY, at(0, base=5 * H), 5.5 * H, below_min_for_s=10_000.0, now=0.0)
    assert (d.level, d.move, d.action) == (0, False, LadderAction.STAY)
    assert d.state.service_base_gpu_s == 5 * H  # nothing reset


def test_starvation_comes_before_demotion() -> None:
    d = decide_level(POLICY, at(1), 50 * H, below_min_for_s=400.0, now=0.0)
    assert (d.level, d.action) == (0, LadderAction.PROMOTE_STARVED)


# ------------------------------------------------------------------ rate limit


def test_a_demotion_waits_for_the_interval_since_the_last_move() -> None:
    state = LadderState(0, 50.0, 0.0)  # moved (or started) at t=50; interval 100 s
    held = decide_level(POLICY, state, 2 * H, 0.0, now=149.0)
    assert (held.level, held.move, held.action) == (0, False, LadderAction.RATE_LIMITED)
    assert held.due_level == 1 and held.move_allowed_at == 150.0
    assert held.state == state  # nothing recorded: the next call decides again
    assert held.reason.endswith("held back: the last move was 99s ago (min_move_interval_s 100)")
    done = decide_level(POLICY, held.state, 2 * H, 0.0, now=150.0)
    assert (done.level, done.move, done.action) == (1, True, LadderAction.DEMOTE)
    assert done.move_allowed_at is None and done.state.last_move_at == 150.0


def test_a_new_job_is_not_moved_within_an_interval_of_its_start() -> None:
    """Its guaranteed workers were just created at level 0 (a big job earns 1 GPU-hour fast)."""
    state = LadderState.start(now=0.0)
    assert decide_level(POLICY, state, 1 * H, 0.0, now=60.0).action == LadderAction.RATE_LIMITED
    assert decide_level(POLICY, state, 1 * H, 0.0, now=100.0).action == LadderAction.DEMOTE


def test_a_job_never_moved_is_not_rate_limited() -> None:
    d = decide_level(POLICY, LadderState(), 1 * H, 0.0, now=0.0)
    assert (d.move, d.action) == (True, LadderAction.DEMOTE)


def test_the_rate_limit_holds_back_a_promotion_too() -> None:
    """Only with a state whose last move was recent although the job was below MIN all along
    (the contract's min_move_interval_s <= starvation_s keeps a consistent caller from it)."""
    state = LadderState(2, 990.0, 0.0)
    held = decide_level(POLICY, state, 20 * H, below_min_for_s=300.0, now=1000.0)
    assert (held.level, held.action, held.due_level) == (2, LadderAction.RATE_LIMITED, 0)
    assert held.move_allowed_at == 1090.0


def test_nothing_due_is_not_rate_limited() -> None:
    d = decide_level(POLICY, LadderState(1, 0.0, 0.0), 2 * H, 0.0, now=1.0)
    assert (d.action, d.move_allowed_at) == (LadderAction.STAY, None)


def test_a_whole_life_on_the_ladder() -> None:
    """An 8-GPU job: demoted twice, preempted below MIN, promoted, demoted again."""
    state, moves = LadderState.start(now=0.0), []
    # (now, attained GPU-hours, seconds below MIN)
    for now, hours, below in [
        (60, 0.5, 0),
        (450, 1.0, 0),  # 1 GPU-hour: level 1
        (4900, 11, 0),  # 10 GPU-hours: level 2
        (5000, 11.2, 0),
        (5400, 11.2, 300),  # preempted by higher levels at t=5100: starving, back to 0
        (5500, 11.9, 0),
        (5900, 12.2, 0),  # 1 GPU-hour since its promotion: level 1
    ]:
        d = decide_level(POLICY, state, hours * H, below, now=float(now))
        state = d.state
        if d.move:
            moves.append((now, d.level, d.action.value))
    assert moves == [
        (450, 1, "demote"),
        (4900, 2, "demote"),
        (5400, 0, "promote_starved"),
        (5900, 1, "demote"),
    ]


def test_a_state_off_the_ladder_is_refused() -> None:
    with pytest.raises(ValueError, match=re.escape("level 3 is not on a ladder of levels 0..2")):
        decide_level(POLICY, at(3), 0.0, 0.0, now=0.0)


# ------------------------------------------------------------------ the policy


def test_the_default_policy_is_the_contracts() -> None:
    policy = LadderPolicy()
    assert policy.priority_classes == DEFAULT_LADDER_PRIORITY_CLASSES
    assert policy.thresholds_gpu_s == tuple(h * H for h in DEFAULT_LADDER_THRESHOLDS_GPU_H)
    assert policy.last_level == 2 and policy.min_move_interval_s <= policy.starvation_s


def test_the_policy_of_a_jobs_settings() -> None:
    assert LadderPolicy.from_settings(KubernetesSettings()) is None  # no ladder
    k8s = KubernetesSettings(
        ladder_priority_classes=" a, b ",
        ladder_thresholds_gpu_h="2.5",
        ladder_starvation_s=200.0,
        ladder_min_move_interval_s=50.0,
    )
    assert LadderPolicy.from_settings(k8s) == LadderPolicy(("a", "b"), (9000.0,), 200.0, 50.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"priority_classes": ("a",), "thresholds_gpu_s": ()}, "two levels or more"),
        ({"priority_classes": ("a", "a"), "thresholds_gpu_s": (1.0,)}, "two levels or more"),
        ({"thresholds_gpu_s": (1.0,)}, "3 levels need 2 thresholds"),
        ({"thresholds_gpu_s": (2.0, 1.0)}, "positive and increasing"),
        ({"thresholds_gpu_s": (0.0, 1.0)}, "positive and increasing"),
        ({"starvation_s": 0.0}, "starvation_s > 0"),
        ({"min_move_interval_s": 301.0, "starvation_s": 300.0}, "min_move_interval_s <= "),
        ({"min_move_interval_s": -1.0}, "0 <= min_move_interval_s"),
    ],
)
def test_a_ladder_that_cannot_work_is_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        LadderPolicy(**kwargs)


# ------------------------------------------------------------------ PriorityClass values

VALUES = {"l0": -2, "l1": -3, "l2": -4, "opp": -5}


def test_values_between_opportunistic_and_serving_each_above_the_next_pass() -> None:
    check_priority_values(POLICY, VALUES, "opp")
    check_priority_values(POLICY, {**VALUES, "l0": 999}, "opp", serving_value=1000)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {**VALUES, "l1": -2},
            "level 0 ('l0', -2) must be above level 1 ('l1', -2): a job at level 0 could not "
            "preempt level 1's guaranteed workers",
        ),
        (
            {**VALUES, "l2": -2},
            "level 1 ('l1', -3) must be above level 2 ('l2', -2)",
        ),
        (
            {**VALUES, "l0": 0},
            "level 0 ('l0', 0) must be below serving (0): serving pods could not preempt its "
            "workers",
        ),
        (
            {**VALUES, "l2": -5},
            "level 2 ('l2', -5) must be above the opportunistic class ('opp', -5): its "
            "guaranteed workers could not preempt opportunistic ones",
        ),
        ({"l0": -2, "l2": -4, "opp": -5}, "no PriorityClass 'l1' in the cluster"),
        ({"l0": -2, "l1": -3, "l2": -4}, "no PriorityClass 'opp' in the cluster"),
    ],
)
def test_values_that_break_the_ladder_are_named(values: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        check_priority_values(POLICY, values, "opp")


def test_a_state_survives_its_record() -> None:
    state = LadderState(2, 123.5, 7200.0)
    assert LadderState.from_record(state.to_record(), last_level=2) == state
    assert LadderState.from_record({"level": 0, "last_move_at": None}, 2) == LadderState()
    # A ladder shortened since the record was written: its last level
    assert LadderState.from_record(state.to_record(), last_level=1).level == 1
    with pytest.raises(ValueError, match="not a ladder state"):
        LadderState.from_record({"level": "high"}, 2)


def test_the_guaranteed_workers_of_another_level_move_in_slot_order() -> None:
    workers = [
        GuaranteedWorker("w-1-0", 1, 0),
        GuaranteedWorker("w-0-3", 0, 0),
        GuaranteedWorker("w-2-0", 2, 0),  # an opportunistic slot (MIN 2): never on the ladder
        GuaranteedWorker("w-3-0", 3, None),
    ]
    assert workers_to_move(workers, 1, min_workers=2) == ("w-0-3", "w-1-0")
    assert workers_to_move(workers, 0, min_workers=2) == ()
    # a pod of an unknown level is left alone (replaced at the job's level when it ends)
    unknown = [GuaranteedWorker("w-0-0", 0, None), GuaranteedWorker("w-1-0", 1, 2)]
    assert workers_to_move(unknown, 1, min_workers=2) == ("w-1-0",)
