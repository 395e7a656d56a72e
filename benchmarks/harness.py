"""What every benchmark suite shares: its work directory and embedded etcd (stopped on exit, error,
Ctrl-C or SIGTERM), helpers for its local agents, the options every suite takes (``--quick``,
``--out``), and its result: one JSON file with the environment, date and commit, and a summary
table printed at the end.

Results go to ``benchmarks/results/<suite>/<suite>-<YYYY-MM-DD>-<shortcommit>.json``; a
``--quick`` run (a smoke run, its numbers mean little) writes under a new temporary directory
instead, so that it never replaces a committed result.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kfp_elastic.etcd.embedded import EmbeddedEtcd
from kfp_elastic.testing.nodes import AgentGroup, run_with_cleanup

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "benchmarks" / "results"


# --------------------------------------------------------------------------- options


def suite_parser(prog: str, doc: str, quick_help: str) -> argparse.ArgumentParser:
    """A suite's parser: its module docstring ``doc`` gives the description (the first line)
    and the epilog (the rest), with the common options (:func:`add_common_options`)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=doc.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=doc.split("\n\n", 1)[1],
    )
    add_common_options(parser, quick_help)
    return parser


def add_common_options(parser: argparse.ArgumentParser, quick_help: str) -> None:
    """``--quick`` (what it shortens is the suite's own: ``quick_help``) and ``--out``."""
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run ({quick_help}); writes under a new temporary directory",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="result file (default: benchmarks/results/<suite>/<suite>-<date>-<commit>.json)",
    )


