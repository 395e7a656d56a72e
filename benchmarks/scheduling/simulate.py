"""A discrete-event simulation of a GPU cluster replaying a trace, gang against elastic.

    python -m benchmarks scheduling simulate \\
        --gpus 64 --jobs 80,160,320 --start-hour 8 --window-hours 8 --seed 1 \\
        --policies gang,elastic --json out.json
    python -m benchmarks scheduling simulate --quick   # 12 jobs on 8 GPUs
    python -m benchmarks scheduling simulate --gpus 64,512 --load 8,16,24 --json out.json
    python -m benchmarks scheduling simulate --workload exp1.json --json out.json

Samples ``--jobs`` jobs of ``--trace`` (default: the Philly trace in the repository,
``benchmarks/scheduling/data/philly.csv.gz``; a plain CSV is read too) submitted within
``--window-hours`` from ``--start-hour`` of the day (any day of the trace; duration >= 60 s, GPU
time < 1000 h; uniformly among the eligible jobs, seeded: ``benchmarks/scheduling/trace.py``)
and runs each policy over the same workload on ``--gpus`` GPUs
(``benchmarks/scheduling/simulator.py`` describes the model, the policies, the costs and the
metrics). ``--gpus`` and ``--jobs`` take comma-separated lists: every pair runs,
each with its own sample. The result file holds ``runs`` (one per pair) and, when there is one
pair, its ``policies`` at the top: ``{"policies": {"gang": {...}, "elastic": {...}}}``.
``--load L`` (a list) samples ``round(L × gpus)`` jobs per cluster size instead of ``--jobs``.
``--seeds 1-10`` runs every configuration once per seed and adds ``spread``: elastic/gang's JCT
and pending ratios over the seeds (``benchmarks/scheduling/seeds.py``).
A PNG next to the JSON draws the average JCT and the mean pending time against the load.

``--workload FILE`` simulates experiment 1's jobs instead (an experiment-1 result file:
``benchmarks/scheduling/workload.py``), with its measured costs, and prints the simulated
makespan and JCTs against the measured ones (relative error, PASS within 10 %); its PNG draws
the slots each job holds over time.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness import (
    check_policies,
    comma_list,
    parse_options,
    recorded_path,
    suite_parser,
    write_result,
)
from benchmarks.scheduling import workload
from benchmarks.scheduling.figures import load_title, plot_loads, png_next_to
from benchmarks.scheduling.occupancy import plot_slots
from benchmarks.scheduling.seeds import mean_runs, parse_seeds, spread
from benchmarks.scheduling.simulator import (
    ALL_POLICIES,
    GPUS_PER_NODE,
    JOIN_S,
    MIN_RULES,
    POLICIES,
    SCALINGS,
    SHRINK_S,
    Costs,
    min_workers_of,
    simulate,
)
from benchmarks.scheduling.trace import DEFAULT_TRACE, read_trace, sample

QUICK = {"gpus": [8], "jobs": [12]}


def _counts(text: str) -> list[int]:
    try:
        values = [int(v) for v in comma_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _loads(text: str) -> list[float]:
    try:
        values = [float(v) for v in comma_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected numbers > 0, got {text!r}")
    return values


def _seeds(text: str) -> list[int]:
    try:
        return parse_seeds(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _min_rule(text: str) -> int | str:
    if text in MIN_RULES:
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"expected an integer >= 1 or one of {', '.join(MIN_RULES)}, got {text!r}"
        )
    return value


def build_parser() -> argparse.ArgumentParser:
    """``python -m benchmarks scheduling simulate``'s options."""
    parser = suite_parser(
        "python -m benchmarks scheduling simulate",
        __doc__,
        f"--gpus {QUICK['gpus'][0]} --jobs {QUICK['jobs'][0]}",
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="the result file (the same as --out)"
    )
    parser.add_argument(
        "--trace",
        type=Path,
        default=DEFAULT_TRACE,
        help=f"a philly.csv, gzipped or plain (default {recorded_path(DEFAULT_TRACE)})",
    )
    parser.add_argument("--gpus", type=_counts, default=[64], help="GPUs in the cluster (list)")
    parser.add_argument("--jobs", type=_counts, default=[160], help="jobs to sample (list)")
    parser.add_argument(
        "--load",
        type=_loads,
        default=None,
        help="jobs per GPU to sample (list; round(load × gpus) jobs), instead of --jobs",
    )
    parser.add_argument(
        "--workload",
        type=Path,
        default=None,
        help="an experiment-1 result file: simulate its jobs with its measured costs and "
        "compare (benchmarks/scheduling/workload.py)",
    )
    parser.add_argument(
        "--pace",
        choices=workload.PACES,
        default="curve",
        help="with --workload: a step lasts the curve's time (curve), or that times how much "
        "slower the run's gang jobs trained than the curve (measured: the runtime's pauses "
        "and the machine's load in one factor)",
    )
    parser.add_argument("--start-hour", type=float, default=8.0, help="window start, hour of day")
    parser.add_argument("--window-hours", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--seeds",
        type=_seeds,
        default=None,
        help="several seeds instead of --seed (1-10, or 1,2,5): every configuration once per "
        "seed, each its own sample; adds the ratios' spread over the seeds",
    )
    parser.add_argument(
        "--policies",
        type=comma_list,
        default=list(POLICIES),
        help="gang, elastic (the default: both), elastic-ladder, tiresias",
    )
    parser.add_argument(
        "--scaling",
        choices=SCALINGS,
        default="linear",
        help="a job's speed at w GPUs: linear, or its type's measured curve (pollux)",
    )
    parser.add_argument(
        "--min-workers",
        type=_min_rule,
        default=1,
        help="elastic MIN (guaranteed workers) per job: a number (at most the job's GPUs), "
        "one (1) or half (ceil(GPUs / 2))",
    )
    parser.add_argument("--gpus-per-node", type=int, default=GPUS_PER_NODE)
    parser.add_argument(
        "--join-s",
        type=float,
        default=JOIN_S,
        help="a bound worker's wait before it trains (docs/benchmarks.md: capacity freed -> "
        "first step of the bigger world, worker pods)",
    )
    parser.add_argument(
        "--shrink-s",
        type=float,
        default=SHRINK_S,
        help="a job's pause when it loses a worker (docs/benchmarks.md: preemption -> first "
        "step of the smaller world, worker pods)",
    )
    parser.add_argument(
        "--start-s",
        type=float,
        default=None,
        help="a worker bound while its job does not train: its wait before the first step "
        "(default: --join-s)",
    )
    parser.add_argument(
        "--join-pause-s",
        type=float,
        default=0.0,
        help="the part of --join-s during which the job's running world stands still",
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options, checked, with ``--quick`` applied."""
    parser = build_parser()
    args = parse_options(parser, argv)
    if args.json is not None:
        if args.out is not None:
            parser.error("give --json or --out, not both")
        args.out = args.json
    if args.quick:
        args.gpus, args.jobs = QUICK["gpus"], QUICK["jobs"]
    check_policies(parser, args.policies, ALL_POLICIES)
    if args.gpus_per_node < 1:
        parser.error("--gpus-per-node must be >= 1")
    if min(args.join_s, args.shrink_s, args.join_pause_s, args.start_s or 0.0) < 0:
        parser.error("--join-s, --shrink-s, --start-s and --join-pause-s must be >= 0")
    if args.join_pause_s > args.join_s:
        parser.error("--join-pause-s is part of --join-s: at most --join-s")
    if args.quick and args.workload is not None:
        parser.error("--quick samples a trace; a --workload run is already small")
    return args


def _jobs_per_size(args: argparse.Namespace, gpus: int) -> list[int]:
    if args.load is None:
        return args.jobs
    return [max(1, round(load * gpus)) for load in args.load]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.time()
    if args.workload is not None:
        return _main_workload(args, began)
    try:
        trace = read_trace(args.trace)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    costs = Costs(args.join_s, args.shrink_s, args.start_s, args.join_pause_s)
    seeds = args.seeds or [args.seed]
    runs = []
    for gpus in args.gpus:
        for count in _jobs_per_size(args, gpus):
            for seed in seeds:
                try:
                    jobs = sample(trace, count, args.start_hour, args.window_hours, seed, gpus)
                except ValueError as error:
                    print(f"error: {error}", file=sys.stderr)
                    return 2
                runs.append(_run(args, costs, jobs, gpus, count, seed))
    summary = {
        f"{run['gpus']}gpus_{run['jobs']}jobs"
        + (f"_seed{run['seed']}" if len(seeds) > 1 else ""): {
            policy: {"avg_jct_s": m["avg_jct_s"], "makespan_s": m["makespan_s"]}
            for policy, m in run["policies"].items()
        }
        for run in runs
    }
    report: dict = {"runs": runs}
    if len(runs) == 1:
        report["policies"] = runs[0]["policies"]
    if len(seeds) > 1:
        report["spread"] = spread(runs)
        for row in report["spread"]:
            print(_spread_line(row), flush=True)
    out = write_result("scheduling", args, began, True, summary, report)
    drawn = mean_runs(runs) if len(seeds) > 1 else runs
    figure = plot_loads(drawn, png_next_to(out), load_title(vars(args)))
    print(f"wrote {figure}")
    return 0


def _run(
    args: argparse.Namespace, costs: Costs, jobs: list, gpus: int, count: int, seed: int
) -> dict:
    """Every policy over one sample: the run's entry of the result file."""
    policies = {}
    for policy in args.policies:
        t0 = time.monotonic()
        result = simulate(
            jobs, gpus, policy, costs, args.scaling, args.min_workers, args.gpus_per_node
        )
        wall = time.monotonic() - t0
        policies[policy] = {**result.as_dict(), "wall_s": round(wall, 2)}
        print(
            f"gpus={gpus} jobs={count} seed={seed} {policy:<8} "
            f"avg_jct={result.avg_jct_s:9.0f}s p99={result.p99_jct_s:9.0f}s "
            f"makespan={result.makespan_s:9.0f}s util={result.utilization:.3f} "
            f"idle_waiting={result.idle_while_waiting:.3f} resizes={result.resizes} "
            f"({wall:.1f} s to simulate)",
            flush=True,
        )
    return {
        "gpus": gpus,
        "jobs": count,
        "jobs_per_gpu": round(count / gpus, 3),
        "seed": seed,
        "requested_gpus": sum(j.gpus for j in jobs),
        "multi_gpu_jobs": sum(j.gpus > 1 for j in jobs),
        "guaranteed_gpus": sum(min_workers_of(j.gpus, args.min_workers) for j in jobs),
        "work_gpu_s": round(sum(j.work for j in jobs), 1),
        "policies": policies,
    }


def _spread_line(row: dict) -> str:
    def part(name: str) -> str:
        d = row[name]
        if d is None:
            return f"{name} -"
        ci = d["ci95"] or [d["mean"], d["mean"]]
        met = row[f"{name}_goal_met"]
        return (
            f"{name} {d['mean']:.2f} (95% CI {ci[0]:.2f}-{ci[1]:.2f}, range "
            f"{d['min']:.2f}-{d['max']:.2f}, goal met on {met}/{d['n']})"
        )

    return (
        f"gpus={row['gpus']} jobs={row['jobs']} over {len(row['seeds'])} seeds: "
        f"{part('jct_ratio')}; {part('pending_ratio')}"
    )


def _main_workload(args: argparse.Namespace, began: float) -> int:
    """Simulate an experiment-1 result's jobs and compare with what it measured."""
    try:
        measured = workload.read_measured(args.workload)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    policies = [p for p in args.policies if p in measured.jobs]
    if not policies:
        print(f"error: {args.workload} measured none of {args.policies}", file=sys.stderr)
        return 2
    simulated = {p: workload.simulate_measured(measured, p, pace=args.pace) for p in policies}
    comparison = workload.compare(measured, simulated)
    for line in workload.comparison_lines(comparison):
        print(line)
    report = {
        "workload": recorded_path(args.workload),
        "slots": measured.slots,
        "job_type": measured.job_type,
        "costs": {p: vars(c) for p, c in measured.costs.items()},
        "step_s": workload.step_check(measured),
        "pace": args.pace,
        "pace_factor": round(workload.pace_factor(measured), 4) if args.pace == "measured" else 1.0,
        "policies": {p: sim.result.as_dict() for p, sim in simulated.items()},
        "comparison": comparison,
    }
    summary = {
        p: {
            "makespan_s": round(sim.result.makespan_s, 1),
            "measured_makespan_s": measured.makespan_s[p],
        }
        for p, sim in simulated.items()
    }
    out = write_result("scheduling", args, began, True, summary, report)
    figure = plot_slots(
        {f"{p} (simulated)": simulated[p].samples for p in policies},
        measured.slots,
        png_next_to(out),
        f"simulated slots per job: {args.workload.name}",
    )
    print(f"wrote {figure}")
    return 0
