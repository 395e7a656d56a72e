"""What a sharded (FSDP2) job's elastic restore costs: host-memory shards against DCP on disk.

    python -m benchmarks sharded [--quick] [--repeats N] [--paths memory,disk] [--out FILE]
                                 [--hidden H] [--batch-size B] [--auto-seconds S]
                                 [--every1-steps N] [--keep-logs]

Three local "nodes" (one torchrun agent with one gloo worker each, ``--nnodes=2:3``, elastic-etcd
rendezvous against an embedded etcd) train ``benchmarks/sharded_model_def.py`` (an MLP on the
digits data, ``SHARDING = "per-module"``, AdamW; 50.6 M parameters at ``--hidden 4096``,
``--quick``: 1280, 5.0 M) through ``benchmarks/timed_model_def.py`` (one time stamp per
finished optimizer step), ``--batch-size`` samples per worker and step. Both snapshot paths of
the runtime (``--sharded-snapshots``) train the same model with the same settings, one after the
other (memory, then disk, alternating over ``--repeats``):

memory  every rank copies its shards into a slot file in its node's host memory (a tmpfs
        directory under /dev/shm here, each node its own: ``KFP_ELASTIC_WORKER_NAME``), a
        background thread copies it to the ring neighbour's node; every 10th snapshot (the
        runtime's ``--disk-snapshot-every``) is also DCP's save to disk. A new world reshards
        N -> M from the nodes' memory.
disk    every snapshot is ``torch.distributed.checkpoint.save`` to ``--snapshot-dir``; a new
        world loads it with DCP's resharding (the baseline). The directory is on this machine's
        disk: the restore reads it mostly from the page cache.

Per path and repeat, two jobs:

kill    ``--snapshot-every auto`` (the default). After ``--auto-seconds`` of training in the
        world of 3 and a committed snapshot, the node of rank ``--victim-rank`` (not 0) gets
        SIGKILL on its whole process tree. Measured: (1) seconds from the SIGKILL to the first
        optimizer step of the 2-rank world finished on every rank (with the first new worker's
        "placed" line and the last "restored" line on the way: what follows the restore is one
        whole training step); (2) the bytes the restore moved:
        memory: the "restored ... received_bytes sent_bytes copied_bytes" lines of the new
        ranks (``moved_bytes`` = received + sent, each byte counted at both ends, as the lines
        give it); disk: the size of the DCP directory restored from (measured at the kill);
        ``restored_from`` says where the new ranks' restore came from (memory resp. disk, or
        both when the memory path fell back); (4a) the blocking share of snapshots at
        the default interval: the sum over snapshots (the slowest rank's ``blocking_s``, the
        runtime's "sharded snapshot" lines) over the training time of the world of 3.
every1  ``--snapshot-every 1``: ``--every1-steps`` steps after 2 warm-up steps. (4b) the
        blocking share at a snapshot per step, the same way, and the median step time against
        the median snapshot-free step time of the kill job (what the step really pays, the
        background copy's CPU on a shared box included).

(3) Peak host memory per rank, sampled every ``--sample-s`` while each job runs: VmHWM of each
worker process (/proc/PID/status) and the bytes in its node's memory directory (tmpfs blocks);
``peak_rank_host_bytes`` is the largest VmHWM + node directory over the ranks (one rank per node
here). The slot pages a worker maps count in its VmHWM too (RssShmem, also recorded), so that
sum counts them twice; ``peak_rank_host_bytes_shmem_once`` is VmHWM - the largest RssShmem + the
node directory (an estimate: the two peaks need not coincide).

Goals: SIGKILL -> first step of the 2-rank world <= 3 s and <= 0.3 x the disk path's; snapshot
blocking <= 5 % of the training time at the default interval. Prints every number per path, the
ratios memory / disk and the goals, and writes the JSON result (``benchmarks/harness.py``).
Every agent, worker, etcd and host-memory directory started here is removed on exit, error,
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    comma_list,
    export_checkout_to_children,
    group_log,
    median,
    parse_options,
    run_in_work_dir,
    start_etcd,
    suite_parser,
    write_result,
)
from benchmarks.runtime import wait_until, worker_lines
from benchmarks.sharded_model_def import DEFAULT_HIDDEN, HIDDEN_ENV, parameter_count
from kfp_elastic.etcd.embedded import EmbeddedEtcd
from kfp_elastic.testing.nodes import AgentGroup, new_run_id, read_events

PATHS = ("memory", "disk")
NODES = 3
TIMED = "benchmarks.timed_model_def"
MODEL = "benchmarks.sharded_model_def"
QUICK_HIDDEN = 1280
WARM_STEPS = 2  # every1: steps before the timed ones (the first step builds FSDP's buffers)
# Goals
RECOVERY_GOAL_S = 3.0
RECOVERY_GOAL_RATIO = 0.3
BLOCKING_GOAL = 0.05
SHM = Path("/dev/shm")


# --------------------------------------------------------------------------- log lines

_SNAPSHOT = re.compile(
    r"sharded snapshot step=(\d+) rank=(\d+) mode=(\w+) blocking_s=([\d.]+) "
    r"slot_bytes=(\d+) disk=(\d)"
)
_RESTORED = re.compile(
    r"restored rank=(\d+) world=(\d+) step=(\d+) .*?from=(\w+)(.*?) rng=.*? "
    r"received_bytes=(\d+) sent_bytes=(\d+) copied_bytes=(\d+)"
)


@dataclass(frozen=True)
class SnapshotCost:
    """One rank's "sharded snapshot" line."""

    t: float
    step: int
    rank: int
    mode: str
    blocking_s: float
    slot_bytes: int
    disk: bool


