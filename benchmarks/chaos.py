"""Seeded chaos at one longer training job on the test cluster: is it right, what each event costs.

    python -m benchmarks chaos --seed 1 --events 20
    python -m benchmarks chaos --seeds 1,2,3,4,5 --events 10   # one seed after another
    python -m benchmarks chaos --quick        # 3 events

The chaos test (``tests/e2e/test_chaos.py``) at length, through the same
``chaos.run_chaos``: the compiled ``elastic-train`` task as the master pod with the production
settings on three one-worker nodes, and a ``plan_chaos`` plan whose events are spread over the
whole run (by committed step, up to 90 % of it) fired by the ``ChaosExecutor``. Workers commit
every step (``snapshot_every=1``), so the recovery printed per event is event -> the first step
of the next world for events that took a participant of the rendezvous round (its worker
preempted, killed, its node removed: the first commit after a round without it), and event ->
the next step for the others (etcd restarted, master deleted, capacity added, a worker that had
not joined yet, a node without a member). Each wait is bounded (``--event-timeout``). Checks,
each printed PASS or FAIL: events (each fired and recovered), completion, exactly-once (the
model's per-sample counts and etcd's shard queues), accuracy within 1 point of an undisturbed
run of the same model definition, global batch, shard manifest and seed (a static local
torchrun job, measured in the same run), and no pod or process left. Exits 1 when any check of
any seed failed; writes the JSON report described in ``benchmarks/harness.py`` either way.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    comma_list,
    export_checkout_to_children,
    parse_options,
    suite_parser,
    write_result,
)
from kfp_elastic.testing.cluster.chaos import (
    ChaosResult,
    Check,
    recovery_by_kind,
    run_chaos,
)
from kfp_elastic.testing.cluster.training_run import TrainingRun

QUICK_EVENTS = 3
NODE = {"cpu": "1", "memory": "8Gi"}


def build_parser() -> argparse.ArgumentParser:
    """``python -m benchmarks chaos``'s options."""
    parser = suite_parser("python -m benchmarks chaos", __doc__, f"--events {QUICK_EVENTS}")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--seeds", type=comma_list, default=None, help="several seeds, one after another: 1,2,3"
    )
    parser.add_argument("--events", type=int, default=20)
    parser.add_argument("--nodes", type=int, default=3, help="one-worker nodes at the start")
    parser.add_argument(
        "--epochs", type=int, default=0, help="default: 2 per event (10 steps each at world 3)"
    )
    parser.add_argument("--step-time", type=float, default=0.2)
    parser.add_argument(
        "--event-timeout",
        type=float,
        default=180.0,
        help="seconds to wait for the job to recover from one event (a failed check after)",
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options, checked, with ``--quick`` applied."""
    parser = build_parser()
    args = parse_options(parser, argv)
    if args.quick:
        args.events = QUICK_EVENTS
    if args.events < 1:
        parser.error("--events must be >= 1")
    try:
        args.seed_list = [int(seed) for seed in args.seeds] if args.seeds else [args.seed]
    except ValueError:
        parser.error(f"--seeds takes whole numbers separated by commas, not {args.seeds}")
    if not args.seed_list:
        parser.error("--seeds names no seed")
    return args


def job_params(args: argparse.Namespace) -> dict[str, Any]:
    """The job's pipeline parameters."""
    return {
        "model_def": "kfp_elastic.testing.model_defs.counted_blobs",
        "num_shards": 12,
        "min_workers": 1,
        "max_workers": 3,
        "epochs": args.epochs or 2 * args.events,
        "batch_size": 8,
        "snapshot_every": 1,
        "step_time": args.step_time,
        "worker_cpu": "1",
        "max_wait_s": 300.0,
        "max_failures": 10 * args.events,  # SIGKILLed workers count as failures
    }


def run_seed(args: argparse.Namespace, seed: int) -> ChaosResult:
    """One job under seed ``seed``'s plan; a crash is a failed check, not the end of the suite."""
    with tempfile.TemporaryDirectory(prefix="cluster-chaos-") as tmp:
        nodes = {f"node-{i}": NODE for i in range(1, args.nodes + 1)}
        try:
            with TrainingRun(Path(tmp) / "job", job_params(args), nodes=nodes) as run:
                return run_chaos(
                    run,
                    seed,
                    args.events,
                    NODE,
                    Path(tmp) / "undisturbed",
                    event_timeout_s=args.event_timeout,
                    done_timeout_s=600,
                    exit_handler=True,
                )
        except Exception as exc:  # noqa: BLE001 - recorded as the seed's failed check
            logging.getLogger(__name__).exception("seed %d crashed", seed)
            crashed = ChaosResult(seed=seed)
            crashed.checks.append(Check("run", False, f"{type(exc).__name__}: {exc}"[:800]))
            return crashed


def print_seed(result: ChaosResult) -> None:
    print(f"\n== seed {result.seed}")
    print(
        f"{'#':>3} {'kind':<15} {'target':<22} {'at':>4} {'step':>5} {'world':>6} "
        f"{'recovery_s':>10}"
    )
    for o in result.outcomes:
        world = f"{o.world_before}->{o.world_after}"
        target = o.target.split("-worker-")[-1] if "-worker-" in o.target else o.target
        mark = " (next world)" if o.new_world else ""
        mark += "" if o.ok else f" NOT RECOVERED: expected {o.expected}; seen {o.seen}"
        print(
            f"{o.index:>3} {o.kind.value:<15} {target:<22} {o.at_step:>4} {o.step:>5} "
            f"{world:>6} {o.recovery_s:>10.2f}{mark}"
        )
    for kind, times in recovery_by_kind(result.outcomes).items():
        print(
            f"recovery {kind:<15} n={times['count']:<3} median {times['median_s']:.2f} s  "
            f"max {times['max_s']:.2f} s"
        )
    for check in result.checks:
        print(f"{'PASS' if check.ok else 'FAIL'} {check.name}: {check.detail}")
    print(
        f"seed {result.seed}: {'PASS' if result.ok else 'FAIL'}; job {result.phase} in "
        f"{result.job_s} s over {result.total_steps} steps; master retries "
        f"{result.master_retries}",
        flush=True,
    )
    numbers = {k: result.metrics.get(k) for k in ("steps", "lost_steps", "goodput", "restarts")}
    print(f"seed {result.seed}: job metrics {numbers}; commits {result.commits}", flush=True)


def seed_summary(result: ChaosResult) -> dict[str, Any]:
    return {
        "result": "PASS" if result.ok else "FAIL",
        "failed": ",".join(c.name for c in result.failed()) or "-",
        "events": f"{sum(o.ok for o in result.outcomes)}/{len(result.plan)}",
        "job_s": result.job_s,
        "master_retries": result.master_retries,
        "lost_steps": result.metrics.get("lost_steps"),
        "goodput": result.metrics.get("goodput"),
        "steps_taken_back": result.commits.get("steps_taken_back"),
        "recovery_s": {
            kind: f"{times['median_s']:.2f}/{times['max_s']:.2f} (n={times['count']})"
            for kind, times in recovery_by_kind(result.outcomes).items()
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.time()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("kfp_elastic", "kubernetes", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("kfp_elastic.testing.cluster.chaos").setLevel(logging.INFO)
    export_checkout_to_children()  # pods import kfp_elastic from this checkout
    results: list[ChaosResult] = []
    for seed in args.seed_list:
        results.append(run_seed(args, seed))
        print_seed(results[-1])
        # After every seed: what ran is kept should a later seed be interrupted.
        write_results(args, began, results)
    print(
        f"\n{'seed':>5} {'result':<6} {'events':>7} {'job_s':>7} {'retries':>7} {'lost':>5} "
        f"{'back':>5}  recovery median/max s by kind"
    )
    for result in results:
        row = seed_summary(result)
        kinds = ", ".join(f"{k} {v.split(' ')[0]}" for k, v in row["recovery_s"].items())
        print(
            f"{result.seed:>5} {row['result']:<6} {row['events']:>7} {row['job_s']:>7} "
            f"{row['master_retries']:>7} {row['lost_steps']!s:>5} {row['steps_taken_back']!s:>5}  "
            f"{kinds}"
        )
    return 0 if all(result.ok for result in results) else 1


def write_results(args: argparse.Namespace, began: float, results: list[ChaosResult]) -> None:
    """The suite's result file for the seeds run so far (``harness.write_result``)."""
    ok = all(result.ok for result in results)
    summary = {
        "all_checks_pass": ok,
        "recovery_median_max_s": {
            kind: f"{t['median_s']:.2f}/{t['max_s']:.2f} (n={t['count']})"
            for kind, t in recovery_by_kind([o for r in results for o in r.outcomes]).items()
        },
        **{f"seed {result.seed}": seed_summary(result) for result in results},
    }
    report = {
        "params": job_params(args),
        "seeds": [
            {
                **asdict(result),
                "ok": result.ok,
                "recovery_by_kind": recovery_by_kind(result.outcomes),
                "plan": [{**asdict(e), "kind": e.kind.value} for e in result.plan],
                "outcomes": [{**asdict(o), "kind": o.kind.value} for o in result.outcomes],
            }
            for result in results
        ],
    }
    write_result("chaos", args, began, ok, summary, report)
