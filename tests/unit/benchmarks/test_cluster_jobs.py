"""The scheduling experiments on the test cluster, their pure parts: step logs (steps lost,
training spans, slots trained on, step times), pod times, windows, and exp1's and admission's
plans, measured costs and goals."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from benchmarks.scheduling import admission, exp1
from benchmarks.scheduling.cluster_jobs import (
    PER_WORKER_BATCH,
    PodTimes,
    Step,
    batch_for,
    epochs_for,
    first_step_after,
    first_world_change_after,
    job_size,
    parse_steps,
    step_seconds_by_world,
    steps_lost,
    steps_of,
    track_pods,
    training_intervals,
    training_samples,
    window_utilization,
    world_changes,
)
from benchmarks.scheduling.occupancy import Sample
from kfp_elastic.master.pod_spec_checks import COMPONENT_LABEL, RUN_ID_LABEL
from kfp_elastic.master.timeline import (
    MasterRecovered,
    MasterStarted,
    ModelDefChecked,
    WorkerLaunched,
)


def line(t: float, step: int, world: int, pid: int, rank: int = 0) -> str:
    return json.dumps({"t": t, "step": step, "rank": rank, "world": world, "pid": pid})


def test_parse_steps_keeps_rank_0_in_time_order_and_skips_a_torn_line() -> None:
    text = "\n".join(
        [line(102.0, 2, 2, 7), line(101.0, 1, 2, 7), line(101.0, 1, 2, 8, rank=1), '{"t": 1']
    )
    assert parse_steps(text, 100.0) == [Step(1.0, 1, 2, 7), Step(2.0, 2, 2, 7)]


def test_steps_lost_counts_steps_done_again_after_a_restart() -> None:
    # steps 1..5, then a restart from the snapshot at step 3: 4 and 5 again
    steps = [Step(float(i), n, 4, 1 if i < 5 else 2) for i, n in enumerate([1, 2, 3, 4, 5, 4, 5])]
    assert steps_lost(steps) == 2
    assert steps_lost(steps[:5]) == 0


def test_training_spans_leave_out_the_pause_of_a_new_world() -> None:
    steps = [Step(0, 1, 2, 7), Step(1, 2, 2, 7), Step(5, 3, 4, 9), Step(6, 4, 4, 9)]
    assert training_intervals(steps) == [(0, 1, 2), (5, 6, 4)]
    assert step_seconds_by_world(steps) == {2: 1.0, 4: 1.0}
    assert world_changes(steps) == [(0, 2), (5, 4)]
    assert first_world_change_after(steps, 0.5) == Step(5, 3, 4, 9)
    assert first_world_change_after(steps, 5.5) is None
    assert first_step_after(steps, 1.0) == Step(5, 3, 4, 9)
    assert first_step_after(steps, 0.0, lambda w: w > 2) == Step(5, 3, 4, 9)


def test_training_samples_stack_the_worlds_of_overlapping_jobs() -> None:
    samples = training_samples({"a": [(0, 4, 4)], "b": [(2, 6, 2)]})
    assert samples == [
        Sample(0, {"a": 4}),
        Sample(2, {"a": 4, "b": 2}),
        Sample(4, {"b": 2}),
        Sample(6, {}),
    ]
    # 4 slots × 4 s + 2 × 4 s over 6 slots × 6 s
    assert window_utilization(samples, 6, 0, 6) == round(24 / 36, 4)
    assert window_utilization(samples, 6, 2, 4) == 1.0
    assert window_utilization(samples, 6, None, 4) is None
    assert window_utilization(samples, 6, 4, 4) is None


def pod(name: str, run: str, node: str = "", phase: str = "Pending", **meta: str) -> dict:
    return {
        "metadata": {
            "name": name,
            "labels": {RUN_ID_LABEL: run, COMPONENT_LABEL: "worker"},
            **meta,
        },
        "spec": {"nodeName": node} if node else {},
        "status": {"phase": phase},
    }


def test_track_pods_records_created_bound_stopping_and_gone() -> None:
    pods: dict[str, PodTimes] = {}
    track_pods(pods, [pod("w0", "r"), {"metadata": {"name": "m", "labels": {}}}], 1.0)
    track_pods(pods, [pod("w0", "r", "n1", "Running")], 2.0)
    track_pods(pods, [pod("w0", "r", "n1", "Running", deletionTimestamp="x")], 3.0)
    track_pods(pods, [], 4.0)
    assert pods == {"w0": PodTimes("r", 1.0, 2.0, 3.0, 4.0)}


def test_steps_and_epochs_of_a_job() -> None:
    per_epoch = steps_of(1, 4)  # 240 samples, 2 per worker × 4
    assert per_epoch == 30
    assert epochs_for(61, 4) == 3 and epochs_for(0, 4) == 1


def test_a_job_shorter_than_an_epoch_takes_a_larger_batch_not_a_whole_epoch() -> None:
    assert batch_for(30, 4) == batch_for(700, 4) == PER_WORKER_BATCH  # an epoch or more
    assert batch_for(19, 4) == 3 and steps_of(1, 4, 3) == 20  # the epoch closest to 19 steps
    assert batch_for(1, 4) == 60 and steps_of(1, 4, 60) == 1  # one step an epoch at most
    quick = job_size("cifar10", 4, 1024, 4.0)
    assert (quick.epochs, quick.steps, quick.per_worker_batch) == (1, 20, 3)
    full = job_size("cifar10", 8, 1024, 150.0)
    assert (full.epochs, full.steps, full.per_worker_batch) == (56, 840, PER_WORKER_BATCH)


def test_exp1_plans_gang_and_elastic() -> None:
    gang = exp1.plans("gang", 4, 30.0)
    elastic = exp1.plans("elastic", 4, 30.0)
    assert [(p.min_workers, p.max_workers, p.submit_s) for p in gang] == [
        (4, 4, 0.0),
        (4, 4, 30.0),
    ]
    assert [(p.min_workers, p.max_workers) for p in elastic] == [(1, 4), (1, 4)]
    with pytest.raises(SystemExit):
        exp1.parse_args(["--slots", "8", "--workers", "4"])  # no contention


def job(name: str, submit: float, first: float, end: float, pods: dict, worlds: list) -> dict:
    return {
        "name": name,
        "submit_s": submit,
        "first_step_s": first,
        "end_s": end,
        "pending_s": first - submit,
        "pods": pods,
        "worlds": worlds,
        "steps_lost": 0,
        "evictions_s": [],
        "resubmissions_s": [],
    }


def times(created: float, bound: float | None, stopping=None, gone=None) -> dict:
    return {"created_s": created, "bound_s": bound, "stopping_s": stopping, "gone_s": gone}


def test_exp1_costs_of_the_elastic_run() -> None:
    """Job 2 starts on 2 slots at 10 (pods bound at 6), job 1's pods go at 50, job 2 trains on
    4 from 58: pod starts, join 8 s."""
    jobs = [
        job("job-1", 0, 5, 51, {f"a{i}": times(1, 2 + i * 0.5, gone=50) for i in range(4)}, []),
        job(
            "job-2",
            4,
            10,
            90,
            {"b0": times(5, 6), "b1": times(5, 6), "b2": times(5, 52), "b3": times(5, 52)},
            [(10, 2), (58, 4)],
        ),
    ]
    jobs[0]["worlds"] = [(5, 4)]
    steps = [[], [Step(10, 1, 2, 1), Step(49, 60, 2, 1), Step(58, 61, 4, 2)]]
    costs = exp1.costs("elastic", jobs, steps)
    assert costs["pod_start_s"] == {"job-1": 1.5, "job-2": 4.0}
    assert costs["submit_to_first_bind_s"] == {"job-1": 2.0, "job-2": 2.0}
    assert costs["first_freed_s"] == 50 and costs["join_s"] == 8.0
    assert exp1.both_running(jobs) == (4, 51)


def test_exp1_goals() -> None:
    policies = {
        "gang": {"makespan_s": 100.0, "utilization_both_running": 0.66},
        "elastic": {"makespan_s": 80.0, "utilization_both_running": 0.97},
    }
    assert exp1.goals(policies) == {
        "makespan_ratio": 0.8,
        "makespan_pass": True,
        "utilization_both_running": 0.97,
        "utilization_pass": True,
    }
    policies["elastic"]["makespan_s"] = 90.0
    assert exp1.goals(policies)["makespan_pass"] is False


def test_admission_plans() -> None:
    elastic = admission.plans("elastic", 8, 2, 20.0)
    assert [(p.name, p.min_workers, p.max_workers) for p in elastic] == [("A", 2, 8), ("B", 2, 8)]
    assert elastic[1].after_first_step and elastic[1].submit_s == 20.0
    assert [p.min_workers for p in admission.plans("evict", 8, 2, 20.0)] == [8, 8]


def test_b_alone_is_elastics_b_on_an_empty_cluster_a_few_epochs_long() -> None:
    size = job_size("cifar10", 8, 1024, 150.0)
    alone = admission.alone_plan(8, 2, size)
    beside = admission.plans("elastic", 8, 2, 20.0)[1]
    assert (alone.name, alone.min_workers, alone.max_workers) == ("B", 2, 8)
    assert (beside.min_workers, beside.max_workers) == (2, 8)
    assert alone.submit_s == 0.0 and not alone.after_first_step
    assert alone.size is not None and alone.size.epochs == admission.ALONE_EPOCHS < size.epochs
    assert alone.size.per_worker_batch == size.per_worker_batch


def test_a_jobs_own_start_from_its_timeline() -> None:
    # submitted at 1000.0; its master pod's first process at 1000.5; the check ends after the
    # three first pods (a fourth, attempt 1, replaces one later)
    events = [
        MasterStarted(t=1001.2, seq=1),
        WorkerLaunched(t=1001.4, seq=2, name="w-0-0", index=0, attempt=0),
        WorkerLaunched(t=1001.5, seq=3, name="w-1-0", index=1, attempt=0),
        WorkerLaunched(t=1001.6, seq=4, name="w-2-0", index=2, attempt=0),
        ModelDefChecked(t=1002.9, seq=5, passed=True, seconds=2.1),
        WorkerLaunched(t=1010.0, seq=6, name="w-1-1", index=1, attempt=1),
        MasterRecovered(t=1020.0, seq=7),
    ]
    out = admission.start_analysis(events, 1000.5, 1000.0)
    assert out == {
        "master_pod_started_s": 0.5,
        "master_started_event_s": 1.2,
        "first_pod_launched_s": 1.4,
        "pods_after_master_s": 0.9,
        "model_def_check_s": 2.1,
        "model_def_check_passed": True,
        "check_ended_after_pods": True,
    }
    # a check that ended before the first pods were launched: seen in the timeline's order
    early = [events[0], replace(events[4], seq=2)] + [
        replace(e, seq=e.seq + 1) for e in events[1:4]
    ]
    assert admission.start_analysis(early, 1000.5, 1000.0)["check_ended_after_pods"] is False
    # nothing known: no master pod seen, no events
    blank = admission.start_analysis([], None, 1000.0)
    assert blank["pods_after_master_s"] is None and blank["check_ended_after_pods"] is None


def test_admission_goals_against_b_alone_from_the_same_run() -> None:
    def run(first: float, after_master: float | None) -> dict:
        starts = {"pods_after_master_s": after_master}
        return {"admission": {"b_first_step_s": first, "a_steps_lost": 0}, "starts": starts}

    alone = run(8.0, 1.2)
    verdict = admission.goals({"elastic": run(9.5, 1.4), "gang": run(150.0, 1.6)}, alone)
    assert verdict["alone"] == {
        "b_first_step_s": 8.0,
        "b_pods_after_master_s": 1.2,
        "b_pods_after_master_pass": True,
    }
    elastic = verdict["elastic"]
    assert elastic["b_beside_a_minus_alone_s"] == 1.5
    assert elastic["b_beside_a_within_alone_pass"] is True
    assert elastic["b_pods_after_master_pass"] is True
    assert verdict["gang"]["b_pods_after_master_pass"] is False
    assert "b_beside_a_within_alone_pass" not in verdict["gang"]  # B alone is elastic's B
    late = admission.goals({"elastic": run(10.5, None)}, alone)["elastic"]
    assert late["b_beside_a_within_alone_pass"] is False
    assert late["b_pods_after_master_pass"] is False  # not measured is no pass


def test_admission_analysis_of_an_elastic_run() -> None:
    a = job(
        "A",
        0,
        5,
        100,
        {
            "a0": times(1, 2),
            "a6": times(1, 2, stopping=30.0, gone=31),
            "a7": times(1, 2, stopping=30.0, gone=31),
        },
        [(5, 8), (33, 6), (101, 6)],
    )
    b = job("B", 29, 36, 150, {"b0": times(30, 31.5), "b1": times(30, 31.5)}, [(36, 2), (110, 8)])
    steps = [[Step(5, 1, 8, 1), Step(29, 100, 8, 1), Step(33, 101, 6, 2)], []]
    out = admission.analyse("elastic", {"jobs": [a, b]}, steps)
    assert out["b_first_pod_created_s"] == 1.0 and out["b_first_pod_bound_s"] == 2.5
    assert out["b_first_step_s"] == 7 and out["a_steps_lost"] == 0
    assert out["shrink_s"] == 3.0 and out["a_world_after_shrink"] == 6
    assert out["b_world_after_other_ends"] == 8
    verdict = admission.goals({"elastic": {"admission": out}})["elastic"]
    assert verdict["b_first_step_pass"] is False and verdict["a_no_step_lost_pass"] is True


def test_an_evicted_job_resumes_at_its_first_step_after_its_resubmission() -> None:
    # The evicted pods step on while their graceful deletion runs (61.2 -> 61.9 s): those steps
    # are not A running again.
    steps = [Step(60.9, 187, 8, 1), Step(61.25, 189, 8, 1), Step(61.9, 192, 8, 1)]
    steps += [Step(282.2, 193, 8, 2), Step(282.4, 194, 8, 2)]
    assert admission.resumed_step(steps, 260.6) == Step(282.2, 193, 8, 2)
    assert admission.resumed_step(steps, None) is None  # never resubmitted
    assert admission.resumed_step(steps[:3], 260.6) is None  # resubmitted, no step since


def test_admission_analysis_of_an_evict_run() -> None:
    a = job("A", 0, 5, 300, {"a0": times(1, 2, stopping=61.7, gone=62)}, [(5, 8)])
    a["evictions_s"], a["resubmissions_s"] = [61.2], [260.6]
    b = job("B", 55, 80, 250, {"b0": times(61.8, 61.8)}, [(80, 8)])
    steps = [[Step(5, 1, 8, 1), Step(61.25, 189, 8, 1), Step(61.9, 192, 8, 1)], []]
    steps[0] += [Step(282.2, 193, 8, 2)]
    out = admission.analyse("evict", {"jobs": [a, b]}, steps)
    assert out["a_resubmitted_s"] == 260.6 and out["a_resumed_s"] == 282.2
    assert out["a_out_s"] == 221.0 and out["restart_s"] == 21.6
    assert "shrink_s" not in out


def test_kueue_like_eviction_evicts_a_once_and_resubmits_it_after_b() -> None:
    calls: list[str] = []
    records = [SimpleNamespace(evictions=[], submit_s=0.0), SimpleNamespace(submit_s=None)]
    ended = {0: False, 1: False}
    jobs = SimpleNamespace(
        records=records,
        ended=lambda i: ended[i],
        evict=lambda i: (calls.append(f"evict {i}"), records[0].evictions.append(1.0)),
        evicted=lambda i: bool(records[0].evictions) and "resubmit 0" not in calls,
        resubmit=lambda i: calls.append(f"resubmit {i}"),
    )
    admission.evict_on_arrival(jobs, 0.0)  # B not there yet
    records[1].submit_s = 5.0
    admission.evict_on_arrival(jobs, 5.0)
    admission.evict_on_arrival(jobs, 6.0)  # B runs: A stays out
    ended[1] = True
    admission.evict_on_arrival(jobs, 9.0)
    admission.evict_on_arrival(jobs, 10.0)
    assert calls == ["evict 0", "resubmit 0"]


def test_a_training_run_has_a_cluster_of_its_own_or_shares_one(tmp_path) -> None:
    from kfp_elastic.testing.cluster.training_run import TrainingRun

    with pytest.raises(ValueError, match="give nodes"):
        TrainingRun(tmp_path, {})
    first = SimpleNamespace()
    with pytest.raises(ValueError, match="give nodes"):
        TrainingRun(tmp_path, {}, nodes={"n": {"cpu": "1"}}, share=first)  # type: ignore[arg-type]
