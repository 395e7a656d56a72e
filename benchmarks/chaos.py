"""Seeded chaos at one longer training job on the test cluster; what each event costs.

    python -m benchmarks chaos --seed 1 --events 20
    python -m benchmarks chaos --quick        # 3 events

The chaos test (``tests/e2e/test_chaos.py``) at length: the compiled ``elastic-train`` task as
the master pod with the production settings on three one-worker nodes, and a ``plan_chaos`` plan
fired by the ``ChaosExecutor`` (each event once the job committed progress since the previous
one). Workers commit every step (``snapshot_every=1``), so the recovery printed per event is
event -> the first step of the next world for events that take a worker (preempted, killed, its
node removed: the first commit after a new rendezvous round), and event -> the next step for the
others (etcd restarted, master deleted, capacity added, a node without a worker removed). At the
end: exactly-once (the model's per-sample counts and etcd's shard queues), leftovers, and the
final accuracy next to an undisturbed run of the same model definition, global batch, shard
manifest and seed (a static local torchrun job, measured in the same run). Writes the JSON
report described in ``benchmarks/harness.py``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from benchmarks.harness import (
    add_common_options,
    export_checkout_to_children,
    parse_options,
    write_result,
)
from kfp_elastic.testing.cluster.chaos import ChaosExecutor, plan_chaos
from kfp_elastic.testing.cluster.training_run import TrainingRun, undisturbed_accuracy

QUICK_EVENTS = 3
NODE = {"cpu": "1", "memory": "8Gi"}


def build_parser() -> argparse.ArgumentParser:
    """``python -m benchmarks chaos``'s options."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks chaos",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    add_common_options(parser, f"--events {QUICK_EVENTS}")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--events", type=int, default=20)
    parser.add_argument("--nodes", type=int, default=3, help="one-worker nodes at the start")
    parser.add_argument(
        "--epochs", type=int, default=0, help="default: 2 per event (10 steps each at world 3)"
    )
    parser.add_argument("--step-time", type=float, default=0.2)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options, checked, with ``--quick`` applied."""
    parser = build_parser()
    args = parse_options(parser, argv)
    if args.quick:
        args.events = QUICK_EVENTS
    if args.events < 1:
        parser.error("--events must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.time()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("kfp_elastic", "kubernetes", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("kfp_elastic.testing.cluster.chaos").setLevel(logging.INFO)
    export_checkout_to_children()  # pods import kfp_elastic from this checkout
    params = {
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
    plan = plan_chaos(args.seed, args.events, nodes=args.nodes, min_nodes=params["min_workers"])
    job_began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cluster-chaos-") as tmp:
        nodes = {f"node-{i}": NODE for i in range(1, args.nodes + 1)}
        with TrainingRun(Path(tmp) / "job", params, nodes=nodes) as run:
            run.start()
            outcomes = ChaosExecutor(run, NODE, timeout_s=180).apply(plan)
            phase = run.wait_done(600)
            job_s = time.monotonic() - job_began
            run.check_exactly_once()
            disturbed = run.accuracy()
            metrics = run.metrics()
            base_world = run.base_world_size()
            calm = undisturbed_accuracy(Path(tmp) / "undisturbed", run, base_world)
            run.exit_handler()
            run.wait_no_leftovers()
            retries = run.retries
        leftovers = sorted(run.cluster.leftover_processes())
    print(f"{'#':>3} {'kind':<15} {'target':<22} {'step':>5} {'world':>6} {'recovery_s':>10}")
    for o in outcomes:
        world = f"{o.world_before}->{o.world_after}"
        target = o.target.split("-worker-")[-1] if "-worker-" in o.target else o.target
        mark = " (next world)" if o.new_world else ""
        print(
            f"{o.index:>3} {o.kind.value:<15} {target:<22} {o.step:>5} {world:>6} "
            f"{o.recovery_s:>10.2f}{mark}"
        )
    by_kind: dict[str, list[float]] = {}
    for o in outcomes:
        by_kind.setdefault(o.kind.value, []).append(o.recovery_s)
    medians = {kind: round(statistics.median(v), 2) for kind, v in sorted(by_kind.items())}
    print(f"median recovery by kind: {medians}")
    print(
        f"job {phase} in {job_s:.1f} s; exactly once: yes (counts and shard queues); "
        f"accuracy {disturbed:.4f} vs undisturbed {calm:.4f} (diff {disturbed - calm:+.4f}); "
        f"master retries {retries}; leftover processes {leftovers}"
    )
    ok = len(outcomes) == args.events and abs(disturbed - calm) <= 0.01
    summary = {
        "events": len(outcomes),
        "median_recovery_s": medians,
        "job_s": round(job_s, 1),
        "exactly_once": True,
        "accuracy": disturbed,
        "undisturbed_accuracy": calm,
        "leftover_processes": len(leftovers),
    }
    report = {
        "seed": args.seed,
        "params": params,
        "base_world_size": base_world,
        "outcomes": [{**asdict(o), "kind": o.kind.value} for o in outcomes],
        "job_phase": phase,
        "master_retries": retries,
        "metrics": metrics,
        "leftover_processes": leftovers,
    }
    write_result("chaos", args, began, ok, summary, report)
    return 0 if ok else 1
