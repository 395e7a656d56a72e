"""Admission into a full cluster: a job arrives while another fills every slot.

    python -m benchmarks scheduling admission            # 8 slots, jobs of up to 8
    python -m benchmarks scheduling admission --quick    # a short smoke run (evict only)

Job A trains on all 8 slots; job B, as large, arrives later (``--arrival`` of A's training
time alone after A's first step). Three policies, each a fresh test cluster
(``benchmarks/scheduling/cluster_jobs.py``):

- ``elastic``: A and B min 2, max 8. B's two guaranteed workers preempt two of A's
  opportunistic ones (Kubernetes priority preemption: DisruptionTarget, SIGTERM, A snapshots
  and goes on with 6); each grows back when the other ends.
- ``gang``: min = max = 8: B waits until A is done.
- ``evict``: min = max = 8, and B's arrival evicts A whole, as Kueue preempts a workload (its
  master and every worker pod deleted, graceful termination); A runs again (the same run, its
  task's pod once more) when B is done and resumes from its last snapshot.

Before the policies (unless ``--no-alone``), B runs alone on an empty cluster of its own (the
same job as elastic's B, a few epochs long: only its start is measured), the reference for B
beside A from the same run. For every run of B: its master pod's first process start, the
master's ``master_started`` event, its first ``worker_launched`` event and its
``model_def_checked`` event (the check runs while the pods are created), all read after the run.

Goals: B's first step within 5 s of its submission; beside a full A (elastic) within B alone
+ 2 s; B's worker pods created within 1.5 s of its master pod's start; A loses no step
(elastic). docs/scheduling.md, "Admission into a full cluster", describes what is measured.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    check_policies,
    comma_list,
    export_checkout_to_children,
    parse_options,
    suite_parser,
    write_result,
)
from benchmarks.scheduling.cluster_jobs import (
    ClusterJobs,
    JobPlan,
    JobSize,
    Step,
    first_world_change_after,
    job_size,
    plot_policies,
    result_out,
    steps_of,
)
from benchmarks.scheduling.throughput import JOB_TYPES
from kfp_elastic.master.timeline import (
    Event,
    MasterStarted,
    ModelDefChecked,
    WorkerLaunched,
    of_type,
)
from kfp_elastic.processes import seconds_since_start

POLICIES = ("elastic", "gang", "evict")
FIRST_STEP_GOAL_S = 5.0  # B's submission -> its first step
BESIDE_ALONE_GOAL_S = 2.0  # B's first step beside a full A, past B's alone (the same run)
PODS_AFTER_MASTER_GOAL_S = 1.5  # B's master pod's first process -> its first worker pod
ALONE_EPOCHS = 4  # B alone: long enough to take its first steps at any world
# Two slots: each start of a job is its master and two workers (the CPU of a small machine)
QUICK = {"solo_s": 4.0, "slots": 2, "min_workers": 1}


def build_parser() -> argparse.ArgumentParser:
    """``python -m benchmarks scheduling admission``'s options."""
    parser = suite_parser(
        "python -m benchmarks scheduling admission",
        __doc__,
        f"--solo-s {QUICK['solo_s']:g} --slots {QUICK['slots']} "
        f"--min-workers {QUICK['min_workers']} --policies evict",
    )
    parser.add_argument("--slots", type=int, default=8, help="GPUs; each job asks them all")
    parser.add_argument("--min-workers", type=int, default=2, help="elastic: each job's minimum")
    parser.add_argument("--job-type", choices=JOB_TYPES, default="cifar10")
    parser.add_argument("--global-batch", type=float, default=1024)
    parser.add_argument(
        "--solo-s", type=float, default=150.0, help="a job's training seconds alone on all slots"
    )
    parser.add_argument(
        "--arrival", type=float, default=0.25, help="B arrives this fraction of --solo-s in"
    )
    parser.add_argument("--policies", type=comma_list, default=list(POLICIES))
    parser.add_argument(
        "--no-alone",
        dest="alone",
        action="store_false",
        help="skip B's run alone on an empty cluster (the reference of its first step)",
    )
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between samples")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options, checked, with ``--quick`` applied."""
    parser = build_parser()
    args = parse_options(parser, argv)
    if args.quick:
        args.solo_s, args.slots = QUICK["solo_s"], QUICK["slots"]
        args.min_workers = QUICK["min_workers"]
        # evict: the policy with the most to check (eviction, the job run again); at 4 s
        # of training A is done before B's pods start, so elastic's preemption is not reached
        args.policies = ["evict"]
        args.alone = False
    check_policies(parser, args.policies, POLICIES)
    if not 1 <= args.min_workers < args.slots:
        parser.error("need 1 <= --min-workers < --slots (B must fit beside A)")
    if args.solo_s <= 0 or args.global_batch <= 0 or args.interval <= 0:
        parser.error("--solo-s, --global-batch and --interval must be > 0")
    if not 0 <= args.arrival < 1:
        parser.error("--arrival is a fraction of A's solo time: 0 <= it < 1")
    return args


