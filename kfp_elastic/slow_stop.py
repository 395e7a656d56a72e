"""A stop that takes too long leaves its stacks in the log.

A preempted worker stops within about a second (the next sync, a committed snapshot), and
Kubernetes SIGKILLs whatever is left at the end of the grace period (30 s by default). A stop
that hangs until then holds a slot another pod waits for, and the SIGKILL erases why. Armed at
the SIGTERM, Python's ``faulthandler`` writes every thread's stack to stderr (the pod's log) if
the process is still alive ``STOP_STACKS_AFTER_S`` later: the log then says where it hung.
"""

from __future__ import annotations

import faulthandler
import logging
import sys

log = logging.getLogger("kfp_elastic.slow_stop")

# Well past a normal stop (a sync interval and a snapshot commit), well inside the default
# 30 s grace period, so that the stacks are written before the SIGKILL.
STOP_STACKS_AFTER_S = 10.0


def arm(what: str, after_s: float = STOP_STACKS_AFTER_S) -> None:
    """After a SIGTERM: write every thread's stack to stderr if this process still runs
    ``after_s`` seconds later (once; a later call re-arms). Safe in a signal handler."""
    try:
        faulthandler.dump_traceback_later(after_s, repeat=False, file=sys.stderr)
    except (ValueError, RuntimeError, OSError) as error:  # stderr closed or not a file
        log.warning("stop stacks not armed what=%s error=%r", what, error)


def disarm() -> None:
    """The stop finished in time (a process that goes on after an agreed stop, as a test)."""
    faulthandler.cancel_dump_traceback_later()
