"""What does the elastic worker runtime cost, and how many steps does a lost node cost?

    python -m benchmarks runtime [--quick] [--parts throughput,disrupt,micro]
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
              static   benchmarks.static_ddp_baseline: plain DDP, c10d rendezvous,
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
            ElasticLoop.commit does on the training thread: state_dict, optimizer state, RNG, then
            Snapshotter.save's copy into the snapshot buffer), the time a snapshot adds to the
            step after it (with ``--device cuda`` the copies of parameters and optimizer state
            overlap that step's forward and backward; CUDA is synchronised before every clock
            read), its background part (header +
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

Prints the tables and ratios and writes all runs as JSON (see ``benchmarks/harness.py``). Every
agent, worker and etcd started here is killed on exit, error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import random
import re
import signal
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    add_common_options,
    agents_done,
    comma_list,
    group_log,
    median,
    parse_options,
    run_in_work_dir,
    start_etcd,
    worker_pids,
    write_result,
)
from kfp_elastic.job_spec import DEVICES
from kfp_elastic.rendezvous.embedded_etcd import EmbeddedEtcd, free_port
from kfp_elastic.testing.nodes import AgentGroup, new_run_id, read_events

# --------------------------------------------------------------------------- workload

MODELS = {
    "digits": "kfp_elastic.worker.examples.digits",
    "wide": "benchmarks.wide_digits",
    "1b": "benchmarks.billion_params",  # GPU only: 8.6 GB of state
}
TIMED = "benchmarks.timed_model_def"
BATCH = 32  # per worker
TRAIN_SAMPLES = 1437  # digits train split (80 % of 1,797)
SETUP_TIMEOUT_S = 300.0
HUGE = 10**9
AUTO = 0  # --snapshot-every auto (the runner's default)


def steps_per_epoch(world: int) -> int:
    return -(-TRAIN_SAMPLES // (world * BATCH))


_WORKER_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\] worker (\w+) (.*)$")


def worker_lines(text: str, needle: str) -> list[tuple[float, str]]:
    """(time.time(), message) of the runtime's log lines containing ``needle``."""
    found = []
    for line in text.splitlines():
        match = _WORKER_LINE.match(line)
        if match and needle in match.group(3):
            stamp = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            found.append((stamp, match.group(3)))
    return found


# --------------------------------------------------------------------------- throughput

