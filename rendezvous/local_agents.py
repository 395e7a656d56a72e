"""Run local torchrun agents as separate "nodes" (demo, tests, benchmarks, local launcher).

Each :class:`Agent` is one ``python -m kfp_elastic.rendezvous.agent --nproc-per-node=N``
(torchrun with a faster start; ``launcher=TORCHRUN`` for plain torchrun; N is 1 unless given)
process in its own session (process group), like one pod. torchrun starts its workers with
``start_new_session=True`` too, so a worker is *not* in its agent's process group: the whole tree
of an agent is found by a tag in the environment (inherited by the workers) and by walking
``/proc``. :class:`AgentGroup` SIGKILLs every tree it started when it exits, also on errors.

    with AgentGroup(tmp_path) as group:
        a = group.start(backend="c10d", endpoint=ep, run_id="r1", nnodes="2", script_args=[...])
        ...

Each node started by an :class:`AgentGroup` gets GPUs of its own (``CUDA_VISIBLE_DEVICES``, the
rule of ``kfp_elastic.gpus``, as the master's local launcher does); ``device="cuda"`` (or ``auto``
on a GPU machine) with more processes than GPUs is refused before the node starts.

``tests/helpers.py`` re-exports this module for the tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from kfp_elastic.gpus import gpus_for_worker, require_gpus, visible_gpus
from kfp_elastic.rendezvous.embedded_etcd import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY_DDP = REPO_ROOT / "examples" / "tiny_ddp.py"
TAG_VAR = "KFP_ELASTIC_HARNESS_TAG"

T = TypeVar("T")

__all__ = [
    "REPO_ROOT",
    "TINY_DDP",
    "Agent",
    "AgentGroup",
    "first_step_with_world",
    "free_port",
    "new_run_id",
    "read_events",
    "sigkill_process_tree",
    "steps_by_world",
    "tiny_ddp_args",
    "wait_for",
    "wait_for_events",
]


# --------------------------------------------------------------------------- processes


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Fields after the command name "(...)": state, ppid, ...
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def _pids_with_tag(tag: str) -> set[int]:
    needle = f"{TAG_VAR}={tag}".encode()
    found: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.add(int(entry))
    return found


def _descendants(root: int) -> set[int]:
    children = _children_map()
    found: set[int] = set()
    todo = [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def sigkill_process_tree(root: int) -> None:
    """SIGKILL ``root`` and every process below it (stopped first, so none can fork away)."""
    _signal_quietly(root, signal.SIGSTOP)
    for pid in {root} | _descendants(root):
        _signal_quietly(pid, signal.SIGKILL)


def _signal_quietly(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


# What starts an agent: ``kfp-elastic agent`` (torchrun with a faster start, see
# ``rendezvous/agent.py``) or plain torchrun (what users of other backends run).
AGENT: tuple[str, ...] = (sys.executable, "-m", "kfp_elastic.rendezvous.agent")
TORCHRUN: tuple[str, ...] = (sys.executable, "-m", "torch.distributed.run")


def with_repo_on_path(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with this checkout (or installation) first on ``PYTHONPATH``: how every local
    agent, its workers and the master's check of a worker's entry import ``kfp_elastic``."""
    python_path = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return {**env, "PYTHONPATH": python_path}


