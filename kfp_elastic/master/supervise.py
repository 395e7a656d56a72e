"""Root of a local worker's process tree: runs the torchrun agent and writes how it ended.

    python -m kfp_elastic.master.supervise EXIT_FILE -- python -m kfp_elastic.rendezvous.agent ...

A local worker may outlive the master that started it (a master SIGKILL, then a new master
adopts the worker). Only a process's parent learns its exit status, and the agent's parent
would be gone, so this small supervisor is the parent: it forwards SIGTERM/SIGINT/SIGHUP to the
agent (the kubelet's preemption notice goes to a container's PID 1 the same way), waits, and
writes ``{"code": <agent exit code, negative = killed by that signal>, "signal": <first signal
this supervisor received, or null>}`` to EXIT_FILE atomically. It exits with the agent's code
(128 + signal when the agent was killed). Standard library only, so it starts in milliseconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def write_exit_file(path: str, code: int, received: int | None) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump({"code": code, "signal": received}, handle)
    os.replace(tmp, path)


def read_exit_file(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print(
            "usage: python -m kfp_elastic.master.supervise EXIT_FILE -- COMMAND...", file=sys.stderr
        )
        return 2
    exit_file, command = argv[0], argv[2:]
    received: list[int] = []
    child: subprocess.Popen[bytes] | None = None

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    child = subprocess.Popen(command)  # same session: killpg(root) reaches the agent too
    if received and child.poll() is None:  # a signal came before the child existed
        child.send_signal(received[0])
    code = child.wait()
    write_exit_file(exit_file, code, received[0] if received else None)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
