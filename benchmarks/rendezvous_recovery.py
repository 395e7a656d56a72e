"""How fast do torchrun rendezvous backends recover from a lost node and absorb a new one?

    python benchmarks/rendezvous_recovery.py [--repeats 5] [--backends elastic-etcd,c10d,etcd-v2]
                                             [--sizes 8,32,128] [--quick] [--out FILE]

Per backend, on local processes (one torchrun agent with one gloo worker = one "node", running
examples/tiny_ddp.py):

kill   3 agents with --nnodes=2:3 train in a 3-node world; SIGKILL the whole process tree of one
       non-first node; seconds from the kill to the first training step of the 2-node world.
join   2 agents with --nnodes=2:3 train; launch a 3rd; seconds from its launch to the first step
       of the 3-node world. Also measured, as a reference: a fresh python importing torch +
       torch._dynamo (what a cold worker process of the new node would need before a step).
form   N handlers (registry.get_rendezvous_handler, min=max=N) spread over --form-processes
       processes (default 8; benchmarks/form_processes.py), each calling next_rendezvous() in
       its own thread at the same moment; seconds until all N returned.

Each kill/join run uses a fresh run id and fresh agents and counts as recovered when it reached the
target world within --cap seconds. Prints medians and the ratios elastic-etcd / c10d and writes
all runs as JSON to --out. Every agent, worker and etcd started here is killed on exit, error or
Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# The parts live in modules beside this script, imported by their package path like
# benchmarks.form_processes, so that each is loaded once under one name.
from benchmarks.rendezvous_recovery_common import (  # noqa: E402
    BACKENDS,
    Backend,
    BackendSpec,
    check_available,
    cold_import_reference,
    summarize,
)
from benchmarks.rendezvous_recovery_form import (  # noqa: E402
    form_round,
    form_round_in_processes,
)
from benchmarks.rendezvous_recovery_kill_join import SETTLE_S, run_agents_scenario  # noqa: E402
from kfp_elastic.rendezvous.local_agents import run_with_cleanup  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "rendezvous_recovery.json"


# --------------------------------------------------------------------------- main


def bench_backend(
    spec: BackendSpec, args: argparse.Namespace, work_dir: Path, stack: contextlib.ExitStack
) -> dict[str, Any]:
    result: dict[str, Any] = {"note": spec.note, "status": "ok"}
    reason = check_available(spec.name)
    if reason:
        print(f"[{spec.name}] skipped: {reason}", flush=True)
        return {**result, "status": "skipped", "reason": reason}
    try:
        extra = args.elastic_conf if spec.name == "elastic-etcd" else {}
        backend = Backend(spec, stack, work_dir, extra)
    except Exception as error:  # noqa: BLE001
        reason = f"could not start its etcd: {type(error).__name__}: {error}"
        print(f"[{spec.name}] skipped: {reason}", flush=True)
        return {**result, "status": "skipped", "reason": reason}
    result["disable_shared_store"] = spec.disable_shared_store
    for scenario in [s for s in ("kill", "join") if s in args.scenarios]:
        runs = []
        for repeat in range(args.repeats):
            run = run_agents_scenario(backend, scenario, args, work_dir)
            runs.append(run)
            shown = f"{run.seconds:.2f} s" if run.recovered else f"FAILED ({run.error})"
            if run.recovered and run.registered_s is not None:
                shown += (
                    f" ({run.seconds - run.registered_s:.2f} s after the new node"
                    f" registered at {run.registered_s:.2f} s)"
                )
            print(
                f"[{spec.name}] {scenario} {repeat + 1}/{args.repeats}: {shown}"
                f" (worker failed {run.worker_failed_s}, rendezvous {run.rendezvous_done_s},"
                f" worker start {run.worker_start_s}) restart_counts={run.restart_counts}",
                flush=True,
            )
        result[scenario] = summarize(runs, args.cap)
    gave_up_at: int | None = None
    for size in args.sizes if "form" in args.scenarios else []:
        if gave_up_at is not None:
            result[f"form{size}"] = {"skipped": f"N={gave_up_at} did not form within the cap"}
            print(f"[{spec.name}] form N={size}: skipped, N={gave_up_at} failed", flush=True)
            continue
        runs = []
        for repeat in range(args.repeats):
            if args.form_processes > 1:
                run = form_round_in_processes(backend, size, args.form_cap, args.form_processes)
            else:
                run = form_round(backend, size, args.form_cap)
            runs.append(run)
            shown = f"{run.seconds:.2f} s" if run.recovered else f"FAILED ({run.error})"
            print(f"[{spec.name}] form N={size} {repeat + 1}/{args.repeats}: {shown}", flush=True)
            if not run.recovered:  # larger rounds and more repeats would only time out too
                gave_up_at = size
                break
        result[f"form{size}"] = summarize(runs, args.form_cap)
    if backend.etcd:
        backend.etcd.stop()
    return result


def print_table(results: dict[str, Any], sizes: list[int]) -> dict[str, float | None]:
    rows = [
        row
        for row in ("kill", "join", *(f"form{n}" for n in sizes))
        if any(row in data for data in results.values())
    ]
    names = list(results)
    ratios: dict[str, float | None] = {}
    header = f"{'median seconds':<16}" + "".join(f"{n:>18}" for n in names)
    if "elastic-etcd" in names and "c10d" in names:
        header += f"{'elastic/c10d':>14}"
    print("\n" + header)
    for row in rows:
        line = f"{row:<16}"
        for name in names:
            data = results[name].get(row)
            if not data or "runs" not in data:
                line += f"{'-':>18}"
                continue
            med = data["median_s"]
            cell = f"{med:.2f}" if med is not None else "n/a"
            cell += f" ({data['recovered']}/{data['runs']})"
            line += f"{cell:>18}"
        if "elastic-etcd" in names and "c10d" in names:
            ours = (results["elastic-etcd"].get(row) or {}).get("median_s")
            theirs = (results["c10d"].get(row) or {}).get("median_s")
            ratios[row] = round(ours / theirs, 3) if ours and theirs else None
            line += f"{ratios[row] if ratios[row] is not None else '-':>14}"
        print(line)
    print("(k/n) = runs that reached the target world within the cap\n")
    return ratios


def print_join_reference(results: dict[str, Any], reference: dict[str, Any]) -> None:
    """The join against a cold worker's imports, measured in this run."""
    print(
        f"join reference: a fresh python importing torch + torch._dynamo (what a cold worker "
        f"of the new node needs before its first step) takes {reference['median_s']:.2f} s here "
        f"(median of {len(reference['runs_s'])})"
    )
    for name, data in results.items():
        join = (data.get("join") or {}).get("median_s")
        if join and reference["median_s"]:
            ratio = join / reference["median_s"]
            print(f"  {name}: join {join:.2f} s = {ratio:.2f} x the reference")
        after = [
            d["seconds"] - d["registered_s"]
            for d in (data.get("join") or {}).get("details", [])
            if d.get("recovered") and d.get("registered_s") is not None
        ]
        if after:
            print(
                f"  {name}: from the new node's registration to the first step: "
                f"{statistics.median(after):.2f} s median ({min(after):.2f}-{max(after):.2f})"
            )
    print()