class Agent:
    """One torchrun agent (``--nproc-per-node=nproc_per_node``), started in its own session."""

    def __init__(
        self,
        *,
        backend: str,
        endpoint: str,
        run_id: str,
        log_path: str | os.PathLike[str],
        nnodes: str = "2:3",
        script: str | os.PathLike[str] = TINY_DDP,
        script_args: Sequence[str] = (),
        max_restarts: int = 10,
        monitor_interval: float = 0.2,
        rdzv_conf: Mapping[str, object] | str | None = None,
        disable_shared_store: bool = False,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        name: str | None = None,
        nproc_per_node: int = 1,
        launcher: Sequence[str] = AGENT,
        cwd: str | os.PathLike[str] = REPO_ROOT,
    ) -> None:
        """``cwd``: the agent's and its workers' working directory."""
        self.name = name or f"agent-{uuid.uuid4().hex[:6]}"
        self.tag = f"{self.name}-{uuid.uuid4().hex}"
        self.log_path = Path(log_path)
        if isinstance(rdzv_conf, Mapping):
            rdzv_conf = ",".join(f"{key}={value}" for key, value in rdzv_conf.items())
        self.command = [
            *launcher,
            f"--rdzv-backend={backend}",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}",
            f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc_per_node}",
            f"--max-restarts={max_restarts}",
            f"--monitor-interval={monitor_interval}",
        ]
        if rdzv_conf:
            self.command.append(f"--rdzv-conf={rdzv_conf}")
        self.command += [*extra_args, str(script), *map(str, script_args)]
        self.env = with_repo_on_path({**os.environ, **(env or {})})
        self.env[TAG_VAR] = self.tag
        self.env.setdefault("OMP_NUM_THREADS", "1")
        if disable_shared_store:
            self.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        self.process: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None  # time.time() of the launch
        self.cwd = Path(cwd)

    def start(self) -> Agent:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"# {time.time():.3f} {' '.join(self.command)}\n".encode())
            log.flush()
            self.started_at = time.time()
            self.process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError(f"{self.name} not started")
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the agent to exit and return its code; ``TimeoutExpired`` after ``timeout``."""
        if self.process is None:
            raise RuntimeError(f"{self.name} not started")
        return self.process.wait(timeout)

    def tree_pids(self) -> set[int]:
        """The agent, its workers (in their own sessions) and their children, also orphans."""
        pids = _pids_with_tag(self.tag)
        if self.alive():
            pids |= {self.pid} | _descendants(self.pid)
        return pids

    def sigkill_tree(self) -> float:
        """SIGKILL the agent and every process below it (a node dying); returns time.time()."""
        if self.alive():
            _signal_quietly(self.pid, signal.SIGSTOP)  # no new workers while we collect pids
        killed_at = time.time()
        pids = self.tree_pids()
        for pid in pids:
            _signal_quietly(pid, signal.SIGKILL)
        if self.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(10)
        return killed_at

    def sigterm(self) -> float:
        """SIGTERM the agent pid only, as the kubelet does to a container's PID 1."""
        sent_at = time.time()
        if self.alive():
            _signal_quietly(self.pid, signal.SIGTERM)
        return sent_at

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def __repr__(self) -> str:
        state = "not started" if self.process is None else f"pid={self.pid} rc={self.returncode}"
        return f"Agent({self.name}, {state})"


