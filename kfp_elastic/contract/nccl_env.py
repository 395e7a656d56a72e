"""What a NCCL worker process's environment must hold for its abort (``worker/device.py``'s
``StallAbort``) to write a rescue: ``TORCH_NCCL_ASYNC_ERROR_HANDLING``. The agent's rendezvous
handler sets it for every worker it starts (a user's own script makes its process group itself),
and the built-in runtime again before it makes its own (pure but for ``os.environ``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping

# The worker's logger: a user's script that configured no logging shows its warning
# (``worker/elastic.py``), as it shows the rest of the worker's.
log = logging.getLogger("kfp_elastic.worker")

# torch 2.13, ProcessGroupNCCL.hpp, what its watchdog does when a collective fails or times out:
# 0 nothing (a collective whose peer hangs alive stays blocked for good), 1 and 3 (3 is the
# default) tear the process down before any rescue is written, 2 (CleanUpOnly) aborts the
# communicators and lets the blocked call raise. ``_abort_process_group`` advises 0 so that the
# watchdog does not abort for us; 2 is chosen because its abort is the same
# ``ProcessGroupNCCL::abort`` and it keeps the collective timeout effective where neither
# SIGTERM nor a broken round comes. Read when the process group is created: set by the agent
# for its workers (a user's script creates its own group) and again by the runtime.
NCCL_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_ERROR_HANDLING = "2"


def nccl_error_handling_override(environ: Mapping[str, str]) -> str | None:
    """The warning to log when ``environ`` holds another value of
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` than the one the abort needs (None: unset or the same).
    The value is overridden, not refused: a pod template's generic NCCL settings must not stop
    a job, and no other value gets the rescue written."""
    current = environ.get(NCCL_ERROR_HANDLING_ENV)
    if current is None or current.strip() == NCCL_ERROR_HANDLING:
        return None
    return (
        f"{NCCL_ERROR_HANDLING_ENV}={current!r} overridden with {NCCL_ERROR_HANDLING}: a worker "
        "whose peer died must abort its NCCL communicators and write its rescue "
        "(0 leaves a hung collective blocked, 1 and 3 end the process first)"
    )


def nccl_error_handling_not_set(environ: Mapping[str, str]) -> str | None:
    """For a NCCL group someone else made (a user's script, after reading ``environ``): the
    warning when it was made without the value the abort needs (None: it was)."""
    current = environ.get(NCCL_ERROR_HANDLING_ENV)
    if current is not None and current.strip() == NCCL_ERROR_HANDLING:
        return None
    return (
        f"{NCCL_ERROR_HANDLING_ENV}={current!r} when the process group was made: set it to "
        f"{NCCL_ERROR_HANDLING} before dist.init_process_group (the elastic-etcd rendezvous "
        "does for its workers), else a peer's loss may end this process before its rescue"
    )


def set_nccl_error_handling(environ: MutableMapping[str, str] | None = None) -> None:
    """Set ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` for process groups made after this (in this
    process and its children), logging a value it replaces."""
    environ = os.environ if environ is None else environ
    warning = nccl_error_handling_override(environ)
    if warning is not None:
        log.warning("%s", warning)
    environ[NCCL_ERROR_HANDLING_ENV] = NCCL_ERROR_HANDLING
