"""A steady load: Poisson arrivals of trace-sampled jobs at an offered load, measured over a
window that leaves out warm-up and drain, for gang FIFO, Tiresias, elastic FIFO and elastic with
the least-attained-service ladder.

    python -m benchmarks scheduling steady                      # 64 and 512 GPUs, 0.6..1.2
    python -m benchmarks scheduling steady --gpus 64 --load 1.0 --seeds 1-3
    python -m benchmarks scheduling steady --quick              # a tiny smoke run

**Arrivals**: jobs drawn uniformly (with replacement) from the Philly trace's eligible jobs
(``trace.eligible``; a job asking more GPUs than the cluster has is cut to it, its GPU time
kept), submitted by a Poisson process of rate ``L × GPUs / E[GPU-seconds per job]``: the
offered load ``L`` is the GPU time arriving per second over the cluster's capacity. Arrivals run
for ``--warmup-h + --window-h + --cooldown-h`` hours.

**Measured** (as Pollux and Tiresias report a steady state): the jobs that arrive within the
window ``[warmup, warmup + window)``: their mean and 99th-percentile JCT and mean pending time
(submission to first step); utilization and idle GPUs while a job waits over the window's time
only. The jobs arriving in the cool-down keep the cluster loaded while the measured ones finish;
every job runs to its end.

**Policies** (``benchmarks/scheduling/simulator.py``): ``gang`` (first-in first-out with
backfill), ``tiresias`` (gang + the ladder's levels, whole-job preemption, ``restart_s`` per
restart), ``elastic`` (two tiers, first come first served), ``elastic-ladder`` (the product's
ladder, ``kfp_elastic.master.ladder``). Every configuration runs each seed's same arrivals under
every policy; ratios are per seed, their mean with a 95 % t-interval over the seeds.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    apply_quick,
    check_policies,
    comma_list,
    parse_options,
    suite_parser,
    write_result,
)
from benchmarks.scheduling.cluster_jobs import result_out
from benchmarks.scheduling.seeds import describe, parse_seeds
from benchmarks.scheduling.simulator import (
    ALL_POLICIES,
    SHRINK_S,
    STOP_S,
    Costs,
    Simulation,
    percentile,
)
from benchmarks.scheduling.trace import DEFAULT_TRACE, Job, TraceJob, eligible, read_trace
from kfp_elastic.job_spec import (
    DEFAULT_LADDER_MIN_MOVE_INTERVAL_S,
    DEFAULT_LADDER_PRIORITY_CLASSES,
    DEFAULT_LADDER_STARVATION_S,
    DEFAULT_LADDER_THRESHOLDS_GPU_H,
)
from kfp_elastic.master.ladder import LadderPolicy

HOUR = 3600.0
JCT_GOAL_GANG = 0.6  # elastic-ladder / gang mean JCT, at most
JCT_GOAL_TIRESIAS = 0.85  # elastic-ladder / tiresias mean JCT, at most
PENDING_GOAL = 0.2  # elastic-ladder / gang mean pending, at most
QUICK = {"gpus": [16], "load": [1.0], "seeds": [1, 2], "warmup_h": 2.0, "window_h": 4.0}


def build_parser() -> argparse.ArgumentParser:
    """``python -m benchmarks scheduling steady``'s options."""
    parser = suite_parser(
        "python -m benchmarks scheduling steady",
        __doc__,
        "--gpus 16 --load 1.0 --seeds 1,2 --warmup-h 2 --window-h 4",
    )
    parser.add_argument("--gpus", type=lambda t: [int(x) for x in comma_list(t)], default=[64, 512])
    parser.add_argument(
        "--load",
        type=lambda t: [float(x) for x in comma_list(t)],
        default=[0.6, 0.8, 1.0, 1.2],
        help="offered loads (GPU time arriving / capacity)",
    )
    parser.add_argument("--seeds", type=parse_seeds, default=list(range(1, 11)))
    parser.add_argument("--policies", type=comma_list, default=["gang", *ALL_POLICIES[1:]])
    parser.add_argument("--warmup-h", type=float, default=12.0)
    parser.add_argument("--window-h", type=float, default=24.0)
    parser.add_argument("--cooldown-h", type=float, default=None, help="default: --window-h / 2")
    parser.add_argument(
        "--min-workers",
        default="half",
        help="elastic jobs' MIN: one, half (ceil of half the request) or a number",
    )
    parser.add_argument(
        "--thresholds",
        type=parse_thresholds,
        action="append",
        help="the ladder's thresholds in GPU-hours (comma-separated, increasing; one per level "
        "but the last); repeat it to compare ladders in one run (default: the product's "
        + ",".join(f"{h:g}" for h in DEFAULT_LADDER_THRESHOLDS_GPU_H)
        + ")",
    )
    parser.add_argument(
        "--starvation-s",
        type=float,
        default=DEFAULT_LADDER_STARVATION_S,
        help="the ladder's starvation time (default: the product's %(default)g s)",
    )
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    return parser


