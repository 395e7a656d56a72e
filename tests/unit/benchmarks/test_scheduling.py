"""``python -m benchmarks scheduling``: the throughput curves, the trace sampler, the scheduler
adapter, the simulator on workloads whose answer is known by hand, and a ``--quick`` run."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks import suite_module
from benchmarks.scheduling import throughput, workload
from benchmarks.scheduling.placement import (
    GUARANTEED_PRIORITY,
    OPPORTUNISTIC_PRIORITY,
    SimPod,
    nodes_of,
    schedule,
)
from benchmarks.scheduling.simulator import (
    Costs,
    Simulation,
    min_workers_of,
    percentile,
    simulate,
)
from benchmarks.scheduling.trace import DEFAULT_TRACE, Job, read_trace, sample, seconds_of_day
from tests.helpers import REPO_ROOT

# --------------------------------------------------------------------------- throughput


def row(nodes: int, replicas: int, batch: int, step: float, sync: float) -> dict[str, str]:
    return {
        "num_nodes": str(nodes),
        "num_replicas": str(replicas),
        "local_bsz": str(batch),
        "step_time": str(step),
        "sync_time": str(sync),
    }


def test_the_curve_rule_on_hand_made_measurements() -> None:
    curve = throughput.curve_from_rows(
        "toy",
        [
            # compute = step - sync: the smallest over placements per batch
            row(2, 6, 10, 1.5, 0.5),  # compute 1.0
            row(6, 6, 10, 1.9, 0.6),  # compute 1.3 (a worse placement)
            row(2, 6, 20, 2.5, 0.5),  # compute 2.0
            row(2, 6, 30, 3.5, 0.7),  # 6 replicas, fewest nodes: syncs 0.5, 0.5, 0.7 -> 0.5
            row(4, 12, 10, 2.0, 0.9),  # 12 replicas, fewest nodes 4: syncs 0.9, 1.1 -> 1.0
            row(4, 12, 20, 3.1, 1.1),
            row(8, 12, 10, 9.0, 5.0),  # not the fewest nodes: ignored for sync
        ],
    )
    assert curve.batches == (10.0, 20.0, 30.0)
    assert curve.compute(10) == pytest.approx(1.0)
    assert curve.compute(15) == pytest.approx(1.5)  # linear between batches
    assert curve.compute(5) == pytest.approx(1.0)  # the smallest batch's time below it
    assert curve.compute(60) == pytest.approx(2.8 * 2)  # proportional above the largest
    assert curve.replicas == (1, 6, 12)
    assert curve.sync_s == pytest.approx((0.0, 0.5, 1.0))
    assert curve.sync(1) == 0.0
    assert curve.sync(2) == pytest.approx(0.1)  # 0 at 1 GPU .. the 6-GPU value
    assert curve.sync(9) == pytest.approx(0.75)
    assert curve.sync(100) == pytest.approx(1.0)  # the largest count's value above it
    assert curve.reference_batch == 20.0


def test_step_seconds_of_every_measured_job_type() -> None:
    for job_type in throughput.JOB_TYPES:
        curve = throughput.curve(job_type)
        batch = 8 * curve.reference_batch
        # one GPU: all compute, nothing to all-reduce
        assert throughput.step_seconds(job_type, 1, batch) == pytest.approx(curve.compute(batch))
        assert throughput.step_seconds(job_type, 8, batch) == pytest.approx(
            curve.compute(batch / 8) + curve.sync(8)
        )
        assert throughput.speedup(job_type, 1, 1, batch) == pytest.approx(1.0)
    # the measured curves: an image model scales, the tiny recommender does not
    imagenet = 64 * throughput.curve("imagenet").reference_batch
    assert throughput.speedup("imagenet", 16, 1, imagenet) > 10
    assert throughput.speedup("ncf", 16, 1, 64 * throughput.curve("ncf").reference_batch) < 2


def test_bad_curve_questions_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown job type 'gpt'"):
        throughput.step_seconds("gpt", 1, 8)
    with pytest.raises(ValueError, match="gpus must be >= 1"):
        throughput.step_seconds("bert", 0, 8)
    with pytest.raises(ValueError, match="global batch"):
        throughput.step_seconds("bert", 2, 0)


# --------------------------------------------------------------------------- trace sampling

HEADER = "timestamp,duration,num_gpus,gpu_time,cluster\n"


def write_trace(path: Path, rows: list[tuple[str, float, int]]) -> Path:
    lines = [f"{when},{duration},{gpus},{duration * gpus},c1\n" for when, duration, gpus in rows]
    path.write_text(HEADER + "".join(lines))
    return path


def test_sampling_keeps_the_window_and_the_filters(tmp_path: Path) -> None:
    trace = read_trace(
        write_trace(
            tmp_path / "t.csv",
            [
                ("2017-10-01 08:00:00", 100, 1),  # in, offset 0
                ("2017-10-02 09:30:00", 200, 2),  # in (another day), offset 5400
                ("2017-10-03 15:59:59", 300, 4),  # in, last second of the window
                ("2017-10-01 16:00:00", 400, 1),  # out: the window ends at 16:00
                ("2017-10-01 07:59:59", 400, 1),  # out: before it
                ("2017-10-01 10:00:00", 59, 1),  # out: shorter than a minute
                ("2017-10-01 10:00:00", 1000 * 3600 / 8, 8),  # out: 1000 GPU-hours
                ("2017-10-01 11:00:00", 500, 128),  # in, cut to the cluster's 16 GPUs
            ],
        )
    )
    jobs = sample(trace, 4, start_hour=8, window_hours=8, seed=3, cluster_gpus=16)
    assert [(j.submit_s, j.gpus, j.work) for j in jobs] == [
        (0, 1, 100),
        (5400, 2, 400),
        (3 * 3600, 16, 500 * 128),  # its GPU time is kept
        (8 * 3600 - 1, 4, 1200),
    ]
    assert all(j.job_type in throughput.JOB_TYPES for j in jobs)
    with pytest.raises(ValueError, match="only 4 eligible jobs"):
        sample(trace, 5, start_hour=8, window_hours=8, seed=3, cluster_gpus=16)


def test_sampling_is_seeded_uniform_and_wraps_past_midnight(tmp_path: Path) -> None:
    rows = [
        (f"2017-10-{1 + i % 20:02d} {(22 + i % 4) % 24:02d}:00:00", 60 + i, 1) for i in range(80)
    ]
    trace = read_trace(write_trace(tmp_path / "t.csv", rows))
    first = sample(trace, 10, start_hour=22, window_hours=4, seed=1, cluster_gpus=8)
    assert first == sample(trace, 10, start_hour=22, window_hours=4, seed=1, cluster_gpus=8)
    assert first != sample(trace, 10, start_hour=22, window_hours=4, seed=2, cluster_gpus=8)
    # 22:00, 23:00 of one day and 00:00, 01:00 of the next are 0, 1, 2 and 3 hours in
    assert {j.submit_s for j in first} <= {0, 3600, 7200, 10800}
    assert [j.submit_s for j in first] == sorted(j.submit_s for j in first)
    with pytest.raises(ValueError, match="start-hour"):
        sample(trace, 1, start_hour=24, window_hours=4, seed=1, cluster_gpus=8)


def test_a_gzipped_trace_reads_as_the_plain_one(tmp_path: Path) -> None:
    plain = write_trace(tmp_path / "t.csv", [("2017-10-01 08:00:00", 100, 2)] * 3)
    zipped = tmp_path / "t.csv.gz"
    zipped.write_bytes(gzip.compress(plain.read_bytes()))
    assert read_trace(zipped) == read_trace(plain) and len(read_trace(plain)) == 3


def test_the_default_trace_is_the_philly_trace_in_the_repository() -> None:
    assert DEFAULT_TRACE == REPO_ROOT / "benchmarks" / "scheduling" / "data" / "philly.csv.gz"
    assert suite_module("scheduling").parse_args(["simulate"]).trace == DEFAULT_TRACE
    trace = read_trace(DEFAULT_TRACE)
    # the Pollux artifact's philly.csv (benchmarks/scheduling/data/README.md)
    assert len(trace) == 82_247
    assert [sum(j.gpus == n for j in trace) for n in (1, 2, 4, 8, 16)] == [
        76_627,
        1_818,
        1_870,
        1_643,
        199,
    ]


def test_a_bad_trace_gets_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="pass --trace"):
        read_trace(tmp_path / "missing.csv")
    (tmp_path / "bad.csv").write_text("when,duration\n")
    with pytest.raises(ValueError, match="missing column"):
        read_trace(tmp_path / "bad.csv")
    with pytest.raises(ValueError, match="YYYY-MM-DD"):
        seconds_of_day("2017-10-01T08:00")
    assert seconds_of_day("2017-10-01 08:01:02") == 8 * 3600 + 62


# --------------------------------------------------------------------------- placement


def test_the_reduced_snapshot_gives_plan_s_own_answer() -> None:
    """The adapter hands ``plan`` only what can change its answer: the same binds and victims
    as the whole snapshot, over random clusters with the ladder's levels and pods stopping."""
    rng = random.Random(7)
    levels = [-2, -3, -4, GUARANTEED_PRIORITY]  # guaranteed workers: the ladder's or not
    for _ in range(120):
        nodes = nodes_of(rng.randint(4, 40), rng.choice([1, 4, 8]))
        version = 0
        bound, pending = [], []

        def pod(prefix: str, chance: float) -> SimPod:
            nonlocal version
            version += 1
            guaranteed = rng.random() < chance
            priority = rng.choice(levels) if guaranteed else OPPORTUNISTIC_PRIORITY
            return SimPod(f"{prefix}{version}", priority, guaranteed, version)

        for node, gpus in nodes.items():
            for _ in range(rng.choice([gpus, gpus, rng.randint(0, gpus)])):  # mostly full
                if rng.random() < 0.1:  # a victim in its graceful stop
                    version += 1
                    one = SimPod(f"t{version}", 10**9, False, version, terminating=True)
                else:
                    one = pod("b", 0.4)
                one.bind(node)
                bound.append(one)
        pending = [pod("p", 0.3) for _ in range(rng.randint(0, 30))]
        rng.shuffle(pending)
        full = schedule(nodes, bound, pending, reduce=False)
        reduced = schedule(nodes, bound, pending)
        assert [(p.name, n) for p, n in reduced.binds] == [(p.name, n) for p, n in full.binds]
        assert [p.name for p in reduced.victims] == [p.name for p in full.victims]


