"""The throughput part of ``benchmarks/elastic_runtime.py``: time-sliced jobs of 2 nodes each
(the static DDP baseline and the elastic runtime with several snapshot schedules) and their
steps/s inside the windows."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.elastic_runtime_common import (
    AUTO,
    BATCH,
    HUGE,
    MODELS,
    REPO_ROOT,
    SETUP_TIMEOUT_S,
    TIMED,
    agents_done,
    group_log,
    median,
    steps_per_epoch,
    worker_lines,
    worker_pids,
)
from kfp_elastic.rendezvous.embedded_etcd import EmbeddedEtcd, free_port
from kfp_elastic.rendezvous.local_agents import AgentGroup, new_run_id, read_events

BASELINE = REPO_ROOT / "benchmarks" / "static_ddp_baseline.py"
ETCD_REQUEST_TIMEOUT_S = 120  # throughput jobs' workers: outlasts any SIGSTOP pause here
AGENT_CPU_S = 3.0  # seconds over which the agents' own CPU use is measured


def _signal(pids: set[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


@dataclass
class Job:
    name: str
    label: str
    snapshot_every: int | None  # None: the static baseline
    steps_file: Path
    group: AgentGroup
    total_steps: int
    launched_at: float = 0.0
    first_step_at: float | None = None
    paused: bool = False
    done: bool = False
    # (SIGCONT time, SIGSTOP time, disturbed: a worker exited during the window)
    windows: list[tuple[float, float, bool]] = field(default_factory=list)
    error: str | None = None

    def events(self) -> list[dict[str, Any]]:
        return [e for e in read_events(self.steps_file) if e.get("rank") == 0]


def start_throughput_job(
    name: str,
    snapshot_every: int | None,
    args: argparse.Namespace,
    etcd: EmbeddedEtcd,
    work_dir: Path,
) -> Job:
    run_id = new_run_id(name)
    run_dir = work_dir / run_id
    run_dir.mkdir(parents=True)
    steps_file = run_dir / "steps.jsonl"
    group = AgentGroup(run_dir / "logs")
    label = (
        "static DDP"
        if snapshot_every is None
        else "elastic auto"
        if snapshot_every == AUTO
        else f"elastic K={'inf' if snapshot_every >= HUGE else snapshot_every}"
    )
    job = Job(
        name,
        label,
        snapshot_every,
        steps_file,
        group,
        args.epochs * steps_per_epoch(2),
        launched_at=time.time(),
    )
    env = {
        "TIMED_STEPS_FILE": str(steps_file),
        "TIMED_STEP_NUMBERS": "0",
        "TIMED_ETCD_REQUEST_TIMEOUT": str(ETCD_REQUEST_TIMEOUT_S),
        "TIMED_MODEL_DEF": MODELS[args.model],
    }
    if snapshot_every is None:
        endpoint = f"127.0.0.1:{free_port()}"
        for index in range(2):
            group.start(
                name=f"node{index}",
                backend="c10d",
                endpoint=endpoint,
                run_id=run_id,
                nnodes="2",
                max_restarts=0,
                rdzv_conf={"is_host": int(index == 0)},
                script=BASELINE,
                env=env,
                device=args.device,
                script_args=[
                    "--device",
                    args.device,
                    "--epochs",
                    args.epochs,
                    "--batch-size",
                    BATCH,
                    "--steps-file",
                    steps_file,
                ],
            )
    else:
        for index in range(2):
            group.start(
                name=f"node{index}",
                backend="elastic-etcd",
                endpoint=etcd.endpoint,
                run_id=run_id,
                nnodes="2:3",
                max_restarts=3,
                rdzv_conf={"last_call_timeout": 1},
                env=env,
                device=args.device,
                script="-m",
                script_args=[
                    "worker",
                    "--device",
                    args.device,
                    "--model-def",
                    TIMED,
                    "--epochs",
                    args.epochs,
                    "--batch-size",
                    BATCH,
                    "--snapshot-every",
                    "auto" if snapshot_every == AUTO else snapshot_every,
                    "--snapshot-dir",
                    run_dir / "snapshots",
                    "--etcd",
                    etcd.endpoint,
                ],
            )
    return job


def pause_when_training(jobs: list[Job], timeout: float) -> None:
    """SIGSTOP each job's workers as soon as it has finished a step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(j.paused or j.error for j in jobs):
        for job in jobs:
            if job.paused or job.error:
                continue
            events = job.events()
            if events:
                _signal(worker_pids(job.group), signal.SIGSTOP)
                job.paused = True
                job.first_step_at = events[0]["t"]
                print(
                    f"  {job.label}: first step {job.first_step_at - job.launched_at:.1f} s "
                    "after launch; paused",
                    flush=True,
                )
            elif agents_done(job.group):
                job.error = "agents exited before the first step"
                print(f"  {job.label}: FAILED to start\n{job.group.logs(20)}", flush=True)
        time.sleep(0.1)
    for job in jobs:
        if not (job.paused or job.error):
            job.error = f"no step within {timeout:.0f} s"
            print(f"  {job.label}: FAILED: {job.error}\n{job.group.logs(20)}", flush=True)


