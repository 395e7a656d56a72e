"""A stop that hangs past ``slow_stop``'s delay leaves every thread's stack in the log."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from tests.helpers import REPO_ROOT

HANGS_AFTER_SIGTERM = textwrap.dedent(
    """
    import signal, sys, threading, time
    from kfp_elastic import slow_stop

    def on_sigterm(signum, frame):
        slow_stop.arm("test", after_s=0.3)

    def hung_in_the_stop():
        time.sleep(1.5)

    signal.signal(signal.SIGTERM, on_sigterm)
    threading.Thread(target=lambda: time.sleep(5), name="side", daemon=True).start()
    print("ready", flush=True)
    sys.stdin.readline()  # the test sends SIGTERM, then closes stdin
    hung_in_the_stop()
    """
)


def test_a_hung_stop_writes_every_threads_stack_and_a_quick_one_nothing() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", HANGS_AFTER_SIGTERM],
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate("\n", timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert "Timeout (0:00:00" in stderr, stderr
    assert "hung_in_the_stop" in stderr and stderr.count("Thread 0x") >= 2, stderr

    quick = subprocess.run(
        [sys.executable, "-c", "from kfp_elastic import slow_stop; slow_stop.arm('t', 0.3)"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert quick.returncode == 0 and quick.stderr == "", quick.stderr
