"""Warm start: a process that has torch imported and forks workers from itself on request.

A cold worker spends seconds on ``import torch`` and on what DDP and torch.optim pull in
(``torch._dynamo``) before its first step; after a membership change every worker pays that
again. The agent (see ``rendezvous/warm_start.py``) keeps one zygote per agent: it imports the
preload modules once, then forks a worker for each request of ``zygote_shim.py`` in a few
milliseconds. A worker forked here is set up like a fresh ``python [-u] script.py`` / ``python
[-u] -m module``: the shim's stdin/stdout/stderr, environment, working directory, ``sys.argv``,
``sys.path[0]``, fresh RNG seeds and thread settings, its own session, and normal exit handling
(non-daemon threads joined, atexit handlers run).

The zygote never creates threads, sockets to other hosts, CUDA contexts or process groups, so a
fork from it is safe. It dies with its agent (parent-death signal), and its workers die with it.
CUDA is the exception it checks for (``fork_poison``): once a process has called the CUDA driver
(``torch.cuda.is_available()`` without ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` is enough), torch
marks every fork of it a "bad fork" that cannot use CUDA. A zygote in that state starts every
worker cold (the shim runs the command itself) and says why in its log.

    python -m kfp_elastic.rendezvous.zygote (--socket PATH | --listen-fd FD) --parent-pid PID
                                [--preload mod1:mod2]
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import logging
import os
import selectors
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field

from kfp_elastic.processes import own_memory_map
from kfp_elastic.rendezvous.zygote_shim import recv_message, send_message

log = logging.getLogger("kfp_elastic.rendezvous.zygote")

WARM_STARTED_ENV = "KFP_ELASTIC_WARM_STARTED"
DEFAULT_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",
    "torch.optim",
)
# How long the zygote waits for the rest of a fork request once a worker connected: the
# request is a few hundred bytes sent at once by a process of this package, so only a broken
# client takes longer, and the zygote must not hang on it (internal, not a setting).
REQUEST_TIMEOUT_S = 10.0
_PR_SET_PDEATHSIG = 1
_BAD_FORK_EXIT = 3  # the probe child's exit code when it could not use CUDA


@dataclass(frozen=True)
class PythonTarget:
    """What ``python [-u] (SCRIPT | -m MODULE) ARGS...`` runs."""

    args: tuple[str, ...]
    script: str | None = None
    module: str | None = None
    unbuffered: bool = False


def parse_python_command(argv: list[str] | tuple[str, ...]) -> PythonTarget | None:
    """The target of a worker command, or ``None`` when warm start cannot reproduce it.

    ``argv[0]`` is the interpreter. Only ``-u`` is accepted as an interpreter option (torchrun
    adds it); any other option (``-X``, ``-O``, ``-c``...) means the command runs cold.
    """
    rest = list(argv[1:])
    unbuffered = False
    while rest and rest[0] == "-u":
        unbuffered = True
        rest.pop(0)
    if not rest:
        return None
    if rest[0] == "-m":
        if len(rest) < 2 or not rest[1] or rest[1].startswith("-"):
            return None
        return PythonTarget(args=tuple(rest[2:]), module=rest[1], unbuffered=unbuffered)
    if rest[0].startswith("-"):
        return None
    return PythonTarget(args=tuple(rest[1:]), script=rest[0], unbuffered=unbuffered)


def zygote_command(listener_fd: int, parent_pid: int, modules: tuple[str, ...]) -> list[str]:
    """The command of a fresh zygote serving the inherited listening socket ``listener_fd``."""
    return [
        sys.executable,
        "-m",
        "kfp_elastic.rendezvous.zygote",
        "--listen-fd",
        str(listener_fd),
        "--parent-pid",
        str(parent_pid),
        "--preload",
        ":".join(modules),
    ]


def set_parent_death_signal(signum: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signum))
    except (OSError, AttributeError):
        pass  # not Linux: the agent's atexit stop still ends the zygote


@dataclass
class _Worker:
    conn: socket.socket
    pid: int = 0
    pidfd: int | None = None
    started: float = field(default_factory=time.monotonic)


class Zygote:
    """Accepts shim connections and forks one worker per request; reports each exit code."""

    def __init__(
        self, listener: socket.socket, parent_pid: int, cold_reason: str | None = None
    ) -> None:
        """``cold_reason``: why workers must not be forked from here (``fork_poison``); every
        request is then answered with it and the shim starts the worker cold."""
        self._listener = listener
        self._parent_pid = parent_pid
        self.cold_reason = cold_reason
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ, ("accept", None))
        self._workers: dict[int, _Worker] = {}
        self._poll_exits = not hasattr(os, "pidfd_open")

    def serve_forever(self) -> None:
        while os.getppid() == self._parent_pid:
            for key, _ in self._selector.select(timeout=0.05 if self._poll_exits else 1.0):
                kind, worker = key.data
                if worker is not None and worker.pid not in self._workers:
                    continue  # handled earlier in this batch (exit and hang-up together)
                if kind == "accept":
                    self._accept()
                elif kind == "conn":
                    self._on_shim_readable(worker)
                else:
                    self._reap(worker)
            if self._poll_exits:
                for worker in list(self._workers.values()):
                    self._reap(worker, block=False)
        log.info("agent pid=%d is gone; zygote exits", self._parent_pid)

    def _accept(self) -> None:
        conn, _ = self._listener.accept()
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        if uid != os.getuid():
            log.warning("refused a connection from uid=%d", uid)
            conn.close()
            return
        conn.settimeout(REQUEST_TIMEOUT_S)
        try:
            request, fds = recv_message(conn, max_fds=3)
        except (OSError, ValueError) as error:
            log.warning("bad request: %s", error)
            conn.close()
            return
        try:
            self._start(conn, request, fds)
        finally:
            for fd in fds:
                os.close(fd)

    def _start(self, conn: socket.socket, request: dict | None, fds: list[int]) -> None:
        target, problem = _validate(request, fds, self.cold_reason)
        if target is None:
            _reply(conn, {"error": problem})
            conn.close()
            return
        assert request is not None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._close_in_child()
            conn.close()
            _run_worker(target, request["env"], request["cwd"], fds)  # never returns
        worker = _Worker(conn=conn, pid=pid)
        if not self._poll_exits:
            worker.pidfd = os.pidfd_open(pid)
            self._selector.register(worker.pidfd, selectors.EVENT_READ, ("exit", worker))
        self._selector.register(conn, selectors.EVENT_READ, ("conn", worker))
        self._workers[pid] = worker
        _reply(conn, {"pid": pid})
        log.info("forked worker pid=%d target=%s", pid, target.module or target.script)

    def _on_shim_readable(self, worker: _Worker) -> None:
        # The shim never writes after its request: readable means it is gone (torchrun killed
        # it), so its worker must go too.
        try:
            os.killpg(worker.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._reap(worker)

    def _reap(self, worker: _Worker, block: bool = True) -> None:
        pid, status = os.waitpid(worker.pid, 0 if block else os.WNOHANG)
        if pid == 0:
            return
        exit_code = os.waitstatus_to_exitcode(status)
        _reply(worker.conn, {"exit_code": exit_code})
        log.info(
            "worker pid=%d exited code=%d after %.1fs",
            worker.pid,
            exit_code,
            time.monotonic() - worker.started,
        )
        self._forget(worker)

    def _forget(self, worker: _Worker) -> None:
        self._workers.pop(worker.pid, None)
        for registered in (worker.conn, worker.pidfd):
            if registered is not None:
                try:
                    self._selector.unregister(registered)
                except (KeyError, ValueError):
                    pass
        if worker.pidfd is not None:
            os.close(worker.pidfd)
        worker.conn.close()

    def _close_in_child(self) -> None:
        for worker in self._workers.values():
            if worker.pidfd is not None:
                os.close(worker.pidfd)
            worker.conn.close()
        self._selector.close()
        self._listener.close()


def _validate(
    request: dict | None, fds: list[int], cold_reason: str | None = None
) -> tuple[PythonTarget | None, str]:
    if not isinstance(request, dict) or len(fds) != 3:
        return None, "malformed request"
    argv, env, cwd = request.get("argv"), request.get("env"), request.get("cwd")
    if not (isinstance(argv, list) and isinstance(env, dict) and isinstance(cwd, str)):
        return None, "malformed request"
    if not argv or os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
        return None, f"interpreter {argv[:1]} is not the zygote's {sys.executable}"
    target = parse_python_command(argv)
    if target is None:
        return None, f"command {argv} is not 'python [-u] SCRIPT|-m MODULE ...'"
    if cold_reason is not None:
        return None, cold_reason
    return target, ""


def nvml_loaded(maps: str | None = None) -> bool:
    """Whether NVML (``libnvidia-ml``) is loaded in this process (``maps``: its memory map).

    NVML is not fork-safe: a fork inherits its initialised state and its open device files, and
    a zygote forked from the agent even has those files replaced by /dev/null; NCCL's
    ``nvmlInit`` then fails in every worker. ``import torch`` does not load it."""
    if maps is None:
        maps = own_memory_map()
    return "libnvidia-ml" in maps


def fork_poison(probe: bool = True) -> str | None:
    """Why a process forked from this one could not use CUDA, or ``None`` when it could.

    torch's CUDA module refuses to initialise in a fork of a process that called the CUDA
    driver ("Cannot re-initialize CUDA in forked subprocess"): ``torch.cuda.is_initialized()``
    covers a process that initialised CUDA, ``torch.cuda._is_in_bad_fork()`` a process that is
    itself such a fork (a zygote forked from a poisoned agent), and with ``probe`` a child is
    forked to ask (the driver was called here, e.g. ``torch.cuda.is_available()``, which leaves
    both False). NVML loaded here (``nvml_loaded``) poisons forks as well: CUDA works in them,
    NCCL does not. A CPU-only torch build is never poisoned; without torch nothing is asked.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    cuda = torch.cuda
    if cuda.is_initialized():
        return "CUDA is initialised in this process; its forks cannot use CUDA"
    if nvml_loaded():
        return (
            "NVML is loaded in this process (torch.cuda.is_available with "
            "PYTORCH_NVML_BASED_CUDA_CHECK=1 initialises it and never shuts it down): in its "
            "forks NVML, and NCCL with it, fails ('GPU access blocked by the operating system')"
        )
    if cuda._is_in_bad_fork():
        return (
            "this process is a fork of one that called the CUDA driver (torch.cuda.is_available"
            " or device_count without PYTORCH_NVML_BASED_CUDA_CHECK=1); its forks cannot use CUDA"
        )
    if not probe or not cuda._is_compiled():
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = _BAD_FORK_EXIT if cuda._is_in_bad_fork() else 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code == _BAD_FORK_EXIT:
        return (
            "the CUDA driver was called in this process (torch.cuda.is_available or device_count"
            " without PYTORCH_NVML_BASED_CUDA_CHECK=1): a fork of it cannot use CUDA"
        )
    if code != 0:
        return f"a probe fork of this process exited with code {code}"
    return None


