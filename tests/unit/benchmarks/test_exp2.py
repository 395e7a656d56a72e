"""Serving beside training (``benchmarks/scheduling/exp2.py``): the pure parts. The HPA
stand-in's replica count, the request-rate curve, reaction windows and the utilization outside
them, and each scale event's measures from pod times and commits."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.scheduling import exp2
from benchmarks.scheduling.exp2 import (
    Phase,
    ScaleEvent,
    complement,
    desired_replicas,
    node_gpus,
    parse_curve,
    rate_at,
    reaction_windows,
    settle,
    utilization_over,
    world_samples,
)
from benchmarks.scheduling.occupancy import Sample


def test_desired_replicas_is_rate_over_capacity_rounded_up_within_bounds() -> None:
    assert desired_replicas(8, 5, 2, 6) == 2
    assert desired_replicas(28, 5, 2, 6) == 6
    assert desired_replicas(10, 5, 1, 6) == 2  # exactly full: no extra replica
    assert desired_replicas(10.5, 5, 1, 6) == 3
    assert desired_replicas(0, 5, 2, 6) == 2  # never below min
    assert desired_replicas(100, 5, 2, 6) == 6  # never above max
    for bad in ((1, 0, 1, 2), (1, 5, 3, 2), (1, 5, -1, 2)):
        with pytest.raises(ValueError):
            desired_replicas(*bad)


def test_the_curve_gives_each_phase_its_rate() -> None:
    curve = parse_curve("40:8, 60:28,70:8")
    assert curve == [Phase(40, 8), Phase(60, 28), Phase(70, 8)]
    assert [rate_at(curve, t) for t in (-1, 0, 39.9, 40, 99.9, 100, 500)] == [
        8,
        8,
        8,
        28,
        28,
        8,
        8,
    ]
    for bad in ("", "40", "40:x", "0:8", "5:-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_curve(bad)


def test_options_fill_the_presets_and_refuse_what_cannot_fit() -> None:
    full = exp2.parse_args([])
    assert (full.slots, full.serving, full.min_workers) == (8, (2, 6), 2)
    quick = exp2.parse_args(["--quick"])
    assert (quick.slots, quick.serving, quick.settle_timeout) == (3, (1, 2), 0.0)
    for bad in (["--serving", "2:8"], ["--min-workers", "3"], ["--capacity", "0"]):
        with pytest.raises(SystemExit):
            exp2.parse_args(bad)
    assert node_gpus(8) == [4, 4] and node_gpus(3) == [3] and node_gpus(6) == [4, 2]


def test_complement_leaves_out_every_window() -> None:
    assert complement([], 0, 10) == [(0, 10)]
    assert complement([(2, 3), (5, 7)], 0, 10) == [(0, 2), (3, 5), (7, 10)]
    assert complement([(2, 6), (4, 8)], 0, 10) == [(0, 2), (8, 10)]  # overlapping
    assert complement([(-5, 1), (9, 20)], 0, 10) == [(1, 9)]  # past either end
    assert complement([(0, 10)], 0, 10) == []


def test_utilization_over_intervals_by_owner() -> None:
    # 4 slots: 4 busy until t=2, 2 busy (training only) until t=4
    samples = [
        Sample(0, {"job": 2, "serving": 2}),
        Sample(2, {"job": 2}),
        Sample(4, {"job": 2, "serving": 2}),
    ]
    assert utilization_over(samples, 4, [(0, 2)]) == 1.0
    assert utilization_over(samples, 4, [(0, 2), (4, 6)], ["serving"]) == 0.5
    assert utilization_over(samples, 4, [(0, 6)]) == pytest.approx(20 / 24)
    assert utilization_over(samples, 4, []) is None


def test_settle_measures_room_the_world_change_and_the_window() -> None:
    event = ScaleEvent(t=10, replicas_from=2, replicas_to=3, training_world=5, created=["s-new"])
    times = {
        "s-new": {"created": 10.0, "bound": 11.5, "running": 11.7},
        "w-3": {"created": 1.0, "bound": 1.0, "running": 2.0, "deleting": 10.1, "gone": 11.4},
        "w-1": {"created": 1.0, "bound": 1.0, "running": 2.0, "deleting": 3.0, "gone": 4.0},
    }
    commits = [(9.0, 6), (12.5, 6), (13.0, 5), (14.0, 5)]  # the old world's last, the new one's
    settle(event, times, commits, training=["w-1", "w-3"])
    assert (event.room_s, event.running_s) == ([1.5], [1.7])
    assert event.victims == {"w-3": 1.3}  # w-1 went long before
    assert (event.serving_settled_s, event.training_first_step_s, event.settled_s) == (
        1.7,
        3.0,
        3.0,
    )
    assert event.training_pause_s == 0.5  # the old world's last commit at 12.5
    assert reaction_windows([event], end=20) == [(10, 13.0)]

    # A pod scaled away before it had room waited at least until its deletion.
    late = ScaleEvent(t=10, replicas_from=2, replicas_to=3, training_world=5, created=["s-late"])
    settle(late, {"s-late": {"created": 10.0, "deleting": 35.5}}, commits)
    assert (late.room_s, late.no_room_s) == ([], [25.5])

    down = ScaleEvent(t=30, replicas_from=3, replicas_to=2, training_world=6, deleted=["s-new"])
    settle(down, {"s-new": {"created": 10.0}}, commits)
    assert (down.serving_settled_s, down.training_first_step_s, down.settled_s) == (
        None,
        None,
        None,
    )
    assert reaction_windows([event, down], end=40) == [(10, 13.0), (30, 40)]  # open to the end


def test_world_samples_count_a_world_until_its_next_commit_or_a_pause() -> None:
    worlds = world_samples([(1.0, 6), (0.0, 6), (5.0, 2), (5.5, 2)], gap_s=2.0)
    assert [(s.t, dict(s.held)) for s in worlds] == [
        (0.0, {"world": 6}),
        (1.0, {"world": 6}),
        (3.0, {}),  # no commit for 2 s: paused
        (5.0, {"world": 2}),
        (5.5, {"world": 2}),
        (7.5, {}),
    ]
    assert utilization_over(worlds, 8, [(0, 8)], ["world"]) == pytest.approx((18 + 5) / 64)
