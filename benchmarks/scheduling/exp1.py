"""Experiment 1: two jobs on six slots, gang against elastic, on the test cluster.

    python -m benchmarks scheduling exp1                 # 6 slots, 2 jobs of 4, 240 s solo
    python -m benchmarks scheduling exp1 --quick         # a short smoke run

ElasticDL's experiment at a compressed time scale: 6 slots (GPUs), two jobs asking 4 each,
the second submitted at 1/8 of the first's solo training time after the first (not before the
first's first step). ``gang``: both jobs min = max = 4 (the second waits until it can have 4;
its pods that bind meanwhile hold slots but do not train). ``elastic``: min 1, max 4 (the
second starts at once on the 2 free slots and grows to 4 when the first ends). The jobs are
KFP runs on one test cluster (``benchmarks/scheduling/cluster_jobs.py``) training the timed
model definition: every step sleeps what ``--job-type`` takes for ``--global-batch`` samples on
the world's GPUs. docs/scheduling.md, "Experiment 1: two jobs on six slots", describes what is
measured.
"""

from __future__ import annotations

import argparse
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
    first_world_change_after,
    job_size,
    plot_policies,
    result_out,
    samples_from,
    window_utilization,
)
from benchmarks.scheduling.throughput import JOB_TYPES

POLICIES = ("gang", "elastic")
MAKESPAN_GOAL = 0.84  # elastic / gang, the seed's 809 s / 968 s
UTILIZATION_GOAL = 0.95  # elastic, while both jobs are in the cluster
# Few processes to start; the first job trains long enough (60 steps) for the second to start
# beside it under a loaded CI machine (its pods take 10-20 s there).
QUICK = {"solo_s": 21.0, "slots": 3, "workers": 2}


def build_parser() -> argparse.ArgumentParser:
    """``python -m benchmarks scheduling exp1``'s options."""
    parser = suite_parser(
        "python -m benchmarks scheduling exp1",
        __doc__,
        f"--solo-s {QUICK['solo_s']:g} --slots {QUICK['slots']} --workers {QUICK['workers']}",
    )
    parser.add_argument("--slots", type=int, default=6, help="GPUs in the cluster")
    parser.add_argument("--workers", type=int, default=4, help="what each job asks (max)")
    parser.add_argument("--job-type", choices=JOB_TYPES, default="cifar10")
    parser.add_argument(
        "--global-batch", type=float, default=1024, help="samples per step the pacing assumes"
    )
    parser.add_argument(
        "--solo-s",
        type=float,
        default=240.0,
        help="a job's training seconds alone at --workers (sets its steps; long against the "
        "pods' start, tens of seconds on a loaded machine)",
    )
    parser.add_argument("--policies", type=comma_list, default=list(POLICIES))
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between samples")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options, checked, with ``--quick`` applied."""
    parser = build_parser()
    args = parse_options(parser, argv)
    if args.quick:
        args.solo_s, args.slots, args.workers = QUICK["solo_s"], QUICK["slots"], QUICK["workers"]
    check_policies(parser, args.policies, POLICIES)
    if not 1 <= args.workers <= args.slots < 2 * args.workers:
        parser.error("need 1 <= --workers <= --slots < 2 * --workers (the jobs must contend)")
    if args.solo_s <= 0 or args.global_batch <= 0 or args.interval <= 0:
        parser.error("--solo-s, --global-batch and --interval must be > 0")
    return args


def plans(policy: str, workers: int, second_submit_s: float) -> list[JobPlan]:
    """The two jobs of ``policy``: gang asks exactly ``workers``, elastic 1 to ``workers``."""
    low = workers if policy == "gang" else 1
    return [
        JobPlan("job-1", 0.0, low, workers),
        JobPlan("job-2", second_submit_s, low, workers),
    ]


def both_running(jobs: Sequence[Mapping[str, Any]]) -> tuple[float | None, float | None]:
    """The window in which both jobs are in the cluster: the second's submission to the
    first's end."""
    return jobs[1]["submit_s"], jobs[0]["end_s"]


def costs(policy: str, jobs: Sequence[Mapping[str, Any]], steps: Sequence[Any]) -> dict:
    """What a simulator needs, measured in this policy's run: each job's submission -> its first
    worker pod bound (the master pod's start, then scheduling), its pod start (the bind of the
    pod that completed its first world -> its first step), and for the second job the
    wait from the first's capacity freed (its first worker pod gone) to the first step of the
    second's bigger world (elastic: join) or its first step (gang: start)."""
    out: dict[str, Any] = {"pod_start_s": {}, "submit_to_first_bind_s": {}}
    for job in jobs:
        binds = [p["bound_s"] for p in job["pods"].values() if p["bound_s"] is not None]
        if binds and job["submit_s"] is not None:  # the master's start, then scheduling
            out["submit_to_first_bind_s"][job["name"]] = round(min(binds) - job["submit_s"], 3)
        first, world = job["first_step_s"], (job["worlds"] or [[None, 0]])[0][1]
        bound = sorted(
            p["bound_s"]
            for p in job["pods"].values()
            if p["bound_s"] is not None and first is not None and p["bound_s"] <= first
        )
        if first is not None and len(bound) >= world >= 1:
            out["pod_start_s"][job["name"]] = round(first - bound[world - 1], 3)
    gone = [p["gone_s"] for p in jobs[0]["pods"].values() if p["gone_s"] is not None]
    freed = min(gone) if gone else None
    out["first_freed_s"] = freed
    if freed is not None and jobs[1]["first_step_s"] is not None:
        if jobs[1]["first_step_s"] > freed:  # gang: it starts only then
            out["gang_start_after_free_s"] = round(jobs[1]["first_step_s"] - freed, 3)
        else:
            grown = first_world_change_after(steps[1], freed)
            if grown is not None:
                out["join_s"] = round(grown.t - freed, 3)
    return out