BASELINE = "benchmarks.static_ddp_baseline"  # run by torchrun -m
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
                script="-m",
                env=env,
                device=args.device,
                script_args=[
                    BASELINE,
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
                    "kfp_elastic.worker",
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


# --------------------------------------------------------------------------- disrupt


@dataclass
class Disruption:
    kind: str  # "sigkill" | "sigterm"
    run_id: str
    victim: str = ""
    victim_rank: int | None = None
    trigger_step: int | None = None  # the event follows this step (+ polling, + delay_s)
    delay_s: float = 0.0  # random wait after the trigger step
    highest_step: int | None = None  # highest step an old-world worker finished
    committed_before: int | None = None  # last "committed step=" logged before the event
    restored_step: int | None = None  # "restored rank=0 world=2 step=S"
    first_new_step: int | None = None  # the new world's first finished step (= restored + 1)
    lost_steps: int | None = None
    recovery_s: float | None = None  # event -> first step of the 2-node world
    victim_exit: int | None = None
    error: str | None = None
    logs: str | None = None


def disrupt_run(
    kind: str,
    victim_rank: int,
    phase: float,
    args: argparse.Namespace,
    etcd: EmbeddedEtcd,
    work_dir: Path,
    rng: random.Random,
    stack: contextlib.ExitStack,
) -> Disruption:
    """One 3-node run; the node whose worker has ``victim_rank`` gets the signal after step
    ``steps_per_epoch(3) + 1 + int(phase * K)`` (phase in [0, 1)) + a random part of a step."""
    run_id = new_run_id(kind)
    result = Disruption(kind, run_id)
    run_dir = work_dir / run_id
    run_dir.mkdir(parents=True)
    steps_file = run_dir / "steps.jsonl"
    group = AgentGroup(run_dir / "logs")
    stack.callback(group.kill_all)
    k = args.snapshot_every
    with group:
        try:
            for index in range(3):
                group.start(
                    name=f"node{index}",
                    backend="elastic-etcd",
                    endpoint=etcd.endpoint,
                    run_id=run_id,
                    nnodes="2:3",
                    max_restarts=10,
                    rdzv_conf={"last_call_timeout": 1},
                    script="-m",
                    env={"TIMED_STEPS_FILE": str(steps_file)},
                    device=args.device,
                    script_args=[
                        "kfp_elastic.worker",
                        "--device",
                        args.device,
                        "--model-def",
                        TIMED,
                        "--epochs",
                        args.disrupt_epochs,
                        "--batch-size",
                        BATCH,
                        "--snapshot-every",
                        k,
                        "--step-time",
                        args.step_time,
                        "--snapshot-dir",
                        run_dir / "snapshots",
                        "--etcd",
                        etcd.endpoint,
                    ],
                )
            wait_until(
                lambda: len({e["rank"] for e in read_events(steps_file) if e["world"] == 3}) == 3,
                SETUP_TIMEOUT_S,
                "a step of every rank of the 3-node world",
                group,
            )
            pid_of_rank = {e["rank"]: e["pid"] for e in read_events(steps_file) if e["world"] == 3}
            victim = next(a for a in group.agents if pid_of_rank[victim_rank] in a.tree_pids())
            result.victim = victim.name
            victim_pids = victim.tree_pids()
            # A step of the second epoch (the first epoch end, a forced snapshot, is behind),
            # then a random fraction of a step: the event lands anywhere in a snapshot interval.
            trigger = steps_per_epoch(3) + 1 + int(phase * k)
            result.trigger_step = trigger
            wait_until(
                lambda: any(
                    e["world"] == 3 and (e["step"] or 0) >= trigger for e in read_events(steps_file)
                ),
                SETUP_TIMEOUT_S,
                f"step {trigger} of the 3-node world",
                group,
            )
            result.delay_s = round(rng.uniform(0, max(args.step_time, 0.01)), 3)
            time.sleep(result.delay_s)
            event_t = victim.sigkill_tree() if kind == "sigkill" else victim.sigterm()
            wait_until(
                lambda: any(e["world"] == 2 and e["t"] > event_t for e in read_events(steps_file)),
                args.recovery_cap,
                "a step of the 2-node world",
                group,
            )
            wait_until(
                lambda: restored_after(group_log(group), event_t) is not None,
                10.0,
                "the new world's 'restored' log line",
                group,
            )
            with contextlib.suppress(Exception):
                result.victim_exit = victim.wait(30 if kind == "sigterm" else 1)
            events = read_events(steps_file)
            old_pids = {e["pid"] for e in events if e["t"] <= event_t}
            old = [e for e in events if e["pid"] in old_pids and e["step"] is not None]
            result.highest_step = max(e["step"] for e in old)
            ranks = {e["rank"] for e in old if e["pid"] in victim_pids}
            result.victim_rank = min(ranks) if ranks else None
            new = sorted(
                (e for e in events if e["world"] == 2 and e["t"] > event_t), key=lambda e: e["t"]
            )
            result.first_new_step = new[0]["step"]
            result.recovery_s = round(new[0]["t"] - event_t, 3)
            text = group_log(group)
            result.restored_step = restored_after(text, event_t)
            committed = [
                int(m.group(1))
                for t, line in worker_lines(text, "committed step=")
                if t <= event_t and (m := re.search(r"step=(\d+)", line))
            ]
            result.committed_before = max(committed) if committed else 0
            if result.restored_step is not None:
                result.lost_steps = result.highest_step - result.restored_step
        except Exception as error:  # noqa: BLE001 - one failed run must not end the benchmark
            result.error = f"{type(error).__name__}: {error}"
            result.logs = group.logs(25)
    return result


def restored_after(text: str, after: float) -> int | None:
    for _t, line in sorted(worker_lines(text, "restored rank=0 world=2 ")):
        if _t > after - 0.01:
            return int(re.search(r"step=(\d+)", line).group(1))  # type: ignore[union-attr]
    return None


def wait_until(predicate: Any, timeout: float, what: str, group: AgentGroup) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout:.0f} s")
        if agents_done(group):
            raise RuntimeError(f"all agents exited before {what}")
        time.sleep(0.05)


