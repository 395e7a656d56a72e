"""Workers as local process trees: one torchrun agent each, like one pod each.

A worker is ``python -m kfp_elastic.master.supervise EXIT_FILE -- python -m
kfp_elastic.rendezvous.agent ...
ENTRY`` started in its own session (``master.local_agent.Agent``), so it survives a master
SIGKILL. The supervisor records how the agent ended (see ``master/supervise.py``); the agent's
tag (an environment variable every process of the tree inherits) finds the whole tree in
``/proc``, also the workers torchrun starts in sessions of their own.

With a ``registry`` (the master's :class:`~master.state.MasterState`) every worker's pid, tag
and files are recorded in etcd, and a new launcher over the same registry *adopts* the workers
that still run (same pid, same tag) instead of starting them again. Local processes have no
watch API: :meth:`events` polls every ``poll_interval_s``.

How an ended worker is classified:

- agent exited 0: Succeeded/Completed; the master deleted it: Failed/Deleted;
- SIGTERM to the tree's root (``preempt``, like a kubelet), the agent or the whole tree killed
  by a signal (``kill``, OOM killer), or gone while no master watched: Failed/Preempted;
- agent exited ``ORPHANED_EXIT_CODE`` (it stopped itself: no master for ``orphan_timeout_s``):
  Failed/Orphaned, a disruption;
- agent exited non-zero otherwise: Failed/Error (the message ends with the log's last lines).

``capacity`` simulates a cluster with room for that many workers: more stay Pending
(Unschedulable) until a slot frees.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol

from kfp_elastic.gpus import gpus_for_worker, require_gpus, visible_gpus
from kfp_elastic.job_env import DEFAULT_MEMORY_SNAPSHOT_DIR, MEMORY_DIR_ENV
from kfp_elastic.job_spec import DEFAULT_WORKER_MAX_RESTARTS
from kfp_elastic.master.launcher import (
    Launcher,
    Reason,
    WorkerEvent,
    WorkerHandle,
    WorkerPhase,
    WorkerStatus,
    next_attempts,
)
from kfp_elastic.master.local_agent import TAG_VAR, Agent
from kfp_elastic.master.supervise import read_exit_file
from kfp_elastic.processes import has_env, parent
from kfp_elastic.rendezvous.orphan import ORPHANED_EXIT_CODE

log = logging.getLogger(__name__)

MONITOR_INTERVAL_S = 0.2  # how often each torchrun agent polls its workers


class WorkerRegistry(Protocol):
    """Where the launcher records its processes (``MasterState`` implements it)."""

    def workers(self) -> dict[str, dict[str, Any]]: ...

    def update_worker(self, name: str, **fields: Any) -> dict[str, Any]: ...


@dataclass
class _Worker:
    name: str
    index: int
    attempt: int
    agent: Agent
    exit_file: Path
    launched_at: float
    pid: int | None = None  # of the supervisor; None while waiting for capacity
    adopted: bool = False
    preempting: bool = False
    deleting: bool = False
    final: WorkerStatus | None = None  # frozen once the tree ended
    removed: bool = False  # deleted and dead: no longer listed


class LocalLauncher(Launcher):
    def __init__(
        self,
        *,
        run_id: str,
        endpoint: str,
        min_workers: int,
        max_workers: int,
        entry: Sequence[str],
        workdir: str | os.PathLike[str],
        nproc_per_worker: int = 1,
        rdzv_conf: Mapping[str, object] | None = None,
        env: Mapping[str, str] | None = None,
        registry: WorkerRegistry | None = None,
        capacity: int | None = None,
        max_restarts: int = DEFAULT_WORKER_MAX_RESTARTS,
        monitor_interval_s: float = MONITOR_INTERVAL_S,
        grace_s: float = 5.0,
        poll_interval_s: float = 0.2,
        gpus: Sequence[str] | None = None,
        device: str | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        """``gpus``: the machine's GPUs to share out (``kfp_elastic.gpus``); None: the visible
        ones. ``device``: the workers' ``--device`` (None: a command of the user's); a job that
        computes on GPUs and has more processes than GPUs is refused here (``GpuShortage``).
        ``cwd``: the workers' working directory (default: this process's, so a model definition
        or script next to the caller is found, like under a torchrun started there)."""
        if not entry:
            raise ValueError("the worker entry (script or -m module) is empty")
        self.run_id = run_id
        self.endpoint = endpoint
        self.nnodes = f"{min_workers}:{max_workers}"
        self.cwd = Path(cwd or os.getcwd()).resolve()
        self.entry = absolute_script(list(entry), self.cwd)
        self.workdir = Path(workdir).resolve()
        self.nproc_per_worker = nproc_per_worker
        self.gpus = tuple(visible_gpus() if gpus is None else gpus)
        require_gpus(device, max_workers * nproc_per_worker, self.gpus)
        if self.gpus and len(self.gpus) < max_workers * nproc_per_worker:
            log.warning(
                "local workers share GPUs: %d workers x %d processes on %d GPUs (NCCL refuses "
                "two ranks on one GPU: use fewer workers, or --device cpu)",
                max_workers,
                nproc_per_worker,
                len(self.gpus),
            )
        self.rdzv_conf = dict(rdzv_conf or {})
        self.env = dict(env or {})
        self.registry = registry
        self.capacity = capacity
        self.max_restarts = max_restarts
        self.monitor_interval_s = monitor_interval_s
        self.grace_s = grace_s
        self.poll_interval_s = poll_interval_s
        self._lock = threading.RLock()
        self._workers: dict[str, _Worker] = {}
        self._attempts: dict[int, int] = {}
        self._timers: list[threading.Thread] = []
        (self.workdir / "workers").mkdir(parents=True, exist_ok=True)
        if registry is not None:
            self._adopt(registry.workers())

    # -- adoption -----------------------------------------------------------------------------
    def _adopt(self, records: Mapping[str, Mapping[str, Any]]) -> None:
        self._attempts.update(next_attempts(records))
        for name, record in records.items():
            index, attempt = int(record.get("index", 0)), int(record.get("attempt", 0))
            if record.get("ended") or "tag" not in record:
                continue  # recorded as ended by the master: nothing to adopt
            worker = self._new_worker(name, index, attempt, record.get("launched_at"))
            worker.agent.tag = worker.agent.env[TAG_VAR] = record["tag"]
            worker.exit_file = Path(record.get("exit_file", worker.exit_file))
            worker.pid = record.get("pid") or self._find_root(worker)
            worker.adopted = worker.pid is not None
            self._workers[name] = worker
            state = (
                "waiting for capacity"
                if worker.pid is None
                else ("running" if self._alive(worker) else "ended while no master watched")
            )
            log.info(
                "worker adopted name=%s index=%d attempt=%d pid=%s state=%s",
                name,
                index,
                attempt,
                worker.pid,
                state,
            )

    @staticmethod
    def _find_root(worker: _Worker) -> int | None:
        """The root of a tree started but not recorded (the master died in between)."""
        pids = worker.agent.tree_pids()  # by tag: the agent object has no process of its own
        roots = [pid for pid in pids if parent(pid) not in pids]
        return min(roots) if roots else None

    # -- Launcher -----------------------------------------------------------------------------
    def launch(self, worker_index: int) -> WorkerHandle:
        with self._lock:
            attempt = self._attempts.get(worker_index, 0)
            self._attempts[worker_index] = attempt + 1
            worker = self._new_worker(f"worker-{worker_index}-{attempt}", worker_index, attempt)
            self._workers[worker.name] = worker
            self._record(worker)
            if self.capacity is None or self._running_count() < self.capacity:
                self._start(worker)
            else:
                log.info(
                    "worker pending name=%s reason=no free local slot capacity=%d",
                    worker.name,
                    self.capacity,
                )
        return WorkerHandle(worker.name, worker_index, attempt)

    def delete(self, name: str) -> None:
        with self._lock:
            worker = self._workers.get(name)
            if worker is None or worker.deleting or worker.removed:
                return
            if worker.pid is None:  # never started
                worker.deleting = True
                worker.final = self._final(
                    worker, WorkerPhase.DELETED, Reason.DELETED, "deleted before it started"
                )
                return
            ended = self._status(worker).ended  # classified before `deleting` colours it
            worker.deleting = True
            if ended:
                return
            log.info("worker deleting name=%s pid=%s grace_s=%g", name, worker.pid, self.grace_s)
            self._signal_root(worker, signal.SIGTERM)  # the agent revokes its lease at once
            self._kill_later(worker, self.grace_s)

    def list_workers(self) -> list[WorkerStatus]:
        with self._lock:
            self._tick()
            return [self._status(w) for w in self._workers.values() if not w.removed]

    def events(self, stop: threading.Event) -> Iterator[WorkerEvent]:
        known: dict[str, WorkerStatus] = {}
        while not stop.is_set():
            current = {s.name: s for s in self.list_workers()}
            for name, status in current.items():
                before = known.get(name)
                if before is None or _key(before) != _key(status):
                    known[name] = status
                    yield _event(status)
            for name in [n for n in known if n not in current]:
                with self._lock:
                    worker = self._workers.get(name)
                    last = worker.final if worker and worker.final else known[name]
                del known[name]
                yield _event(last, phase=WorkerPhase.DELETED)
            stop.wait(self.poll_interval_s)

    def job_ended(self) -> None:
        """Remove the run's sharded-model shards from this machine's host memory: every local
        node keeps them under ``{memory dir}/{run id}/{worker}``, and a node that was killed
        cannot remove its own."""
        root = self.env.get(MEMORY_DIR_ENV) or os.environ.get(MEMORY_DIR_ENV)
        run_dir = Path(root or DEFAULT_MEMORY_SNAPSHOT_DIR) / self.run_id
        shutil.rmtree(run_dir, ignore_errors=True)

    def close(self) -> None:
        """Wait for pending SIGKILLs (deleted trees). Running workers are left running."""
        for timer in list(self._timers):
            timer.join()

    # -- test and fault-injection hooks --------------------------------------------------------
    def preempt(self, name: str, grace_s: float | None = None) -> None:
        """SIGTERM the tree's root like a kubelet does, SIGKILL the tree after ``grace_s``."""
        with self._lock:
            worker = self._workers[name]
            worker.preempting = True
            log.info("worker preempting name=%s pid=%s", name, worker.pid)
            self._signal_root(worker, signal.SIGTERM)
            self._kill_later(worker, self.grace_s if grace_s is None else grace_s)

    def kill(self, name: str) -> None:
        """SIGKILL the whole process tree at once (a node dying)."""
        with self._lock:
            worker = self._workers[name]
        log.info("worker killing name=%s pid=%s", name, worker.pid)
        worker.agent.sigkill_tree()

    def pids(self, name: str) -> set[int]:
        """Every live process of a worker's tree (tests)."""
        return self._workers[name].agent.tree_pids()

    def worker_pid(self, name: str) -> int | None:
        return self._workers[name].pid

    def log_path(self, name: str) -> Path:
        return self._workers[name].agent.log_path

    # -- internals ----------------------------------------------------------------------------
    def _new_worker(
        self, name: str, index: int, attempt: int, launched_at: float | None = None
    ) -> _Worker:
        agent, exit_file = worker_agent(
            name=name,
            index=index,
            run_id=self.run_id,
            endpoint=self.endpoint,
            nnodes=self.nnodes,
            entry=self.entry,
            nproc_per_worker=self.nproc_per_worker,
            max_restarts=self.max_restarts,
            monitor_interval_s=self.monitor_interval_s,
            rdzv_conf=self.rdzv_conf,
            env=self.env,
            gpus=self.gpus,
            workdir=self.workdir,
            cwd=self.cwd,
        )
        return _Worker(name, index, attempt, agent, exit_file, launched_at or time.time())

    def _record(self, worker: _Worker) -> None:
        if self.registry is not None:
            self.registry.update_worker(
                worker.name,
                index=worker.index,
                attempt=worker.attempt,
                launched_at=worker.launched_at,
                pid=worker.pid,
                tag=worker.agent.tag,
                exit_file=str(worker.exit_file),
                log=str(worker.agent.log_path),
            )

    def _start(self, worker: _Worker) -> None:
        with contextlib.suppress(FileNotFoundError):
            worker.exit_file.unlink()
        worker.agent.start()
        worker.pid = worker.agent.pid
        self._record(worker)
        log.info(
            "worker started name=%s index=%d attempt=%d pid=%d tag=%s log=%s",
            worker.name,
            worker.index,
            worker.attempt,
            worker.pid,
            worker.agent.tag,
            worker.agent.log_path,
        )

    def _running_count(self) -> int:
        return sum(1 for w in self._workers.values() if w.pid is not None and self._alive(w))

    def _tick(self) -> None:
        """Start workers waiting for capacity; mark deleted workers that are dead as removed."""
        for worker in self._workers.values():
            if worker.deleting and not worker.removed and self._status(worker).ended:
                worker.removed = True
        if self.capacity is None:
            return
        free = self.capacity - self._running_count()
        for worker in self._workers.values():
            if free <= 0:
                break
            if worker.pid is None and not worker.deleting:
                self._start(worker)
                free -= 1

    def _alive(self, worker: _Worker) -> bool:
        if worker.pid is None:
            return False
        if worker.agent.process is not None:
            return worker.agent.process.poll() is None
        return has_env(worker.pid, TAG_VAR, worker.agent.tag)

    def _status(self, worker: _Worker) -> WorkerStatus:
        if worker.final is not None:
            if worker.removed:
                return _with(worker.final, phase=WorkerPhase.DELETED)
            return worker.final
        if worker.pid is None:
            return WorkerStatus(
                worker.name,
                WorkerPhase.PENDING,
                Reason.UNSCHEDULABLE,
                f"no free local slot (capacity {self.capacity})",
                worker_index=worker.index,
                attempt=worker.attempt,
            )
        if self._alive(worker):
            reason = (
                Reason.DELETED
                if worker.deleting
                else Reason.PREEMPTED
                if worker.preempting
                else None
            )
            return WorkerStatus(
                worker.name,
                WorkerPhase.RUNNING,
                reason,
                worker_index=worker.index,
                attempt=worker.attempt,
            )
        phase, reason, message, code = self._classify_end(worker)
        worker.final = self._final(worker, phase, reason, message, code)
        worker.agent.sigkill_tree()  # orphaned torchrun workers of a killed agent, if any
        log.info(
            "worker ended name=%s phase=%s reason=%s exit_code=%s message=%s",
            worker.name,
            phase.value,
            reason.value,
            code,
            message,
        )
        return worker.final

    def _final(
        self,
        worker: _Worker,
        phase: WorkerPhase,
        reason: Reason,
        message: str,
        code: int | None = None,
    ) -> WorkerStatus:
        return WorkerStatus(
            worker.name,
            phase,
            reason,
            message,
            code,
            worker.index,
            worker.attempt,
            node="localhost",
        )

    def _classify_end(self, worker: _Worker) -> tuple[WorkerPhase, Reason, str, int | None]:
        info = read_exit_file(worker.exit_file)
        root_code = worker.agent.process.returncode if worker.agent.process else None
        code = info.get("code") if info else None
        if worker.deleting:
            return WorkerPhase.FAILED, Reason.DELETED, "deleted by the master", code
        if code == 0:
            return WorkerPhase.SUCCEEDED, Reason.COMPLETED, "exit code 0", 0
        if info and info.get("signal"):
            return (
                WorkerPhase.FAILED,
                Reason.PREEMPTED,
                f"terminated by {_signame(info['signal'])}, agent exit code {code}",
                code,
            )
        if worker.preempting:
            return WorkerPhase.FAILED, Reason.PREEMPTED, "preempted", code
        if code is not None and code < 0:
            return WorkerPhase.FAILED, Reason.PREEMPTED, f"agent killed by {_signame(-code)}", code
        if code is None and root_code is not None and root_code < 0:
            return (
                WorkerPhase.FAILED,
                Reason.PREEMPTED,
                f"process tree killed by {_signame(-root_code)}",
                root_code,
            )
        if code is None and root_code is None:
            return (
                WorkerPhase.FAILED,
                Reason.PREEMPTED,
                "ended while no master watched (no exit record)",
                None,
            )
        code = code if code is not None else root_code
        if code == ORPHANED_EXIT_CODE:
            return (
                WorkerPhase.FAILED,
                Reason.ORPHANED,
                f"exit code {code}: stopped itself after a snapshot, its run had no master",
                code,
            )
        tail = _log_tail(worker.agent.log_path)
        return (
            WorkerPhase.FAILED,
            Reason.ERROR,
            f"exit code {code}" + (f"; log: {tail}" if tail else ""),
            code,
        )

    def _signal_root(self, worker: _Worker, sig: signal.Signals) -> None:
        if worker.pid is not None and self._alive(worker):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(worker.pid, sig)

    def _kill_later(self, worker: _Worker, delay_s: float) -> None:
        def run() -> None:
            deadline = time.monotonic() + delay_s
            while time.monotonic() < deadline:
                with self._lock:
                    if not self._alive(worker):
                        break
                time.sleep(0.05)
            worker.agent.sigkill_tree()  # also the orphans of a tree whose root already ended

        timer = threading.Thread(target=run, daemon=True, name=f"kill-{worker.name}")
        self._timers = [t for t in self._timers if t.is_alive()] + [timer]
        timer.start()