def test_a_guaranteed_worker_preempts_only_opportunistic_ones() -> None:
    nodes = nodes_of(2, 2)
    bound = [
        SimPod("g", GUARANTEED_PRIORITY, True, 1),
        SimPod("o", OPPORTUNISTIC_PRIORITY, False, 2),
    ]
    for pod in bound:
        pod.bind("node-0")
    new_guaranteed = SimPod("new-g", GUARANTEED_PRIORITY, True, 3)
    new_opportunistic = SimPod("new-o", OPPORTUNISTIC_PRIORITY, False, 4)
    placed = schedule(nodes, bound, [new_opportunistic, new_guaranteed])
    assert (placed.binds, [p.name for p in placed.victims]) == ([], ["o"])


# --------------------------------------------------------------------------- simulator

NO_COSTS = Costs(join_s=0.0, shrink_s=0.0)
TWO_OF_FOUR = [Job("a", 0.0, 4, 400.0), Job("b", 0.0, 4, 400.0)]  # 100 s each at 4 GPUs


def test_two_jobs_of_four_on_six_gpus_by_hand() -> None:
    gang = simulate(TWO_OF_FOUR, 6, "gang", NO_COSTS)
    # one after the other: a 0..100, b 100..200
    assert (gang.makespan_s, gang.avg_jct_s, gang.mean_pending_s) == (200.0, 150.0, 50.0)
    assert (gang.resizes, gang.preemptions) == (0, 0)
    assert gang.utilization == pytest.approx(800 / 1200)
    assert gang.idle_while_waiting == pytest.approx(2 * 100 / 1200)  # b waits, 2 GPUs idle
    elastic = simulate(TWO_OF_FOUR, 6, "elastic", NO_COSTS)
    # b starts at once on the 2 free GPUs (200 done by 100 s) and grows to 4: 50 s more
    assert (elastic.makespan_s, elastic.avg_jct_s, elastic.mean_pending_s) == (150.0, 125.0, 0.0)
    assert (elastic.resizes, elastic.preemptions) == (1, 0)
    assert elastic.utilization == pytest.approx(800 / 900)
    assert elastic.idle_while_waiting == 0.0