def snapshot_costs(text: str) -> list[SnapshotCost]:
    """Every "sharded snapshot" line of the logs, in time order."""
    found = []
    for t, line in worker_lines(text, "sharded snapshot step="):
        match = _SNAPSHOT.search(line)
        if match:
            step, rank, mode, blocking, slot, disk = match.groups()
            found.append(
                SnapshotCost(t, int(step), int(rank), mode, float(blocking), int(slot), disk == "1")
            )
    return sorted(found, key=lambda c: c.t)


def blocking_by_step(costs: Sequence[SnapshotCost], world: int) -> dict[int, tuple[float, bool]]:
    """Per snapshot step of a world of ``world`` ranks: (the slowest rank's blocking seconds,
    whether a disk save was part of it). The ranks wait for the slowest in the next step's
    collectives, so that is what the step pays."""
    by_step: dict[int, list[SnapshotCost]] = {}
    for cost in costs:
        by_step.setdefault(cost.step, []).append(cost)
    return {
        step: (max(c.blocking_s for c in items), any(c.disk for c in items))
        for step, items in by_step.items()
        if len({c.rank for c in items}) == world
    }


@dataclass(frozen=True)
class Restored:
    """One rank's "restored" line."""

    t: float
    rank: int
    world: int
    step: int
    source: str  # memory | disk | nothing
    detail: str  # "(3 slots)" | "dcp-000000012"
    received: int
    sent: int
    copied: int


def restored_lines(text: str, after: float) -> list[Restored]:
    """The "restored" lines logged after ``after`` (time.time())."""
    found = []
    for t, line in worker_lines(text, "restored rank="):
        match = _RESTORED.search(line)
        if match and t > after - 0.01:  # the log's clock has millisecond steps
            rank, world, step, source, detail, received, sent, copied = match.groups()
            found.append(
                Restored(
                    t,
                    int(rank),
                    int(world),
                    int(step),
                    source,
                    detail.strip(),
                    int(received),
                    int(sent),
                    int(copied),
                )
            )
    return sorted(found, key=lambda r: r.t)


# --------------------------------------------------------------------------- step times


def step_done_times(events: Sequence[dict[str, Any]], world: int) -> dict[int, float]:
    """Step number -> when every rank of a world of ``world`` ranks had finished it (the last
    rank's post-hook time stamp)."""
    by_step: dict[int, list[float]] = {}
    for event in events:
        if event.get("world") == world and event.get("step") is not None:
            by_step.setdefault(event["step"], []).append(event["t"])
    return {step: max(times) for step, times in by_step.items() if len(times) == world}


def window_share(
    done: dict[int, float], blocking: dict[int, tuple[float, bool]], first: int, last: int
) -> dict[str, Any]:
    """Steps ``first`` .. ``last`` (both finished): the snapshots taken after steps ``first`` ..
    ``last - 1`` (each lies between two of the steps) and their blocking over the time between
    step ``first`` and step ``last``; the step intervals with and without a snapshot."""
    seconds = done[last] - done[first]
    taken = {s: b for s, b in blocking.items() if first <= s < last}
    blocked = sum(b for b, _ in taken.values())
    intervals = {
        s: done[s + 1] - done[s] for s in range(first, last) if s + 1 in done and s in done
    }
    plain = [v for s, v in intervals.items() if s not in blocking]
    with_snapshot = [v for s, v in intervals.items() if s in blocking]
    return {
        "first_step": first,
        "last_step": last,
        "seconds": round(seconds, 3),
        "snapshots": len(taken),
        "snapshots_with_disk_save": sum(1 for _, disk in taken.values() if disk),
        "blocking_s": [round(b, 4) for b, _ in taken.values()],
        "blocked_s": round(blocked, 4),
        "blocking_share": round(blocked / seconds, 5) if seconds > 0 else None,
        "median_step_s": round(statistics.median(intervals.values()), 4) if intervals else None,
        "median_plain_step_s": round(statistics.median(plain), 4) if plain else None,
        "median_snapshot_step_s": (
            round(statistics.median(with_snapshot), 4) if with_snapshot else None
        ),
    }


