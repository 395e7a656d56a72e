"""Leave at once when the agent is told to stop (SIGTERM is a preemption notice on Kubernetes).

torchrun turns SIGTERM/SIGINT/SIGHUP/SIGQUIT into ``SignalException`` through
``torch.distributed.elastic.multiprocessing.api._terminate_process_handler``, installed each time
workers start. We wrap that function, and install the wrapper right away for the time before the
first workers start, so every live handler revokes its lease before the agent stops its workers:
peers see the node gone within milliseconds instead of a lease TTL later. The leave runs on a
thread of its own, waited for at most ``LEAVE_WAIT_S``: a signal handler runs on top of
whatever the main thread was doing, which may hold a lock the leave needs.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Protocol

from kfp_elastic import slow_stop

log = logging.getLogger(__name__)

_LEAVE_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
# How long the signal handler waits for the leave before torchrun stops the workers anyway. The
# leave runs on a thread of its own: the code the signal interrupted (on the main thread) may
# hold a lock the leave needs, and it lets go only once the handler has raised; the leave then
# ends while the workers stop. A leave takes milliseconds otherwise.
LEAVE_WAIT_S = 2.0


class Leaver(Protocol):
    def leave(self, reason: str) -> None: ...


_leavers: weakref.WeakSet[Leaver] = weakref.WeakSet()
_install_lock = threading.Lock()
_installed = False


def leave_all(reason: str) -> None:
    for leaver in list(_leavers):
        try:
            leaver.leave(reason)
        except Exception:  # noqa: BLE001 - leaving must never stop the shutdown itself
            log.exception("graceful leave failed reason=%s", reason)


def _wrap(original: Callable[[int, FrameType | None], None]) -> Callable[..., None]:
    def leave_then_terminate(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        slow_stop.arm(f"agent signal={name}")
        leaving = threading.Thread(
            target=leave_all, args=(f"signal {name}",), name="leave", daemon=True
        )
        leaving.start()
        leaving.join(LEAVE_WAIT_S)
        if leaving.is_alive():
            log.warning(
                "leave not done after %.1f s signal=%s: stopping the workers meanwhile",
                LEAVE_WAIT_S,
                name,
            )
        original(signum, frame)

    leave_then_terminate.__wrapped__ = original  # type: ignore[attr-defined]
    return leave_then_terminate


def register(leaver: Leaver) -> None:
    """Make ``leaver.leave()`` run on the agent's termination signals (idempotent)."""
    global _installed
    _leavers.add(leaver)
    with _install_lock:
        if _installed:
            return
        _installed = True
        from torch.distributed.elastic.multiprocessing import api as mp_api

        wrapped = _wrap(mp_api._terminate_process_handler)
        mp_api._terminate_process_handler = wrapped
        if threading.current_thread() is not threading.main_thread():
            return
        for name in _LEAVE_SIGNALS:
            signum = getattr(signal, name, None)
            if signum is None:
                continue
            with contextlib.suppress(ValueError, OSError):
                if signal.getsignal(signum) == signal.SIG_DFL:
                    signal.signal(signum, wrapped)