def worker_agent(
    *,
    name: str,
    index: int,
    run_id: str,
    endpoint: str,
    nnodes: str,
    entry: Sequence[str],
    nproc_per_worker: int,
    max_restarts: int,
    monitor_interval_s: float,
    rdzv_conf: Mapping[str, object],
    env: Mapping[str, str],
    gpus: Sequence[str],
    workdir: Path,
    cwd: Path,
) -> tuple[Agent, Path]:
    """The (not started) agent of local worker ``name`` in slot ``index``, under its supervisor
    (``master/supervise.py``, which writes the exit record), and that record's path: the one
    place a local worker's command and environment are made (the launcher starts it, a dry
    run prints it)."""
    env = {**env, "KFP_ELASTIC_WORKER_NAME": name, "KFP_ELASTIC_WORKER_INDEX": str(index)}
    devices = gpus_for_worker(index, nproc_per_worker, gpus)
    if devices is not None:  # like a pod's own GPUs from the device plugin
        env["CUDA_VISIBLE_DEVICES"] = devices
    agent = Agent(
        backend="elastic-etcd",
        endpoint=endpoint,
        run_id=run_id,
        log_path=workdir / "workers" / f"{name}.log",
        nnodes=nnodes,
        script=entry[0],
        script_args=entry[1:],
        max_restarts=max_restarts,
        monitor_interval=monitor_interval_s,
        rdzv_conf=rdzv_conf or None,
        env=env,
        extra_args=[f"--nproc-per-node={nproc_per_worker}"],
        name=name,
        cwd=cwd,
    )
    exit_file = workdir / "workers" / f"{name}.exit"
    agent.command = [
        sys.executable,
        "-m",
        "kfp_elastic.master.supervise",
        str(exit_file),
        "--",
        *agent.command,
    ]
    return agent, exit_file


def absolute_script(entry: list[str], cwd: Path) -> list[str]:
    """A relative script path made absolute: a restarted master may run elsewhere."""
    if not entry[0].startswith("-") and (cwd / entry[0]).exists():
        entry[0] = str((cwd / entry[0]).resolve())
    return entry


def _signame(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _log_tail(path: Path, lines: int = 3, chars: int = 400) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    kept = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
    return " | ".join(kept)[-chars:]


def _key(status: WorkerStatus) -> tuple[Any, ...]:
    return status.phase, status.reason, status.exit_code


def _with(status: WorkerStatus, **changes: Any) -> WorkerStatus:
    values = {f.name: getattr(status, f.name) for f in fields(WorkerStatus)}
    return WorkerStatus(**{**values, **changes})


def _event(status: WorkerStatus, **changes: Any) -> WorkerEvent:
    values = {f.name: getattr(status, f.name) for f in fields(WorkerStatus)}
    return WorkerEvent(**{**values, **changes})
