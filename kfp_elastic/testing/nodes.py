"""Run local torchrun agents as separate "nodes" for tests, benchmarks and the demo.

:class:`AgentGroup` starts :class:`~kfp_elastic.master.local_agent.Agent` processes (one per
"node"), gives each node GPUs of its own (``CUDA_VISIBLE_DEVICES``, the rule of
``kfp_elastic.gpus``, as the master's local launcher does) and SIGKILLs every process tree it
started when it exits, also on errors. Unless told otherwise a node runs ``examples/tiny_ddp.py``
of the checkout, with the checkout as its working directory.

    with AgentGroup(tmp_path) as group:
        a = group.start(backend="c10d", endpoint=ep, run_id="r1", nnodes="2", script_args=[...])
        ...

``device="cuda"`` (or ``auto`` on a GPU machine) with more processes than GPUs is refused before
the node starts. The rest reads the events files the example scripts write.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from kfp_elastic.etcd.embedded import free_port
from kfp_elastic.gpus import gpus_for_worker, require_gpus, visible_gpus
from kfp_elastic.master.local_agent import AGENT, TORCHRUN, Agent
from kfp_elastic.processes import sigkill_process_tree, signal_quietly

# The checkout the harness runs from: its examples are what a node runs unless told otherwise.
REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_DDP = REPO_ROOT / "examples" / "tiny_ddp.py"

T = TypeVar("T")

__all__ = [
    "AGENT",
    "REPO_ROOT",
    "TORCHRUN",
    "TINY_DDP",
    "Agent",
    "AgentGroup",
    "first_step_with_world",
    "free_port",
    "new_run_id",
    "read_events",
    "run_with_cleanup",
    "sigkill_process_tree",
    "steps_by_world",
    "tiny_ddp_args",
    "wait_for",
    "wait_for_events",
]


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
        kwargs.setdefault("script", TINY_DDP)
        kwargs.setdefault("cwd", REPO_ROOT)
        agent = Agent(**kwargs)
        self.agents.append(agent)  # before start: cleaned up even if start half-fails
        return agent.start()

    def wait_all(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        return [a.wait(max(0.0, deadline - time.monotonic())) for a in self.agents]

    def kill_all(self) -> None:
        for agent in self.agents:
            if agent.alive():
                signal_quietly(agent.pid, signal.SIGSTOP)
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
