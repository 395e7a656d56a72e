"""Local processes as Linux's ``/proc`` shows them: state, parent, CPU time, age, environment tags,
process trees; the one reader of ``/proc/PID/stat`` and ``/proc/PID/environ``.

A process the project starts carries a tag in its environment (``KFP_ELASTIC_RUN_ID``, the local
launcher's ``KFP_ELASTIC_HARNESS_TAG``, the test cluster's pod uid ...). Its children inherit the
tag, also those torchrun starts in sessions of their own and orphans whose parent died, so the
tag finds a whole tree where parent links and process groups cannot. Every reader tolerates a
process vanishing between two reads (a pid is only a hint until it is signalled).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

PROC = Path("/proc")
# States of a process that has ended (zombie: not yet waited for; dead: being torn down).
ENDED_STATES = ("Z", "X")

# Fields of /proc/PID/stat counted after the command name "(...)" (proc(5) numbers them from 3).
_STATE, _PPID, _UTIME, _STIME, _STARTTIME = 0, 1, 11, 12, 19


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (which may hold spaces and
    parentheses); None when the process is gone or unreadable."""
    try:
        return (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def state(pid: int) -> str:
    """The state letter (R, S, D, T, Z ...); ``X`` for a process that is gone."""
    fields = stat_fields(pid)
    return fields[_STATE] if fields else "X"


def is_running(pid: int) -> bool:
    """The process exists and has not ended (a stopped one counts as running)."""
    return state(pid) not in ENDED_STATES


def parent(pid: int) -> int | None:
    """The parent's pid; None when the process is gone."""
    fields = stat_fields(pid)
    try:
        return int(fields[_PPID]) if fields else None
    except (IndexError, ValueError):
        return None


def seconds_since_start(pid: int) -> float:
    """Age of the process (NaN when ``/proc`` cannot tell)."""
    fields = stat_fields(pid)
    try:
        start_ticks = int(fields[_STARTTIME]) if fields else None
        now = float((PROC / "uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")
    if start_ticks is None:
        return float("nan")
    return now - start_ticks / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: set[int]) -> float:
    """user + system CPU time of the processes (those that still exist)."""
    total = 0
    for pid in pids:
        fields = stat_fields(pid)
        if fields is not None:
            with contextlib.suppress(IndexError, ValueError):
                total += int(fields[_UTIME]) + int(fields[_STIME])
    return total / os.sysconf("SC_CLK_TCK")


def _pids() -> list[int]:
    return [int(entry) for entry in os.listdir(PROC) if entry.isdigit()]


def _env_entry(name: str, value: str) -> bytes:
    return f"{name}={value}".encode()


def _environ(pid: int) -> list[bytes] | None:
    try:
        return (PROC / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None


def has_env(pid: int, name: str, value: str) -> bool:
    """``pid`` runs (has not ended) with ``name=value`` in its environment: the process a tag
    names, not another that reuses its pid."""
    environ = _environ(pid)
    return environ is not None and _env_entry(name, value) in environ and is_running(pid)


def pids_with_env(name: str, value: str) -> set[int]:
    """Running local processes (not this one) with ``name=value`` in their environment (an
    ended process, a zombie, has no environment left to show)."""
    needle = _env_entry(name, value)
    found: set[int] = set()
    for pid in _pids():
        if pid == os.getpid():
            continue
        environ = _environ(pid)
        if environ is not None and needle in environ and is_running(pid):
            found.add(pid)
    return found


def children_map() -> dict[int, list[int]]:
    """Parent pid → its children's pids, for every process now."""
    children: dict[int, list[int]] = {}
    for pid in _pids():
        ppid = parent(pid)
        if ppid is not None:
            children.setdefault(ppid, []).append(pid)
    return children


def descendants(root: int) -> set[int]:
    """Every process below ``root`` (children, their children ...), not ``root`` itself."""
    children = children_map()
    found: set[int] = set()
    todo = [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def signal_quietly(pid: int, sig: signal.Signals) -> None:
    """Send ``sig``; a process that is gone (or not ours) is no error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def sigkill_process_tree(root: int) -> None:
    """SIGKILL ``root`` and every process below it (stopped first, so none can fork away)."""
    signal_quietly(root, signal.SIGSTOP)
    for pid in {root} | descendants(root):
        signal_quietly(pid, signal.SIGKILL)


def sigkill_tagged(name: str, value: str, rounds: int = 3, pause_s: float = 0.1) -> None:
    """SIGKILL every process with ``name=value`` in its environment, again after each pause
    (a process may fork while the first round runs), until none is left or ``rounds`` ran."""
    for _ in range(rounds):
        left = pids_with_env(name, value)
        if not left:
            return
        for pid in left:
            signal_quietly(pid, signal.SIGKILL)
        time.sleep(pause_s)


# -- this process -------------------------------------------------------------------------------


def own_open_fds() -> list[int]:
    """This process's open file descriptors (empty without ``/proc``)."""
    try:
        listed = sorted(int(name) for name in os.listdir(PROC / "self" / "fd"))
    except OSError:
        return []
    open_now = []
    for fd in listed:  # the listing's own descriptor is closed again by now
        try:
            os.fstat(fd)
        except OSError:
            continue
        open_now.append(fd)
    return open_now


def own_thread_names() -> list[str]:
    """OS thread names of this process (empty without ``/proc``)."""
    names = []
    try:
        tasks = os.listdir(PROC / "self" / "task")
    except OSError:
        return names
    for task in tasks:
        try:
            names.append((PROC / "self" / "task" / task / "comm").read_text().strip())
        except OSError:
            pass
    return names


def own_memory_map() -> str:
    """This process's memory map (``/proc/self/maps``: the files and libraries it has mapped);
    empty when it cannot be read."""
    try:
        return (PROC / "self" / "maps").read_text()
    except OSError:
        return ""