# --------------------------------------------------------------------------- host memory


def proc_status_kb(pid: int, keys: Sequence[str]) -> dict[str, int] | None:
    """``keys`` of /proc/PID/status in kB (None: the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    values = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in keys:
            values[name] = int(rest.split()[0])
    return values


def proc_env(pid: int, name: str) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = f"{name}=".encode()
    for entry in raw.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None


def dir_bytes(path: Path, allocated: bool = False) -> int:
    """Bytes of the files below ``path`` (``allocated``: the blocks they use, as tmpfs charges
    them)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                stat = os.stat(os.path.join(root, name))
                total += stat.st_blocks * 512 if allocated else stat.st_size
    return total


@dataclass
class WorkerPeak:
    pid: int
    node: str | None
    rank: int
    world: int
    vmhwm_bytes: int = 0
    rss_shmem_bytes: int = 0  # the largest seen (the slots' pages it had mapped)


class MemorySampler:
    """Samples, every ``interval`` s on a thread of its own, VmHWM and RssShmem of every worker
    that wrote a step line (its pid, rank and world are in the line; its node from its
    environment) and the bytes in each node's host-memory directory."""

    def __init__(self, steps_file: Path, node_dirs: dict[str, Path], interval: float) -> None:
        self.steps_file, self.node_dirs, self.interval = steps_file, node_dirs, interval
        self.workers: dict[int, WorkerPeak] = {}
        self.node_peak: dict[str, int] = dict.fromkeys(node_dirs, 0)
        self._offset = 0
        self._partial = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="memory-sampler")

    def start(self) -> MemorySampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        """One last sample, then the thread ends (safe to repeat)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()
        self.sample()

    def _new_pids(self) -> None:
        try:
            with open(self.steps_file, "rb") as handle:
                handle.seek(self._offset)
                chunk = handle.read()
        except FileNotFoundError:
            return
        self._offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event["pid"] not in self.workers:
                    node = proc_env(event["pid"], "KFP_ELASTIC_WORKER_NAME")
                    self.workers[event["pid"]] = WorkerPeak(
                        event["pid"], node, event["rank"], event["world"]
                    )

    def sample(self) -> None:
        self._new_pids()
        for worker in self.workers.values():
            status = proc_status_kb(worker.pid, ("VmHWM", "RssShmem"))
            if status:
                worker.vmhwm_bytes = max(worker.vmhwm_bytes, status.get("VmHWM", 0) * 1024)
                worker.rss_shmem_bytes = max(
                    worker.rss_shmem_bytes, status.get("RssShmem", 0) * 1024
                )
        for node, path in self.node_dirs.items():
            self.node_peak[node] = max(self.node_peak[node], dir_bytes(path, allocated=True))

    def report(self) -> dict[str, Any]:
        """Per worker (rank, world, node): its VmHWM, RssShmem and its node's directory peak."""
        ranks = []
        for worker in sorted(self.workers.values(), key=lambda w: (-w.world, w.rank)):
            node_bytes = self.node_peak.get(worker.node or "", 0)
            ranks.append(
                {
                    **asdict(worker),
                    "node_dir_bytes": node_bytes,
                    "host_bytes": worker.vmhwm_bytes + node_bytes,
                    "host_bytes_shmem_once": worker.vmhwm_bytes
                    - worker.rss_shmem_bytes
                    + node_bytes,
                }
            )
        return {
            "ranks": ranks,
            "node_dir_peak_bytes": self.node_peak,
            "peak_vmhwm_bytes": max((r["vmhwm_bytes"] for r in ranks), default=None),
            "peak_node_dir_bytes": max(self.node_peak.values(), default=None),
            "peak_rank_host_bytes": max((r["host_bytes"] for r in ranks), default=None),
            "peak_rank_host_bytes_shmem_once": max(
                (r["host_bytes_shmem_once"] for r in ranks), default=None
            ),
        }


