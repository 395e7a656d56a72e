"""``kfp-elastic run-local``: the elastic-training pipeline on this machine, no cluster.

kfp.local (SubprocessRunner) runs every task as a local process: shard the built-in digits
dataset, train with 1..2 local torchrun workers against an embedded etcd while worker 1 is
preempted mid-training (its replacement joins), evaluate the model. Progress lines (rounds,
commits, the injected fault, lost workers) stream while it runs; at the end it prints where
the model, the metrics and the HTML report are. Every process it started is stopped when it
ends, also on Ctrl-C or an error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

SESSION_ENV = "KFP_ELASTIC_LOCAL_SESSION"  # inherited by every process this run starts
DEFAULT_ROOT = Path(tempfile.gettempdir()) / "kfp-elastic-runs"
PIPELINE_NAME = "elastic-training"


# The demo's own values, over the job contract's defaults (kfp_elastic/job_spec.py): more epochs, a
# slower step and frequent snapshots so that the injected preemption lands mid-training.
DEMO = {
    "epochs": 3,
    "snapshot_every": 5,
    "step_time": 0.15,
    "num_shards": 16,
    "inject_faults": "preempt:worker-1@step15",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from kfp_elastic import job_spec as spec

    default = {**spec.defaults(), "model_def": spec.DEFAULT_MODEL_DEF, **DEMO}
    p = argparse.ArgumentParser(
        prog="kfp-elastic run-local",
        description="Run the elastic-training pipeline on this "
        "machine through kfp.local (no cluster).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--pipeline-root",
        type=Path,
        default=DEFAULT_ROOT,
        help="where kfp.local writes every task's outputs",
    )
    p.add_argument("--model-def", default=default["model_def"])
    p.add_argument("--dataset", default="", help="empty: the model definition's own dataset")
    p.add_argument("--num-shards", type=int, default=default["num_shards"])
    for name in ("min_workers", "max_workers", "epochs", "batch_size", "snapshot_every"):
        p.add_argument(spec.flag_of(name), type=int, default=default[name])
    p.add_argument(
        "--step-time",
        type=float,
        default=default["step_time"],
        help="minimum seconds per step, so the fault lands mid-training",
    )
    p.add_argument(
        "--inject-faults",
        default=default["inject_faults"],
        help="ACTION:worker-N@WHEN,... (WHEN: 20s or step10); '' for none",
    )
    p.add_argument(
        "--etcd-endpoint",
        default="",
        help="empty: $KFP_ELASTIC_ETCD_ENDPOINTS, else an embedded etcd (TLS/auth: the other "
        "KFP_ELASTIC_ETCD_* variables, docs/security.md)",
    )
    return p.parse_args(argv)


def arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The pipeline's parameters for a local run."""
    return {
        "model_def": args.model_def,
        "dataset": args.dataset,
        "num_shards": args.num_shards,
        "min_workers": args.min_workers,
        "max_workers": args.max_workers,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "snapshot_every": args.snapshot_every,
        "step_time": args.step_time,
        "inject_faults": args.inject_faults,
        "etcd_endpoint": args.etcd_endpoint,
        "launcher": "local",
    }


def run_pipeline(pipeline_root: Path, params: dict[str, Any]) -> tuple[bool, Path | None]:
    """Run the pipeline under kfp.local; (succeeded, the run's output directory)."""
    from kfp import local

    from kfp_elastic.pipelines.elastic_training import local_pipeline

    pipeline_root.mkdir(parents=True, exist_ok=True)
    before = set(pipeline_root.glob(f"{PIPELINE_NAME}-*"))
    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=str(pipeline_root),
        raise_on_error=True,
    )
    ok = True
    try:
        local_pipeline()(**params)
    except RuntimeError as error:
        print(f"\n{error}", flush=True)
        ok = False
    runs = sorted(
        set(pipeline_root.glob(f"{PIPELINE_NAME}-*")) - before, key=lambda p: p.stat().st_mtime
    )
    return ok, (runs[-1] if runs else None)


def artifact_metadata(task_dir: Path, name: str) -> dict[str, Any]:
    """Metadata of output artifact ``name`` as kfp.local recorded it (Metrics values)."""
    try:
        output = json.loads((task_dir / "executor_output.json").read_text())
        return output["artifacts"][name]["artifacts"][0].get("metadata", {})
    except (OSError, ValueError, KeyError, IndexError):
        return {}


def outputs(run_dir: Path) -> dict[str, Path]:
    """Where the interesting outputs of a run are (only those that exist)."""
    train, evaluate = run_dir / "elastic-train", run_dir / "evaluate"
    found = {
        "model": train / "model",
        "report": train / "report",
        "train metrics": train / "executor_output.json",
        "evaluation": evaluate / "executor_output.json",
        "worker logs": train / "job" / "workers",
    }
    return {k: v for k, v in found.items() if v.exists()}


def print_outputs(ok: bool, run_dir: Path | None) -> None:
    print("\n" + "=" * 78)
    print(f"pipeline {PIPELINE_NAME}: {'SUCCEEDED' if ok else 'FAILED'}")
    if run_dir is None:
        print("no output directory was created")
        return
    print(f"outputs under {run_dir}")
    where = outputs(run_dir)
    report = where.get("report")
    if report is not None:
        html = report.with_name("report.html")
        shutil.copyfile(report, html)
        where["report"] = html
    for name, path in where.items():
        print(f"  {name + ':':15} {path}")
    train = artifact_metadata(run_dir / "elastic-train", "metrics")
    if train:
        print("  training:      " + ", ".join(f"{k}={v}" for k, v in train.items()))
    scores = artifact_metadata(run_dir / "evaluate", "metrics")
    if scores:
        print("  evaluation:    " + ", ".join(f"{k}={v}" for k, v in scores.items()))
    if report is not None:
        print(f"open the report: xdg-open {where['report']}  (or any browser)")
    print("=" * 78, flush=True)


def stop_session(session: str, grace_s: float = 15.0) -> int:
    """Wait up to ``grace_s`` for this session's processes to end, then kill the rest."""
    from kfp_elastic.components.common import reap_local_processes, run_pids

    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and run_pids(session, SESSION_ENV):
        time.sleep(0.2)
    return len(reap_local_processes(session, env=SESSION_ENV))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    session = uuid.uuid4().hex
    os.environ[SESSION_ENV] = session  # kfp.local's task processes and their workers inherit it
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    # The components name the project image; here they run in this Python environment.
    warnings.filterwarnings("ignore", message=".*non-Python base image.*")
    print(
        f"running pipeline {PIPELINE_NAME} locally (kfp.local, embedded etcd), faults: "
        f"{args.inject_faults or 'none'}; outputs under {args.pipeline_root}",
        flush=True,
    )
    ok, run_dir = False, None
    try:
        ok, run_dir = run_pipeline(args.pipeline_root, arguments(args))
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every process of this run", file=sys.stderr, flush=True)
    finally:
        with contextlib.suppress(KeyboardInterrupt):
            left = stop_session(session)
            if left:
                print(f"stopped {left} leftover processes", file=sys.stderr, flush=True)
    print_outputs(ok, run_dir)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
