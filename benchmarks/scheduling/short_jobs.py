"""Short jobs beside a long one: the least-attained-service ladder against elastic FIFO, on the
test cluster.

    python -m benchmarks scheduling ladder               # 8 slots, a long job, 4 short ones
    python -m benchmarks scheduling ladder --quick       # a short smoke run

A long job (min ``--long-min``, max all ``--slots``) trains alone first; ``--arrival`` seconds
after its first step, ``--short-jobs`` short jobs (min = max = ``--short-workers``) arrive
``--spacing`` seconds apart, each training ``--short-solo-s`` alone. Two policies, each a fresh
test cluster (``benchmarks/scheduling/cluster_jobs.py``, the paced model):

- ``elastic``: the two tiers (docs/master.md): every job's first MIN workers guaranteed (one
  class), the rest opportunistic. A short job's guaranteed workers preempt the long job's
  opportunistic ones; once those are gone, short jobs wait for each other first come, first
  served, since the long job's guaranteed workers are of their own class.
- ``ladder``: every job names the ladder (``--thresholds`` compressed in time like the jobs:
  the long job leaves level 0 after seconds, a short job never does). The long job's guaranteed
  workers move down (re-created, snapshot first), so the short jobs' level-0 workers preempt
  them too: the short jobs all run at once, the long job waits (below its MIN) while they do,
  and loses no step.

Goals (docs/scheduling.md, "Short jobs beside a long one"): the short jobs' mean JCT with the
ladder at most 0.7x elastic FIFO's in the same run; the long job loses 0 steps in both.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    apply_quick,
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
    job_size,
    plot_policies,
    result_out,
)
from benchmarks.scheduling.throughput import JOB_TYPES
from kfp_elastic.job_spec import DEFAULT_LADDER_PRIORITY_CLASSES
from kfp_elastic.master.timeline import Event

POLICIES = ("elastic", "ladder")
SHORT_JCT_GOAL = 0.7  # ladder / elastic FIFO, the short jobs' mean JCT
QUICK = {
    "slots": 4,
    "long_min": 3,
    "short_jobs": 2,
    "short_workers": 1,
    "long_solo_s": 60.0,
    "short_solo_s": 8.0,
    "arrival": 25.0,
    "thresholds": "0.005,0.05",
    "min_move_interval": 5.0,
}


def build_parser() -> argparse.ArgumentParser:
    """``python -m benchmarks scheduling ladder``'s options."""
    parser = suite_parser(
        "python -m benchmarks scheduling ladder",
        __doc__,
        " ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()),
    )
    parser.add_argument("--slots", type=int, default=8, help="GPUs in the cluster")
    parser.add_argument("--long-min", type=int, default=6, help="the long job's min_workers")
    parser.add_argument("--short-jobs", type=int, default=4)
    parser.add_argument(
        "--short-workers", type=int, default=2, help="what each short job asks (min = max)"
    )
    parser.add_argument("--long-solo-s", type=float, default=300.0, help="alone on all slots")
    parser.add_argument("--short-solo-s", type=float, default=30.0, help="alone at its size")
    parser.add_argument(
        "--arrival",
        type=float,
        default=60.0,
        help="seconds after the long job's first step that the first short job arrives",
    )
    parser.add_argument("--spacing", type=float, default=2.0, help="seconds between short jobs")
    parser.add_argument(
        "--thresholds",
        default="0.05,0.5",
        help="the ladder's thresholds in GPU-hours (compressed as the jobs are: the long job "
        "passes the first within seconds, a short job never)",
    )
    parser.add_argument("--min-move-interval", type=float, default=15.0)
    parser.add_argument(
        "--starvation", type=float, default=600.0, help="longer than the short jobs take"
    )
    parser.add_argument("--job-type", choices=JOB_TYPES, default="cifar10")
    parser.add_argument("--global-batch", type=float, default=1024)
    parser.add_argument("--policies", type=comma_list, default=list(POLICIES))
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between samples")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options, checked, with ``--quick`` applied."""
    parser = build_parser()
    args = parse_options(parser, argv)
    apply_quick(args, QUICK)
    check_policies(parser, args.policies, POLICIES)
    if not 1 <= args.long_min < args.slots:
        parser.error("need 1 <= --long-min < --slots (the long job has opportunistic workers)")
    if not 1 <= args.short_workers <= args.slots or args.short_jobs < 1:
        parser.error("need --short-jobs >= 1 and 1 <= --short-workers <= --slots")
    if args.short_jobs * args.short_workers <= args.slots - args.long_min:
        parser.error(
            "the short jobs must not all fit beside the long job's MIN (else no policy matters):"
            " --short-jobs x --short-workers > --slots - --long-min"
        )
    if min(args.long_solo_s, args.short_solo_s, args.global_batch, args.interval) <= 0:
        parser.error("--long-solo-s, --short-solo-s, --global-batch, --interval must be > 0")
    if args.arrival < 0 or args.spacing < 0:
        parser.error("--arrival and --spacing must be >= 0")
    return args


def ladder_params(args: argparse.Namespace) -> dict[str, Any]:
    """The task parameters that give a job the ladder (the manifests' three levels)."""
    return {
        "ladder_priority_classes": ",".join(DEFAULT_LADDER_PRIORITY_CLASSES),
        "ladder_thresholds_gpu_h": args.thresholds,
        "ladder_min_move_interval_s": args.min_move_interval,
        "ladder_starvation_s": args.starvation,
    }