def test_start_and_join_costs_by_hand() -> None:
    costs = Costs(join_s=5.0, shrink_s=1.0)
    gang = simulate(TWO_OF_FOUR, 6, "gang", costs)
    # a: 5..105; b admitted at 105, trains 110..210
    assert (gang.makespan_s, gang.avg_jct_s) == (210.0, 157.5)
    elastic = simulate(TWO_OF_FOUR, 6, "elastic", costs)
    # b trains on 2 from 5; its 2 more workers are bound at 105 and train from 110:
    # 2 × 105 = 210 done, 190 left at 4 GPUs = 47.5 s
    assert elastic.makespan_s == pytest.approx(157.5)
    assert elastic.avg_jct_s == pytest.approx((105 + 157.5) / 2)
    assert elastic.mean_pending_s == 5.0


def test_a_new_job_s_guaranteed_worker_shrinks_another_job() -> None:
    jobs = [Job("a", 0.0, 6, 600.0), Job("b", 10.0, 2, 100.0)]
    gang = simulate(jobs, 6, "gang", Costs(0.0, 1.0))
    assert (gang.makespan_s, gang.avg_jct_s, gang.preemptions) == (150.0, 120.0, 0)
    elastic = simulate(jobs, 6, "elastic", Costs(0.0, 1.0))
    # at 10 s b's guaranteed worker preempts one of a's opportunistic ones: a pauses 1 s, then
    # trains on 5 (495 by 110 s, when b ends: 100 s on 1 GPU) and on 6 again (45 left: 7.5 s)
    assert (elastic.preemptions, elastic.resizes) == (1, 2)
    assert elastic.lost_work_s == pytest.approx(5.0)  # 5 workers paused 1 s
    assert elastic.makespan_s == pytest.approx(117.5)
    assert elastic.avg_jct_s == pytest.approx((117.5 + 100) / 2)


