"""One local torchrun agent as a separate "node": the process the master's local launcher starts
(and the local nodes harness, ``kfp_elastic.testing.nodes``).

An :class:`Agent` is one ``python -m kfp_elastic.rendezvous.agent --nproc-per-node=N`` (torchrun
with a faster start; ``launcher=TORCHRUN`` for plain torchrun) process in its own session
(process group), like one pod. torchrun starts its workers with ``start_new_session=True`` too, so
a worker is *not* in its agent's process group: the whole tree of an agent is found by a tag in
the environment (inherited by the workers) and by walking ``/proc`` (``kfp_elastic.processes``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import kfp_elastic
from kfp_elastic.processes import descendants, pids_with_env, signal_quietly

# Where ``kfp_elastic`` is imported from (a checkout or site-packages): first on the agents'
# PYTHONPATH, so that they and their workers run this very copy.
IMPORT_ROOT = Path(kfp_elastic.__file__).resolve().parent.parent
TAG_VAR = "KFP_ELASTIC_HARNESS_TAG"

__all__ = [
    "AGENT",
    "TAG_VAR",
    "TORCHRUN",
    "Agent",
    "with_package_on_path",
]

# What starts an agent: ``kfp-elastic agent`` (torchrun with a faster start, see
# ``rendezvous/agent.py``) or plain torchrun (what users of other backends run).
AGENT: tuple[str, ...] = (sys.executable, "-m", "kfp_elastic.rendezvous.agent")
TORCHRUN: tuple[str, ...] = (sys.executable, "-m", "torch.distributed.run")


def with_package_on_path(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the directory ``kfp_elastic`` is imported from first on ``PYTHONPATH``: how
    every local agent, its workers and the master's check of a worker's entry import it."""
    python_path = os.pathsep.join(p for p in (str(IMPORT_ROOT), env.get("PYTHONPATH", "")) if p)
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
        script: str | os.PathLike[str],
        nnodes: str = "2:3",
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
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        """``script``: what each worker runs; ``cwd``: the agent's and its workers' working
        directory (None: this process's)."""
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
        self.env = with_package_on_path({**os.environ, **(env or {})})
        self.env[TAG_VAR] = self.tag
        self.env.setdefault("OMP_NUM_THREADS", "1")
        if disable_shared_store:
            self.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        self.process: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None  # time.time() of the launch
        self.cwd = None if cwd is None else Path(cwd)

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
        pids = pids_with_env(TAG_VAR, self.tag)
        if self.alive():
            pids |= {self.pid} | descendants(self.pid)
        return pids

    def sigkill_tree(self) -> float:
        """SIGKILL the agent and every process below it (a node dying); returns time.time()."""
        if self.alive():
            signal_quietly(self.pid, signal.SIGSTOP)  # no new workers while we collect pids
        killed_at = time.time()
        pids = self.tree_pids()
        for pid in pids:
            signal_quietly(pid, signal.SIGKILL)
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
            signal_quietly(self.pid, signal.SIGTERM)
        return sent_at

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def __repr__(self) -> str:
        state = "not started" if self.process is None else f"pid={self.pid} rc={self.returncode}"
        return f"Agent({self.name}, {state})"
