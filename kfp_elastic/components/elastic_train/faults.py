"""Fault injection for demos and tests: ``preempt:worker-1@step10,kill:worker-0@40s``.

Each comma-separated item is ``ACTION:worker-N@WHEN``:

- ``ACTION``: ``preempt`` (SIGTERM to the worker, SIGKILL after a grace period, like a kubelet
  evicting a pod; in a cluster: the pod is deleted with its grace period) or ``kill`` (SIGKILL of
  the whole process tree at once, like a node dying; in a cluster: deleted with grace 0).
- ``worker-N``: the worker slot N (0 .. max_workers-1), i.e. whichever attempt of it runs then.
- ``WHEN``: ``20s`` (or ``20``) seconds after the first rendezvous round formed (training
  started), or ``step10``: as soon as a commit at step >= 10 is on the timeline.

A fault whose slot has no running worker when it is due waits until one runs. Parsing and the
"is it due" decision are pure; :class:`FaultInjector` only adds the clock and the launcher.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kfp_elastic.master.timeline import END_KINDS, Committed, Event, RoundFormed

ACTIONS = ("preempt", "kill")
_ITEM = re.compile(
    r"(?P<action>[a-z]+):worker-(?P<index>\d+)@(?:(?P<step>step\d+)|"
    r"(?P<seconds>\d+(?:\.\d+)?)s?)"
)
SYNTAX = "ACTION:worker-N@WHEN with ACTION preempt|kill and WHEN like 20s or step10"


@dataclass(frozen=True)
class Fault:
    action: str
    worker_index: int
    at_s: float | None = None  # seconds after the first round formed
    at_step: int | None = None  # committed step
    text: str = ""


def parse_faults(spec: str, max_workers: int | None = None) -> tuple[Fault, ...]:
    """Parse ``spec``; ``ValueError`` names the bad item and the syntax."""
    faults = []
    for raw in (spec or "").split(","):
        item = raw.strip()
        if not item:
            continue
        match = _ITEM.fullmatch(item.lower())
        if match is None:
            raise ValueError(f"inject_faults: cannot parse {item!r}; expected {SYNTAX}")
        action, index = match["action"], int(match["index"])
        if action not in ACTIONS:
            raise ValueError(
                f"inject_faults: unknown action {action!r} in {item!r}; "
                f"use one of {', '.join(ACTIONS)}"
            )
        if max_workers is not None and index >= max_workers:
            raise ValueError(
                f"inject_faults: {item!r} names worker-{index} but workers are "
                f"worker-0 .. worker-{max_workers - 1} (max_workers={max_workers})"
            )
        if match["step"]:
            faults.append(Fault(action, index, at_step=int(match["step"][4:]), text=item))
        else:
            faults.append(Fault(action, index, at_s=float(match["seconds"]), text=item))
    return tuple(faults)


@dataclass(frozen=True)
class Progress:
    """What the timeline says so far (for deciding which faults are due)."""

    first_round_t: float | None = None  # master time of the first round formed
    step: int = 0  # last committed step
    finished: bool = False

    @classmethod
    def of(cls, events: Sequence[Event]) -> Progress:
        first = next((e.t for e in events if isinstance(e, RoundFormed)), None)
        steps = [e.step for e in events if isinstance(e, Committed)]
        finished = any(e.kind in END_KINDS for e in events)
        return cls(first, steps[-1] if steps else 0, finished)


def is_due(fault: Fault, progress: Progress, now: float) -> bool:
    """``now`` is on the master's clock (``time.time()``: the master runs in this process)."""
    if progress.finished or progress.first_round_t is None:
        return False
    if fault.at_step is not None:
        return progress.step >= fault.at_step
    return now - progress.first_round_t >= (fault.at_s or 0.0)


def pick_target(workers: Sequence[Any], index: int) -> str | None:
    """The running worker of slot ``index`` that nobody is stopping yet (``WorkerStatus``-like:
    name, worker_index, phase, reason, ended), or None."""
    for status in workers:
        phase = getattr(getattr(status, "phase", None), "value", getattr(status, "phase", None))
        taken = getattr(status, "reason", None) is not None  # already being stopped
        if (
            status.worker_index == index
            and phase == "Running"
            and not taken
            and not getattr(status, "ended", False)
        ):
            return status.name
    return None


@dataclass
class Injected:
    t: float
    fault: Fault
    target: str


@dataclass
class FaultInjector:
    """Calls ``act(action, worker_name)`` for each fault once it is due and its slot runs a
    worker; call :meth:`poll` with the timeline so far."""

    faults: Sequence[Fault]
    list_workers: Callable[[], Sequence[Any]]
    act: Callable[[str, str], None]
    clock: Callable[[], float] = time.time
    done: list[Injected] = field(default_factory=list)

    @property
    def pending(self) -> list[Fault]:
        fired = {id(i.fault) for i in self.done}
        return [f for f in self.faults if id(f) not in fired]

    def poll(self, events: Sequence[Event]) -> list[Injected]:
        progress = Progress.of(events)
        now = self.clock()
        due = [f for f in self.pending if is_due(f, progress, now)]
        if not due:
            return []
        workers = self.list_workers()
        fired = []
        for fault in due:
            target = pick_target(workers, fault.worker_index)
            if target is None:
                continue  # slot empty right now (being replaced): try again next poll
            self.act(fault.action, target)
            record = Injected(now, fault, target)
            self.done.append(record)
            fired.append(record)
        return fired