def plans(policy: str, slots: int, min_workers: int, arrival_s: float) -> list[JobPlan]:
    low = min_workers if policy == "elastic" else slots
    return [JobPlan("A", 0.0, low, slots), JobPlan("B", arrival_s, low, slots, True)]


def alone_plan(slots: int, min_workers: int, size: JobSize) -> JobPlan:
    """Elastic's B on an empty cluster, submitted at once; ``ALONE_EPOCHS`` of its epochs."""
    epochs = min(size.epochs, ALONE_EPOCHS)
    short = JobSize(
        size.step_s, epochs, steps_of(epochs, slots, size.per_worker_batch), size.per_worker_batch
    )
    return JobPlan("B", 0.0, min_workers, slots, size=short)


def process_started_wall(pids: set[int], now_wall: float) -> float | None:
    """The unix time the oldest of ``pids`` started (a pod's first process), from ``/proc``."""
    ages = [age for pid in pids if not math.isnan(age := seconds_since_start(pid))]
    return now_wall - max(ages) if ages else None


def record_master_starts(jobs: ClusterJobs, starts: dict[int, float]) -> None:
    """Each submitted job's master pod's first process start (unix), once, while it runs."""
    for i, rec in enumerate(jobs.records):
        if i in starts or rec.submit_s is None:
            continue
        run = jobs.runs[i]
        started = process_started_wall(run.pod_pids(run.master), time.time())
        if started is not None:
            starts[i] = started


def start_analysis(
    events: Sequence[Event], master_started_wall: float | None, submit_wall: float
) -> dict[str, Any]:
    """How a job's own start went, from its master's timeline (the first master's events:
    before any ``master_recovered``) and its master pod's first process start (unix times;
    ``submit_wall``: the job's submission). ``pods_after_master_s``: that process start -> the
    first ``worker_launched`` event; ``check_ended_after_pods``: the model definition's check
    ended after every first worker pod was launched (timeline order)."""
    started = of_type(events, MasterStarted)
    launched = of_type(events, WorkerLaunched)
    checked = of_type(events, ModelDefChecked)
    first_launch = launched[0] if launched else None

    def since_submit(t: float | None) -> float | None:
        return None if t is None else round(t - submit_wall, 3)

    out: dict[str, Any] = {
        "master_pod_started_s": since_submit(master_started_wall),
        "master_started_event_s": since_submit(started[0].t if started else None),
        "first_pod_launched_s": since_submit(first_launch.t if first_launch else None),
        "pods_after_master_s": None,
        "model_def_check_s": checked[0].seconds if checked else None,
        "model_def_check_passed": checked[0].passed if checked else None,
        "check_ended_after_pods": None,
    }
    if first_launch is not None and master_started_wall is not None:
        out["pods_after_master_s"] = round(first_launch.t - master_started_wall, 3)
    if checked and launched:
        first_wave = [e for e in launched if e.attempt == launched[0].attempt]
        out["check_ended_after_pods"] = checked[0].seq > max(e.seq for e in first_wave)
    return out