def print_form_traffic(result: dict[str, Any], sizes: list[int]) -> None:
    """etcd's work per node while a round forms: flat in N means flat time on N hosts."""
    rows = [(n, (result.get(f"form{n}") or {}).get("etcd_per_node_median")) for n in sizes]
    rows = [(n, traffic) for n, traffic in rows if traffic]
    if not rows:
        return
    print("elastic-etcd, etcd's work per node while the round forms (from etcd's /metrics):")
    print(
        f"{'N':>5} {'phase':<15}{'requests':>10}{'stream in':>11}{'watch out':>11}{'bytes out':>11}"
    )
    for size, traffic in rows:
        for phase, counts in traffic.items():
            print(
                f"{size:>5} {phase:<15}{counts['requests']:>10.1f}"
                f"{counts['stream_messages_in']:>11.1f}{counts['watch_messages_out']:>11.1f}"
                f"{counts['bytes_out']:>11.0f}"
            )
    print()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backends", default="elastic-etcd,c10d,etcd-v2")
    parser.add_argument("--sizes", default="8,32,128", help="round sizes N for `form`")
    parser.add_argument("--scenarios", default="kill,join,form", help="a subset of these")
    parser.add_argument("--quick", action="store_true", help="--repeats 1 --sizes 8")
    parser.add_argument("--cap", type=float, default=60.0, help="recovery cap per run, seconds")
    parser.add_argument("--form-cap", type=float, default=120.0, help="cap per `form` run")
    parser.add_argument(
        "--form-processes",
        type=int,
        default=8,
        help="spread the N handlers of `form` over this many processes "
        "(1: all in this process, one thread each)",
    )
    parser.add_argument("--last-call-timeout", type=int, default=1)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--shared-store",
        action="store_true",
        help="torch's default for every backend: leave TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset",
    )
    parser.add_argument(
        "--elastic-conf",
        default="",
        help="extra --rdzv-conf for elastic-etcd only (agents and form), e.g. lease_ttl=10",
    )
    parser.add_argument(
        "--elastic-launcher",
        choices=("agent", "torchrun"),
        default="agent",
        help="what starts elastic-etcd's agents: `kfp-elastic agent` (what the master runs) or "
        "plain torchrun (a user's own command); other backends always run plain torchrun",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the work dir")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.sizes = 1, "8"
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in args.backends if b not in BACKENDS]
    if unknown:
        parser.error(f"unknown backends {unknown}; known: {list(BACKENDS)}")
    args.elastic_conf = dict(
        item.split("=", 1) for item in args.elastic_conf.split(",") if "=" in item
    )
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    args.sizes = [int(s) for s in str(args.sizes).split(",") if s.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    work_dir = Path(tempfile.mkdtemp(prefix="rdzv-bench-"))
    results: dict[str, Any] = {}
    began = time.time()

    def body(stack: contextlib.ExitStack) -> None:
        for name in args.backends:
            spec = BACKENDS[name]
            if args.shared_store:
                spec = replace(spec, disable_shared_store=False)
            results[name] = bench_backend(spec, args, work_dir, stack)

    code = run_with_cleanup(work_dir, args.keep_logs, body)
    reference = cold_import_reference(args.repeats) if "join" in args.scenarios else None
    ratios = print_table(results, args.sizes)
    if reference is not None:
        print_join_reference(results, reference)
    print_form_traffic(results.get("elastic-etcd", {}), args.sizes)
    report = {
        "benchmark": "rendezvous_recovery",
        "started": began,
        "duration_s": round(time.time() - began, 1),
        "complete": code == 0,
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
        },
        "settings": {
            "repeats": args.repeats,
            "sizes": args.sizes,
            "cap_s": args.cap,
            "form_cap_s": args.form_cap,
            "nnodes": "2:3",
            "nproc_per_node": 1,
            "max_restarts": 10,
            "monitor_interval": 0.2,
            "last_call_timeout": args.last_call_timeout,
            "step_time": args.step_time,
            "shared_store": args.shared_store,
            "elastic_conf": args.elastic_conf,
            "elastic_launcher": args.elastic_launcher,
            "settle_s": SETTLE_S,
            "form": (
                f"handlers in {args.form_processes} processes, one thread each, "
                "min_nodes=max_nodes=N"
            ),
        },
        "results": results,
        "ratios_elastic_etcd_over_c10d": ratios,
        "join_cold_import_reference": reference,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}" + (f" (logs kept in {work_dir})" if args.keep_logs else ""))
    return code


if __name__ == "__main__":
    sys.exit(main())