def bench_disrupt(
    args: argparse.Namespace, etcd: EmbeddedEtcd, work_dir: Path, stack: contextlib.ExitStack
) -> dict[str, Any]:
    rng = random.Random(args.seed)
    runs: dict[str, list[Disruption]] = {"sigkill": [], "sigterm": []}
    for repeat in range(args.repeats):
        # The victim's rank cycles 0, 1, 2 (rank 0 writes the snapshots); the trigger step is
        # stratified over the snapshot interval.
        phase = (repeat + rng.random()) / args.repeats
        for kind in ("sigkill", "sigterm"):  # alternated: same drift for both
            run = disrupt_run(kind, repeat % 3, phase, args, etcd, work_dir, rng, stack)
            runs[kind].append(run)
            shown = (
                f"lost {run.lost_steps} (highest {run.highest_step}, committed before "
                f"{run.committed_before}, restored {run.restored_step}, first new step "
                f"{run.first_new_step}); victim {run.victim} rank {run.victim_rank}; "
                f"recovery {run.recovery_s} s"
                if run.error is None
                else f"FAILED ({run.error})\n{run.logs}"
            )
            print(f"[disrupt] {kind} {repeat + 1}/{args.repeats}: {shown}", flush=True)
    out: dict[str, Any] = {}
    for kind, items in runs.items():
        lost = [r.lost_steps for r in items if r.lost_steps is not None]
        out[kind] = {
            "median_lost": median(lost),
            "max_lost": max(lost) if lost else None,
            "runs": len(items),
            "measured": len(lost),
            "median_recovery_s": median([r.recovery_s for r in items if r.recovery_s is not None]),
            "details": [asdict(r) for r in items],
        }
    return out


# --------------------------------------------------------------------------- micro