def evict_on_arrival(jobs: ClusterJobs, now: float) -> None:
    """Kueue's way: B's arrival evicts A whole; A runs again once B is done."""
    a, b = jobs.records
    if b.submit_s is not None and not a.evictions and not jobs.ended(0):
        jobs.evict(0)
    if jobs.evicted(0) and jobs.ended(1):
        jobs.resubmit(0)


def resumed_step(steps: Sequence[Step], resubmitted_s: float | None) -> Step | None:
    """An evicted job's first step once it runs again: its first step after its resubmission
    (None without one). The steps between the eviction and the resubmission are the evicted
    pods' last ones, taken while their graceful deletion ran."""
    if resubmitted_s is None:
        return None
    return next((s for s in steps if s.t > resubmitted_s), None)


def analyse(
    policy: str, result: Mapping[str, Any], steps: Sequence[Sequence[Step]]
) -> dict[str, Any]:
    """B's admission (submission -> its first worker pod created, bound, its first step), A's
    shrink (its first worker told to stop -> its first step in the smaller world), A's steps
    lost, its time out of the cluster (eviction -> its first step after its resubmission) and
    restart (resubmission -> that step), and whether each grew back to all slots."""
    a, b = result["jobs"]
    out: dict[str, Any] = {}
    submit = b["submit_s"]
    created = sorted(p["created_s"] for p in b["pods"].values())
    bound = sorted(p["bound_s"] for p in b["pods"].values() if p["bound_s"] is not None)
    out["b_first_pod_created_s"] = round(created[0] - submit, 3) if created else None
    out["b_first_pod_bound_s"] = round(bound[0] - submit, 3) if bound else None
    out["b_first_step_s"] = b["pending_s"]
    out["a_steps_lost"] = a["steps_lost"]
    stopping = sorted(p["stopping_s"] for p in a["pods"].values() if p["stopping_s"] is not None)
    if stopping:
        out["a_first_stop_s"] = stopping[0]
        after = first_world_change_after(steps[0], stopping[0])
        if policy == "elastic" and after is not None:
            out["shrink_s"] = round(after.t - stopping[0], 3)
            out["a_world_after_shrink"] = after.world
    if a["evictions_s"]:
        evicted = a["evictions_s"][0]
        resubmitted = a["resubmissions_s"][0] if a["resubmissions_s"] else None
        resumed = resumed_step(steps[0], resubmitted)
        out["a_resubmitted_s"] = resubmitted
        out["a_resumed_s"] = None if resumed is None else round(resumed.t, 3)
        out["a_out_s"] = None if resumed is None else round(resumed.t - evicted, 3)
        if resumed is not None and resubmitted is not None:
            out["restart_s"] = round(resumed.t - resubmitted, 3)
    for job, other in ((a, b), (b, a)):
        later = [w for t, w in job["worlds"] if other["end_s"] and t > other["end_s"]]
        out[f"{job['name'].lower()}_world_after_other_ends"] = max(later) if later else None
    return out


def run_jobs(
    args: argparse.Namespace,
    plans_: Sequence[JobPlan],
    root: Path,
    size: JobSize,
    evict: bool = False,
) -> tuple[dict[str, Any], list[list[Step]]]:
    """``plans_`` on a fresh test cluster: the result (its ``starts``: the last job's own
    start, ``start_analysis``) and each job's steps."""
    starts: dict[int, float] = {}

    def tick(jobs: ClusterJobs, now: float) -> None:
        record_master_starts(jobs, starts)
        if evict:
            evict_on_arrival(jobs, now)

    with ClusterJobs(
        root,
        plans_,
        args.slots,
        args.job_type,
        args.global_batch,
        size.epochs,
        interval_s=args.interval,
        per_worker_batch=size.per_worker_batch,
    ) as jobs:
        jobs.run(tick)
        result = jobs.result()
        steps = [r.steps for r in jobs.records]
        last = len(plans_) - 1
        submit = jobs.records[last].submit_s
        assert submit is not None
        result["starts"] = start_analysis(
            jobs.runs[last].timeline(), starts.get(last), jobs.t0_wall + submit
        )
    return result, steps


