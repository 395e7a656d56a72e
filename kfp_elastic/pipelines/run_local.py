"""``kfp-elastic run-local``: the elastic-training pipeline on this machine, no cluster.

kfp.local (SubprocessRunner) runs every task as a local process: shard the built-in digits
dataset, train with 1..2 local torchrun workers against an embedded etcd while worker 1 is
preempted mid-training (its replacement joins), evaluate the model. Progress lines (rounds,
commits, the injected fault, lost workers) stream while it runs; at the end it prints where
the model, the metrics and the HTML report are. Every process it started is stopped when it
ends, also on Ctrl-C or an error.

kfp.local's own output (executor inputs as JSON, tracebacks: hundreds of lines) goes to a log
file next to the runs; the terminal shows the task and progress lines (``terminal_line``) and,
when the run failed, the reason (``failure_reason``) and where the logs are. ``--verbose``
shows everything.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TextIO

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
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show kfp.local's whole output (executor inputs, tracebacks), not only the task "
        "and progress lines; it always goes to the run's log file",
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


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# What reaches the terminal without --verbose: kfp.local's task lines and the components' own.
_SHOWN = re.compile(
    r"( - (INFO|ERROR|WARNING) - (Executing task|Task '[^']+' finished)"
    r"|^Pipeline '[^']+' finished"
    r"|^(elastic_train|evaluate|stop_workers|shard manifest|embedded etcd at|stopped \d+)"
    r"|^\[\s*\d+\.\d+s\] )"
)
_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception)): (.+)$")
_TASK_FAILED = re.compile(r"Task '([^']+)' finished with status FAILURE")


def plain(line: str) -> str:
    """A line of kfp.local's output without its colours and indentation."""
    return _ANSI.sub("", line).strip()


def terminal_line(line: str) -> bool:
    """Whether a line of the pipeline's output is shown without ``--verbose``."""
    return bool(_SHOWN.search(plain(line)))


def failure_reason(lines: Iterable[str]) -> str | None:
    """``task NAME: ErrorType: message`` of the first task that failed: the last exception
    line its output shows (None when no task failed)."""
    error: str | None = None
    for raw in lines:
        line = plain(raw)
        found = _ERROR_LINE.match(line)
        if found:
            error = f"{found.group(1)}: {found.group(2)}"
        failed = _TASK_FAILED.search(line)
        if failed:
            return f"task {failed.group(1)}: {error or 'failed (see the log)'}"
        if " - INFO - Executing task" in line:
            error = None
    return None


class _Tee(io.TextIOBase):
    """Every line to ``log``; the lines ``show`` accepts to ``terminal`` as well."""

    def __init__(self, log: TextIO, terminal: TextIO, show: Callable[[str], bool]) -> None:
        self.log, self.terminal, self.show = log, terminal, show
        self.pending = ""

    def write(self, text: str) -> int:
        self.log.write(text)
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if self.show(line):
                self.terminal.write(line + "\n")
                self.terminal.flush()
        return len(text)

    def flush(self) -> None:
        self.log.flush()


def run_pipeline(
    pipeline_root: Path, params: dict[str, Any], log_path: Path, verbose: bool = False
) -> bool:
    """Run the pipeline under kfp.local, its output into ``log_path`` (and the terminal lines,
    or everything with ``verbose``); whether it succeeded."""
    from kfp import local

    from kfp_elastic.pipelines.elastic_training import local_pipeline

    show = (lambda line: True) if verbose else terminal_line
    with open(log_path, "a", encoding="utf-8") as log:
        tee = _Tee(log, sys.stdout, show)
        with contextlib.redirect_stdout(tee), warnings.catch_warnings():
            if not verbose:  # kfp.local's notes on settings it ignores locally
                warnings.filterwarnings("ignore", module=r"kfp\.")
            local.init(
                runner=local.SubprocessRunner(use_venv=False),
                pipeline_root=str(pipeline_root),
                raise_on_error=True,
            )
            try:
                local_pipeline()(**params)
            except RuntimeError as error:
                print(f"\n{error}", flush=True)
                return False
    return True


def run_dirs(pipeline_root: Path) -> set[Path]:
    return set(pipeline_root.glob(f"{PIPELINE_NAME}-*"))


def new_run_dir(pipeline_root: Path, before: set[Path]) -> Path | None:
    """The run directory kfp.local created since ``before`` (the newest), if any."""
    runs = sorted(run_dirs(pipeline_root) - before, key=lambda p: p.stat().st_mtime)
    return runs[-1] if runs else None


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


def print_outputs(
    ok: bool,
    run_dir: Path | None,
    log_path: Path | None = None,
    reason: str | None = None,
    pipeline_root: Path | None = None,
) -> None:
    print("\n" + "=" * 78)
    print(f"pipeline {PIPELINE_NAME}: {'SUCCEEDED' if ok else 'FAILED'}")
    if not ok:
        print(f"  reason:        {reason or 'unknown (see the log)'}")
    if log_path is not None:
        print(f"  full log:      {log_path}")
    if run_dir is None:
        print(
            f"no run directory under {pipeline_root or 'the pipeline root'}: the run stopped "
            "before kfp.local created one"
        )
        print("=" * 78, flush=True)
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
    args.pipeline_root.mkdir(parents=True, exist_ok=True)
    log_path = args.pipeline_root / f"run-local-{time.strftime('%Y%m%d-%H%M%S')}-{session[:6]}.log"
    print(
        f"running pipeline {PIPELINE_NAME} locally (kfp.local, embedded etcd), faults: "
        f"{args.inject_faults or 'none'}; outputs under {args.pipeline_root}; "
        f"kfp.local's output in {log_path}",
        flush=True,
    )
    before = run_dirs(args.pipeline_root)
    ok, reason = False, None
    try:
        ok = run_pipeline(args.pipeline_root, arguments(args), log_path, args.verbose)
    except KeyboardInterrupt:
        reason = "interrupted (Ctrl-C)"
        print("\ninterrupted: stopping every process of this run", file=sys.stderr, flush=True)
    finally:
        with contextlib.suppress(KeyboardInterrupt):
            left = stop_session(session)
            if left:
                print(f"stopped {left} leftover processes", file=sys.stderr, flush=True)
    if not ok and reason is None:
        with open(log_path, encoding="utf-8", errors="replace") as log:
            reason = failure_reason(log)
    print_outputs(ok, new_run_dir(args.pipeline_root, before), log_path, reason, args.pipeline_root)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