# --------------------------------------------------------------------------- one job


@dataclass
class Job:
    path: str  # memory | disk
    kind: str  # kill | every1
    run_id: str
    run_dir: Path
    steps_file: Path
    snapshot_dir: Path
    memory_root: Path  # the runtime's --memory-snapshot-dir; a node's is <root>/<run>/<node>
    group: AgentGroup

    def node_dirs(self) -> dict[str, Path]:
        return {f"node{i}": self.memory_root / self.run_id / f"node{i}" for i in range(NODES)}


def start_job(
    path: str,
    kind: str,
    args: argparse.Namespace,
    etcd: EmbeddedEtcd,
    work_dir: Path,
    memory_root: Path,
    stack: contextlib.ExitStack,
) -> Job:
    run_id = new_run_id(f"{path}-{kind}")
    run_dir = work_dir / run_id
    run_dir.mkdir(parents=True)
    group = AgentGroup(run_dir / "logs")
    stack.callback(group.kill_all)
    job = Job(
        path,
        kind,
        run_id,
        run_dir,
        run_dir / "steps.jsonl",
        run_dir / "snapshots",
        memory_root,
        group,
    )
    every = "auto" if kind == "kill" else "1"
    for index in range(NODES):
        name = f"node{index}"
        group.start(
            name=name,
            backend="elastic-etcd",
            endpoint=etcd.endpoint,
            run_id=run_id,
            nnodes=f"2:{NODES}",
            max_restarts=10,
            rdzv_conf={"last_call_timeout": 1},
            script="-m",
            env={
                "TIMED_STEPS_FILE": str(job.steps_file),
                "TIMED_MODEL_DEF": MODEL,
                HIDDEN_ENV: str(args.hidden),
                "KFP_ELASTIC_WORKER_NAME": name,  # the node's own memory directory
            },
            device="cpu",
            script_args=[
                "kfp_elastic.worker",
                *("--device", "cpu", "--model-def", TIMED),
                *("--epochs", args.epochs, "--batch-size", args.batch_size),
                *("--snapshot-every", every, "--sharded-snapshots", path),
                *("--snapshot-dir", job.snapshot_dir),
                *("--memory-snapshot-dir", memory_root),
                *("--disk-snapshot-every", args.disk_snapshot_every),
                *("--etcd", etcd.endpoint),
            ],
        )
    return job


def end_job(job: Job, keep_logs: bool) -> None:
    """Kill the job and drop its state (hundreds of MB); the logs stay with ``keep_logs``."""
    job.group.kill_all()
    shutil.rmtree(job.memory_root / job.run_id, ignore_errors=True)
    shutil.rmtree(job.snapshot_dir, ignore_errors=True)
    if not keep_logs:
        shutil.rmtree(job.run_dir, ignore_errors=True)


def committed_steps(text: str) -> list[int]:
    return [
        int(m.group(1))
        for _t, line in worker_lines(text, "committed step=")
        if (m := re.search(r"committed step=(\d+)", line))
    ]


def world_events(job: Job, world: int) -> list[dict[str, Any]]:
    return [e for e in read_events(job.steps_file) if e.get("world") == world]


def all_ranks_stepped(job: Job, world: int, after: float = 0.0) -> bool:
    events = [e for e in world_events(job, world) if e["t"] > after]
    return len({e["rank"] for e in events}) == world


# --------------------------------------------------------------------------- kill job