def test_gang_backfills_a_job_that_fits_behind_a_blocked_one() -> None:
    jobs = [Job("a", 0.0, 4, 400.0), Job("big", 1.0, 6, 600.0), Job("small", 2.0, 2, 20.0)]
    gang = simulate(jobs, 6, "gang", NO_COSTS)
    # big waits for a; small fits the 2 free GPUs at once (2..12); big runs 100..200
    assert gang.makespan_s == 200.0
    assert gang.avg_jct_s == pytest.approx((100 + 199 + 10) / 3)


def test_the_metrics_split_one_gpu_jobs_from_the_others() -> None:
    jobs = [*TWO_OF_FOUR, Job("one", 0.0, 1, 50.0)]
    gang = simulate(jobs, 6, "gang", NO_COSTS)
    # a 0..100 and one 0..50 fit at once; b waits for a: 100..200
    assert (gang.jobs_1gpu, gang.avg_jct_1gpu_s, gang.mean_pending_1gpu_s) == (1, 50.0, 0.0)
    assert (gang.avg_jct_multi_s, gang.mean_pending_multi_s) == (150.0, 50.0)


def test_pollux_scaling_uses_the_job_type_s_curve() -> None:
    job = Job("a", 0.0, 4, 400.0, "imagenet")
    alone = simulate([job], 4, "elastic", NO_COSTS, scaling="pollux")
    assert alone.makespan_s == pytest.approx(100.0)  # at its own size: the trace's duration
    # a long 2-GPU job (all its workers guaranteed) leaves the 4-GPU job 2 GPUs
    hog = Job("hog", 0.0, 2, 2 * 1000.0, "imagenet")
    squeezed = simulate([hog, job], 4, "elastic", NO_COSTS, scaling="pollux", min_workers=2)
    batch = 4 * throughput.curve("imagenet").reference_batch
    slower = throughput.speedup("imagenet", 4, 2, batch)
    assert 1 < slower < 2
    assert squeezed.avg_jct_s == pytest.approx((1000.0 + 100.0 * slower) / 2)


