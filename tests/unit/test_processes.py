"""``kfp_elastic.processes``: the one reader of ``/proc``, against real processes."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator

import pytest

from kfp_elastic import processes
from tests.helpers import wait_for

TAG = "KFP_ELASTIC_TEST_PROCESS_TAG"
# A child that starts a grandchild in a session of its own (as torchrun starts its workers),
# prints the grandchild's pid and sleeps.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""


@pytest.fixture
def tagged() -> Iterator[tuple[str, subprocess.Popen[str], int]]:
    """(tag value, a child with the tag, its grandchild's pid); both killed at the end."""
    value = uuid.uuid4().hex
    child = subprocess.Popen(
        [sys.executable, "-c", PARENT],
        env={**os.environ, TAG: value},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    grandchild = int(child.stdout.readline())
    try:
        # Printed right after its fork: while it execs, /proc shows no environment for a moment.
        wait_for(lambda: processes.has_env(grandchild, TAG, value), 10, what="the grandchild")
        yield value, child, grandchild
    finally:
        for pid in processes.pids_with_env(TAG, value) | {child.pid}:
            processes.signal_quietly(pid, signal.SIGKILL)
        child.wait(10)


def test_sigkill_tagged_leaves_no_tagged_process_in_any_session(tagged) -> None:
    value, child, grandchild = tagged
    processes.sigkill_tagged(TAG, value)
    child.wait(10)  # reaped: no longer running
    wait_for(lambda: not processes.is_running(grandchild), 10, what="the grandchild gone")
    assert processes.pids_with_env(TAG, value) == set()


def test_a_tag_finds_the_whole_tree_also_in_other_sessions(tagged) -> None:
    value, child, grandchild = tagged
    assert processes.pids_with_env(TAG, value) == {child.pid, grandchild}
    assert processes.has_env(grandchild, TAG, value)
    assert not processes.has_env(grandchild, TAG, "another-value")
    assert processes.descendants(child.pid) == {grandchild}
    assert processes.parent(grandchild) == child.pid
    assert processes.parent(child.pid) == os.getpid()
    assert processes.pids_with_env(TAG, uuid.uuid4().hex) == set()


def test_an_ended_child_is_a_zombie_until_reaped_then_gone(tagged) -> None:
    value, child, grandchild = tagged
    assert processes.is_running(child.pid) and processes.state(child.pid) in "RSD"
    child.kill()
    wait_for(lambda: processes.state(child.pid) == "Z", 10, what="the child to end")
    assert not processes.is_running(child.pid)
    assert not processes.has_env(child.pid, TAG, value)  # ended: no longer the tagged process
    assert child.pid not in processes.pids_with_env(TAG, value)
    assert grandchild in processes.pids_with_env(TAG, value)  # the orphan is still found
    child.wait(10)
    assert processes.state(child.pid) == "X"
    assert processes.parent(child.pid) is None
    assert processes.stat_fields(child.pid) is None
    assert math.isnan(processes.seconds_since_start(child.pid))


def test_sigkill_process_tree_ends_every_process_below(tagged) -> None:
    value, child, grandchild = tagged
    processes.sigkill_process_tree(child.pid)
    child.wait(10)
    wait_for(lambda: not processes.is_running(grandchild), 10, what="the grandchild to end")
    assert processes.pids_with_env(TAG, value) == set()


def test_age_and_cpu_time_of_this_process() -> None:
    assert processes.seconds_since_start(os.getpid()) >= 0
    assert processes.cpu_seconds({os.getpid()}) > 0
    assert processes.cpu_seconds({os.getpid(), 2**22 + 1}) >= 0  # a pid that is gone counts 0
    assert os.getpid() not in processes.pids_with_env("PATH", os.environ["PATH"])


def test_this_process_fds_threads_and_memory_map(tmp_path) -> None:
    with open(tmp_path / "file", "w") as file:
        fd = file.fileno()
        assert fd in processes.own_open_fds()
    assert fd not in processes.own_open_fds()
    started = threading.Event()
    stop = threading.Event()

    def run() -> None:
        started.set()
        stop.wait(10)

    thread = threading.Thread(target=run)
    before = len(processes.own_thread_names())
    thread.start()
    started.wait(10)
    try:
        assert len(processes.own_thread_names()) == before + 1
    finally:
        stop.set()
        thread.join(10)
    assert "libc" in processes.own_memory_map()