def parse_options(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> argparse.Namespace:
    """A suite's options with the common ones checked: a smoke run's numbers must not land
    among the committed results."""
    args = parser.parse_args(argv)
    if args.quick and args.out is not None and is_under(args.out, RESULTS):
        parser.error(f"--quick writes no result under {RESULTS}: drop --out or point it elsewhere")
    # The code that runs is the checkout's now: a commit made during a long run must not name
    # its result (``write_result``).
    args._checkout_at_start = git_commit()
    return args


def apply_quick(args: argparse.Namespace, settings: Mapping[str, Any]) -> None:
    """``--quick``: a suite's smoke-run settings (option name -> value) over its options."""
    if args.quick:
        for key, value in settings.items():
            setattr(args, key, value)


def check_policies(
    parser: argparse.ArgumentParser, policies: Sequence[str], known: Sequence[str]
) -> None:
    """``--policies``: at least one, each known (else the parser's error, naming them)."""
    unknown = [p for p in policies if p not in known]
    if unknown or not policies:
        parser.error(f"--policies: unknown {unknown}; choose among {', '.join(known)}")


def comma_list(text: str) -> list[str]:
    """``"a, b,,c"`` → ``["a", "b", "c"]`` (the suites' comma-separated options)."""
    return [item.strip() for item in str(text).split(",") if item.strip()]


def is_under(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


# --------------------------------------------------------------------------- result file


def result_path(root: Path, suite: str, date: str, commit: str) -> Path:
    """``root/<suite>/<suite>-<date>-<commit>.json``."""
    return root / suite / f"{suite}-{date}-{commit}.json"


def git_commit(repo: Path = REPO_ROOT) -> tuple[str, bool]:
    """(short commit of HEAD, whether tracked files differ from it); ("unknown", False) outside
    a git checkout."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        return git("rev-parse", "--short", "HEAD"), bool(
            git("status", "--porcelain", "--untracked-files=no")
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown", False


def environment() -> dict[str, Any]:
    """Where the numbers were measured."""
    import torch

    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }


def recorded_path(path: Path | str) -> str:
    """``path`` as a result records it: relative to the checkout (``benchmarks/...``; one
    outside it as ``../...``), so that a committed result names no machine's directories."""
    return Path(os.path.relpath(Path(path).resolve(), REPO_ROOT)).as_posix()


def jsonable_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The options of a run as its result records them (paths: :func:`recorded_path`)."""
    return {
        k: (recorded_path(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
        if not k.startswith("_")
    }


def write_result(
    suite: str,
    args: argparse.Namespace,
    began: float,
    complete: bool,
    summary: Mapping[str, Any],
    report: Mapping[str, Any],
) -> Path:
    """Write the suite's result (``report`` under the common header) and print the summary table
    and where it went. Returns the file written."""
    now = datetime.now(timezone.utc)
    commit, dirty = git_commit()
    started = getattr(args, "_checkout_at_start", None)
    if started is not None:  # what ran: the checkout at the start, changed since or not
        dirty = started[1] or dirty or started[0] != commit
        commit = started[0]
    date = now.strftime("%Y-%m-%d")
    if args.out is not None:
        out = args.out
    else:
        root = Path(tempfile.mkdtemp(prefix="benchmarks-quick-")) if args.quick else RESULTS
        out = result_path(root, suite, date, commit)
    document = {
        "benchmark": suite,
        "date": now.isoformat(timespec="seconds"),
        "commit": commit,
        "uncommitted_changes": dirty,
        "quick": args.quick,
        "started": began,
        "duration_s": round(time.time() - began, 1),
        "complete": complete,
        "environment": environment(),
        "settings": jsonable_settings(args),
        "summary": dict(summary),
        **report,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2, default=str) + "\n")
    print(summary_table(suite, summary))
    print(f"wrote {out}" + (" (--quick: a temporary directory)" if args.quick else ""), flush=True)
    return out


def summary_rows(summary: Mapping[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """(name, value) per leaf of ``summary``, nested names joined with dots."""
    rows: list[tuple[str, str]] = []
    for key, value in summary.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            rows += summary_rows(value, f"{name}.")
        elif value is None:
            rows.append((name, "-"))
        elif isinstance(value, float):
            rows.append((name, f"{value:g}"))
        else:
            rows.append((name, str(value)))
    return rows


def summary_table(suite: str, summary: Mapping[str, Any]) -> str:
    """The suite's headline numbers, one per line, printed at the end of every run."""
    rows = summary_rows(summary) or [("(nothing measured)", "")]
    width = max(len(name) for name, _ in rows) + 2
    lines = [f"summary: {suite}", *(f"  {name:<{width}}{value}" for name, value in rows)]
    return "\n".join(lines)


# --------------------------------------------------------------------------- numbers


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def first_after(times: Iterable[float], after: float) -> float | None:
    """Seconds from ``after`` to the earliest of ``times`` later than it (None: none later)."""
    later = [t for t in times if t > after]
    return round(min(later) - after, 3) if later else None


# --------------------------------------------------------------------------- processes


def run_in_work_dir(
    prefix: str, keep_logs: bool, body: Callable[[Path, contextlib.ExitStack], None]
) -> tuple[int, Path]:
    """Run ``body(work_dir, stack)`` in a new work directory; whatever it registers on ``stack``
    (agents, etcd; the directory unless ``keep_logs``) is cleaned up on return, error, Ctrl-C or
    SIGTERM. Returns (exit code: 0, 130 interrupted or 1 error, the work directory)."""
    work_dir = Path(tempfile.mkdtemp(prefix=prefix))
    code = run_with_cleanup(work_dir, keep_logs, lambda stack: body(work_dir, stack))
    return code, work_dir


def start_etcd(
    stack: contextlib.ExitStack, work_dir: Path, name: str = "etcd", **options: Any
) -> EmbeddedEtcd:
    """An embedded etcd with its data and log under ``work_dir``, stopped when ``stack`` closes
    (``options``: EmbeddedEtcd's, e.g. ``enable_v2`` or ``tls``)."""
    etcd = EmbeddedEtcd(data_dir=work_dir / name, log_file=work_dir / f"{name}.log", **options)
    stack.callback(etcd.stop)
    etcd.start()
    return etcd


def worker_pids(group: AgentGroup) -> set[int]:
    """The processes below the group's agents (the workers), not the agents themselves."""
    pids: set[int] = set()
    for agent in group.agents:
        pids |= agent.tree_pids() - ({agent.pid} if agent.process else set())
    return pids


def agents_done(group: AgentGroup) -> bool:
    return all(not agent.alive() for agent in group.agents)


def group_log(group: AgentGroup) -> str:
    """Every agent's log (its workers' output included), one after the other."""
    return "\n".join(agent.log_text() for agent in group.agents)


def export_checkout_to_children() -> None:
    """Processes started from here (agents, pods, workers) import ``benchmarks.*`` and
    ``tests.*`` model definitions from this checkout."""
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )
