"""Start the agent's zygote by forking the agent, so that it inherits the agent's ``import torch``.

A new node is cold: its agent imports torch (≈ 2 s here), and a zygote started as a new process
imports torch again before DDP's ``torch._dynamo`` (≈ 1.7 s more), so the node's first worker
was ready only ≈ 6 s after launch. Forked from the agent while the agent has no thread besides
those ``import torch`` starts (before the handler opens its gRPC channel), the zygote starts
with torch loaded and imports only what the agent lacks.

The child is made to look like ``python -m kfp_elastic.rendezvous.zygote`` started by
``subprocess.Popen``:
its own session, stdin on ``/dev/null``, the agent's other descriptors released (``/dev/null`` in
their place), default signal handlers, the agent's exit handlers dropped, and the agent's
logging changes undone. When the agent has
threads already (the zygote died and is restarted later), :mod:`warm_start` starts it as a new
process instead. A fork of an agent that called the CUDA driver (torch marks it a "bad fork":
torchrun's ``LaunchConfig`` calls ``torch.cuda.is_available()``) could never give its workers
CUDA: that zygote replaces itself at once by a fresh ``python -m kfp_elastic.rendezvous.zygote``
(``exec``, same pid and listening socket), which imports torch itself.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence

from kfp_elastic.processes import own_open_fds, own_thread_names, seconds_since_start
from kfp_elastic.rendezvous.zygote import (
    fork_poison,
    preload,
    serve,
    set_parent_death_signal,
    zygote_command,
)

log = logging.getLogger(__name__)

_RESET_SIGNALS = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCHLD", "SIGALRM")
_UNSAFE_THREAD_PREFIXES = ("grpc", "event_engine", "lifeguard", "default-execut", "resolver-exec")
# Loggers the agent configures and a fresh ``python -m kfp_elastic.rendezvous.zygote`` would
# not have.
_AGENT_LOGGERS = ("kfp_elastic.rendezvous",)


def fork_is_safe() -> bool:
    """Whether forking this process now gives a child that can run Python and import safely.

    No other Python thread (it could hold the import lock or a logging lock) and no gRPC thread
    (gRPC's state does not survive a fork). Native thread pools that ``import numpy``/``torch``
    start (OpenBLAS) re-create themselves after a fork; the zygote forks every worker with them.
    """
    if threading.active_count() != 1:
        return False
    names = own_thread_names()  # none without /proc: then nothing is forked
    return bool(names) and not any(name.startswith(_UNSAFE_THREAD_PREFIXES) for name in names)


class ForkedZygote:
    """The parent's handle on a forked zygote, with the part of ``Popen`` that warm start uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -1  # reaped by someone else
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"zygote pid {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_zygote(
    listener: socket.socket,
    modules: Sequence[str],
    agent_exit_handlers: Sequence[Callable[[], object]] = (),
) -> ForkedZygote | None:
    """Fork this agent into a zygote serving ``listener``; ``None`` when it is not safe now.

    ``agent_exit_handlers``: the agent's ``atexit`` functions that its workers must not run
    (exit handlers registered by imports stay, as in a fresh process).
    """
    if not fork_is_safe():
        log.info(
            "zygote not forked: this process has threads %s (Python: %d)",
            own_thread_names(),
            threading.active_count(),
        )
        return None
    parent_pid = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _serve_in_child(listener, parent_pid, tuple(modules), agent_exit_handlers)  # no return
    return ForkedZygote(pid)


def _serve_in_child(
    listener: socket.socket,
    parent_pid: int,
    modules: tuple[str, ...],
    agent_exit_handlers: Sequence[Callable[[], object]],
) -> None:
    code = 1
    try:
        _become_zygote(listener.fileno())
        for handler in agent_exit_handlers:
            atexit.unregister(handler)
        set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != parent_pid:
            code = 0  # the agent died before the death signal was armed
        else:
            log.info(
                "zygote pid=%d forked from agent pid=%d, %.2fs after the agent started",
                os.getpid(),
                parent_pid,
                seconds_since_start(parent_pid),
            )
            poison = fork_poison(probe=False)
            if poison is not None:
                _exec_fresh_zygote(listener.fileno(), parent_pid, modules, poison)
            preload(list(modules))
            serve(listener, parent_pid)
            code = 0
    except BaseException:  # noqa: BLE001 - a forked child must never return into the agent
        traceback.print_exc()
    finally:
        os._exit(code)


def _exec_fresh_zygote(
    listener_fd: int, parent_pid: int, modules: tuple[str, ...], reason: str
) -> None:
    """Become ``python -m kfp_elastic.rendezvous.zygote`` on the same socket (never returns):
    a new program has none of the agent's CUDA state. Same pid: the agent's handle stays valid."""
    log.warning("zygote pid=%d restarts as a fresh process: %s", os.getpid(), reason)
    logging.shutdown()
    os.set_inheritable(listener_fd, True)
    command = zygote_command(listener_fd, parent_pid, modules)
    os.execv(command[0], command)


def _become_zygote(listener_fd: int) -> None:
    os.setsid()  # like Popen(start_new_session=True): the agent's signals stay the agent's
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    for fd in own_open_fds():
        if fd > 2 and fd not in (listener_fd, devnull):
            # /dev/null in place of closing: the agent's objects that own these numbers stay
            # valid, and a number is never reused under them.
            os.dup2(devnull, fd)
    os.close(devnull)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent decides when the zygote stops
    for name in _RESET_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # Python's own default
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:
        pass
    for name in _AGENT_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.setLevel(logging.NOTSET)
        logger.propagate = True
    logging.root.handlers.clear()
    logging.basicConfig(
        level=os.environ.get("KFP_ELASTIC_LOG_LEVEL", "INFO").upper(),
        format="[%(asctime)s] elastic-etcd %(levelname)s %(name)s: %(message)s",
    )
