"""The spread of the simulated ratios over seeds (benchmarks/scheduling/seeds.py), pure."""

from __future__ import annotations

import pytest

from benchmarks.scheduling import simulate
from benchmarks.scheduling.seeds import describe, mean_runs, parse_seeds, spread, t95


def run(seed: int, gang_jct: float, elastic_jct: float, gang_pending: float, pending: float):
    return {
        "gpus": 64,
        "jobs": 512,
        "jobs_per_gpu": 8.0,
        "seed": seed,
        "policies": {
            "gang": {"avg_jct_s": gang_jct, "mean_pending_s": gang_pending},
            "elastic": {"avg_jct_s": elastic_jct, "mean_pending_s": pending},
        },
    }


def test_seeds_are_ranges_or_lists_each_once() -> None:
    assert parse_seeds("1-3,7,2") == [1, 2, 3, 7]
    assert parse_seeds("5") == [5]
    for bad in ("", "a-b", "3-1"):
        with pytest.raises(ValueError):
            parse_seeds(bad)
    with pytest.raises(SystemExit):
        simulate.parse_args(["--seeds", "3-1"])


def test_describe_gives_a_students_t_interval_of_the_mean() -> None:
    d = describe([0.5, 0.6, 0.7])
    assert (d["n"], d["mean"], d["sd"], d["min"], d["max"]) == (3, 0.6, 0.1, 0.5, 0.7)
    half = t95(3) * 0.1 / 3**0.5  # 4.303 for 2 degrees of freedom
    assert d["ci95"] == [round(0.6 - half, 4), round(0.6 + half, 4)]
    assert describe([0.4])["ci95"] is None and t95(100) == 1.96


def test_spread_counts_the_seeds_meeting_each_goal_and_skips_a_queue_free_gang() -> None:
    runs = [
        run(1, 10.0, 5.0, 4.0, 0.4),  # 0.5 and 0.1: both goals
        run(2, 10.0, 7.0, 4.0, 2.0),  # 0.7 and 0.5: neither
        run(3, 10.0, 6.6, 0.0, 0.0),  # gang had no queue: no pending ratio
    ]
    (row,) = spread(runs)
    assert row["seeds"] == [1, 2, 3]
    assert row["jct_ratio"]["n"] == 3 and row["jct_ratio_goal_met"] == 1
    assert row["pending_ratio"]["n"] == 2 and row["pending_ratio_goal_met"] == 1
    (mean,) = mean_runs(runs)
    assert mean["policies"]["elastic"]["avg_jct_s"] == pytest.approx(6.2)