def serve(listener: socket.socket, parent_pid: int) -> None:
    """Serve the agent's shims: warm (forked) workers, or cold ones when a fork could not use
    CUDA (``fork_poison``, checked once: the zygote runs no code of its workers)."""
    cold_reason = fork_poison()
    if cold_reason is not None:
        log.warning("warm start off, workers start cold: %s", cold_reason)
    Zygote(listener, parent_pid, cold_reason).serve_forever()


def _reply(conn: socket.socket, message: dict) -> None:
    try:
        send_message(conn, message)
    except OSError:
        pass  # the shim is gone; its worker is reaped anyway


def _run_worker(target: PythonTarget, env: dict, cwd: str, fds: list[int]) -> None:
    code = 1
    try:
        _become_fresh_process(target, env, cwd, fds)
        keep_process_groups_until_exit()
        code = _run_target(target)
    except BaseException:  # noqa: BLE001 - a forked child must never return into the zygote
        sys.excepthook(*sys.exc_info())
    finally:
        os._exit(code)


def _become_fresh_process(target: PythonTarget, env: dict, cwd: str, fds: list[int]) -> None:
    os.setsid()  # like torchrun's start_new_session: signals reach the worker's whole group
    set_parent_death_signal(signal.SIGKILL)
    for std_fd, fd in enumerate(fds):
        os.dup2(fd, std_fd)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)  # the shim's stdio arrived as new descriptors; the worker has them as 0-2
    for signum in (
        signal.SIGTERM,
        signal.SIGHUP,
        signal.SIGQUIT,
        signal.SIGUSR1,
        signal.SIGUSR2,
        signal.SIGCHLD,
    ):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # Python's own default
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    os.environ[WARM_STARTED_ENV] = "1"
    if target.module is not None:
        sys.path[0] = os.getcwd()
    else:
        sys.path[0] = os.path.dirname(os.path.realpath(target.script))  # type: ignore[arg-type]
    interactive = os.isatty(1)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(
            write_through=target.unbuffered,  # type: ignore[union-attr]
            line_buffering=interactive or stream is sys.stderr,
        )
    _fresh_random_state()
    logging.getLogger().handlers.clear()
    logging.getLogger().setLevel(logging.WARNING)
    log.handlers.clear()


