"""Warm start: the zygote forks workers that behave like fresh ``python script.py`` processes.

The zygote here preloads only ``json`` (fast); torchrun runs with the real preload are in
tests/e2e/test_torchrun.py.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kfp_elastic.processes import is_running
from kfp_elastic.rendezvous.warm_start import SHIM_PATH, shim_command
from kfp_elastic.rendezvous.zygote import PythonTarget, parse_python_command
from kfp_elastic.rendezvous.zygote_shim import SOCKET_ENV
from tests.helpers import running_zygote, wait_for

PY = sys.executable

WORKER = textwrap.dedent("""
    import atexit, json, os, random, sys, threading, time
    info = {"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
            "env": os.environ.get("PROBE_VALUE"),
            "warm": os.environ.get("KFP_ELASTIC_WARM_STARTED"),
            "pid": os.getpid(), "random": random.random(), "main": __name__}
    print(json.dumps(info), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "sleep":
        time.sleep(60)
    if mode == "raise":
        raise RuntimeError("boom from the worker")
    if mode == "thread":
        def late():
            time.sleep(0.3)
            print("thread done", flush=True)
        threading.Thread(target=late).start()
        atexit.register(lambda: print("atexit ran", flush=True))
        sys.exit(0)
    sys.exit(3)
""")


# --------------------------------------------------------------------------- pure parts
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            [PY, "-u", "train.py", "--lr", "1"],
            PythonTarget(("--lr", "1"), script="train.py", unbuffered=True),
        ),
        ([PY, "train.py"], PythonTarget((), script="train.py")),
        (
            [PY, "-u", "-m", "kfp_elastic.worker", "--model-def", "m"],
            PythonTarget(("--model-def", "m"), module="kfp_elastic.worker", unbuffered=True),
        ),
        ([PY, "-X", "dev", "train.py"], None),
        ([PY, "-c", "print(1)"], None),
        ([PY, "-m"], None),
        ([PY, "-u"], None),
    ],
)
def test_python_commands_warm_start_can_reproduce(argv, expected) -> None:
    assert parse_python_command(argv) == expected


def test_only_python_worker_commands_go_through_the_shim() -> None:
    assert shim_command([PY, "-u", "t.py", "a"]) == [PY, "-S", SHIM_PATH, PY, "-u", "t.py", "a"]
    assert shim_command(["/usr/bin/numactl", "--cpunodebind=0", PY, "t.py"]) is None
    assert shim_command(["/bin/echo", "t.py"]) is None  # torchrun --no-python
    assert shim_command([PY, "-O", "t.py"]) is None


# --------------------------------------------------------------------------- real zygote
@pytest.fixture
def zygote(tmp_path: Path):
    directory = tmp_path / "z"
    directory.mkdir(mode=0o700)
    path = str(directory / "sock")
    with running_zygote(path, ["json"]) as process:
        yield path, process


@pytest.fixture
def worker_script(tmp_path: Path) -> Path:
    script = tmp_path / "scripts" / "worker_probe.py"
    script.parent.mkdir()
    script.write_text(WORKER)
    return script


def run_shim(socket_path: str, args: list[str], tmp_path: Path, **popen) -> subprocess.Popen:
    env = {**os.environ, SOCKET_ENV: socket_path, "PROBE_VALUE": "from-the-shim"}
    return subprocess.Popen(
        [PY, "-S", SHIM_PATH, PY, "-u", *args],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **popen,
    )


def worker_info(output: str) -> dict:
    import json

    return json.loads(output.splitlines()[0])


def test_a_forked_worker_looks_like_a_fresh_process(zygote, worker_script, tmp_path) -> None:
    path, _ = zygote
    first = run_shim(path, [str(worker_script), "a", "b"], tmp_path)
    out, err = first.communicate(timeout=30)
    assert first.returncode == 3, err
    info = worker_info(out)
    assert info["argv"] == [str(worker_script), "a", "b"]
    assert info["cwd"] == str(tmp_path)
    assert info["path0"] == str(worker_script.parent)
    assert info["env"] == "from-the-shim"
    assert info["warm"] == "1"
    assert info["main"] == "__main__"
    assert "to stderr" in err
    second = run_shim(path, [str(worker_script)], tmp_path)
    out2, _ = second.communicate(timeout=30)
    assert worker_info(out2)["random"] != info["random"], "each worker gets fresh RNG seeds"


def test_module_targets_run_as_main(zygote, worker_script, tmp_path) -> None:
    path, _ = zygote
    shim = run_shim(path, ["-m", "worker_probe", "x"], worker_script.parent)
    out, err = shim.communicate(timeout=30)
    assert shim.returncode == 3, err
    info = worker_info(out)
    assert info["argv"][1:] == ["x"] and info["argv"][0].endswith("worker_probe.py")
    assert info["path0"] == str(worker_script.parent)


def test_exceptions_threads_and_atexit_behave_as_in_python(zygote, worker_script, tmp_path) -> None:
    path, _ = zygote
    failing = run_shim(path, [str(worker_script), "raise"], tmp_path)
    _, err = failing.communicate(timeout=30)
    assert failing.returncode == 1
    assert "RuntimeError: boom from the worker" in err
    assert "zygote.py" not in err and "runpy" not in err, err
    threaded = run_shim(path, [str(worker_script), "thread"], tmp_path)
    out, err = threaded.communicate(timeout=30)
    assert threaded.returncode == 0, err
    assert out.splitlines()[1:] == ["thread done", "atexit ran"]


def alive(pid: int) -> bool:
    return is_running(pid)


def test_signals_reach_the_worker_and_its_death_reaches_torchrun(
    zygote, worker_script, tmp_path
) -> None:
    path, _ = zygote
    shim = run_shim(path, [str(worker_script), "sleep"], tmp_path)
    pid = worker_info(shim.stdout.readline())["pid"]
    os.killpg(shim.pid, signal.SIGTERM)  # what torchrun's SubprocessHandler.close does
    assert shim.wait(30) == -signal.SIGTERM
    wait_for(lambda: not alive(pid), 10, what="the worker to end")


def test_a_killed_shim_takes_its_worker_with_it(zygote, worker_script, tmp_path) -> None:
    path, _ = zygote
    shim = run_shim(path, [str(worker_script), "sleep"], tmp_path)
    pid = worker_info(shim.stdout.readline())["pid"]
    os.killpg(shim.pid, signal.SIGKILL)  # torchrun's escalation after its close timeout
    shim.wait(30)
    wait_for(lambda: not alive(pid), 10, what="the zygote to kill the orphaned worker")


def test_workers_die_with_the_zygote(zygote, worker_script, tmp_path) -> None:
    path, process = zygote
    shim = run_shim(path, [str(worker_script), "sleep"], tmp_path)
    pid = worker_info(shim.stdout.readline())["pid"]
    os.killpg(process.pid, signal.SIGKILL)  # the agent and its zygote gone at once
    assert shim.wait(30) != 0
    wait_for(lambda: not alive(pid), 10, what="the worker to die with its zygote")


def test_without_a_zygote_the_worker_starts_cold(worker_script, tmp_path) -> None:
    shim = run_shim(str(tmp_path / "no-such.sock"), [str(worker_script), "a"], tmp_path)
    out, err = shim.communicate(timeout=60)
    assert shim.returncode == 3, err
    info = worker_info(out)
    assert info["warm"] is None and info["pid"] == shim.pid, "exec'd in place of the shim"
    assert "starting the worker cold" in err


def test_the_zygote_refuses_what_it_cannot_reproduce(zygote, tmp_path) -> None:
    from kfp_elastic.rendezvous.zygote_shim import recv_message, send_message

    path, _ = zygote
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        send_message(sock, {"argv": ["/bin/sh", "-c", "true"], "env": {}, "cwd": "/"}, [0, 1, 2])
        reply, _ = recv_message(sock)
    assert reply is not None and "not the zygote's" in reply["error"]
    started = time.monotonic()
    shim = run_shim(path, ["-X", "dev", "-c", "pass"], tmp_path)  # not warm-startable: cold
    assert shim.wait(60) == 0 and time.monotonic() - started < 60