def kill_run(
    path: str,
    args: argparse.Namespace,
    etcd: EmbeddedEtcd,
    work_dir: Path,
    memory_root: Path,
    stack: contextlib.ExitStack,
) -> dict[str, Any]:
    """One ``--snapshot-every auto`` job of 3 nodes; the victim's node SIGKILLed (module doc)."""
    job = start_job(path, "kill", args, etcd, work_dir, memory_root, stack)
    result: dict[str, Any] = {"path": path, "run_id": job.run_id, "error": None}
    sampler = MemorySampler(job.steps_file, job.node_dirs(), args.sample_s).start()
    try:
        group = job.group
        wait_until(
            lambda: all_ranks_stepped(job, NODES),
            args.setup_timeout,
            "a step of every rank of the world of 3",
            group,
        )
        started = time.monotonic()
        wait_until(
            lambda: (
                time.monotonic() - started >= args.auto_seconds
                and committed_steps(group_log(group))
            ),
            args.setup_timeout + args.auto_seconds,
            f"{args.auto_seconds:g} s of training and a committed snapshot",
            group,
        )
        events = world_events(job, NODES)
        pid_of_rank = {e["rank"]: e["pid"] for e in events}
        victim = next(a for a in group.agents if pid_of_rank[args.victim_rank] in a.tree_pids())
        # Right after a step finished: the same moment of a step for both paths.
        seen = len(events)
        wait_until(lambda: len(world_events(job, NODES)) > seen, 60, "the next step", group)
        killed_at = victim.sigkill_tree()
        # What the disk path will read: the DCP directories as they are now (the survivors
        # write no complete one before the new world restores).
        dcp_bytes = {
            p.name: dir_bytes(p) for p in sorted(job.snapshot_dir.glob("dcp-*")) if p.is_dir()
        }
        result |= {"victim": victim.name, "victim_rank": args.victim_rank, "killed_at": killed_at}
        wait_until(
            lambda: step_after(job, killed_at) is not None,
            args.recovery_cap,
            "a step of the 2-rank world finished on both ranks",
            group,
        )
        wait_until(
            lambda: (
                len([r for r in restored_lines(group_log(group), killed_at) if r.world == 2]) == 2
            ),
            30,
            "both new ranks' 'restored' lines",
            group,
        )
        first_step, first_t = step_after(job, killed_at)  # type: ignore[misc]
        # A few steps of the new world: its workers' memory after the restore is sampled too.
        wait_until(
            lambda: (
                max(step_done_times(world_events(job, 2), 2), default=0)
                >= first_step + args.after_kill_steps
            ),
            args.recovery_cap,
            f"{args.after_kill_steps} more steps of the 2-rank world",
            group,
        )
        sampler.stop()
        text = group_log(group)
        restores = [r for r in restored_lines(text, killed_at) if r.world == 2]
        sources = sorted({r.source for r in restores})
        placed = [t for t, _ in worker_lines(text, "placed rank=") if t > killed_at]
        old_done = step_done_times(world_events(job, NODES), NODES)
        old_done = {s: t for s, t in old_done.items() if t <= killed_at}
        costs = [c for c in snapshot_costs(text) if c.t <= killed_at]
        window_first = min(old_done) + 1  # the first step builds FSDP's buffers: left out
        last_before = max(old_done)
        result |= {
            "recovery_s": round(first_t - killed_at, 3),
            "worker_placed_s": round(min(placed) - killed_at, 3) if placed else None,
            "restored_s": round(max(r.t for r in restores) - killed_at, 3),
            "first_new_step": first_step,
            "last_step_before": last_before,
            "restored_step": restores[0].step,
            "lost_steps": last_before - restores[0].step,
            "restored_from": sources[0] if len(sources) == 1 else sources,
            "restores": [asdict(r) for r in restores],
            "committed_before": max((s for s in committed_steps(text)), default=None),
        }
        if path == "memory":
            received = sum(r.received for r in restores)
            sent = sum(r.sent for r in restores)
            result |= {
                "received_bytes": received,
                "sent_bytes": sent,
                "copied_bytes": sum(r.copied for r in restores),
                "moved_bytes": received + sent,
            }
        else:
            names = {r.detail for r in restores}
            name = names.pop() if len(names) == 1 else None
            result |= {"dcp_dir": name, "moved_bytes": dcp_bytes.get(name or "")}
        result["auto"] = window_share(
            old_done, blocking_by_step(costs, NODES), window_first, last_before
        )
    except Exception as error:  # noqa: BLE001 - one failed run must not end the benchmark
        result["error"] = f"{type(error).__name__}: {error}"
        result["logs"] = job.group.logs(30)
    finally:
        sampler.stop()
        result["host_memory"] = sampler.report()
        end_job(job, args.keep_logs)
    return result


def step_after(job: Job, after: float) -> tuple[int, float] | None:
    """(number, time) of the first step of the 2-rank world finished on both ranks after
    ``after``."""
    done = {s: t for s, t in step_done_times(world_events(job, 2), 2).items() if t > after}
    if not done:
        return None
    step = min(done)
    return step, done[step]


# --------------------------------------------------------------------------- every1 job