def bench_micro(args: argparse.Namespace, etcd: EmbeddedEtcd, work_dir: Path) -> dict[str, Any]:
    import torch

    from kfp_elastic.etcd.client import connect
    from kfp_elastic.worker import snapshot_format
    from kfp_elastic.worker.data_plan import shards_for_length
    from kfp_elastic.worker.progress import Committed, Progress, manifest_from_shards
    from kfp_elastic.worker.snapshot import Snapshotter

    torch.set_num_threads(1)
    model_def = importlib.import_module(MODELS[args.model])
    # --device cuda: the state lives on the GPU and save() copies it into pinned host memory.
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    model = model_def.model().to(device)
    optimizer = model_def.optimizer(model.parameters())
    features, labels = (t.to(device) for t in model_def.dataset("train")[:BATCH])

    def train_step() -> None:
        loss = model_def.loss(model, [features, labels])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(20):
        train_step()  # momentum buffers exist, caches warm

    def state() -> dict[str, Any]:  # what ElasticLoop.commit builds on the training thread
        return {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": 1,
            "epoch": 0,
            "position": 0,
            "rng": torch.get_rng_state(),
        }

    def settle() -> None:
        """Wait for the GPU's queued work: a clock read before it times only the queueing."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(fn: Any, n: int) -> list[float]:
        out = []
        for _ in range(n):
            settle()
            began = time.perf_counter()
            fn()
            settle()
            out.append(time.perf_counter() - began)
        return out

    n = args.micro_n
    snapshotter = Snapshotter(work_dir / "micro-snapshots")
    snapshotter.guard(optimizer)  # as the runtime: the next optimizer.step() waits for the copy
    save_times, steps_with_save = [], []
    for step in range(n):
        settle()  # the step before is done: what follows is this snapshot's cost alone
        began = time.perf_counter()
        snapshotter.save(step, state(), lambda name: None)  # _commit's synchronous part
        save_times.append(time.perf_counter() - began)
        # On a GPU the parameters' copies go on behind save(): the step that follows pays for
        # what of them its forward and backward do not hide (settle() waits for all of it).
        train_step()
        settle()
        steps_with_save.append(time.perf_counter() - began)
        snapshotter.wait()  # the background part, not timed here
    cpu = state()
    packed = snapshot_format.pack(cpu)

    def pack_reused() -> None:
        snapshot_format.pack(cpu, packed.buffer)

    def write_packed() -> None:
        packed._header = None  # the checksum is part of the writer's work
        packed.write_to(work_dir / "micro.snap")

    def steps_after(on_persisted: Any) -> float:
        """Seconds for 10 train steps right after save() (background write under way)."""
        snapshotter.save(0, state(), on_persisted)
        settle()
        began = time.perf_counter()
        for _ in range(10):
            train_step()
        settle()
        spent = time.perf_counter() - began
        snapshotter.wait()
        return spent

    def thread_start() -> None:
        thread = threading.Thread(target=lambda: None)
        thread.start()
        thread.join()

    noop_commit = lambda name: None  # noqa: E731
    step_ms = statistics.median(timed(train_step, n)) * 1e3
    results = {
        "train_step_1proc_ms": step_ms,
        # A step with a snapshot before it, and what the snapshot adds to it: the time the
        # snapshot blocks training (on a GPU: its copy, less what the step overlaps).
        "step_with_snapshot_ms": statistics.median(steps_with_save) * 1e3,
        "snapshot_blocking_ms": max(0.0, statistics.median(steps_with_save) * 1e3 - step_ms),
        "state_build_ms": statistics.median(timed(state, n)) * 1e3,
        "pack_copy_ms": statistics.median(timed(pack_reused, n)) * 1e3,
        # save()'s own time on the training thread (incl. the state build; on a GPU without
        # the parameters' copies, which go on behind it)
        "sync_save_call_ms": statistics.median(save_times) * 1e3,
        "packed_write_ms": statistics.median(timed(write_packed, n)) * 1e3,
        "state_bytes": (work_dir / "micro.snap").stat().st_size,
        "torch_save_ms": statistics.median(
            timed(lambda: torch.save(cpu, work_dir / "micro.pt"), max(5, n // 5))
        )
        * 1e3,
        "thread_start_join_ms": statistics.median(timed(thread_start, n)) * 1e3,
        "ten_steps_ms": statistics.median(
            timed(lambda: [train_step() for _ in range(10)], max(5, n // 5))
        )
        * 1e3,
        "ten_steps_after_save_noop_commit_ms": statistics.median(
            [steps_after(noop_commit) for _ in range(max(5, n // 5))]
        )
        * 1e3,
    }
    client = connect(etcd.client_settings())
    try:
        shards = shards_for_length(TRAIN_SAMPLES, max(1, TRAIN_SAMPLES // 64))
        for epochs in sorted({1, 10, args.epochs, 100}):
            progress = Progress(client, f"/kfp-elastic/micro-{new_run_id()}")
            manifest = manifest_from_shards(shards, epochs)
            previous: Committed | None = None
            revision = 0
            per_epoch = steps_per_epoch(2)
            times = []
            for i in range(1, max(5, n // 10) + 1):
                step = i * 10
                new = Committed(
                    step,
                    (step // per_epoch) % epochs,
                    (step % per_epoch) * 2 * BATCH,
                    "snapshot",
                    2,
                )
                began = time.perf_counter()
                revision = progress.commit(manifest, previous, revision, new)
                times.append(time.perf_counter() - began)
                assert revision
                previous = new
            one_epoch = range(previous.epoch, previous.epoch + 1)
            placement = timed(
                lambda p=progress, m=manifest, c=previous, e=one_epoch: p._placement(m, c, e),
                max(5, n // 10),
            )
            results[f"progress_commit_ms_epochs{epochs}"] = statistics.median(times) * 1e3
            results[f"placement_ms_epochs{epochs}"] = statistics.median(placement) * 1e3
            if epochs == args.epochs:  # the background part as the throughput jobs run it

                def real_commit(
                    name: str, p: Progress = progress, m: Any = manifest, per_epoch: int = per_epoch
                ) -> None:
                    nonlocal previous, revision
                    step = (previous.step if previous else 0) + 10
                    new = Committed(
                        step,
                        (step // per_epoch) % m.epochs,
                        (step % per_epoch) * 2 * BATCH,
                        name,
                        2,
                    )
                    revision = p.commit(m, previous, revision, new)
                    assert revision
                    previous = new

                results["ten_steps_after_save_etcd_commit_ms"] = (
                    statistics.median([steps_after(real_commit) for _ in range(max(5, n // 5))])
                    * 1e3
                )
        results["shards"] = len(shards)
    finally:
        client.close()
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()}


# --------------------------------------------------------------------------- suite

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
        summary["sync_snapshot_ms"] = micro["sync_save_call_ms"]
        summary["snapshot_write_ms"] = micro["packed_write_ms"]
        summary["torch_save_ms"] = micro["torch_save_ms"]
        summary["snapshot_blocking_ms"] = micro["snapshot_blocking_ms"]
        print(
            f"(c) micro, in-process, medians of {args.micro_n}:\n"
            f"    synchronous part of a snapshot (ElasticLoop.commit state + Snapshotter.save): "
            f"{micro['sync_save_call_ms']:.3f} ms = {fmt(100 * share if share else None, '.1f')}"
            f" % of a {fmt(step_ms, '.2f')} ms K=inf step; of it state_dict+optimizer+rng "
            f"{micro['state_build_ms']:.3f} ms, copy into the snapshot buffer "
            f"{micro['pack_copy_ms']:.3f} ms"
            f"\n    a step with a snapshot before it: {micro['step_with_snapshot_ms']:.2f} ms, "
            f"{micro['snapshot_blocking_ms']:.2f} ms more than a step alone "
            f"({micro['snapshot_blocking_ms'] / micro['torch_save_ms']:.3f} x torch.save)"
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


def build_parser() -> argparse.ArgumentParser:
    """``python -m benchmarks runtime``'s options."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks runtime",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--parts", default="throughput,disrupt,micro")
    add_common_options(parser, "fewer epochs, shorter windows, 1 repeat")
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
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options, checked, with ``--quick`` and the derived defaults applied."""
    parser = build_parser()
    args = parse_options(parser, argv)
    if args.quick:
        args.epochs, args.cap = 20, 40.0
        args.repeats, args.disrupt_epochs, args.micro_n = 1, 20, 50
    args.jobs = comma_list(args.jobs)
    for job in args.jobs:
        try:
            job_snapshot_every(job)
        except ValueError as error:
            parser.error(str(error))
    if args.window is None:
        args.window = min(1.0, round(3.0 / max(1, len(args.jobs) - 1), 2))
    if args.warm is None:
        args.warm = min(0.15, args.window / 5)
    args.parts = comma_list(args.parts)
    unknown = set(args.parts) - {"throughput", "disrupt", "micro"}
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report: dict[str, Any] = {}
    began = time.time()

    def body(work_dir: Path, stack: contextlib.ExitStack) -> None:
        etcd = start_etcd(stack, work_dir)
        if "throughput" in args.parts:
            report["throughput"] = bench_throughput(args, etcd, work_dir, stack)
        if "disrupt" in args.parts:
            report["disrupt"] = bench_disrupt(args, etcd, work_dir, stack)
        if "micro" in args.parts:
            print("[micro] snapshot and commit costs in-process", flush=True)
            report["micro"] = bench_micro(args, etcd, work_dir)

    code, work_dir = run_in_work_dir("runtime-bench-", args.keep_logs, body)
    summary = summarize(report, args)
    if args.keep_logs:
        print(f"logs kept in {work_dir}")
    write_result(
        "runtime",
        args,
        began,
        code == 0,
        summary,
        {
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
            **report,
        },
    )
    return code
