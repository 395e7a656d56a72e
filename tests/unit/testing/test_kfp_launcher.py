"""The stand-ins of Argo's emissary and KFP's launcher (testing/cluster/kfp_launcher.py): a
SIGTERM to PID 1 reaches the command's processes through the launcher's process group, the
launcher dies on it without waiting for them, and PID 1 then exits with the launcher's code."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from kfp_elastic.processes import is_running
from kfp_elastic.testing.cluster import kfp_launcher
from tests.helpers import REPO_ROOT, wait_for

# The compiled command's shape: sh runs a Python process that records a SIGTERM and then lingers
# (a master stepping down), so only the launcher's death can end the chain early.
GRANDCHILD = """
import os, signal, sys, time
def on_term(*_):
    open(sys.argv[1], 'w').write('sigterm')
signal.signal(signal.SIGTERM, on_term)
open(sys.argv[1] + '.ready', 'w').write(str(os.getpid()))
time.sleep(30)
"""


def test_sigterm_to_pid_1_reaches_the_command_and_ends_the_chain_without_waiting(
    tmp_path: Path,
) -> None:
    flag = tmp_path / "flag"
    command = ["sh", "-ec", f'{sys.executable} -c "$0" {flag}', GRANDCHILD]
    pid_1 = subprocess.Popen(
        kfp_launcher.wrap(command, python=sys.executable, poll_s=0.05),
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        start_new_session=True,
    )
    try:
        wait_for(
            lambda: Path(f"{flag}.ready").read_text() if Path(f"{flag}.ready").exists() else "",
            20,
            0.05,
            "the command started",
        )
        pid_1.send_signal(signal.SIGTERM)  # what the container runtime does, to PID 1 only
        assert pid_1.wait(timeout=20) == 128 + signal.SIGTERM  # the launcher died of it
        wait_for(flag.exists, 10, 0.05, "the command's process got SIGTERM")
    finally:
        ready = Path(f"{flag}.ready")
        if ready.exists() and ready.read_text():  # the lingering process: a kubelet kills it
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(ready.read_text()), signal.SIGKILL)
        pid_1.kill()
        pid_1.wait()


def test_the_launcher_reports_a_failed_command_as_1() -> None:
    code = subprocess.run(
        kfp_launcher.wrap(["sh", "-c", "exit 7"], python=sys.executable, poll_s=0.05),
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        timeout=30,
    ).returncode
    assert code == 1


# A kubelet stand-in: starts the pod's PID 1 in a session of its own, says its pid, lingers.
KUBELET = """
import subprocess, sys, time
pid_1 = subprocess.Popen(sys.argv[1:], start_new_session=True)
print(pid_1.pid, flush=True)
time.sleep(60)
"""


def test_a_pod_does_not_outlive_the_process_that_runs_the_test_cluster(tmp_path: Path) -> None:
    flag = tmp_path / "flag"
    command = ["sh", "-ec", f'{sys.executable} -c "$0" {flag}', GRANDCHILD]
    kubelet = subprocess.Popen(
        [sys.executable, "-c", KUBELET, *kfp_launcher.wrap(command, sys.executable, 0.05)],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    ready = Path(f"{flag}.ready")
    try:
        assert kubelet.stdout is not None
        pid_1 = int(kubelet.stdout.readline())
        wait_for(lambda: ready.exists() and ready.read_text(), 20, 0.05, "the command started")
        command_pid = int(ready.read_text())
        kubelet.kill()  # dies without stopping its pods
        kubelet.wait()

        def gone(pid: int) -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            return False

        wait_for(lambda: gone(command_pid), 10, 0.05, "the command killed with its node")
        wait_for(lambda: gone(pid_1) or _reap(pid_1), 10, 0.05, "PID 1 gone")
    finally:
        kubelet.kill()
        kubelet.wait()
        if ready.exists() and ready.read_text():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(ready.read_text()), signal.SIGKILL)


def _reap(pid: int) -> bool:
    """PID 1 is reparented to init (or this test process, a subreaper): a zombie counts as gone."""
    with contextlib.suppress(ChildProcessError, OSError):
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    return not is_running(pid)