def every1_run(
    path: str,
    args: argparse.Namespace,
    etcd: EmbeddedEtcd,
    work_dir: Path,
    memory_root: Path,
    stack: contextlib.ExitStack,
) -> dict[str, Any]:
    """One ``--snapshot-every 1`` job of 3 nodes, ended after ``--every1-steps`` timed steps."""
    job = start_job(path, "every1", args, etcd, work_dir, memory_root, stack)
    result: dict[str, Any] = {"path": path, "run_id": job.run_id, "error": None}
    sampler = MemorySampler(job.steps_file, job.node_dirs(), args.sample_s).start()
    try:
        wait_until(
            lambda: all_ranks_stepped(job, NODES),
            args.setup_timeout,
            "a step of every rank of the world of 3",
            job.group,
        )
        first = min(step_done_times(world_events(job, NODES), NODES), default=1) + WARM_STEPS
        last = first + args.every1_steps
        wait_until(
            lambda: last in step_done_times(world_events(job, NODES), NODES),
            args.setup_timeout + args.every1_steps * 60,
            f"step {last}",
            job.group,
        )
        sampler.stop()
        done = step_done_times(world_events(job, NODES), NODES)
        costs = snapshot_costs(group_log(job.group))
        result["every1"] = window_share(done, blocking_by_step(costs, NODES), first, last)
        slots = [c.slot_bytes for c in costs if c.slot_bytes]
        result["slot_bytes_per_rank"] = max(slots) if slots else 0
    except Exception as error:  # noqa: BLE001 - one failed run must not end the benchmark
        result["error"] = f"{type(error).__name__}: {error}"
        result["logs"] = job.group.logs(30)
    finally:
        sampler.stop()
        result["host_memory"] = sampler.report()
        end_job(job, args.keep_logs)
    return result


# --------------------------------------------------------------------------- the suite


def bench(
    args: argparse.Namespace,
    etcd: EmbeddedEtcd,
    work_dir: Path,
    stack: contextlib.ExitStack,
    report: dict[str, Any],
) -> None:
    """Every run, appended to ``report["runs"]`` as it ends (an interrupted benchmark keeps
    what it measured)."""
    # Each node's slots in real host memory (tmpfs), as in a pod; removed on exit.
    memory_root = Path(
        tempfile.mkdtemp(prefix="kfp-elastic-bench-", dir=SHM if SHM.is_dir() else work_dir)
    )
    stack.callback(shutil.rmtree, memory_root, True)
    runs: list[dict[str, Any]] = []
    report |= {"memory_root": str(memory_root), "runs": runs}
    for repeat in range(args.repeats):
        order = args.paths if repeat % 2 == 0 else args.paths[::-1]
        for path in order:
            for kind, run in (("kill", kill_run), ("every1", every1_run)):
                print(f"[{path}] {kind} {repeat + 1}/{args.repeats} ...", flush=True)
                result = run(path, args, etcd, work_dir, memory_root, stack)
                result |= {"kind": kind, "repeat": repeat}
                runs.append(result)
                print(f"[{path}] {kind} {repeat + 1}/{args.repeats}: {shown(result)}", flush=True)


def shown(run: dict[str, Any]) -> str:
    if run["error"] is not None:
        return f"FAILED ({run['error']})\n{run.get('logs', '')}"
    memory = run["host_memory"]
    peak = f"peak rank host {mb(memory['peak_rank_host_bytes'])} MB"
    if run["kind"] == "kill":
        auto = run["auto"]
        return (
            f"recovery {run['recovery_s']} s (worker placed {run['worker_placed_s']} s, restored "
            f"{run['restored_s']} s) from {run['restored_from']} step {run['restored_step']} "
            f"(lost {run['lost_steps']}); moved {mb(run['moved_bytes'])} MB; auto: "
            f"{auto['snapshots']} snapshots blocked {auto['blocked_s']} s of {auto['seconds']} s "
            f"({pct(auto['blocking_share'])}); {peak}"
        )
    every1 = run["every1"]
    return (
        f"snapshot every step: blocked {every1['blocked_s']} s of {every1['seconds']} s "
        f"({pct(every1['blocking_share'])}), median step {every1['median_step_s']} s; {peak}"
    )