def cpu_seconds(pids: set[int]) -> float:
    """utime + stime of the processes (those alive now)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def agent_pids(job: Job) -> set[int]:
    return {a.pid for a in job.group.agents if a.alive()}


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (a stopped one counts as running)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def time_slice(jobs: list[Job], window: float, cap: float) -> int:
    """Run the jobs alone in turn (rotating order) until all are done or ``cap`` passed.

    A window in which a worker of the job exited before the job's last step (a crash and
    restart) is kept but marked ``disturbed`` and left out of the rates.
    """
    began = time.monotonic()
    rounds = 0
    pids: dict[str, set[int]] = {}
    while time.monotonic() - began < cap:
        active = [j for j in jobs if not (j.done or j.error)]
        if not active:
            break
        shift = rounds % len(active)
        for job in active[shift:] + active[:shift]:
            if not pids.get(job.name) or not all(_running(p) for p in pids[job.name]):
                pids[job.name] = worker_pids(job.group)  # (re)scan only when needed: slow
            mine = pids[job.name]
            if not mine:
                job.done = True
                continue
            t_cont = time.time()
            _signal(mine, signal.SIGCONT)
            time.sleep(window)
            _signal(mine, signal.SIGSTOP)
            t_stop = time.time()
            events = job.events()
            finished = len(events) >= job.total_steps
            disturbed = not finished and not all(_running(p) for p in mine)
            job.windows.append((t_cont, t_stop, disturbed))
            if disturbed:
                print(
                    f"  {job.label}: a worker exited during window {len(job.windows) - 1}; "
                    "window left out",
                    flush=True,
                )
            if finished or agents_done(job.group):
                job.done = True
        rounds += 1
        if rounds % 5 == 0 or all(j.done or j.error for j in jobs):
            done = ", ".join(f"{j.label}: {len(j.events())}/{j.total_steps}" for j in jobs)
            print(f"  round {rounds} ({time.monotonic() - began:.0f} s): {done}", flush=True)
    return rounds


def window_rates(job: Job, warm: float, min_span: float) -> list[dict[str, Any]]:
    """Steps and seconds per undisturbed window, after ``warm`` s; cut at the job's last step."""
    times = sorted(e["t"] for e in job.events())
    last = times[-1] if times else 0.0
    finished = len(times) >= job.total_steps
    rows = []
    for index, (t_cont, t_stop, disturbed) in enumerate(job.windows):
        if disturbed:
            continue
        start = t_cont + warm
        end = min(t_stop, last) if finished else t_stop
        span = end - start
        if span < min_span:
            continue
        steps = sum(1 for t in times if start < t <= end)
        rows.append(
            {
                "window": index,
                "start": start,
                "seconds": round(span, 4),
                "steps": steps,
                "steps_per_s": round(steps / span, 3),
            }
        )
    return rows


def snapshots_per_step(
    snapshot_every: int | None, total: int, per_epoch: int, committed: int = 0
) -> float:
    """Snapshots per step of a job: from the schedule, or (auto) the commits it logged."""
    if snapshot_every is None:
        return 0.0
    if snapshot_every == AUTO:
        return committed / total
    taken = sum(1 for s in range(1, total + 1) if s % snapshot_every == 0 or s % per_epoch == 0)
    return taken / total


JOBS = "static,auto,k10,kinf"


