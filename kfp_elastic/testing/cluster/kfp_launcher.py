"""Stand-ins for the two programs a KFP v2 task pod runs before the compiled command, as far as
process structure and signals go: what a pod deletion does to the command they run.

On the KFP v2 backend (Argo Workflows) a task pod's main container runs

    /var/run/argo/argoexec emissary -- /kfp-launcher/launch FLAGS -- sh -ec '...' ARGS

- ``emissary`` (argo-workflows ``cmd/argoexec/commands/emissary.go``, ``signal.go``,
  ``workflow/executor/osspecific``) is PID 1. It starts the launcher in a process group of its
  own (``Setpgid``), forwards every signal it gets (SIGTERM included) to that process group
  (``Kill(-pgid)``), reaps children with ``Wait4(-1, WNOHANG)`` once a second and, when the
  launcher is reaped, exits with its code (128 + N when killed by signal N). PID 1 exiting ends
  the container's PID namespace: the kernel SIGKILLs every process left in it. Here the
  emissary also SIGKILLs the launcher's process group and exits when its parent (the test
  cluster's kubelet) is gone: a process that died without stopping its pods (SIGKILL, a test's
  timeout) leaves none of them running, as a node that goes down takes its containers with it.
- ``launch`` (kubeflow/pipelines ``backend/src/v2/component/launcher_v2.go``: ``exec.Command``,
  ``command.Run()``; no ``signal.Notify`` anywhere in ``backend/src/v2``) runs the command as a
  plain child (same process group) and forwards nothing; a Go program that does not handle
  SIGTERM exits on it, so the launcher dies at once. A failed command makes it exit 1
  (``glog.Exit``).

So a pod deletion reaches the compiled command's processes (``sh`` and the Python executor with
the master) through the emissary's process-group signal, and the container ends as soon as the
emissary notices the launcher is gone: between 0 and ``--poll-s`` (1 s) after the SIGTERM, not
after ``terminationGracePeriodSeconds``.

    python -m kfp_elastic.testing.cluster.kfp_launcher emissary [--poll-s S] -- \\
        python -m kfp_elastic.testing.cluster.kfp_launcher launch -- COMMAND...

Standard library only (it starts in milliseconds). Not modelled: anything else the two do
(artifacts, metadata, caching, output parameters).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time

MODULE = "kfp_elastic.testing.cluster.kfp_launcher"
ARGO_WAIT_POLL_S = 1.0  # the emissary's Wait4 loop sleeps a second between reaps
# The emissary forwards every signal it gets but SIGCHLD and SIGURG; these are the ones sent to
# a container from outside (the runtime's SIGTERM, kubectl exec kill, ...).
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
_PR_SET_CHILD_SUBREAPER = 36


def wrap(
    command: list[str], python: str = "python3", poll_s: float = ARGO_WAIT_POLL_S
) -> list[str]:
    """``command`` as the task pod's container runs it: under the emissary and the launcher."""
    module = [python, "-m", MODULE]
    return [*module, "emissary", f"--poll-s={poll_s}", "--", *module, "launch", "--", *command]


def exit_status(status: int) -> int:
    """A ``waitpid`` status as the emissary reports it: the exit code, or 128 + signal."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def emissary(command: list[str], poll_s: float) -> int:
    # PID 1 of a container reaps every orphan of the container; a subreaper does here.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    started: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if not started:
            return  # nothing to forward to yet
        try:
            os.killpg(os.getpgid(started[0]), signum)
        except ProcessLookupError:  # the group is gone: Kill falls back to the pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(started[0], signum)

    for sig in FORWARDED:  # before the child starts, as signal.Notify is
        signal.signal(sig, forward)
    runtime = os.getppid()  # the kubelet: a container does not outlive its node
    started.append(subprocess.Popen(command, process_group=0).pid)
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return 1
        if pid == started[0]:
            return exit_status(status)
        if os.getppid() != runtime:  # the test cluster's process died without stopping pods
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpgid(started[0]), signal.SIGKILL)
            return 128 + signal.SIGKILL
        time.sleep(poll_s)


def launch(command: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)  # a Go program without signal.Notify dies on these
    return 0 if subprocess.run(command).returncode == 0 else 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kfp_launcher", description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=("emissary", "launch"))
    parser.add_argument("--poll-s", type=float, default=ARGO_WAIT_POLL_S)
    if "--" not in argv:
        parser.error("expected -- COMMAND...")
    cut = argv.index("--")
    args, command = parser.parse_args(argv[:cut]), argv[cut + 1 :]
    if not command:
        parser.error("expected -- COMMAND...")
    return emissary(command, args.poll_s) if args.role == "emissary" else launch(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