def mb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:.1f}"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f} %"


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def path_numbers(runs: list[dict[str, Any]], path: str) -> dict[str, Any]:
    """The medians over a path's repeats (peaks: the largest)."""
    kills = [r for r in runs if r["path"] == path and r["kind"] == "kill" and r["error"] is None]
    ones = [r for r in runs if r["path"] == path and r["kind"] == "every1" and r["error"] is None]
    mine = [r for r in runs if r["path"] == path]

    def peak(key: str) -> int | None:
        values = [r["host_memory"][key] for r in mine if r["host_memory"][key] is not None]
        return max(values) if values else None

    plain = median(
        [r["auto"]["median_plain_step_s"] for r in kills if r["auto"]["median_plain_step_s"]]
    )
    every1_step = median(
        [r["every1"]["median_step_s"] for r in ones if r["every1"]["median_step_s"]]
    )
    return {
        "kill_to_first_step_s": median([r["recovery_s"] for r in kills]),
        "kill_to_worker_placed_s": median(
            [r["worker_placed_s"] for r in kills if r["worker_placed_s"] is not None]
        ),
        "kill_to_restored_s": median([r["restored_s"] for r in kills]),
        "restore_moved_bytes": median([r["moved_bytes"] for r in kills if r["moved_bytes"]]),
        "peak_rank_host_bytes": peak("peak_rank_host_bytes"),
        "peak_rank_host_bytes_shmem_once": peak("peak_rank_host_bytes_shmem_once"),
        "peak_vmhwm_bytes": peak("peak_vmhwm_bytes"),
        "peak_node_dir_bytes": peak("peak_node_dir_bytes"),
        "blocking_share_auto": median(
            [r["auto"]["blocking_share"] for r in kills if r["auto"]["blocking_share"] is not None]
        ),
        "blocking_share_every1": median(
            [
                r["every1"]["blocking_share"]
                for r in ones
                if r["every1"]["blocking_share"] is not None
            ]
        ),
        "snapshot_blocking_s_every1": median(
            [
                statistics.median(r["every1"]["blocking_s"])
                for r in ones
                if r["every1"]["blocking_s"]
            ]
        ),
        "plain_step_s": plain,
        "every1_step_s": every1_step,
        "every1_step_overhead": (
            round(every1_step / plain - 1, 4) if plain and every1_step is not None else None
        ),
        "restored_from": sorted({str(r["restored_from"]) for r in kills}),
        "runs": len(mine),
        "failed": sum(1 for r in mine if r["error"] is not None),
    }


RATIO_KEYS = (
    "kill_to_first_step_s",
    "kill_to_restored_s",
    "restore_moved_bytes",
    "peak_rank_host_bytes",
    "peak_rank_host_bytes_shmem_once",
    "peak_vmhwm_bytes",
    "blocking_share_auto",
    "blocking_share_every1",
    "every1_step_s",
)


