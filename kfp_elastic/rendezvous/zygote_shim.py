"""The process torchrun starts for a worker when warm start is on: it has the worker forked.

torchrun runs ``python -S zygote_shim.py <the worker command>``. This file uses only the standard
library (it starts in ~20 ms because ``-S`` skips site-packages): it hands the worker command,
environment, working directory and its stdin/stdout/stderr to the agent's zygote (a process that
has torch imported already, see ``rendezvous/zygote.py``), which forks the worker. The shim then
stands in for the worker: it forwards the signals torchrun sends and exits with the worker's exit
code, or dies by the worker's signal, so torchrun cannot tell the difference.

If the zygote is unreachable or refuses, the shim ``exec``s the command itself: the worker then
starts cold, exactly as without warm start (same pid, process group and file descriptors).

Wire format (also used by the zygote): each message is a 4-byte big-endian length and that many
bytes of UTF-8 JSON. The request carries fds 0, 1 and 2 as SCM_RIGHTS ancillary data.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

SOCKET_ENV = "KFP_ELASTIC_ZYGOTE_SOCKET"
# Longest wait for the zygote's answer (it answers once its imports are done).
REPLY_TIMEOUT_S = 300.0
FORWARDED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
_HEADER = struct.Struct(">I")


def send_message(sock: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    payload = json.dumps(message).encode()
    data = _HEADER.pack(len(payload)) + payload
    if fds:
        socket.send_fds(sock, [data[:1]], fds)
        data = data[1:]
    sock.sendall(data)


def _recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            return None
        chunks += chunk
    return bytes(chunks)


def recv_message(sock: socket.socket, max_fds: int = 0) -> tuple[dict | None, list[int]]:
    """One message (``None`` at end of stream) and the fds that came with its first byte."""
    fds: list[int] = []
    if max_fds:
        first, fds, _flags, _addr = socket.recv_fds(sock, 1, max_fds)
        if not first:
            return None, fds
        rest = _recv_exactly(sock, _HEADER.size - 1)
        header = first + rest if rest is not None else None
    else:
        header = _recv_exactly(sock, _HEADER.size)
    if header is None:
        return None, fds
    payload = _recv_exactly(sock, _HEADER.unpack(header)[0])
    if payload is None:
        return None, fds
    return json.loads(payload), fds


def _exec_cold(command: list[str], reason: str) -> None:
    if reason:
        sys.stderr.write(f"[elastic-etcd warm start] starting the worker cold: {reason}\n")
        sys.stderr.flush()
    env = {k: v for k, v in os.environ.items() if k != SOCKET_ENV}
    os.execve(command[0], command, env)


def _die_like(exit_code: int) -> None:
    if exit_code < 0:
        signum = -exit_code
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os._exit(exit_code if 0 <= exit_code < 256 else 1)


def main(command: list[str]) -> None:
    if not command:
        sys.stderr.write("usage: python -S zygote_shim.py PYTHON [ARGS...]\n")
        os._exit(2)
    path = os.environ.get(SOCKET_ENV)
    if not path:
        _exec_cold(command, "")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        env = {k: v for k, v in os.environ.items() if k != SOCKET_ENV}
        send_message(sock, {"argv": command, "env": env, "cwd": os.getcwd()}, [0, 1, 2])
        sock.settimeout(REPLY_TIMEOUT_S)
        reply, _ = recv_message(sock)
        sock.settimeout(None)
    except OSError as error:
        sock.close()
        _exec_cold(command, f"zygote at {path} unreachable ({error})")
        return
    if not reply or "pid" not in reply:
        sock.close()
        _exec_cold(command, (reply or {}).get("error", "zygote closed the connection"))
        return
    worker_pid = int(reply["pid"])

    def forward(signum: int, _frame: object) -> None:
        try:
            os.killpg(worker_pid, signum)  # the worker leads its own process group
        except ProcessLookupError:
            pass

    for name in FORWARDED_SIGNALS:
        signal.signal(getattr(signal, name), forward)
    try:
        final, _ = recv_message(sock)
    except OSError:
        final = None
    # No final message: the zygote died, and the worker with it (parent-death signal).
    _die_like(int(final["exit_code"]) if final and "exit_code" in final else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
