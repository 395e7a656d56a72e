"""Agent side of warm start: route torchrun's worker starts through a zygote (``zygote.py``).

torchrun starts a script worker as ``Popen([python, "-u", script, ...])`` in
``SubprocessHandler._popen``. When warm start is on (``--rdzv-conf warm_start=true``, the
default), the handler wraps that method in the agent process: a Python worker command is started
as ``python -S zygote_shim.py <command>`` instead, and the shim has the agent's zygote fork the
worker with torch already imported. Under torchrun the zygote is forked from the agent as the
handler is created (``zygote_fork.py``: it inherits the agent's ``import torch``); elsewhere it is
started on the first worker start (so handlers created outside torchrun never start one), and
again, as a new process, if it has died. It stops with the agent.
Anything warm start cannot reproduce (``--no-python``, NUMA binding, interpreter options other
than ``-u``, another interpreter) is started exactly as before.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kfp_elastic.rendezvous.zygote import DEFAULT_PRELOAD, parse_python_command, zygote_command
from kfp_elastic.rendezvous.zygote_fork import ForkedZygote, fork_zygote

__all__ = ["DEFAULT_PRELOAD", "install", "shim_command", "ZygoteProcess"]
from kfp_elastic.rendezvous.zygote_shim import SOCKET_ENV

log = logging.getLogger(__name__)

# True while torchrun runs inside ``kfp-elastic agent`` (``agent.py``) in this process.
_in_agent = False

SHIM_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote_shim.py")
STOP_TIMEOUT_S = 5.0


def shim_command(args: Sequence[str], python: str = sys.executable) -> list[str] | None:
    """The shim command that stands in for worker command ``args``, or ``None`` to run it as is."""
    if not args or os.path.realpath(args[0]) != os.path.realpath(python):
        return None
    if parse_python_command(list(args)) is None:
        return None
    return [python, "-S", SHIM_PATH, *args]


class ZygoteProcess:
    """The agent's zygote: started on demand, restarted if it died, stopped at agent exit."""

    def __init__(self, preload: Sequence[str]) -> None:
        self.preload = tuple(preload)
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | ForkedZygote | None = None
        self._directory: str | None = None
        atexit.register(self.stop)

    def socket_path(self, fork_from_here: bool = False) -> str | None:
        """The socket of a live (possibly still importing) zygote; ``None`` if it cannot start.

        ``fork_from_here``: start it by forking this process when that is safe (see
        ``zygote_fork.py``), so that it inherits what this process has imported.
        """
        with self._lock:
            if self._process is not None and self._process.poll() is None:
                return self._socket()
            self._cleanup()
            try:
                self._directory = tempfile.mkdtemp(prefix="kfp-elastic-zygote-")  # mode 0700
                # Bound here, so shims can connect (and wait) before the zygote has started.
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
                    listener.bind(self._socket())
                    listener.listen(64)
                    forked = (
                        fork_zygote(listener, self.preload, (self.stop,))
                        if fork_from_here
                        else None
                    )
                    self._process = forked or subprocess.Popen(
                        zygote_command(listener.fileno(), os.getpid(), self.preload),
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                        pass_fds=(listener.fileno(),),
                    )
            except OSError as error:
                log.warning("warm start off: cannot start the zygote (%s)", error)
                self._cleanup()
                return None
            log.info(
                "warm start: zygote pid=%d %s preload=%s",
                self._process.pid,
                "forked from this agent" if forked else "started",
                ",".join(self.preload),
            )
            return self._socket()

    def stop(self) -> None:
        with self._lock:
            self._cleanup()

    def _socket(self) -> str:
        assert self._directory is not None
        return os.path.join(self._directory, "zygote.sock")

    def _cleanup(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None


_install_lock = threading.Lock()
_zygote: ZygoteProcess | None = None


def _wrap_popen(original: Callable[..., Any]) -> Callable[..., Any]:
    def popen_through_zygote(self: Any, args: tuple, env: dict[str, str]) -> Any:
        zygote = _zygote
        command = shim_command(args) if zygote is not None else None
        path = zygote.socket_path() if zygote is not None and command is not None else None
        if command is None or path is None:
            return original(self, args, env)
        return original(self, tuple(command), {**env, SOCKET_ENV: path})

    popen_through_zygote.__wrapped__ = original  # type: ignore[attr-defined]
    return popen_through_zygote


def install(preload: Sequence[str] = DEFAULT_PRELOAD) -> None:
    """Start this agent's workers through a zygote from now on (idempotent)."""
    global _zygote
    with _install_lock:
        if _zygote is not None:
            return
        from torch.distributed.elastic.multiprocessing.subprocess_handler import (
            subprocess_handler,
        )

        handler_class = subprocess_handler.SubprocessHandler
        handler_class._popen = _wrap_popen(handler_class._popen)  # type: ignore[method-assign]
        _zygote = ZygoteProcess(preload)
    if _running_under_torchrun():
        # Forked now, before the handler opens its gRPC channel (threads): the zygote starts
        # with the agent's torch and imports the rest while the first round forms.
        _zygote.socket_path(fork_from_here=True)


@contextlib.contextmanager
def agent_process() -> Iterator[None]:
    """Marks this process as an agent while ``kfp-elastic agent`` runs torchrun in it: its
    zygote is then forked from it (``install``)."""
    global _in_agent
    _in_agent = True
    try:
        yield
    finally:
        _in_agent = False


def _running_under_torchrun() -> bool:
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return (
        _in_agent
        or getattr(main_spec, "name", None) == "torch.distributed.run"
        or os.path.basename(sys.argv[0]) == "torchrun"
    )