def _fresh_random_state() -> None:
    """Forked children share the zygote's RNG states; give each what a new process has."""
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.random.default_generator.manual_seed(torch.initial_seed())
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))


_kept_process_groups: list[object] = []


def keep_process_groups_until_exit() -> None:
    """Hold every process group this worker creates until the worker's ``os._exit``.

    Torch's Gloo process group joins its worker threads in its destructor. When the last
    reference goes away in Python (a DDP model freed as ``main()`` returns, after
    ``destroy_process_group()``), that destructor runs with the GIL held (pybind11 frees the
    Reducer without releasing it), while a Gloo thread that is dropping the last reference to a
    finished collective needs the GIL to release a Python object the work holds (a
    Python-created tensor, or the ``contextvars`` context the autograd engine stashes in the
    thread-local state every collective issued during ``backward()`` captures): each waits
    for the other forever. It is torch's race (a cold ``python script.py`` hits it as well), and
    the zygote's workers hit it more often. A forked worker ends with ``os._exit`` after its
    exit handlers, which runs no destructor, so a group that is never freed from Python cannot
    deadlock; its threads and sockets end with the process, as they do at a cold process's end.
    """
    distributed_c10d = sys.modules.get("torch.distributed.distributed_c10d")
    create = getattr(distributed_c10d, "_new_process_group_helper", None)
    if create is None or getattr(create, "_keeps_groups", False):
        return  # torch.distributed not preloaded, or a torch without this helper

    def create_and_keep(*args, **kwargs):
        created = create(*args, **kwargs)
        _kept_process_groups.append(created[0] if isinstance(created, tuple) else created)
        return created

    create_and_keep._keeps_groups = True  # type: ignore[attr-defined]
    distributed_c10d._new_process_group_helper = create_and_keep  # type: ignore[union-attr]