def goals(numbers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each goal: met (True), missed (False) or not measured (None)."""
    memory, disk = numbers.get("memory", {}), numbers.get("disk", {})
    recovery, baseline = memory.get("kill_to_first_step_s"), disk.get("kill_to_first_step_s")
    blocking = memory.get("blocking_share_auto")
    return {
        f"kill_to_first_step_le_{RECOVERY_GOAL_S:g}s": (
            None if recovery is None else recovery <= RECOVERY_GOAL_S
        ),
        f"kill_to_first_step_le_{RECOVERY_GOAL_RATIO:g}x_disk": (
            None
            if recovery is None or baseline is None
            else recovery <= RECOVERY_GOAL_RATIO * baseline
        ),
        f"blocking_auto_le_{BLOCKING_GOAL:.0%}".replace("%", "pct"): (
            None if blocking is None else blocking <= BLOCKING_GOAL
        ),
    }


def summarize(report: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    runs = report.get("runs", [])
    numbers = {path: path_numbers(runs, path) for path in args.paths}
    ratios = (
        {key: ratio(numbers["memory"][key], numbers["disk"][key]) for key in RATIO_KEYS}
        if set(PATHS) <= set(numbers)
        else {}
    )
    met = goals(numbers)
    report |= {"paths": numbers, "memory_over_disk": ratios, "goals": met}
    width = max(len(k) for k in numbers[args.paths[0]]) + 2
    print(
        f"\nsharded restore: {MODEL} (hidden {args.hidden}, {report['model']['parameters']:,} "
        f"parameters, AdamW), {NODES} nodes x 1 gloo worker, batch {args.batch_size} per worker; "
        f"SIGKILL of rank {args.victim_rank}'s node after {args.auto_seconds:g} s"
    )
    print(f"{'':<{width}}" + "".join(f"{p:>16}" for p in args.paths) + f"{'memory/disk':>14}")
    for key in numbers[args.paths[0]]:
        if key in ("restored_from", "runs", "failed"):
            cells = "".join(f"{str(numbers[p][key]):>16}" for p in args.paths)
            print(f"{key:<{width}}{cells}")
            continue
        cells = "".join(f"{fmt(numbers[p][key]):>16}" for p in args.paths)
        print(f"{key:<{width}}{cells}{fmt(ratios.get(key)):>14}")
    for name, value in met.items():
        print(f"goal {name}: {'-' if value is None else 'met' if value else 'MISSED'}")
    print()
    summary: dict[str, Any] = {"model_parameters": report["model"]["parameters"]}
    for path in args.paths:
        summary[path] = {
            key: value
            for key, value in numbers[path].items()
            if key not in ("restored_from", "runs")
        } | {"restored_from": ",".join(numbers[path]["restored_from"])}
    if ratios:
        summary["memory_over_disk"] = ratios
    summary["goals"] = {
        k: None if v is None else ("met" if v else "MISSED") for k, v in met.items()
    }
    return summary


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """``python -m benchmarks sharded``'s options."""
    parser = suite_parser(
        "python -m benchmarks sharded",
        __doc__,
        f"--hidden {QUICK_HIDDEN} (5.0 M parameters), 1 repeat, shorter jobs",
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs of each path (alternated)")
    parser.add_argument("--paths", default=",".join(PATHS), help="memory, disk or both")
    parser.add_argument(
        "--hidden",
        type=int,
        default=DEFAULT_HIDDEN,
        help="the MLP's width (default %(default)s: 50.6 M parameters)",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="samples per worker and step")
    parser.add_argument(
        "--epochs",
        type=int,
        default=20,
        help="the jobs' --epochs: more than they reach, as each ends once measured (the runtime "
        "writes every epoch's shard queues to etcd at the start)",
    )
    parser.add_argument(
        "--auto-seconds",
        type=float,
        default=60.0,
        help="kill job: seconds the world of 3 trains before the SIGKILL (default %(default)s)",
    )
    parser.add_argument(
        "--every1-steps", type=int, default=10, help="every1 job: steps timed (default %(default)s)"
    )
    parser.add_argument(
        "--after-kill-steps",
        type=int,
        default=2,
        help="kill job: steps of the 2-rank world after its first (memory sampled)",
    )
    parser.add_argument(
        "--victim-rank", type=int, default=1, choices=(1, 2), help="whose node is killed"
    )
    parser.add_argument(
        "--disk-snapshot-every",
        type=int,
        default=10,
        help="the memory path's --disk-snapshot-every (the runtime's default %(default)s)",
    )
    parser.add_argument("--sample-s", type=float, default=0.2, help="host memory sampling period")
    parser.add_argument("--setup-timeout", type=float, default=300.0)
    parser.add_argument("--recovery-cap", type=float, default=180.0)
    parser.add_argument("--keep-logs", action="store_true", help="keep the work dir")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options, checked, with ``--quick`` applied."""
    parser = build_parser()
    args = parse_options(parser, argv)
    if args.quick:
        args.hidden, args.repeats = QUICK_HIDDEN, 1
        args.auto_seconds, args.every1_steps, args.after_kill_steps = 5.0, 4, 1
    args.paths = comma_list(args.paths)
    unknown = set(args.paths) - set(PATHS)
    if unknown or not args.paths:
        parser.error(f"--paths: memory, disk or both, not {sorted(unknown) or 'nothing'}")
    if args.repeats < 1 or args.every1_steps < 1 or args.hidden < 1 or args.batch_size < 1:
        parser.error("--repeats, --every1-steps, --hidden and --batch-size must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.time()
    export_checkout_to_children()  # the workers import benchmarks.* model definitions
    report: dict[str, Any] = {
        "model": {
            "definition": MODEL,
            "hidden": args.hidden,
            "parameters": parameter_count(args.hidden),
            # fp32 parameters and AdamW's two moments
            "state_bytes": 3 * 4 * parameter_count(args.hidden),
        }
    }

    def body(work_dir: Path, stack: contextlib.ExitStack) -> None:
        etcd = start_etcd(stack, work_dir)
        bench(args, etcd, work_dir, stack, report)

    code, work_dir = run_in_work_dir("sharded-bench-", args.keep_logs, body)
    summary = summarize(report, args)
    if args.keep_logs:
        print(f"logs kept in {work_dir}")
    failed = any(r["error"] is not None for r in report.get("runs", []))
    write_result(
        "sharded",
        args,
        began,
        code == 0 and not failed,
        summary,
        {
            "method": {
                "recovery": "SIGKILL of the victim node's process tree -> the first step of the "
                "2-rank world finished on both ranks (optimizer step post-hook time stamps)",
                "moved_bytes": "memory: sum over the new ranks of received_bytes + sent_bytes of "
                "their 'restored' lines; disk: bytes of the DCP directory restored from",
                "host_memory": "VmHWM of each worker (sampled /proc/PID/status) + the peak "
                "allocated bytes of its node's host-memory directory",
                "blocking_share": "sum over snapshots of the slowest rank's blocking_s ('sharded "
                "snapshot' lines) / the time between the window's first and last step",
            },
            **report,
        },
    )
    return code if code else int(failed)
