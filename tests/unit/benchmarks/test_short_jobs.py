"""``python -m benchmarks scheduling ladder``'s pure parts: its options, the jobs it plans for
each policy, what it reads from a result, and its goals."""

from __future__ import annotations

import pytest

from benchmarks.scheduling import short_jobs
from benchmarks.scheduling.cluster_jobs import JobSize
from kfp_elastic.job_spec import DEFAULT_LADDER_PRIORITY_CLASSES
from kfp_elastic.master.timeline import JobDone, WorkerLaunched

LONG, SHORT = JobSize(0.2, 10, 300), JobSize(0.5, 1, 12, 20)


def test_plans_give_only_the_ladder_policy_the_ladder_and_short_jobs_a_clock() -> None:
    args = short_jobs.parse_args([])
    elastic = short_jobs.plans("elastic", args, LONG, SHORT)
    ladder = short_jobs.plans("ladder", args, LONG, SHORT)
    for plans in (elastic, ladder):
        long, *shorts = plans
        assert (long.min_workers, long.max_workers, long.size) == (6, 8, LONG)
        assert len(shorts) == 4
        assert all((p.min_workers, p.max_workers, p.size) == (2, 2, SHORT) for p in shorts)
        # on a clock from the long job's first step, not each other's start
        assert all(p.after_first_step and p.after_first_job_only for p in shorts)
        assert [p.submit_s for p in shorts] == [60.0, 62.0, 64.0, 66.0]
    assert all(p.params == {} for p in elastic)
    levels = ",".join(DEFAULT_LADDER_PRIORITY_CLASSES)
    assert all(p.params["ladder_priority_classes"] == levels for p in ladder)
    assert all(p.params["ladder_thresholds_gpu_h"] == "0.05,0.5" for p in ladder)


def test_quick_applies_its_settings() -> None:
    args = short_jobs.parse_args(["--quick"])
    assert (args.slots, args.long_min, args.short_jobs, args.short_workers) == (4, 3, 2, 1)
    assert args.thresholds == "0.005,0.05"


@pytest.mark.parametrize(
    "argv",
    [
        ["--policies", "gang"],
        ["--long-min", "8"],  # no opportunistic workers
        ["--short-jobs", "1"],  # 2 workers fit beside a MIN of 6 on 8 slots
        ["--short-solo-s", "0"],
    ],
)
def test_options_that_cannot_make_the_experiment_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        short_jobs.parse_args(argv)


def _job(name: str, jct: float, pending: float, lost: int = 0) -> dict:
    return {"name": name, "jct_s": jct, "pending_s": pending, "steps_lost": lost}


def test_analyse_and_goals() -> None:
    elastic = {"jobs": [_job("long", 400, 5), _job("short-1", 50, 5), _job("short-2", 150, 100)]}
    ladder = {"jobs": [_job("long", 480, 5), _job("short-1", 50, 5), _job("short-2", 60, 10)]}
    policies = {}
    for name, result in (("elastic", elastic), ("ladder", ladder)):
        result["short_jobs"] = short_jobs.analyse(result)
        policies[name] = result
    assert policies["elastic"]["short_jobs"]["short_mean_jct_s"] == 100.0
    assert policies["ladder"]["short_jobs"]["short_mean_pending_s"] == 7.5
    verdict = short_jobs.goals(policies)
    assert verdict["short_mean_jct_ratio"] == 0.55 and verdict["short_mean_jct_pass"]
    assert verdict["ladder_no_step_lost_pass"] and verdict["elastic_long_steps_lost"] == 0
    ladder["jobs"][0]["steps_lost"] = 2
    ladder["short_jobs"] = short_jobs.analyse(ladder)
    assert not short_jobs.goals(policies)["ladder_no_step_lost_pass"]


def test_ladder_moves_are_read_from_the_timeline() -> None:
    events = [WorkerLaunched(t=101.0, name="w-0"), JobDone(t=150.0)]
    assert short_jobs.ladder_moves(events, 100.0) == []
