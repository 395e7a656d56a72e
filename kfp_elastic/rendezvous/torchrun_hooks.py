"""Wrapping a method of torchrun's agent, once per process.

The handler changes a few of torchrun's agent methods in the agent process
(``peer_failures.py``: ``_monitor_workers``; ``broken_round.py``: ``_rendezvous``). Every handler
a process creates asks again; the method is wrapped the first time only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

_lock = threading.Lock()
_MARK = "_kfp_elastic_wrapper"  # the wrapper factory that made a method


def wrap_once(
    owner: Any, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    """Replace ``owner.name`` by ``wrap(owner.name)`` unless ``wrap`` made it already."""
    with _lock:
        current = getattr(owner, name)
        if getattr(current, _MARK, None) is wrap:
            return
        wrapped = wrap(current)
        setattr(wrapped, _MARK, wrap)
        setattr(owner, name, wrapped)