def test_a_job_trains_only_with_min_workers_ready() -> None:
    """Gang without an admission queue (the test cluster's gang: the master asks for all its
    workers, those that fit bind): the second job holds 2 GPUs but trains only when all 4 run."""
    gang = Simulation(TWO_OF_FOUR, 6, "gang", NO_COSTS, gang_queue=False, record=True)
    result = gang.run()
    assert gang.job_times["b"] == (0.0, 100.0, 200.0)
    assert result.utilization == pytest.approx((800 + 2 * 100) / 1200)  # b's 2 bound, idle
    assert gang.holdings[:2] == [(0.0, "a", 1), (0.0, "a", 2)]
    # elastic with MIN = half of 4: b trains on its 2 guaranteed workers, as with MIN 1
    half = simulate(TWO_OF_FOUR, 6, "elastic", NO_COSTS, min_workers="half")
    assert (half.makespan_s, half.avg_jct_s) == (150.0, 125.0)
    # MIN 3: the guaranteed workers go first (3 + 3 = 6 GPUs), a's 4th waits: both train on 3
    three = simulate(TWO_OF_FOUR, 6, "elastic", NO_COSTS, min_workers=3)
    assert (three.makespan_s, three.mean_pending_s) == (pytest.approx(400 / 3), 0.0)
    # MIN 4 (= MAX): b's 2 bound workers wait for a to end
    late = simulate(TWO_OF_FOUR, 6, "elastic", NO_COSTS, min_workers=4)
    assert (late.makespan_s, late.mean_pending_s) == (200.0, 50.0)
    assert [min_workers_of(g, "half") for g in (1, 2, 3, 8)] == [1, 1, 2, 4]
    assert min_workers_of(4, 9) == 4
    with pytest.raises(ValueError, match="unknown MIN rule"):
        min_workers_of(4, "most")


def test_start_join_pause_and_shrink_costs_by_hand() -> None:
    costs = Costs(join_s=5.0, shrink_s=1.0, start_s=8.0, join_pause_s=2.0)
    sim = Simulation(TWO_OF_FOUR, 6, "elastic", costs)
    sim.run()
    # a: trains 8..108; b: 2 workers from 8 (first start); its 2 more are bound at 108, ready
    # at 111 (join 5 - pause 2), b stands still 111..113: 2 × 103 = 206 done by 111, 194 left
    # at 4 GPUs from 113: 48.5 s
    assert sim.job_times["a"] == (0.0, 8.0, 108.0)
    assert sim.job_times["b"] == pytest.approx((0.0, 8.0, 161.5))
    with pytest.raises(ValueError, match="part of join_s"):
        Costs(join_s=1.0, join_pause_s=2.0)


def test_bad_simulations_are_refused() -> None:
    with pytest.raises(ValueError, match="more than 2 GPUs"):
        simulate(TWO_OF_FOUR, 2, "gang")
    with pytest.raises(ValueError, match="unknown policy"):
        simulate(TWO_OF_FOUR, 8, "fifo")
    assert percentile([1, 2, 3, 4], 50) == 2.5


# --------------------------------------------------------------------------- command line


def test_the_suite_s_subcommands_and_quick() -> None:
    suite = suite_module("scheduling")
    assert "simulate" in suite.COMMANDS
    assert suite.parse_args(["--quick"]).jobs == [12]  # no subcommand: simulate
    args = suite.parse_args(["simulate", "--gpus", "64,512", "--jobs", "80,160"])
    assert (args.gpus, args.jobs, args.policies) == ([64, 512], [80, 160], ["gang", "elastic"])
    with pytest.raises(SystemExit):
        suite.parse_args(["simulate", "--policies", "gang,fifo"])
    with pytest.raises(SystemExit):
        suite.parse_args(["exp9"])


