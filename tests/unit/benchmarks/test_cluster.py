"""``python -m benchmarks cluster`` without running it: the command line, ``--dry-run``, and the
pure parts that turn step lines and timeline times into the durations and ratios it reports."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.cluster import (
    Measured,
    first_after,
    job_params,
    main,
    new_processes,
    parse_args,
    rank_of,
    step_times,
    steps_since,
    summarize,
    table,
)


def test_defaults_quick_and_bad_paths() -> None:
    args = parse_args([])
    assert (args.repeats, args.paths, args.dry_run) == (3, ("cluster", "local"), False)
    assert parse_args(["--quick"]).repeats == 1
    assert parse_args(["--paths", "local"]).paths == ("local",)
    with pytest.raises(SystemExit):
        parse_args(["--paths", "cluster,moon"])
    with pytest.raises(SystemExit):
        parse_args(["--repeats", "0"])


def test_the_job_outlasts_every_repeat() -> None:
    # ~60 steps an epoch at 3 workers: each repeat (two events + settling) fits in 15 epochs.
    assert job_params(parse_args(["--repeats", "5"]))["epochs"] >= 15 * 5
    assert job_params(parse_args([]))["max_workers"] == 3


def test_dry_run_prints_the_plan_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    assert main(["--quick", "--dry-run", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "repeats=1" in printed and "benchmarks.timed_model_def" in printed
    assert not out.exists()


STEPS = [  # what benchmarks/timed_model_def.py appends, one line per step and process
    {"t": 10.0, "step": 7, "rank": 0, "world": 3, "pid": 100},
    {"t": 10.1, "step": 7, "rank": 2, "world": 3, "pid": 300},
    {"t": 10.5, "step": 8, "rank": 0, "world": 3, "pid": 100},
    {"t": 10.6, "step": 8, "rank": 1, "world": 3, "pid": 300},  # pid 300 became rank 1
    {"t": 14.2, "step": 9, "rank": 1, "world": 2, "pid": 400},
    {"t": 14.0, "step": 9, "rank": 0, "world": 2, "pid": 500},  # lines need not be in order
    {"t": 14.3, "step": 10, "rank": 0, "world": 2, "pid": 500},
]


def test_event_to_first_step_of_the_new_world() -> None:
    assert first_after(step_times(STEPS, 2), after=10.7) == 3.3
    assert first_after(step_times(STEPS, 3), after=10.7) is None  # the old world stopped
    assert first_after(step_times(STEPS, 3), after=10.0) == 0.1  # strictly later only
    assert first_after([], after=0.0) is None


def test_settle_steps_count_rank_zero_of_that_world_after_a_time() -> None:
    assert steps_since(STEPS, 3, after=9.0) == 2
    assert steps_since(STEPS, 2, after=14.0) == 1
    assert steps_since(STEPS, 2, after=15.0) == 0


def test_victim_rank_is_its_last_rank_before_the_event() -> None:
    assert rank_of(STEPS, {300}, before=10.7) == 1
    assert rank_of(STEPS, {300}, before=10.2) == 2
    assert rank_of(STEPS, {999}, before=20.0) is None


def test_a_started_worker_is_one_that_runs_processes_now_and_ran_none_before() -> None:
    before = {"w-0": {1, 2}, "w-1": {3}, "w-2": set()}  # w-2: a Pending pod
    assert new_processes(before, {"w-0": {1, 2}, "w-1": {3}, "w-2": set()}) == set()
    assert new_processes(before, {"w-0": {1, 2}, "w-2": {7}}) == {"w-2"}
    assert new_processes(before, {"w-0": {1, 2}, "w-1": {3}, "w-3": {8}}) == {"w-3"}


def test_summary_medians_and_cluster_over_local_ratio() -> None:
    runs = [
        Measured("cluster", "shrink", 0, seconds=4.0, lost_s=2.0, round_s=0.5),
        Measured("cluster", "shrink", 1, seconds=6.0, lost_s=2.0, round_s=0.7),
        Measured("cluster", "shrink", 2, seconds=5.0, lost_s=3.0, round_s=0.6),
        Measured("local", "shrink", 0, seconds=2.5),
        Measured("local", "shrink", 1, error="TimeoutError: late"),
        Measured("cluster", "grow", 0, seconds=9.0, round_s=5.0, started_s=1.5),
        Measured("local", "grow", 0, error="RuntimeError: ended"),
    ]
    summary = summarize(runs)
    shrink = summary["shrink"]
    assert shrink["cluster"] == {
        "median_s": 5.0,
        "min_s": 4.0,
        "max_s": 6.0,
        "median_lost_s": 2.0,
        "median_round_s": 0.6,
        "median_started_s": None,
        "measured": 3,
        "runs": 3,
    }
    assert (shrink["local"]["median_s"], shrink["local"]["measured"]) == (2.5, 1)
    assert (shrink["local"]["runs"], shrink["ratio_cluster_local"]) == (2, 2.0)
    # Nothing measured on one side: no ratio, and the table says so instead of failing.
    assert summary["grow"]["local"]["median_s"] is None
    assert summary["grow"]["cluster"]["median_started_s"] == 1.5
    assert summary["grow"]["ratio_cluster_local"] is None
    lines = table(summary).splitlines()
    assert lines[1].split()[-3:] == ["5.00", "2.50", "2.00"]
    assert lines[2].split()[-3:] == ["9.00", "-", "-"]