def run_policy(args: argparse.Namespace, policy: str, root: Path, size: JobSize, second: float):
    with ClusterJobs(
        root,
        plans(policy, args.workers, second),
        args.slots,
        args.job_type,
        args.global_batch,
        size.epochs,
        interval_s=args.interval,
        per_worker_batch=size.per_worker_batch,
    ) as jobs:
        jobs.run()
        result = jobs.result()
        steps = [r.steps for r in jobs.records]
    start, end = both_running(result["jobs"])
    training = samples_from(result["training_samples"])
    held = samples_from(result["held_samples"])
    result["both_running_s"] = [start, end]
    result["utilization_both_running"] = window_utilization(training, args.slots, start, end)
    result["utilization_both_running_held"] = window_utilization(held, args.slots, start, end)
    result["measured"] = costs(policy, result["jobs"], steps)
    return result


def goals(policies: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """PASS/FAIL of the two goals (None where a policy did not run)."""
    out: dict[str, Any] = {}
    if "gang" in policies and "elastic" in policies:
        ratio = policies["elastic"]["makespan_s"] / policies["gang"]["makespan_s"]
        out["makespan_ratio"] = round(ratio, 3)
        out["makespan_pass"] = ratio <= MAKESPAN_GOAL
    if "elastic" in policies:
        util = policies["elastic"]["utilization_both_running"]
        out["utilization_both_running"] = util
        out["utilization_pass"] = util is not None and util >= UTILIZATION_GOAL
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.time()
    export_checkout_to_children()  # the pods import benchmarks.* from this checkout
    size = job_size(args.job_type, args.workers, args.global_batch, args.solo_s)
    step_s, epochs, steps, solo = size.step_s, size.epochs, size.steps, size.solo_s
    second = solo / 8
    print(
        f"{args.slots} slots, 2 jobs of {args.workers}, {args.job_type} at global batch "
        f"{args.global_batch:g}: {steps} steps of {step_s:.3f} s = {solo:.1f} s alone; the "
        f"second {second:.1f} s after the first",
        flush=True,
    )
    policies: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="exp1-") as tmp:
        for policy in args.policies:
            r = run_policy(args, policy, Path(tmp) / policy, size, second)
            policies[policy] = r
            jobs = r["jobs"]
            print(
                f"{policy:<8} makespan={r['makespan_s']:.1f}s "
                + " ".join(
                    f"{j['name']}: pending={j['pending_s']}s jct={j['jct_s']}s" for j in jobs
                )
                + f" util={r['utilization']} util_both={r['utilization_both_running']}"
                f" (held {r['utilization_both_running_held']})",
                flush=True,
            )
    verdict = goals(policies)
    for key, goal, value in (
        ("makespan_pass", f"elastic/gang makespan <= {MAKESPAN_GOAL}", "makespan_ratio"),
        (
            "utilization_pass",
            f"utilization while both run >= {UTILIZATION_GOAL}",
            "utilization_both_running",
        ),
    ):
        if key in verdict:
            print(f"{'PASS' if verdict[key] else 'FAIL'}: {goal} ({verdict[value]})")
    measured = {
        "step_s_by_world": {
            policy: {j["name"]: j["step_s_by_world"] for j in r["jobs"]}
            for policy, r in policies.items()
        },
        **{policy: r["measured"] for policy, r in policies.items()},
    }
    report = {
        "slots": args.slots,
        "workers": args.workers,
        "job_type": args.job_type,
        "global_batch": args.global_batch,
        "steps": steps,
        "epochs": epochs,
        "per_worker_batch": size.per_worker_batch,
        "solo_training_s": round(solo, 3),
        "second_submit_s": round(second, 3),
        "policies": policies,
        "goals": verdict,
        "measured_costs": measured,
    }
    summary = {
        policy: {
            "makespan_s": r["makespan_s"],
            "utilization_both_running": r["utilization_both_running"],
            **{f"{j['name']}_jct_s": j["jct_s"] for j in r["jobs"]},
        }
        for policy, r in policies.items()
    } | {"goals": verdict}
    result_out(args, "exp1")
    out = write_result("scheduling", args, began, True, summary, report)
    title = (
        f"two jobs of {args.workers} on {args.slots} slots ({args.job_type}, time compressed):"
        " gang above, elastic below"
    )
    print(f"figure {plot_policies(out.with_suffix('.png'), policies, args.slots, title)}")
    return 0