def test_quick_simulate_writes_both_policies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [
        (f"2017-10-{1 + i % 9:02d} {8 + i % 8:02d}:{i % 60:02d}:00", 60 + 37 * i, 1 + i % 3)
        for i in range(30)
    ]
    trace = write_trace(tmp_path / "t.csv", rows)
    out = tmp_path / "out.json"
    argv = ["simulate", "--quick", "--trace", str(trace), "--seed", "2", "--json", str(out)]
    assert suite_module("scheduling").main(argv) == 0  # as python -m benchmarks scheduling ...
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert (report["benchmark"], report["quick"]) == ("scheduling", True)
    assert set(report["policies"]) == {"gang", "elastic"}
    for metrics in report["policies"].values():
        assert metrics["jobs"] == 12
        for key in ("avg_jct_s", "p99_jct_s", "makespan_s", "mean_pending_s", "lost_work_s"):
            assert metrics[key] >= 0
        assert 0 < metrics["utilization"] <= 1
        assert 0 <= metrics["idle_while_waiting"] < 1
        assert metrics["resizes"] >= 0
    assert "summary: scheduling" in printed and f"wrote {out}" in printed
    assert out.with_suffix(".png").stat().st_size > 0  # JCT and pending against the load


def test_a_result_records_its_paths_relative_to_the_checkout(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    argv = ["simulate", "--quick", "--seed", "2", "--json", str(out)]  # the default trace
    assert suite_module("scheduling").main(argv) == 0
    settings = json.loads(out.read_text())["settings"]
    assert settings["trace"] == "benchmarks/scheduling/data/philly.csv.gz"
    for key in ("out", "json"):  # outside the checkout: still relative to it
        assert not Path(settings[key]).is_absolute()
        assert (REPO_ROOT / settings[key]).resolve() == out.resolve()


# --------------------------------------------------------------------------- experiment 1

FIXTURE = Path(__file__).with_name("exp1_result_fixture.json")
ELASTICDL = Path(workload.__file__).parent / "data" / "elasticdl-experiment-1.json"


def test_experiment_1_s_workload_simulated_by_hand() -> None:
    measured = workload.read_measured(FIXTURE)
    assert measured.costs["gang"] == measured.costs["elastic"]  # one set for both policies
    costs = measured.costs["elastic"]
    assert (costs.first_start_s, costs.join_s, costs.join_pause_s, costs.shrink_s) == (
        6.0,  # the median of the measured pod starts
        5.0,
        1.0,
        1.5,
    )
    assert [j.min_workers for j in measured.jobs["gang"]] == [4, 4]
    assert [j.min_workers for j in measured.jobs["elastic"]] == [1, 1]
    s2, s4 = (throughput.step_seconds("bert", w, 64) for w in (2, 4))
    gang = workload.simulate_measured(measured, "gang")
    end_1 = 6.0 + 100 * s4  # pod start, then 100 steps on 4
    assert gang.job_times["job-1"] == pytest.approx((0.0, 6.0, end_1))
    # job-2 holds 2 slots from 21.3 s and trains when its other 2 have started after job-1
    assert gang.job_times["job-2"] == pytest.approx((21.3, end_1 + 6.0, end_1 + 6.0 + 100 * s4))
    elastic = workload.simulate_measured(measured, "elastic")
    # job-2 trains on 2 from 27.3 s; its 2 more are ready 4 s after job-1's end, the world
    # stands still 1 s (the join's pause) and trains on 4 from end_1 + 5
    on_two = (end_1 + 4.0 - 27.3) / s2
    assert elastic.job_times["job-2"] == pytest.approx(
        (21.3, 27.3, end_1 + 5.0 + (100 - on_two) * s4)
    )
    # slots held: at job-1's end its 4 go to job-2 at the same instant
    assert [s.held for s in elastic.samples][-3:] == [
        {"job-1": 4, "job-2": 2},
        {"job-2": 4},
        {},
    ]
    comparison = workload.compare(measured, {"gang": gang, "elastic": elastic})
    assert comparison["pass"]
    row = comparison["policies"]["elastic"]["jobs"]["job-2"]["jct"]
    assert row["error"] == pytest.approx((elastic.job_times["job-2"][2] - 21.3) / 228.7 - 1, 1e-3)
    assert workload.step_check(measured)["4"] == {"curve": round(s4, 4), "measured": 1.72}
    # a measured JCT 20 % away fails the comparison
    data = json.loads(FIXTURE.read_text())
    data["policies"]["gang"]["jobs"][1]["jct_s"] *= 1.2
    off = workload.measured_from(data)
    verdict = workload.compare(off, {"gang": workload.simulate_measured(off, "gang")})
    assert not verdict["pass"]
    assert any(
        "job-2 JCT" in line and "FAIL" in line for line in workload.comparison_lines(verdict)
    )


def test_experiment_1_s_costs_measured_per_policy_and_job() -> None:
    """The shape the experiment writes: costs per policy, per job; the master's start
    (submission -> first worker bound) delays the job's arrival, not its submission."""
    data = json.loads(FIXTURE.read_text())
    data.pop("max_workers")
    data["workers"] = 4
    for row in data["policies"]["elastic"]["jobs"]:
        row.update(max_workers=4, min_workers=1)
    data["measured_costs"] = {
        "gang": {
            "pod_start_s": {"job-1": 5.0, "job-2": 7.0},
            "submit_to_first_bind_s": {"job-1": 2.0, "job-2": 3.0},
            "gang_start_after_free_s": 9.0,
        },
        "elastic": {"pod_start_s": {"job-1": 6.0}, "join_s": 8.0},
        "step_s_by_world": {"gang": {"job-1": {"4": 1.7}}, "elastic": {"job-2": {"4": 1.8}}},
    }
    measured = workload.measured_from(data)
    gang, elastic = measured.costs["gang"], measured.costs["elastic"]
    assert (gang.first_start_s, gang.join_s, gang.shrink_s) == (6.0, 6.0, 0.0)  # nothing joins
    assert (elastic.first_start_s, elastic.join_s) == (6.0, 8.0)
    assert measured.step_s == {4: pytest.approx(1.75)}
    assert [j.master_start_s for j in measured.jobs["gang"]] == [2.0, 3.0]
    assert [j.master_start_s for j in measured.jobs["elastic"]] == [0.0, 0.0]
    sim = workload.simulate_measured(measured, "gang")
    s4 = throughput.step_seconds("bert", 4, 64)
    assert sim.job_times["job-1"] == pytest.approx((2.0, 8.0, 8.0 + 100 * s4))
    comparison = workload.compare(measured, {"gang": sim})
    jct = comparison["policies"]["gang"]["jobs"]["job-1"]["jct"]["simulated_s"]
    assert jct == pytest.approx(8.0 + 100 * s4, abs=0.01)  # from the submission at 0


def test_the_measured_pace_and_the_master_start_from_the_pods() -> None:
    """``pace="measured"``: every job's work scaled by how much slower the gang jobs trained
    than the curve; without ``submit_to_first_bind_s`` the master's start is read from the
    job's pods (first bound)."""
    data = json.loads(FIXTURE.read_text())
    s4 = throughput.step_seconds("bert", 4, 64)
    for row in data["policies"]["gang"]["jobs"]:  # trained 1.5x the curve's time
        row["jct_s"] = row["first_step_s"] - row["submit_s"] + 1.5 * 100 * s4
    data["policies"]["elastic"]["jobs"][0]["pods"] = {
        "w-0": {"bound_s": 3.5},
        "w-1": {"bound_s": 2.5},
        "w-2": {"bound_s": None},
    }
    measured = workload.measured_from(data)
    assert workload.pace_factor(measured) == pytest.approx(1.5)
    assert [j.master_start_s for j in measured.jobs["elastic"]] == [2.5, 0.0]
    curve = workload.simulate_measured(measured, "gang")
    paced = workload.simulate_measured(measured, "gang", pace="measured")
    first, last = curve.job_times["job-1"][1:], paced.job_times["job-1"][1:]
    assert last[1] - last[0] == pytest.approx(1.5 * (first[1] - first[0]))
    with pytest.raises(ValueError, match="unknown pace"):
        workload.simulate_measured(measured, "gang", pace="guess")


def test_a_bad_workload_gets_a_clear_error(tmp_path: Path) -> None:
    good = json.loads(FIXTURE.read_text())
    for change, message in [
        (lambda d: d.pop("slots"), "has no 'slots'"),
        (lambda d: d.update(job_type="gpt"), "unknown job_type 'gpt'"),
        (lambda d: d["measured_costs"].pop("join_s"), "measured_costs has no 'join_s'"),
        (lambda d: d["measured_costs"].pop("pod_start_s"), "has no 'pod_start_s'"),
        (lambda d: d.pop("max_workers"), "jobs\\[0\\] has no 'max_workers'"),
        (lambda d: d.update(max_workers=8), "max_workers \\(8\\) <= slots \\(6\\)"),
        (lambda d: d.update(job_type=None), "give solo_s"),
        (lambda d: d["measured_costs"].update(shrink_s="soon"), "expected a number"),
    ]:
        data = json.loads(json.dumps(good))
        change(data)
        with pytest.raises(ValueError, match=message):
            workload.measured_from(data)
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        workload.read_measured(tmp_path / "x.json")


def test_simulate_workload_compares_the_elasticdl_reference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ElasticDL's published run (two 4-GPU jobs on 6 GPUs) as a sanity case of the schedule:
    linear scaling, no costs, within 10 %."""
    out = tmp_path / "edl.json"
    argv = ["simulate", "--workload", str(ELASTICDL), "--json", str(out)]
    assert suite_module("scheduling").main(argv) == 0
    printed = capsys.readouterr().out
    assert "PASS: every makespan and JCT within 10%" in printed
    report = json.loads(out.read_text())
    assert report["comparison"]["pass"]
    gang, elastic = report["policies"]["gang"], report["policies"]["elastic"]
    assert (gang["makespan_s"], elastic["makespan_s"]) == (930.0, 757.5)
    assert out.with_suffix(".png").stat().st_size > 0  # slots per job over time


# --------------------------------------------------------------------------- the paced model-def


def test_paced_sleep_fills_the_step_to_the_curve_s_time() -> None:
    from benchmarks.timed_model_def import batch_size, paced_sleep_s

    target = throughput.step_seconds("bert", 4, 32)
    assert paced_sleep_s("bert", 4, 32, began=10.0, now=10.25) == pytest.approx(target - 0.25)
    assert paced_sleep_s("bert", 4, 32, began=10.0, now=10.0 + target + 1) == 0.0
    assert paced_sleep_s("bert", 4, 0, began=None, now=0.0) == 0.0
    assert batch_size((torch.zeros(5, 2), torch.zeros(5))) == 5
    assert batch_size({"x": torch.zeros(3, 1)}) == 3
    assert batch_size(torch.tensor(1.0)) == 1


def test_a_paced_step_sleeps_for_its_job_type_on_its_world(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``TIMED_JOB_TYPE`` the wrapped model-def's step hook sleeps what the curve says for
    the samples ``loss()`` saw × the world size, and still writes its step line."""
    import importlib

    monkeypatch.setenv("TIMED_MODEL_DEF", "kfp_elastic.testing.model_defs.counted_blobs")
    monkeypatch.setenv("TIMED_JOB_TYPE", "imagenet")
    monkeypatch.setenv("TIMED_STEPS_FILE", str(tmp_path / "steps.jsonl"))
    monkeypatch.setenv("WORLD_SIZE", "3")
    import benchmarks.timed_model_def as timed

    timed = importlib.reload(timed)
    slept: list[float] = []
    clock = SimpleNamespace(monotonic=lambda: 100.0, time=lambda: 1.0, sleep=slept.append)
    monkeypatch.setattr(timed, "time", clock)  # the step takes no time on this clock
    net = timed.model()
    data = timed.dataset("train")
    batch = timed.collate([data[i] for i in range(8)])
    timed.loss(net, batch).backward()
    # what optimizer() registers, called as optimizer.step() would (a torch optimizer's first
    # construction imports torch._dynamo: seconds)
    timed._log = timed.StepLog(str(tmp_path / "steps.jsonl"))
    params = {"params": list(net.parameters()), "lr": 1.0}
    timed._after_step(SimpleNamespace(param_groups=[params]), (), {})
    assert slept == [throughput.step_seconds("imagenet", 3, 8 * 3)]  # 8 samples × world 3
    assert json.loads((tmp_path / "steps.jsonl").read_text())["world"] == 3
    monkeypatch.setenv("TIMED_JOB_TYPE", "gpt")
    with pytest.raises(ValueError, match="unknown job type 'gpt'"):
        importlib.reload(timed)
    monkeypatch.undo()
    importlib.reload(timed)  # as the environment of other tests has it
