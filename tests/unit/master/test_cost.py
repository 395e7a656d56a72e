"""master.cost: slot-seconds per tier and their price, folded from made-up timelines (pure)."""

from __future__ import annotations

import pytest

from kfp_elastic.contract.prices import GUARANTEED, OPPORTUNISTIC, Prices
from kfp_elastic.master.cost import SlotUsage, cost_of, tier_of
from kfp_elastic.master.timeline import (
    Committed,
    Event,
    JobDone,
    MasterStarted,
    WorkerCompleted,
    WorkerLaunched,
    WorkerLost,
    WorkerRunning,
)


def timeline() -> list[Event]:
    """min 1, max 2: worker-0 runs 0..100 s; worker-1 is Pending for 10 s, runs 10..40 s and is
    preempted; its replacement is never seen Running. Commits: 10 steps in 10 s at world 2."""
    return [
        MasterStarted(t=0.0, min_workers=1, max_workers=2, nproc_per_worker=1),
        WorkerLaunched(t=0.0, name="w-0-0", index=0),
        WorkerLaunched(t=0.0, name="w-1-0", index=1),
        WorkerRunning(t=0.0, name="w-0-0", index=0),
        WorkerRunning(t=10.0, name="w-1-0", index=1),
        Committed(t=20.5, at=20.0, step=10, round=1, world_size=2),
        Committed(t=30.5, at=30.0, step=20, round=1, world_size=2),
        WorkerLost(t=40.0, name="w-1-0", index=1, cause="preempted"),
        WorkerLaunched(t=40.0, name="w-1-1", index=1),
        Committed(t=60.0, at=60.0, step=25, round=2, world_size=1),
        Committed(t=80.0, at=80.0, step=30, round=2, world_size=1),
        WorkerLost(t=90.0, name="w-1-1", index=1, cause="deleted"),  # never ran
        WorkerCompleted(t=100.0, name="w-0-0", index=0),
        JobDone(t=101.0),
    ]


def test_tiers_follow_the_priority_class_rule() -> None:
    assert [tier_of(i, 2) for i in range(3)] == [GUARANTEED, GUARANTEED, OPPORTUNISTIC]


def test_slots_count_from_running_to_the_recorded_end() -> None:
    usage = SlotUsage().add_all(timeline())
    assert usage.slot_seconds() == {GUARANTEED: 100.0, OPPORTUNISTIC: 30.0}
    assert usage.steps == 30


def test_running_workers_count_until_now_and_the_job_end_closes_them() -> None:
    events = timeline()[:6]  # both running, one commit
    usage = SlotUsage().add_all(events)
    assert usage.slot_seconds() == {GUARANTEED: 0.0, OPPORTUNISTIC: 0.0}
    assert usage.slot_seconds(at=50.0) == {GUARANTEED: 50.0, OPPORTUNISTIC: 40.0}
    usage.add(JobDone(t=60.0))  # the master stopped every worker before it wrote this
    assert usage.slot_seconds(at=1000.0) == {GUARANTEED: 60.0, OPPORTUNISTIC: 50.0}


def test_a_second_running_event_of_a_worker_keeps_the_first() -> None:
    usage = SlotUsage(min_workers=1).add_all(
        [WorkerRunning(t=5.0, name="w", index=0), WorkerRunning(t=9.0, name="w", index=0)]
    )
    usage.add(WorkerLost(t=15.0, name="w"))
    assert usage.slot_seconds()[GUARANTEED] == 10.0


def test_the_jobs_own_size_wins_over_the_timelines() -> None:
    usage = SlotUsage(min_workers=2).add_all(timeline())  # worker 1 was guaranteed then
    assert usage.slot_seconds() == {GUARANTEED: 130.0, OPPORTUNISTIC: 0.0}


def test_cost_per_tier_and_saving_against_a_fixed_size_job() -> None:
    usage = SlotUsage().add_all(timeline())
    cost = cost_of(usage, Prices(on_demand=3.6, spot=1.8))
    assert cost.cost == pytest.approx({GUARANTEED: 0.1, OPPORTUNISTIC: 0.015})
    # Throughput at max size (2 workers) measured: 10 steps per 10 s; 30 steps take 30 s of
    # 2 slots = 60 slot-seconds at on-demand.
    assert (cost.steps_per_second, cost.throughput_measured) == (1.0, True)
    assert cost.fixed_slot_seconds == 60.0
    assert cost.fixed_cost == pytest.approx(0.06)
    assert cost.saving == pytest.approx(0.06 - 0.115)  # this small job cost more


def test_throughput_never_measured_at_max_size_is_scaled_linearly() -> None:
    events = [e for e in timeline() if not (isinstance(e, Committed) and e.world_size == 2)]
    cost = cost_of(SlotUsage().add_all(events), Prices(on_demand=1.0))
    # 5 steps per 20 s at world 1, so 0.5 steps/s at world 2 at best.
    assert (cost.steps_per_second, cost.throughput_measured) == (0.5, False)
    assert cost.fixed_slot_seconds == 2 * 30 / 0.5


def test_without_prices_there_is_no_money_and_without_commits_no_comparison() -> None:
    cost = cost_of(SlotUsage().add_all(timeline()), Prices())
    assert cost.cost is None and cost.total is None and cost.saving is None
    assert cost.fixed_slot_seconds == 60.0
    early = cost_of(SlotUsage().add_all(timeline()[:5]), Prices(on_demand=1.0), at=10.0)
    assert early.fixed_cost is None and early.saving is None
    assert early.total == pytest.approx(10 / 3600)


def test_opportunistic_workers_at_on_demand_without_a_spot_price() -> None:
    prices = Prices(on_demand=2.0)
    assert (prices.of(GUARANTEED), prices.of(OPPORTUNISTIC)) == (2.0, 2.0)
    assert Prices(on_demand=2.0, spot=0.5).of(OPPORTUNISTIC) == 0.5