def plans(
    policy: str, args: argparse.Namespace, long_size: JobSize, short_size: JobSize
) -> list[JobPlan]:
    """The long job, then the short ones on a clock from the long job's first step."""
    extra = ladder_params(args) if policy == "ladder" else {}
    long = JobPlan("long", 0.0, args.long_min, args.slots, size=long_size, params=extra)
    shorts = [
        JobPlan(
            f"short-{k + 1}",
            args.arrival + k * args.spacing,
            args.short_workers,
            args.short_workers,
            after_first_step=True,
            after_first_job_only=True,
            size=short_size,
            params=extra,
        )
        for k in range(args.short_jobs)
    ]
    return [long, *shorts]


def analyse(result: Mapping[str, Any]) -> dict[str, Any]:
    """The short jobs' JCTs and pending times (mean, max), the long job's JCT and steps lost."""
    long, *shorts = result["jobs"]
    jcts = [j["jct_s"] for j in shorts]
    pending = [j["pending_s"] for j in shorts]
    return {
        "short_jct_s": jcts,
        "short_mean_jct_s": round(statistics.fmean(jcts), 3),
        "short_max_jct_s": max(jcts),
        "short_mean_pending_s": round(statistics.fmean(pending), 3),
        "long_jct_s": long["jct_s"],
        "long_steps_lost": long["steps_lost"],
        "steps_lost": {j["name"]: j["steps_lost"] for j in result["jobs"]},
    }


def ladder_moves(events: Sequence[Event], t0_wall: float) -> list[dict[str, Any]]:
    """A job's ladder events from its timeline, each with its time since the experiment's
    start."""
    return [
        {"t": round(e.t - t0_wall, 3), "kind": e.kind_name, **e.payload()}
        for e in events
        if "ladder" in e.kind_name or "level" in e.kind_name
    ]


def goals(policies: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """PASS/FAIL of the goals (those whose policies ran)."""
    out: dict[str, Any] = {}
    if {"elastic", "ladder"} <= set(policies):
        ratio = (
            policies["ladder"]["short_jobs"]["short_mean_jct_s"]
            / policies["elastic"]["short_jobs"]["short_mean_jct_s"]
        )
        out["short_mean_jct_ratio"] = round(ratio, 3)
        out["short_mean_jct_pass"] = ratio <= SHORT_JCT_GOAL
    for policy, r in policies.items():
        out[f"{policy}_long_steps_lost"] = r["short_jobs"]["long_steps_lost"]
        out[f"{policy}_no_step_lost_pass"] = all(
            lost == 0 for lost in r["short_jobs"]["steps_lost"].values()
        )
    return out


def run_policy(
    args: argparse.Namespace, policy: str, root: Path, long_size: JobSize, short_size: JobSize
) -> dict[str, Any]:
    with ClusterJobs(
        root,
        plans(policy, args, long_size, short_size),
        args.slots,
        args.job_type,
        args.global_batch,
        long_size.epochs,
        interval_s=args.interval,
        per_worker_batch=long_size.per_worker_batch,
    ) as jobs:
        jobs.run()
        result = jobs.result()
        result["ladder_moves"] = {
            rec.plan.name: ladder_moves(run.timeline(), jobs.t0_wall)
            for rec, run in zip(jobs.records, jobs.runs, strict=True)
        }
    result["short_jobs"] = analyse(result)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.time()
    export_checkout_to_children()  # the pods import benchmarks.* from this checkout
    long_size = job_size(args.job_type, args.slots, args.global_batch, args.long_solo_s)
    short_size = job_size(args.job_type, args.short_workers, args.global_batch, args.short_solo_s)
    print(
        f"{args.slots} slots: a long job (min {args.long_min}, {long_size.steps} steps, "
        f"{long_size.solo_s:.1f} s alone), {args.short_jobs} short jobs of {args.short_workers} "
        f"({short_size.steps} steps, {short_size.solo_s:.1f} s alone) from {args.arrival:g} s "
        f"after its first step, {args.spacing:g} s apart",
        flush=True,
    )
    policies: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ladder-") as tmp:
        for policy in args.policies:
            r = run_policy(args, policy, Path(tmp) / policy, long_size, short_size)
            policies[policy] = r
            s = r["short_jobs"]
            print(
                f"{policy:<8} short jobs: mean JCT {s['short_mean_jct_s']} s (max "
                f"{s['short_max_jct_s']} s, mean pending {s['short_mean_pending_s']} s); long "
                f"job: JCT {s['long_jct_s']} s, steps lost {s['long_steps_lost']}",
                flush=True,
            )
    verdict = goals(policies)
    if "short_mean_jct_pass" in verdict:
        print(
            f"{'PASS' if verdict['short_mean_jct_pass'] else 'FAIL'}: short jobs' mean JCT, "
            f"ladder / elastic FIFO <= {SHORT_JCT_GOAL} ({verdict['short_mean_jct_ratio']})"
        )
    for policy in policies:
        print(
            f"{'PASS' if verdict[f'{policy}_no_step_lost_pass'] else 'FAIL'}: {policy}: "
            "no job loses a step"
        )
    report = {
        "slots": args.slots,
        "long": {"min_workers": args.long_min, "steps": long_size.steps},
        "short": {"jobs": args.short_jobs, "workers": args.short_workers},
        "long_solo_s": round(long_size.solo_s, 3),
        "short_solo_s": round(short_size.solo_s, 3),
        "arrival_s": args.arrival,
        "spacing_s": args.spacing,
        "ladder": ladder_params(args),
        "job_type": args.job_type,
        "global_batch": args.global_batch,
        "policies": policies,
        "goals": verdict,
    }
    summary = {policy: r["short_jobs"] for policy, r in policies.items()} | {"goals": verdict}
    result_out(args, "ladder")
    out = write_result("scheduling", args, began, True, summary, report)
    title = (
        f"a long job and {args.short_jobs} short ones on {args.slots} slots: "
        + ", ".join(policies)
        + " (top to bottom)"
    )
    print(f"figure {plot_policies(out.with_suffix('.png'), policies, args.slots, title)}")
    return 0