class AgentGroup:
    """Starts agents and SIGKILLs every process tree it started on exit (also on exceptions)."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        self.log_dir = Path(log_dir)
        self.agents: list[Agent] = []

    def start(self, *, device: str | None = None, **kwargs: Any) -> Agent:
        """``Agent(**kwargs).start()``; ``log_path`` defaults to ``<log_dir>/<name>.log``.
        The node gets GPUs of its own (``kfp_elastic.gpus``) unless ``env`` names some;
        ``device``: its workers' ``--device`` (None: unknown, never refused)."""
        name = kwargs.setdefault("name", f"agent{len(self.agents)}")
        kwargs.setdefault("log_path", self.log_dir / f"{name}.log")
        env = dict(kwargs.get("env") or {})
        if "CUDA_VISIBLE_DEVICES" not in env:
            gpus, nproc = visible_gpus(), int(kwargs.get("nproc_per_node", 1))
            index = len(self.agents)
            require_gpus(device, (index + 1) * nproc, gpus)
            devices = gpus_for_worker(index, nproc, gpus)
            if devices is not None:
                kwargs["env"] = {**env, "CUDA_VISIBLE_DEVICES": devices}
        agent = Agent(**kwargs)
        self.agents.append(agent)  # before start: cleaned up even if start half-fails
        return agent.start()

    def wait_all(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        return [a.wait(max(0.0, deadline - time.monotonic())) for a in self.agents]

    def kill_all(self) -> None:
        for agent in self.agents:
            if agent.alive():
                _signal_quietly(agent.pid, signal.SIGSTOP)
        for agent in self.agents:
            agent.sigkill_tree()

    def logs(self, tail: int = 40) -> str:
        parts = []
        for agent in self.agents:
            lines = agent.log_text().splitlines()[-tail:]
            parts.append(f"==== {agent!r} {agent.log_path}\n" + "\n".join(lines))
        return "\n".join(parts)

    def __enter__(self) -> AgentGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill_all()


# --------------------------------------------------------------------------- events


def new_run_id(prefix: str = "run") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def tiny_ddp_args(
    events: str | os.PathLike[str],
    steps: int = 1_000_000,
    step_time: float = 0.05,
    state_dir: str | os.PathLike[str] | None = None,
) -> list[str]:
    args = ["--steps", str(steps), "--step-time", str(step_time), "--events", str(events)]
    if state_dir is not None:
        args += ["--state-dir", str(state_dir)]
    return args


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All complete JSON lines of an events file (a line being written is skipped)."""
    events: list[dict[str, Any]] = []
    try:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                if line.endswith("\n"):
                    with contextlib.suppress(json.JSONDecodeError):
                        events.append(json.loads(line))
    except FileNotFoundError:
        pass
    return events


def first_step_with_world(
    events: Iterable[Mapping[str, Any]], world_size: int, after_t: float = 0.0
) -> Mapping[str, Any] | None:
    """The earliest ``step`` event after ``after_t`` from a world of ``world_size`` processes."""
    best: Mapping[str, Any] | None = None
    for event in events:
        if (
            event.get("event") == "step"
            and event.get("world_size") == world_size
            and event["t"] > after_t
            and (best is None or event["t"] < best["t"])
        ):
            best = event
    return best


def steps_by_world(events: Iterable[Mapping[str, Any]]) -> dict[int, int]:
    """How many step events each world size produced."""
    counts: dict[int, int] = {}
    for event in events:
        if event.get("event") == "step":
            counts[event["world_size"]] = counts.get(event["world_size"], 0) + 1
    return counts


def wait_for(
    predicate: Callable[[], T], timeout: float, interval: float = 0.05, what: str = "condition"
) -> T:
    """Poll ``predicate`` until it returns something truthy; return it, or raise TimeoutError."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} not reached within {timeout}s")
        time.sleep(interval)


def wait_for_events(
    path: str | os.PathLike[str],
    predicate: Callable[[list[dict[str, Any]]], T],
    timeout: float,
    interval: float = 0.05,
    what: str = "events",
) -> T:
    """``wait_for`` over the parsed events file: returns the first truthy ``predicate(events)``."""
    return wait_for(lambda: predicate(read_events(path)), timeout, interval, what)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (and Ctrl-C, even where SIGINT was inherited as ignored: ``cmd &``) raise
    KeyboardInterrupt inside the block, so ``finally`` / ``ExitStack`` clean-ups stop every
    process a script started."""

    def raise_interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def run_with_cleanup(
    work_dir: Path, keep_work_dir: bool, body: Callable[[contextlib.ExitStack], None]
) -> int:
    """Run ``body(stack)`` for a script: whatever it registers on ``stack`` (processes, etcd,
    and ``work_dir`` unless kept) is cleaned up on return, error, Ctrl-C or SIGTERM. Returns
    the script's exit code: 0, 130 (interrupted) or 1 (error, traceback printed)."""
    with sigterm_as_interrupt(), contextlib.ExitStack() as stack:
        if not keep_work_dir:
            stack.callback(shutil.rmtree, work_dir, True)
        try:
            body(stack)
        except KeyboardInterrupt:
            print("interrupted: cleaning up", file=sys.stderr)
            return 130
        except Exception:  # noqa: BLE001 - a script reports and still cleans up
            traceback.print_exc()
            return 1
    return 0