def run_policy(args: argparse.Namespace, policy: str, root: Path, size: JobSize, arrival: float):
    plans_ = plans(policy, args.slots, args.min_workers, arrival)
    result, steps = run_jobs(args, plans_, root, size, evict=policy == "evict")
    result["admission"] = analyse(policy, result, steps)
    return result


def run_alone(args: argparse.Namespace, root: Path, size: JobSize) -> dict[str, Any]:
    """B alone on an empty cluster: its first step, its own start."""
    result, _ = run_jobs(args, [alone_plan(args.slots, args.min_workers, size)], root, size)
    (b,) = result["jobs"]
    created = sorted(p["created_s"] for p in b["pods"].values())
    result["admission"] = {
        "b_first_pod_created_s": round(created[0] - b["submit_s"], 3) if created else None,
        "b_first_step_s": b["pending_s"],
    }
    return result


def pods_after_master_goal(result: Mapping[str, Any]) -> dict[str, Any]:
    after = result["starts"]["pods_after_master_s"]
    return {
        "b_pods_after_master_s": after,
        "b_pods_after_master_pass": after is not None and after <= PODS_AFTER_MASTER_GOAL_S,
    }


def goals(
    policies: Mapping[str, Mapping[str, Any]], alone: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Per policy: B's first step within ``FIRST_STEP_GOAL_S``, A's steps lost, B's pods
    created within ``PODS_AFTER_MASTER_GOAL_S`` of its master pod's start; with B's run alone:
    its own pods' goal and elastic's B within ``BESIDE_ALONE_GOAL_S`` of it."""
    out: dict[str, Any] = {}
    for policy, r in policies.items():
        first = r["admission"]["b_first_step_s"]
        out[policy] = {
            "b_first_step_s": first,
            "b_first_step_pass": first is not None and first <= FIRST_STEP_GOAL_S,
            "a_steps_lost": r["admission"]["a_steps_lost"],
            "a_no_step_lost_pass": r["admission"]["a_steps_lost"] == 0,
        }
        if "starts" in r:
            out[policy].update(pods_after_master_goal(r))
    if alone is not None:
        out["alone"] = {"b_first_step_s": alone["admission"]["b_first_step_s"]}
        out["alone"].update(pods_after_master_goal(alone))
        elastic = policies.get("elastic")
        alone_first = alone["admission"]["b_first_step_s"]
        if elastic is not None and alone_first is not None:
            beside = elastic["admission"]["b_first_step_s"]
            out["elastic"]["b_beside_a_minus_alone_s"] = (
                None if beside is None else round(beside - alone_first, 3)
            )
            out["elastic"]["b_beside_a_within_alone_pass"] = (
                beside is not None and beside <= alone_first + BESIDE_ALONE_GOAL_S
            )
    return out


def print_goals(verdict: Mapping[str, Mapping[str, Any]]) -> None:
    def line(ok: bool, text: str) -> None:
        print(f"{'PASS' if ok else 'FAIL'}: {text}")

    for policy, g in verdict.items():
        if "b_pods_after_master_pass" in g:
            line(
                g["b_pods_after_master_pass"],
                f"{policy}: B's worker pods created <= {PODS_AFTER_MASTER_GOAL_S:g} s after its "
                f"master pod started ({g['b_pods_after_master_s']} s)",
            )
        if policy == "alone":
            continue
        line(
            g["b_first_step_pass"],
            f"{policy}: B's first step <= {FIRST_STEP_GOAL_S:g} s after submission "
            f"({g['b_first_step_s']} s)",
        )
        if "b_beside_a_within_alone_pass" in g:
            line(
                g["b_beside_a_within_alone_pass"],
                f"{policy}: B's first step beside a full A <= B alone + "
                f"{BESIDE_ALONE_GOAL_S:g} s ({g['b_first_step_s']} s against "
                f"{verdict['alone']['b_first_step_s']} s alone: "
                f"{g['b_beside_a_minus_alone_s']:+} s)",
            )
        line(g["a_no_step_lost_pass"], f"{policy}: A loses no step ({g['a_steps_lost']})")


def print_start(label: str, r: Mapping[str, Any]) -> None:
    st, adm = r["starts"], r["admission"]
    print(
        f"{label:<8} B: master pod started {st['master_pod_started_s']}s, master_started "
        f"{st['master_started_event_s']}s, first pod launched {st['first_pod_launched_s']}s "
        f"(after the master pod: {st['pods_after_master_s']}s), model-def check "
        f"{st['model_def_check_s']}s (ended after the pods: {st['check_ended_after_pods']}), "
        f"first step {adm['b_first_step_s']}s after submission",
        flush=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.time()
    export_checkout_to_children()  # the pods import benchmarks.* from this checkout
    size = job_size(args.job_type, args.slots, args.global_batch, args.solo_s)
    step_s, epochs, steps, solo = size.step_s, size.epochs, size.steps, size.solo_s
    arrival = args.arrival * solo
    print(
        f"{args.slots} slots, A and B of up to {args.slots}, {args.job_type} at global batch "
        f"{args.global_batch:g}: {steps} steps of {step_s:.3f} s = {solo:.1f} s alone; B "
        f"arrives {arrival:.1f} s after A's first step",
        flush=True,
    )
    policies: dict[str, Any] = {}
    alone: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="admission-") as tmp:
        if args.alone:
            alone = run_alone(args, Path(tmp) / "alone", size)
            print_start("alone", alone)
        for policy in args.policies:
            r = run_policy(args, policy, Path(tmp) / policy, size, arrival)
            policies[policy] = r
            adm = r["admission"]
            print(
                f"{policy:<8} B first step {adm['b_first_step_s']}s after submission "
                f"(pod created {adm['b_first_pod_created_s']}s, bound "
                f"{adm['b_first_pod_bound_s']}s); A lost {adm['a_steps_lost']} steps; "
                f"makespan={r['makespan_s']:.1f}s "
                + " ".join(f"{j['name']}: jct={j['jct_s']}s" for j in r["jobs"])
                + f" util={r['utilization']} (held {r['utilization_held']})",
                flush=True,
            )
            print_start(policy, r)
    verdict = goals(policies, alone)
    print_goals(verdict)
    report = {
        "slots": args.slots,
        "job_type": args.job_type,
        "global_batch": args.global_batch,
        "steps": steps,
        "epochs": epochs,
        "per_worker_batch": size.per_worker_batch,
        "solo_training_s": round(solo, 3),
        "arrival_s": round(arrival, 3),
        "alone": alone,
        "policies": policies,
        "goals": verdict,
        "measured_costs": {
            "step_s_by_world": {
                p: {j["name"]: j["step_s_by_world"] for j in r["jobs"]} for p, r in policies.items()
            },
            **{p: r["admission"] for p, r in policies.items()},
            "starts": {
                **({"alone": alone["starts"]} if alone is not None else {}),
                **{p: r["starts"] for p, r in policies.items()},
            },
        },
    }
    summary = {
        policy: {
            "b_first_step_s": r["admission"]["b_first_step_s"],
            "a_steps_lost": r["admission"]["a_steps_lost"],
            "makespan_s": r["makespan_s"],
            **{f"{j['name']}_jct_s": j["jct_s"] for j in r["jobs"]},
            "utilization": r["utilization"],
        }
        for policy, r in policies.items()
    }
    if alone is not None:
        summary["alone"] = {
            "b_first_step_s": alone["admission"]["b_first_step_s"],
            "b_pods_after_master_s": alone["starts"]["pods_after_master_s"],
        }
    for policy, r in policies.items():
        summary[policy]["b_pods_after_master_s"] = r["starts"]["pods_after_master_s"]
    result_out(args, "admission")
    out = write_result("scheduling", args, began, True, summary, report)
    title = f"admission into a full cluster of {args.slots} slots ({args.job_type}, compressed)"
    print(f"figure {plot_policies(out.with_suffix('.png'), policies, args.slots, title)}")
    return 0