def _run_target(target: PythonTarget) -> int:
    import runpy
    import threading

    try:
        if target.module is not None:
            sys.argv = [target.module, *target.args]
            runpy.run_module(target.module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target.script, *target.args]  # type: ignore[list-item]
            runpy.run_path(target.script, run_name="__main__")  # type: ignore[arg-type]
        code = 0
    except SystemExit as exit_request:
        code = _exit_code(exit_request.code)
    except KeyboardInterrupt:
        _print_user_traceback()
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 - printed like the interpreter does
        _print_user_traceback()
        code = 1
    # What the interpreter does at exit: join non-daemon threads, then atexit handlers.
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def _print_user_traceback() -> None:
    """The traceback as ``python script.py`` shows it: without the zygote's and runpy's frames."""
    kind, error, tb = sys.exc_info()
    while tb is not None and (
        tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>")
        or tb.tb_frame.f_code.co_filename.endswith("runpy.py")
    ):
        tb = tb.tb_next
    if error is not None:
        error = error.with_traceback(tb)  # the hook prints the exception's own traceback
    sys.excepthook(kind, error, tb)  # type: ignore[arg-type]


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def preload(modules: list[str]) -> None:
    """Import ``modules`` with the cyclic GC paused, then freeze what they built.

    Importing torch._dynamo allocates hundreds of thousands of long-lived objects; the
    collections they trigger find no garbage and made the import ≈ 25 % slower (1.6 s → 1.2 s
    here), on the path of a joining node's first step. Frozen (``gc.freeze``), those objects are
    never scanned again by a forked worker's collector, so its GC neither costs time nor
    touches (copies) the zygote's pages; they would live as long as the worker anyway.
    """
    import gc

    started = time.monotonic()
    gc.disable()
    try:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception as error:  # noqa: BLE001 - a missing extra module only costs speed
                log.warning("preload of %s failed (%s); workers import it themselves", name, error)
    finally:
        gc.freeze()
        gc.enable()
    log.info(
        "zygote pid=%d ready: preloaded %s in %.1fs",
        os.getpid(),
        ",".join(modules),
        time.monotonic() - started,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="warm-start zygote for elastic-etcd workers")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket", help="unix socket path to listen on")
    where.add_argument("--listen-fd", type=int, help="an inherited listening unix socket")
    parser.add_argument("--parent-pid", type=int, required=True, help="the agent's pid")
    parser.add_argument(
        "--preload",
        default=":".join(DEFAULT_PRELOAD),
        help="':'-separated modules to import before serving",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("KFP_ELASTIC_LOG_LEVEL", "INFO").upper(),
        format="[%(asctime)s] elastic-etcd %(levelname)s %(name)s: %(message)s",
    )
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != args.parent_pid:
        return 0  # the agent died before the death signal was armed
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent decides when we stop
    if args.listen_fd is not None:
        listener = socket.socket(fileno=args.listen_fd)
    else:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(args.socket)
        listener.listen(64)
    # Shims that connect now wait in the backlog until the imports are done.
    preload([name for name in args.preload.split(":") if name])
    serve(listener, args.parent_pid)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
