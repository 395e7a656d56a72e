"""A zygote forked from the agent: it keeps nothing of the agent that a worker could notice.

An "agent" here is a small Python process that holds what a torchrun agent may hold when the
zygote is forked (a pipe, a SIGTERM handler, its own logging, the zygote's stop() at exit) and
then starts the zygote with ``fork_from_here=True``. Workers are started through the real shim.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kfp_elastic.processes import is_running
from kfp_elastic.rendezvous.warm_start import SHIM_PATH
from kfp_elastic.rendezvous.zygote_shim import SOCKET_ENV
from tests.helpers import REPO_ROOT

PY = sys.executable

AGENT = textwrap.dedent("""
    import atexit, json, logging, os, signal, sys, threading, time
    from kfp_elastic.rendezvous.warm_start import ZygoteProcess
    from kfp_elastic.rendezvous.zygote_fork import ForkedZygote
    marker, mode = sys.argv[1], sys.argv[2]
    read_end, write_end = os.pipe()  # held by the agent: must not stay open in workers
    signal.signal(signal.SIGTERM, lambda *_: None)
    logging.getLogger("kfp_elastic.rendezvous").addHandler(logging.StreamHandler(sys.stdout))
    if mode == "thread":
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    if mode == "poisoned":  # what a fork of an agent that called the CUDA driver sees
        import torch
        torch.cuda._is_in_bad_fork = lambda: True
    zygote = ZygoteProcess(["json"])
    path = zygote.socket_path(fork_from_here=True)
    # Registered after the fork, as the handler registers its leave(): never run by workers.
    atexit.register(lambda: open(marker, "a").write("agent exit handler ran\\n"))
    print(json.dumps({"socket": path, "forked": isinstance(zygote._process, ForkedZygote),
                      "zygote_pid": zygote._process.pid,
                      "pipe": os.readlink(f"/proc/self/fd/{write_end}")}), flush=True)
    sys.stdin.read()  # until the test closes our stdin
    zygote.stop()
""")

PROBE = textwrap.dedent("""
    import gc, json, logging, os, signal, sys
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[name] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    print(json.dumps({
        "warm": os.environ.get("KFP_ELASTIC_WARM_STARTED"), "fds": fds,
        "sigterm": str(signal.getsignal(signal.SIGTERM)),
        "sigint": str(signal.getsignal(signal.SIGINT)),
        "rendezvous_handlers": len(logging.getLogger("kfp_elastic.rendezvous").handlers),
        "root_level": logging.root.level, "root_handlers": len(logging.root.handlers),
        "session_leader": os.getsid(0) == os.getpid(),
        "gc_enabled": gc.isenabled(),
        "parent": open(f"/proc/{os.getppid()}/cmdline").read().split("\\0"),
    }), flush=True)
""")


@pytest.fixture
def agent(tmp_path: Path, request):
    mode = getattr(request, "param", "plain")
    marker = tmp_path / "marker.txt"
    marker.write_text("")
    process = subprocess.Popen(
        [PY, "-c", AGENT, str(marker), mode],
        cwd=REPO_ROOT,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        start_new_session=True,
    )
    try:
        info = json.loads(process.stdout.readline())
        yield process, info, marker
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def start_probe(socket_path: str, tmp_path: Path) -> dict:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    shim = subprocess.run(
        [PY, "-S", SHIM_PATH, PY, "-u", str(script)],
        cwd=tmp_path,
        env={**os.environ, SOCKET_ENV: socket_path},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shim.returncode == 0, shim.stderr
    return json.loads(shim.stdout.splitlines()[0])


def test_the_zygote_is_forked_and_its_workers_keep_nothing_of_the_agent(agent, tmp_path) -> None:
    process, info, marker = agent
    assert info["forked"], "no thread but the main one: the zygote is forked from the agent"
    first = start_probe(info["socket"], tmp_path)
    assert first["warm"] == "1"
    assert info["pipe"] not in first["fds"].values(), "the agent's pipe leaked into the worker"
    extra = {fd: target for fd, target in first["fds"].items() if int(fd) > 2}
    assert all(target == "/dev/null" for target in extra.values()), extra
    assert first["sigterm"] == str(signal.SIG_DFL) and "default_int_handler" in first["sigint"]
    assert first["rendezvous_handlers"] == 0 and first["root_handlers"] == 0
    assert first["root_level"] == 30 and first["session_leader"]
    assert first["gc_enabled"], "the zygote imports with GC paused; its workers must have it on"
    # The agent's ZygoteProcess.stop() (an exit handler from before the fork) did not run in
    # the first worker: the zygote's socket directory is still there.
    second = start_probe(info["socket"], tmp_path)
    assert second["warm"] == "1"
    assert marker.read_text() == ""
    process.stdin.close()
    assert process.wait(30) == 0
    assert marker.read_text() == "agent exit handler ran\n", "the agent's own exit still runs"


def test_the_zygote_dies_with_the_agent(agent) -> None:
    process, info, _ = agent
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert _wait_gone(info["zygote_pid"], 10), "the forked zygote outlived its agent"


@pytest.mark.parametrize("agent", ["thread"], indirect=True)
def test_an_agent_with_threads_starts_the_zygote_as_a_new_process(agent, tmp_path) -> None:
    _, info, _ = agent
    assert not info["forked"]
    assert start_probe(info["socket"], tmp_path)["warm"] == "1"


@pytest.mark.parametrize("agent", ["poisoned"], indirect=True)
def test_a_zygote_forked_from_a_poisoned_agent_restarts_as_a_fresh_process(agent, tmp_path) -> None:
    _, info, _ = agent
    assert info["forked"]
    worker = start_probe(info["socket"], tmp_path)
    assert worker["warm"] == "1", "workers still start warm, from the fresh zygote"
    assert "kfp_elastic.rendezvous.zygote" in worker["parent"], worker["parent"]


def _wait_gone(pid: int, timeout: float) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not is_running(pid):  # gone, or dead and left to its new parent to reap
            return True
        time.sleep(0.05)
    return False