def parse_thresholds(text: str) -> tuple[float, ...]:
    """``"1,10"`` -> (1.0, 10.0) GPU-hours."""
    return tuple(float(x) for x in comma_list(text))


def ladder_of(thresholds_gpu_h: Sequence[float], starvation_s: float) -> LadderPolicy:
    """The product's ladder rule with these thresholds: one level more than thresholds (the
    product's class names while they last); ``ValueError`` as the product refuses a ladder."""
    levels = len(thresholds_gpu_h) + 1
    names = list(DEFAULT_LADDER_PRIORITY_CLASSES[:levels])
    names += [f"kfp-elastic-worker-level-{k}" for k in range(len(names), levels)]
    return LadderPolicy(
        priority_classes=tuple(names),
        thresholds_gpu_s=tuple(h * HOUR for h in thresholds_gpu_h),
        starvation_s=starvation_s,
        min_move_interval_s=min(DEFAULT_LADDER_MIN_MOVE_INTERVAL_S, starvation_s),
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parse_options(parser, argv)
    apply_quick(args, QUICK)
    check_policies(parser, args.policies, ALL_POLICIES)
    if min(args.load) <= 0 or min(args.gpus) < 1:
        parser.error("--load must be > 0 and --gpus >= 1")
    if args.warmup_h < 0 or args.window_h <= 0:
        parser.error("--warmup-h must be >= 0 and --window-h > 0")
    if args.cooldown_h is None:
        args.cooldown_h = args.window_h / 2
    args.thresholds = args.thresholds or [DEFAULT_LADDER_THRESHOLDS_GPU_H]
    try:
        args.ladders = [ladder_of(t, args.starvation_s) for t in args.thresholds]
    except ValueError as error:
        parser.error(f"--thresholds/--starvation-s: {error}")
    if args.min_workers not in ("one", "half"):
        try:
            args.min_workers = int(args.min_workers)
        except ValueError:
            parser.error("--min-workers: one, half or a number")
    return args


def mean_gpu_seconds(pool: Sequence[TraceJob]) -> float:
    return statistics.fmean(j.gpu_time_s for j in pool)


def arrivals(
    pool: Sequence[TraceJob], gpus: int, load: float, hours: float, seed: int
) -> list[Job]:
    """Poisson arrivals over ``hours`` at offered ``load`` of ``gpus``, each job drawn from
    ``pool`` (cut to the cluster's size, its GPU time kept)."""
    rng = random.Random(seed)
    rate = load * gpus / mean_gpu_seconds(pool)  # jobs per second
    jobs, t, k = [], 0.0, 0
    while True:
        t += rng.expovariate(rate)
        if t >= hours * HOUR:
            return jobs
        job = rng.choice(pool)
        jobs.append(Job(f"j{k}-{job.name}", t, min(job.gpus, gpus), job.gpu_time_s))
        k += 1


def run_one(
    jobs: Sequence[Job],
    gpus: int,
    policy: str,
    window: tuple[float, float],
    costs: Costs,
    min_workers: int | str,
    ladder: LadderPolicy | None = None,
) -> dict[str, Any]:
    """One policy over one arrival sequence: the window's metrics (``ladder``: the ladder of
    ``elastic-ladder`` and ``tiresias``, default the product's)."""
    sim = Simulation(
        jobs, gpus, policy, costs, min_workers=min_workers, window=window, ladder=ladder
    )
    began = time.perf_counter()
    result = sim.run()
    measured = [j for j in jobs if window[0] <= j.submit_s < window[1]]
    times = [sim.job_times[j.name] for j in measured]
    jct = [end - submit for submit, _, end in times]
    pending = [first - submit for submit, first, _ in times]
    span = (window[1] - window[0]) * gpus
    return {
        "jobs": len(measured),
        "mean_jct_s": statistics.fmean(jct),
        "p99_jct_s": percentile(jct, 99),
        "mean_pending_s": statistics.fmean(pending),
        # every measured job started at its submission, at its own size, never stopped: no
        # policy whose jobs grow at most to their request does better
        "ideal_mean_jct_s": statistics.fmean(j.work / j.gpus for j in measured),
        "utilization": sim.held_s / span,
        "idle_while_waiting": sim.idle_waiting_s / span,
        "preemptions": result.preemptions,
        "ladder_moves": result.ladder_moves,
        "wall_s": time.perf_counter() - began,
    }


RATIOS = (
    ("jct_vs_gang", "mean_jct_s", "gang"),
    ("jct_vs_tiresias", "mean_jct_s", "tiresias"),
    ("pending_vs_gang", "mean_pending_s", "gang"),
    ("p99_vs_gang", "p99_jct_s", "gang"),
)


def ratios(by_policy: Mapping[str, Mapping[str, float]], policy: str) -> dict[str, float]:
    """``policy``'s numbers over the baselines', on one seed."""
    out = {}
    for name, metric, base in RATIOS:
        if policy in by_policy and base in by_policy and by_policy[base][metric] > 0:
            out[name] = by_policy[policy][metric] / by_policy[base][metric]
    return out


def summarize(runs: Sequence[Mapping[str, Any]], policies: Sequence[str]) -> dict[str, Any]:
    """Over the seeds of one configuration: each policy's metrics, and each elastic policy's
    ratios against gang and Tiresias, described (mean, 95 % interval, range)."""
    out: dict[str, Any] = {"policies": {}, "ratios": {}}
    for policy in policies:
        out["policies"][policy] = {
            key: describe([r["by_policy"][policy][key] for r in runs])
            for key in ("mean_jct_s", "p99_jct_s", "mean_pending_s", "utilization")
            + ("idle_while_waiting",)
        }
    # the lowest mean JCT ratio to gang any policy can reach here (jobs at most their request)
    if "gang" in policies:
        out["ideal_jct_vs_gang"] = describe(
            [
                r["by_policy"]["gang"]["ideal_mean_jct_s"] / r["by_policy"]["gang"]["mean_jct_s"]
                for r in runs
            ]
        )
    for policy in ("elastic", "elastic-ladder"):
        per_seed = [ratios(r["by_policy"], policy) for r in runs if policy in r["by_policy"]]
        names = {n for ratio in per_seed for n in ratio}
        out["ratios"][policy] = {
            n: describe([ratio[n] for ratio in per_seed if n in ratio]) for n in sorted(names)
        }
    ladder = out["ratios"].get("elastic-ladder", {})

    def below(name: str, goal: float) -> bool | None:
        return None if name not in ladder else ladder[name]["mean"] <= goal

    out["goals"] = {
        f"jct_vs_gang_le_{JCT_GOAL_GANG}": below("jct_vs_gang", JCT_GOAL_GANG),
        f"jct_vs_tiresias_le_{JCT_GOAL_TIRESIAS}": below("jct_vs_tiresias", JCT_GOAL_TIRESIAS),
        f"pending_vs_gang_le_{PENDING_GOAL}": below("pending_vs_gang", PENDING_GOAL),
        "p99_vs_gang_le_1": below("p99_vs_gang", 1.0),
    }
    return out


def costs_of() -> Costs:
    """The measured costs with the ones the first model left out: a victim's graceful stop
    (``STOP_S``) and a growing world's pause (``SHRINK_S``: the nearest measured pause of a world
    that re-forms its round; the join's own pause is not measured)."""
    return Costs(stop_s=STOP_S, join_pause_s=SHRINK_S)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.time()
    pool = [j for j in read_trace(args.trace) if eligible(j)]
    costs = costs_of()
    hours = args.warmup_h + args.window_h + args.cooldown_h
    window = (args.warmup_h * HOUR, (args.warmup_h + args.window_h) * HOUR)
    configs = []
    for thresholds, ladder in zip(args.thresholds, args.ladders, strict=True):
        for gpus in args.gpus:
            for load in args.load:
                configs.append(
                    run_config(args, pool, costs, hours, window, gpus, load, thresholds, ladder)
                )
    several = len(args.thresholds) > 1
    summary = {
        config_key(c, several): {
            "ladder_jct_vs_gang": _mean(c, "jct_vs_gang"),
            "ladder_jct_vs_tiresias": _mean(c, "jct_vs_tiresias"),
            "ladder_pending_vs_gang": _mean(c, "pending_vs_gang"),
            "ladder_p99_vs_gang": _mean(c, "p99_vs_gang"),
            "ideal_jct_vs_gang": c.get("ideal_jct_vs_gang", {}).get("mean"),
        }
        for c in configs
    }
    report = {
        "trace": "benchmarks/scheduling/data/philly.csv.gz",
        "eligible_jobs": len(pool),
        "mean_gpu_seconds_per_job": round(mean_gpu_seconds(pool), 1),
        "costs": vars(costs),
        "window_s": list(window),
        "configs": configs,
    }
    result_out(args, "steady")
    write_result("scheduling", args, began, True, summary, report)
    return 0


def run_config(
    args: argparse.Namespace,
    pool: Sequence[TraceJob],
    costs: Costs,
    hours: float,
    window: tuple[float, float],
    gpus: int,
    load: float,
    thresholds: Sequence[float],
    ladder: LadderPolicy,
) -> dict[str, Any]:
    """Every seed's arrivals at ``load`` on ``gpus`` under every policy; printed as it ends."""
    started = time.perf_counter()
    runs = []
    for seed in args.seeds:
        jobs = arrivals(pool, gpus, load, hours, seed)
        by_policy = {
            p: run_one(jobs, gpus, p, window, costs, args.min_workers, ladder)
            for p in args.policies
        }
        runs.append({"seed": seed, "arrivals": len(jobs), "by_policy": by_policy})
    summary = summarize(runs, args.policies)
    wall = time.perf_counter() - started
    ladder_ratios = summary["ratios"].get("elastic-ladder", {})
    shown = ", ".join(
        f"{name} {d['mean']:.3f} [{d['ci95'][0]:.3f}, {d['ci95'][1]:.3f}]"
        if d["ci95"]
        else f"{name} {d['mean']:.3f}"
        for name, d in ladder_ratios.items()
    )
    print(
        f"{gpus} GPUs, load {load:g}, thresholds {','.join(f'{h:g}' for h in thresholds)} "
        f"GPU-h: {statistics.fmean(r['arrivals'] for r in runs):.0f} jobs per seed, "
        f"{wall:.0f} s; elastic-ladder: {shown}",
        flush=True,
    )
    return {
        "gpus": gpus,
        "load": load,
        "thresholds_gpu_h": list(thresholds),
        "starvation_s": ladder.starvation_s,
        "wall_s": round(wall, 1),
        **summary,
        "runs": runs,
    }


def config_key(config: Mapping[str, Any], with_thresholds: bool) -> str:
    """``64gpu_load1.2`` (``_ladder1,10`` added when the run compares ladders)."""
    key = f"{config['gpus']}gpu_load{config['load']:g}"
    if with_thresholds:
        key += "_ladder" + ",".join(f"{h:g}" for h in config["thresholds_gpu_h"])
    return key


def _mean(config: Mapping[str, Any], name: str) -> float | None:
    found = config["ratios"].get("elastic-ladder", {}).get(name)
    return None if found is None or math.isnan(found["mean"]) else found["mean"]