def job_snapshot_every(name: str) -> int | None:
    """``static`` -> None, ``auto`` -> AUTO (the default), ``kinf`` -> never (epoch ends
    only), ``k<N>`` -> N."""
    if name == "static":
        return None
    if name == "auto":
        return AUTO
    if name == "kinf":
        return HUGE
    if name.startswith("k") and name[1:].isdigit() and int(name[1:]) >= 1:
        return int(name[1:])
    raise ValueError(f"unknown job {name!r}: use static, auto, kinf or k<N> (N >= 1)")


def bench_throughput(
    args: argparse.Namespace, etcd: EmbeddedEtcd, work_dir: Path, stack: contextlib.ExitStack
) -> dict[str, Any]:
    specs = [(name, job_snapshot_every(name)) for name in args.jobs]
    print(
        f"[throughput] starting {len(specs)} jobs of 2 nodes, {args.epochs} epochs "
        f"({args.epochs * steps_per_epoch(2)} steps) each",
        flush=True,
    )
    jobs = []
    for name, every in specs:
        job = start_throughput_job(name, every, args, etcd, work_dir)
        stack.callback(job.group.kill_all)
        jobs.append(job)
    pause_when_training(jobs, SETUP_TIMEOUT_S)
    # The agents keep running while their workers are stopped: their own CPU use (monitor
    # loop, keep-alives, watches, probes) is background load shared by every window, so it is
    # measured here, with all workers stopped, and reported beside the rates.
    cpu_before = {j.name: cpu_seconds(agent_pids(j)) for j in jobs}
    time.sleep(AGENT_CPU_S)
    agent_cpu = {
        j.name: (cpu_seconds(agent_pids(j)) - cpu_before[j.name]) / AGENT_CPU_S
        if not j.error
        else None
        for j in jobs
    }
    rounds = time_slice(jobs, args.window, args.cap)
    for job in jobs:
        job.group.kill_all()
    per_epoch = steps_per_epoch(2)
    results: dict[str, Any] = {}
    for job in jobs:
        rows = window_rates(job, args.warm, min_span=args.window / 3)
        steps = sum(r["steps"] for r in rows)
        seconds = sum(r["seconds"] for r in rows)
        rates = [r["steps_per_s"] for r in rows]
        results[job.name] = {
            "label": job.label,
            "snapshot_every": job.snapshot_every,
            "steps_per_s": round(steps / seconds, 3) if seconds else None,
            "median_window_steps_per_s": median(rates),
            "min_window_steps_per_s": min(rates) if rates else None,
            "max_window_steps_per_s": max(rates) if rates else None,
            "windows": len(rows),
            "disturbed_windows": sum(1 for w in job.windows if w[2]),
            "measured_steps": steps,
            "measured_s": round(seconds, 3),
            "steps_done": len(job.events()),
            "total_steps": job.total_steps,
            "snapshots_per_step": round(
                snapshots_per_step(
                    job.snapshot_every,
                    job.total_steps,
                    per_epoch,
                    len(worker_lines(group_log(job.group), "committed step=")),
                ),
                4,
            ),
            "first_step_after_launch_s": (
                round(job.first_step_at - job.launched_at, 2) if job.first_step_at else None
            ),
            "agents_cpu_share": (
                round(agent_cpu[job.name], 4) if agent_cpu[job.name] is not None else None
            ),
            "model": args.model,
            "error": job.error,
            "window_rows": rows,
        }
    results["_rounds"] = rounds
    results["_paired"] = paired_ratios(jobs, args)
    return results


def paired_ratios(jobs: list[Job], args: argparse.Namespace) -> dict[str, Any]:
    """job/static of the k-th measured windows (the same round while both run: seconds apart,
    so drift cancels)."""
    by_name = {j.name: window_rates(j, args.warm, args.window / 3) for j in jobs}
    out: dict[str, Any] = {}
    for name in [j.name for j in jobs if j.name != "static"]:
        ours, base = by_name.get(name, []), by_name.get("static", [])
        ratios = []
        for a, b in zip(ours, base, strict=False):  # k-th measured window of each
            if a["steps_per_s"] and b["steps_per_s"]:
                ratios.append(a["steps_per_s"] / b["steps_per_s"])
        out[name] = {
            "median": round(median(ratios), 4) if ratios else None,
            "min": round(min(ratios), 4) if ratios else None,
            "max": round(max(ratios), 4) if ratios else None,
            "pairs": len(ratios),
        }
    return out
