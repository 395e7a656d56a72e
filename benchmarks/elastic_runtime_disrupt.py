"""The disruption part of ``benchmarks/elastic_runtime.py``: 3 nodes train, one node gets SIGKILL
(its whole process tree) or SIGTERM (its agent); how many steps the new 2-node world redoes."""

from __future__ import annotations

import argparse
import contextlib
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.elastic_runtime_common import (
    BATCH,
    SETUP_TIMEOUT_S,
    TIMED,
    agents_done,
    group_log,
    median,
    steps_per_epoch,
    worker_lines,
)
from kfp_elastic.rendezvous.embedded_etcd import EmbeddedEtcd
from kfp_elastic.rendezvous.local_agents import AgentGroup, new_run_id, read_events


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
                        "worker",
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
