"""The simulator's ladder policies (``elastic-ladder``: the product's ``decide_level`` per
job; ``tiresias``: gang with the same levels, whole-job preemption) and the steady-load
subcommand's arrivals and window."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from benchmarks.scheduling import steady
from benchmarks.scheduling.simulator import Costs, Simulation
from benchmarks.scheduling.trace import Job, TraceJob
from kfp_elastic.job_spec import DEFAULT_LADDER_PRIORITY_CLASSES
from kfp_elastic.master.ladder import LadderPolicy

# Leave level 0 at 1000 GPU-seconds, level 1 at 20000; moves at least 60 s apart.
LADDER = LadderPolicy(DEFAULT_LADDER_PRIORITY_CLASSES, (1000.0, 20000.0), 3000.0, 60.0)
# A long job of 8 GPUs holds the cluster; four short jobs of 2 arrive once it was demoted.
LONG_AND_SHORT = [Job("long", 0, 8, 8 * 2000)] + [
    Job(f"s{i}", 600 + 5 * i, 2, 2 * 100) for i in range(4)
]


NO_STOP = Costs()


def run(policy: str, min_workers: int | str = 2, costs: Costs = NO_STOP) -> Simulation:
    sim = Simulation(LONG_AND_SHORT, 8, policy, costs, min_workers=min_workers, ladder=LADDER)
    sim.result = sim.run()  # type: ignore[attr-defined]
    return sim


def starts(sim: Simulation) -> dict[str, float]:
    return {name: first for name, (_, first, _) in sim.job_times.items()}


def test_short_jobs_preempt_a_demoted_long_jobs_guaranteed_workers() -> None:
    elastic, ladder = run("elastic"), run("elastic-ladder")
    # Elastic FIFO: the long job's 4 guaranteed workers stay; the fourth short job waits for
    # a short one to end. With the ladder the long job is at level 1: the fourth preempts it.
    assert starts(elastic)["s3"] > 700
    assert starts(ladder)["s3"] < 630
    assert ladder.result.ladder_moves >= 1 and elastic.result.ladder_moves == 0
    assert ladder.result.avg_jct_s < elastic.result.avg_jct_s
    assert ladder.jobs[0].ladder.level == 1  # 16000 GPU-seconds: never level 2


def test_tiresias_preempts_the_long_job_whole_and_charges_its_restart() -> None:
    gang, tiresias = run("gang"), run("tiresias")
    assert starts(gang)["s0"] > 2000  # FIFO: behind the long job
    assert all(starts(tiresias)[f"s{i}"] < 630 for i in range(4))
    assert tiresias.result.preemptions == 1  # the long job, whole
    long_end = tiresias.job_times["long"][2]
    cheaper = run("tiresias", costs=Costs(restart_s=0.0)).job_times["long"][2]
    assert long_end - cheaper == pytest.approx(Costs().restart_s, abs=1.0)


def test_a_victims_graceful_stop_holds_its_gpu() -> None:
    free = starts(run("elastic"))
    stopping = starts(run("elastic", costs=Costs(stop_s=3.0)))
    # The short jobs' guaranteed workers bind once the long job's victims have stopped
    assert stopping["s0"] == pytest.approx(free["s0"] + 3.0)


def test_a_preemptor_waits_for_its_victims_stop_instead_of_taking_more() -> None:
    # Each short job's workers need exactly the GPUs of the victims chosen for them: while the
    # victims stop, the preemptors wait for those GPUs and evict nothing else.
    free, stopping = run("elastic"), run("elastic", costs=Costs(stop_s=3.0))
    assert stopping.result.preemptions == free.result.preemptions == 6


def test_a_demotion_held_back_by_the_rate_limit_is_made_when_it_ends() -> None:
    # The long job's service passes 1000 GPU-seconds at about 130 s; with moves at least
    # 700 s apart (counted from its start) it stays at level 0 until 700 s, so the fourth
    # short job (at 615 s) preempts it only then.
    slow = LadderPolicy(DEFAULT_LADDER_PRIORITY_CLASSES, (1000.0, 20000.0), 3000.0, 700.0)
    sim = Simulation(LONG_AND_SHORT, 8, "elastic-ladder", NO_STOP, min_workers=2, ladder=slow)
    sim.run()
    assert 700 <= starts(sim)["s3"] < 720
    assert sim.jobs[0].moves == 1


def starving(starvation_s: float) -> Simulation:
    """A (8 GPUs, MIN 8) passes both thresholds (1000 and 3000 GPU-seconds: level 2 at about
    385 s); B (the same size, level 0) arrives at 400 s and takes every GPU, is demoted to
    level 1 at about 530 s, and reaches level 2 only at about 785 s."""
    ladder = LadderPolicy(DEFAULT_LADDER_PRIORITY_CLASSES, (1000.0, 3000.0), starvation_s, 60.0)
    jobs = [Job("a", 0, 8, 8 * 2000), Job("b", 400, 8, 8 * 2000)]
    sim = Simulation(jobs, 8, "elastic-ladder", NO_STOP, min_workers=8, ladder=ladder)
    sim.run()
    return sim


def test_a_starving_job_goes_back_to_level_0() -> None:
    promoted, starved = starving(300.0), starving(1e5)
    # A, below its MIN from 400 s, goes back to level 0 after 300 s and preempts B (level 1)
    a_moves = promoted.jobs[0].moved
    assert [level for _, level in a_moves[:3]] == [1, 2, 0]
    assert a_moves[2][0] == pytest.approx(700.0, abs=1.0)
    # without the promotion A waits at level 2 until B's own demotion to level 2 re-creates
    # B's workers behind A's older pending ones
    assert [level for _, level in starved.jobs[0].moved] == [1, 2]
    assert starved.preemptions == 8  # B takes A's 8 GPUs once
    assert promoted.preemptions > 8  # and A's promoted workers take them back


def test_arrivals_offer_the_load_asked() -> None:
    pool = [TraceJob(f"t{i}", 0, 60.0 * (1 + i % 5), 1 + i % 3) for i in range(50)]
    mean = steady.mean_gpu_seconds(pool)
    jobs = steady.arrivals(pool, 16, 0.8, 200, seed=3)
    offered = sum(j.work for j in jobs) / (200 * 3600 * 16)
    assert offered == pytest.approx(0.8, rel=0.1)
    gaps = [b.submit_s - a.submit_s for a, b in zip(jobs, jobs[1:], strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(mean / (0.8 * 16), rel=0.1)
    assert steady.arrivals(pool, 16, 0.8, 200, seed=3) == jobs  # the seed decides


def test_only_the_windows_jobs_and_time_are_measured() -> None:
    jobs = [Job("before", 0, 4, 4 * 100), Job("in", 50, 4, 4 * 100), Job("after", 500, 4, 400)]
    result = steady.run_one(jobs, 4, "elastic", (40.0, 200.0), Costs(), "half")
    assert result["jobs"] == 1
    assert result["mean_jct_s"] > 100  # "in" waits for "before"
    # utilization over the window's 160 s only
    assert 0 < result["utilization"] <= 1


def test_the_summary_holds_the_ratios_and_goals() -> None:
    def one(jct: float) -> dict:
        return {
            "mean_jct_s": jct,
            "p99_jct_s": jct * 3,
            "mean_pending_s": jct / 10,
            "ideal_mean_jct_s": 40.0,
            "utilization": 0.9,
            "idle_while_waiting": 0.0,
        }

    runs = [
        {"by_policy": {"gang": one(100), "tiresias": one(60), "elastic-ladder": one(50)}}
        for _ in range(3)
    ]
    summary = steady.summarize(runs, ["gang", "tiresias", "elastic-ladder"])
    ratios = summary["ratios"]["elastic-ladder"]
    assert ratios["jct_vs_gang"]["mean"] == 0.5
    assert ratios["jct_vs_tiresias"]["mean"] == pytest.approx(0.8333, abs=1e-3)
    assert summary["goals"]["jct_vs_gang_le_0.6"] and summary["goals"]["jct_vs_tiresias_le_0.85"]
    assert not summary["goals"]["pending_vs_gang_le_0.2"]
    assert summary["ideal_jct_vs_gang"]["mean"] == 0.4  # no policy gets below 40 / 100


def test_quick_run_writes_every_configuration(tmp_path: Path) -> None:
    out = tmp_path / "steady.json"
    assert steady.main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (config,) = result["configs"]
    assert (config["gpus"], config["load"]) == (16, 1.0)
    assert set(config["policies"]) == {"gang", "tiresias", "elastic", "elastic-ladder"}
    assert {"jct_vs_gang", "jct_vs_tiresias", "pending_vs_gang", "p99_vs_gang"} == set(
        config["ratios"]["elastic-ladder"]
    )
    assert len(config["runs"]) == 2 and result["costs"]["stop_s"] > 0


def test_ladders_compared_in_one_run_each_get_their_configurations(tmp_path: Path) -> None:
    out = tmp_path / "steady.json"
    argv = ["--quick", "--out", str(out), "--policies", "gang,elastic-ladder"]
    assert steady.main([*argv, "--thresholds", "1,10", "--thresholds", "0.5"]) == 0
    result = json.loads(out.read_text())
    assert [c["thresholds_gpu_h"] for c in result["configs"]] == [[1.0, 10.0], [0.5]]
    assert set(result["summary"]) == {"16gpu_load1_ladder1,10", "16gpu_load1_ladder0.5"}


def test_a_ladder_of_thresholds_is_the_products_rule_with_them() -> None:
    two = steady.ladder_of((0.5,), 600.0)
    assert two.priority_classes == DEFAULT_LADDER_PRIORITY_CLASSES[:2]
    assert (two.thresholds_gpu_s, two.starvation_s) == ((1800.0,), 600.0)
    four = steady.ladder_of((0.1, 1, 10), 60.0)
    assert len(four.priority_classes) == 4 and four.min_move_interval_s == 60.0
    with pytest.raises(SystemExit):  # refused as the product refuses it
        steady.parse_args(["--thresholds", "10,1"])
