"""What does the elastic worker runtime cost, and how many steps does a lost node cost?

    python benchmarks/elastic_runtime.py [--quick] [--parts throughput,disrupt,micro]
                                         [--model digits|wide|1b] [--jobs static,k10,...]
                                         [--out FILE] [--keep-logs]

Everything runs on local processes against one embedded etcd; one torchrun agent with one gloo
worker is one "node"; the model is chosen by ``--model`` (below), 32 samples per worker and
step.

throughput  Four jobs of 2 nodes each, started together; each job's workers are stopped
            (SIGSTOP; the agents keep running) once it has trained a step; then each job in
            turn runs alone for ``--window`` seconds (SIGCONT ... SIGSTOP; default 1 s), the
            order rotating every round, until the jobs finish or ``--cap`` is reached.
            Steps/s of a job = steps whose ``optimizer.step()`` returned inside its windows,
            minus the first ``--warm`` seconds of each, over that time. Start-up never enters,
            and the drift of a shared 2-core box hits every job alike. The jobs:
              static   benchmarks/static_ddp_baseline.py: plain DDP, c10d rendezvous,
                       DataLoader + DistributedSampler, no snapshots, no etcd
              auto     python -m kfp_elastic.worker, elastic-etcd, its default --snapshot-every auto
                       (snapshots cost <= 1 % of training time; goal >= 0.97 x static)
              K=10     the same with --snapshot-every 10
              K=inf    the same with --snapshot-every 10**9 (epoch ends still snapshot)
            Per-step timestamps come from one JSON line per step that both sides write the
            same way (benchmarks/timed_model_def.py wraps the model-def's optimizer with a
            step post-hook; the baseline calls the same writer). The runtime's etcd requests
            get a 120 s deadline here (instead of 5 s) so that a commit in flight when its
            worker is stopped does not time out and crash the worker.
disrupt     3 nodes (--nnodes=2:3) train with --snapshot-every K (5) and --step-time S (0.05 s);
            at a random step of the second epoch (+ a random fraction of a step) one node's
            whole process tree gets SIGKILL, or its agent alone SIGTERM (as the kubelet sends).
            Lost steps = the highest step any old-world worker finished (step post-hook, with
            the runtime's own step number) minus the step the new world restored from (the
            worker's "restored rank=0 world=2 step=S" log line). Goals: SIGKILL <= 1
            (the survivors' rescue snapshots; without them up to K), SIGTERM = 0. The
            victim's rank cycles 0, 1, 2 over the repeats (rank 0 writes the snapshots) and
            the trigger step is stratified over the snapshot interval.
micro       In-process, on the ``--model`` state: the synchronous part of a snapshot (what
            Trainer._commit does on the training thread: state_dict, optimizer state, RNG, then
            Snapshotter.save's copy into the snapshot buffer), its background part (header +
            CRC32C + write of the snapshot file, Progress.commit to etcd; torch.save of the
            same state for comparison), how much 10 training steps slow down while that
            background part runs (the GIL), and Progress.commit's cost against the number of
            epochs.

--model     the throughput jobs' model: ``digits`` (kfp_elastic.worker.examples.digits, an MLP
            whose 2-worker
            step takes ~4 ms: a stress case where fixed per-step costs weigh most) or ``wide``
            (benchmarks/wide_digits.py, 1.1 M parameters, ~20 ms steps). Both sides train the
            same model-def (``$TIMED_MODEL_DEF``).
--jobs      throughput jobs: ``static``, ``auto``, ``k<N>`` (the runtime with --snapshot-every N)
            or ``kinf`` (no snapshots but the forced ones at epoch ends).

Prints the tables and ratios and writes all runs as JSON to --out. Every agent, worker and
etcd started here is killed on exit, error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# The parts live in modules beside this script, imported by their package path like
# benchmarks.timed_model_def, so that each is loaded once under one name.
from benchmarks.elastic_runtime_common import AUTO, BATCH, HUGE, MODELS  # noqa: E402
from benchmarks.elastic_runtime_disrupt import bench_disrupt  # noqa: E402
from benchmarks.elastic_runtime_micro import bench_micro  # noqa: E402
from benchmarks.elastic_runtime_throughput import (  # noqa: E402
    JOBS,
    bench_throughput,
    job_snapshot_every,
)
from kfp_elastic.job_spec import DEVICES  # noqa: E402
from kfp_elastic.rendezvous.embedded_etcd import EmbeddedEtcd  # noqa: E402
from kfp_elastic.rendezvous.local_agents import run_with_cleanup  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "elastic_runtime.json"
THROUGHPUT_GOAL = 0.97
SIGKILL_GOAL = 1  # steps: survivors' rescue snapshots make a lost node cost the step in flight


# --------------------------------------------------------------------------- report


def fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def summarize(report: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    tp = report.get("throughput")
    if tp:
        print(
            f"\n(a)+(c) steady-state throughput: {MODELS[args.model]}, 2 nodes x 1 gloo "
            f"worker, global "
            f"batch {2 * BATCH}, {args.epochs} epochs; time-sliced windows of {args.window} s "
            f"(first {args.warm} s skipped), {tp['_rounds']} rounds"
        )
        print(
            "method: all jobs start together; once a job has trained a step its workers are "
            "SIGSTOPped; then each job runs alone for a window (SIGCONT..SIGSTOP), order "
            "rotating per round; steps/s = steps finished inside the windows (after the "
            "warm-up) / window time. Start-up is outside every window; drift hits all jobs."
        )
        static = (tp.get("static") or {}).get("steps_per_s")
        paired = tp["_paired"]
        width = max(len(row["label"]) for k, row in tp.items() if not k.startswith("_")) + 2
        print(
            f"{'job':<{width}}{'steps/s':>9}{'ms/step':>9}{'/static':>9}{'pairs med':>10}"
            f"{'windows':>8}{'window range':>14}{'snap/step':>10}{'agents CPU':>11}"
            f"{'start s':>8}"
        )
        for name, row in tp.items():
            if name.startswith("_"):
                continue
            rate = row["steps_per_s"]
            span = (
                fmt(row["min_window_steps_per_s"], ".0f")
                + ".."
                + fmt(row["max_window_steps_per_s"], ".0f")
            )
            agents = row["agents_cpu_share"]
            print(
                f"{row['label']:<{width}}{fmt(rate, '.1f'):>9}"
                f"{fmt(1e3 / rate if rate else None, '.2f'):>9}"
                f"{fmt(rate / static if rate and static else None, '.3f'):>9}"
                f"{fmt((paired.get(name) or {}).get('median'), '.3f'):>10}"
                f"{row['windows']:>8}{span:>14}{row['snapshots_per_step']:>10.3f}"
                f"{fmt(100 * agents if agents is not None else None, '.1f') + ' %':>11}"
                f"{fmt(row['first_step_after_launch_s'], '.0f'):>8}"
            )
        print(
            "(/static: pooled steps/s over static's; pairs med: median of per-round ratios, "
            "windows seconds apart; agents CPU: the two agents' own CPU use, workers stopped)"
        )
        elastic = {
            name: row
            for name, row in tp.items()
            if not name.startswith("_") and name != "static" and row["steps_per_s"]
        }
        if static:
            for name, row in elastic.items():
                ratio = row["steps_per_s"] / static
                summary[f"elastic_{name}_over_static"] = round(ratio, 4)
                pairs = paired.get(name) or {}
                print(
                    f"{row['label']} / static = {ratio:.3f}   goal >= {THROUGHPUT_GOAL}: "
                    f"{'met' if ratio >= THROUGHPUT_GOAL else 'MISSED'}   (per-round pairs: "
                    f"median {fmt(pairs.get('median'), '.3f')}, {fmt(pairs.get('min'), '.3f')}"
                    f"..{fmt(pairs.get('max'), '.3f')}, n={pairs.get('pairs')})"
                )
            default = "auto" if "auto" in elastic else "k10"  # the runner's default
            if default in elastic:
                summary["throughput_goal_met"] = (
                    elastic[default]["steps_per_s"] / static >= THROUGHPUT_GOAL
                )
        snapshotting = [row for row in elastic.values() if AUTO < row["snapshot_every"] < HUGE]
        kinf_row = elastic.get("kinf")
        if snapshotting and kinf_row:
            most = max(snapshotting, key=lambda row: row["snapshots_per_step"])
            r1, rinf = most["steps_per_s"], kinf_row["steps_per_s"]
            s1, sinf = most["snapshots_per_step"], kinf_row["snapshots_per_step"]
            per_snapshot = (1 / r1 - 1 / rinf) / (s1 - sinf)
            base_step = 1 / rinf - per_snapshot * sinf
            summary["snapshot_cost_ms"] = round(per_snapshot * 1e3, 3)
            summary["snapshot_cost_share_of_step"] = round(per_snapshot / base_step, 4)
            print(
                f"\n(c) one snapshot costs the training loop {per_snapshot * 1e3:.2f} ms = "
                f"{100 * per_snapshot / base_step:.1f} % of a snapshot-free step "
                f"({base_step * 1e3:.2f} ms)   [from {most['label']} vs K=inf: (1/r1 - "
                f"1/rinf) / ({s1:.3f} - {sinf:.3f}) snapshots/step]"
            )
    micro = report.get("micro")
    if micro:
        step_ms = None
        if tp and (tp.get("kinf") or {}).get("steps_per_s"):
            step_ms = 1e3 / tp["kinf"]["steps_per_s"]
        share = micro["sync_save_call_ms"] / step_ms if step_ms else None
        summary["sync_snapshot_share_of_step"] = round(share, 4) if share else None
        if not tp:
            print()
        commits = ", ".join(
            f"{micro[k]:.1f} ms at {k.rsplit('epochs', 1)[1]} epochs"
            for k in micro
            if k.startswith("progress_commit_ms")
        )
        stall = micro["ten_steps_after_save_noop_commit_ms"] - micro["ten_steps_ms"]
        stall_etcd = micro.get("ten_steps_after_save_etcd_commit_ms")
        summary["background_stall_ms"] = round(stall, 3)
        print(
            f"(c) micro, in-process, medians of {args.micro_n}:\n"
            f"    synchronous part of a snapshot (Trainer._commit state + Snapshotter.save): "
            f"{micro['sync_save_call_ms']:.3f} ms = {fmt(100 * share if share else None, '.1f')}"
            f" % of a {fmt(step_ms, '.2f')} ms K=inf step; of it state_dict+optimizer+rng "
            f"{micro['state_build_ms']:.3f} ms, copy into the snapshot buffer "
            f"{micro['pack_copy_ms']:.3f} ms"
            f"\n    background part: write + CRC32C {micro['packed_write_ms']:.2f} ms "
            f"({micro['state_bytes']} B; torch.save of the same state: "
            f"{micro['torch_save_ms']:.2f} ms); Progress.commit {commits} "
            f"({micro['shards']} shards)"
            f"\n    10 train steps: {micro['ten_steps_ms']:.2f} ms alone, "
            f"{micro['ten_steps_after_save_noop_commit_ms']:.2f} ms right after save() "
            f"(writer thread running torch.save: +{stall:.2f} ms)"
            + (
                f", {stall_etcd:.2f} ms with the etcd commit at {args.epochs} epochs "
                f"(+{stall_etcd - micro['ten_steps_ms']:.2f} ms)"
                if stall_etcd
                else ""
            )
        )
    dis = report.get("disrupt")
    if dis:
        k = args.snapshot_every
        print(
            f"\n(b) steps lost per disruption: 3 nodes -> 2, --snapshot-every {k}, "
            f"--step-time {args.step_time}"
        )
        print(
            "method: lost = highest step an old-world worker finished (optimizer step "
            "post-hook reading the runtime's step counter) - step in the new world's "
            "'restored rank=0 world=2 step=S' log line; event at a random point of epoch 2"
        )
        print(
            f"{'signal':<9}{'runs':>6}{'median':>8}{'max':>6}{'goal':>8}{'':>8}  "
            "per run: lost (highest reached -> restored) victim rank, recovery s"
        )
        for kind, goal in (("sigkill", SIGKILL_GOAL), ("sigterm", 0)):
            data = dis[kind]
            worst = data["max_lost"]
            met = worst is not None and worst <= goal and data["measured"] == data["runs"]
            summary[f"{kind}_goal_met"] = met
            summary[f"{kind}_max_lost"] = worst
            summary[f"{kind}_median_lost"] = data["median_lost"]
            runs = "; ".join(
                f"{d['lost_steps']} ({d['highest_step']}->{d['restored_step']}) "
                f"r{d['victim_rank']}, {d['recovery_s']}"
                if d["error"] is None
                else "FAILED"
                for d in data["details"]
            )
            print(
                f"{kind.upper():<9}{data['runs']:>6}{fmt(data['median_lost'], 'g'):>8}"
                f"{fmt(worst, 'g'):>6}{('<= ' if goal else '= ') + str(goal):>8}"
                f"{'met' if met else 'MISSED':>8}  {runs}"
            )
    print()
    return summary


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="throughput,disrupt,micro")
    parser.add_argument(
        "--quick", action="store_true", help="smoke: fewer epochs, shorter windows, 1 repeat"
    )
    parser.add_argument("--epochs", type=int, default=60, help="throughput jobs' epochs")
    parser.add_argument(
        "--window",
        type=float,
        default=None,
        help="seconds per time slice (default: 3 / (jobs - 1), at most 1)",
    )
    parser.add_argument(
        "--warm",
        type=float,
        default=None,
        help="seconds skipped at each window start (default: window / 5, at most 0.15)",
    )
    parser.add_argument("--cap", type=float, default=200.0, help="time-slicing cap, seconds")
    parser.add_argument("--repeats", type=int, default=3, help="disruptions of each kind")
    parser.add_argument("--snapshot-every", type=int, default=5, help="K for the disruptions")
    parser.add_argument("--step-time", type=float, default=0.05, help="disruption step time")
    parser.add_argument("--disrupt-epochs", type=int, default=30)
    parser.add_argument("--recovery-cap", type=float, default=90.0)
    parser.add_argument("--micro-n", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="the workers' --device (cuda: local node i uses GPU i %% count)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--keep-logs", action="store_true", help="keep the work dir")
    parser.add_argument(
        "--jobs", default=JOBS, help="throughput jobs: static, kinf, k<N> (default %(default)s)"
    )
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="wide",
        help="throughput jobs' model (default %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.cap = 20, 40.0
        args.repeats, args.disrupt_epochs, args.micro_n = 1, 20, 50
    args.jobs = [j.strip() for j in args.jobs.split(",") if j.strip()]
    for job in args.jobs:
        try:
            job_snapshot_every(job)
        except ValueError as error:
            parser.error(str(error))
    if args.window is None:
        args.window = min(1.0, round(3.0 / max(1, len(args.jobs) - 1), 2))
    if args.warm is None:
        args.warm = min(0.15, args.window / 5)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(args.parts) - {"throughput", "disrupt", "micro"}
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    work_dir = Path(tempfile.mkdtemp(prefix="runtime-bench-"))
    report: dict[str, Any] = {}
    began = time.time()

    def body(stack: contextlib.ExitStack) -> None:
        etcd = EmbeddedEtcd(data_dir=work_dir / "etcd", log_file=work_dir / "etcd.log")
        stack.callback(etcd.stop)
        etcd.start()
        if "throughput" in args.parts:
            report["throughput"] = bench_throughput(args, etcd, work_dir, stack)
        if "disrupt" in args.parts:
            report["disrupt"] = bench_disrupt(args, etcd, work_dir, stack)
        if "micro" in args.parts:
            print("[micro] snapshot and commit costs in-process", flush=True)
            report["micro"] = bench_micro(args, etcd, work_dir)

    code = run_with_cleanup(work_dir, args.keep_logs, body)
    summary = summarize(report, args)
    out = {
        "benchmark": "elastic_runtime",
        "started": began,
        "date": datetime.fromtimestamp(began).isoformat(timespec="seconds"),
        "duration_s": round(time.time() - began, 1),
        "complete": code == 0,
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "load_average_at_end": os.getloadavg(),
        },
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "method": {
            "throughput": "4 jobs started together, workers SIGSTOPped after their first step, "
            "then each job alone for --window s in rotating order; steps/s = "
            "steps finished in the windows after --warm s / that time; "
            "per-step times from an optimizer step post-hook (runtime) and the "
            "same writer in the baseline",
            "snapshot_cost": "(1/r(K=1) - 1/r(K=inf)) / (snapshots per step K=1 - K=inf); "
            "epoch ends snapshot in every elastic job",
            "lost_steps": "highest step finished by an old-world worker (post-hook, runtime "
            "step number) - step of the new world's 'restored rank=0' line",
        },
        "summary": summary,
        **report,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}" + (f" (logs kept in {work_dir})" if args.keep_logs else ""))
    return code


if __name__ == "__main__":
    sys.exit(main())
