"""When a worker failure restarts for free, counts, or ends the agent: pure rules + torch glue.

When a node dies, the survivors' workers often fail first (gloo sees the peer's sockets reset)
and torchrun's agent then counts a failure: it spends one of ``--max-restarts`` (with torchrun's
default of 0 the surviving agent gives up, so one lost node takes a second one with it). A
peer's death is not the survivors' failure. So the agent's ``_monitor_workers`` is wrapped and
every failed result goes through :meth:`ElasticEtcdRendezvousHandler.on_worker_failure`, which
gathers the facts (what happened to the round's membership within ``peer_failure_grace``
seconds, what the failure looked like) and asks :class:`RestartPolicy`:

- **free**: a participant of the round really died or left (its lease is gone or was replaced),
  at most ``max_free_restarts`` times per ``free_restart_window`` seconds. The result is
  reported as healthy; the agent sees ``num_nodes_waiting() > 0`` and restarts its workers
  without spending a restart.
- **count**: anything else, in particular a round change that only re-rounds after another
  node's (or our own) worker failure: that is what a failure that repeats at every start looks
  like, and treating it as free made such a job restart forever.
- **give up**: the workers failed the same way (same exit codes and error line)
  ``max_repeated_failures`` times in a row: the agent stops restarting and fails, whatever is
  left of ``--max-restarts``; the master replaces the worker (a new pod or process tree).

A counted failure (or a give-up) then goes to the job's one failure budget
(``contract/failure_budget.py``: counted once per round in etcd, whichever agent reports it)
and :func:`after_budget` has the last word: a failure that spends the budget, or a fatal one
(``NonFiniteLoss``), makes the agent give up at once instead of restarting in place. The
agent's last error (exception line and traceback tail, from torchrun's error file) also goes to
``RunKeys.worker_error``: it tells the master that this worker's failures are counted already.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from kfp_elastic.contract.failure_budget import FailureBudget, is_fatal
from kfp_elastic.rendezvous.round_formation import NodeRecord, RoundRecord, is_waiting
from kfp_elastic.rendezvous.torchrun_hooks import wrap_once

log = logging.getLogger(__name__)

# What torchrun says when the worker wrote no error file: carries nothing to compare.
_NO_ERROR_FILE = "To enable traceback see"
# What a rank's error says when it is its peer's failure seen through a collective (gloo's
# transport, NCCL's abort), not its own: the other account of a round's failure is better.
PEER_ERROR_MARKS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "pair closure",
    "DistNetworkError",
    "NCCL communicator was aborted",
)
# Bounds of the error text carried through etcd to the master, the component and the report.
ERROR_TEXT_MAX_CHARS = 1500
TRACEBACK_TAIL_LINES = 6


class Verdict(str, Enum):
    FREE = "free"  # restart without spending one of --max-restarts
    COUNT = "count"  # spend one, as torch does
    GIVE_UP = "give_up"  # the same failure again: the agent stops restarting and fails


@dataclass(frozen=True)
class MembershipChange:
    """How the round a node runs in changed, from that node's view of etcd."""

    lost: tuple[str, ...] = ()  # participants whose lease is gone or replaced: died or left
    restarting: tuple[str, ...] = ()  # participants waiting for a new round (a worker failed)
    newcomers: tuple[str, ...] = ()  # nodes that want to join

    @property
    def peer_lost(self) -> bool:
        return bool(self.lost)

    def describe(self) -> str:
        parts = [
            f"{name}={','.join(nodes)}"
            for name, nodes in (
                ("lost", self.lost),
                ("restarting", self.restarting),
                ("newcomers", self.newcomers),
            )
            if nodes
        ]
        return " ".join(parts) or "none"


def membership_change(
    live: Sequence[NodeRecord], current: RoundRecord, leases: Mapping[str, int]
) -> MembershipChange:
    """Compare the live records with round ``current``. ``leases``: each participant's lease as
    first seen in this round; a different lease now means it lost the old one (re-registered)."""
    by_id = {n.node_id: n for n in live}
    lost = tuple(
        p
        for p in current.participants
        if p not in by_id or (leases.get(p) and by_id[p].lease and by_id[p].lease != leases[p])
    )
    waiting = [n for n in live if is_waiting(n, current) and n.node_id not in lost]
    return MembershipChange(
        lost=lost,
        restarting=tuple(n.node_id for n in waiting if n.node_id in current.participants),
        newcomers=tuple(n.node_id for n in waiting if n.node_id not in current.participants),
    )


@dataclass
class RestartPolicy:
    """One agent's memory of its workers' failures; :meth:`decide` is its only rule."""

    max_free_restarts: int = 10
    free_restart_window_s: float = 300.0
    max_repeated_failures: int = 2  # 0: never give up early (torch's --max-restarts only)
    _free_at: deque[float] = field(default_factory=deque)
    _last_signature: str | None = None
    _repeats: int = 0
    _counted: int = 0

    @property
    def repeats(self) -> int:
        """How many counted failures in a row had the latest signature."""
        return self._repeats

    @property
    def counted(self) -> int:
        """Failures counted (not free) so far: the worker errors this agent saw."""
        return self._counted

    def decide(self, change: MembershipChange | None, signature: str, now: float) -> Verdict:
        """``change``: what happened to the round (None: nothing seen); ``signature``: what the
        failure looked like (:func:`failure_signature`); ``now``: the agent's monotonic time."""
        while self._free_at and self._free_at[0] <= now - self.free_restart_window_s:
            self._free_at.popleft()
        if change is not None and change.peer_lost:
            if len(self._free_at) < self.max_free_restarts:
                self._free_at.append(now)
                return Verdict.FREE
        self._counted += 1
        self._repeats = self._repeats + 1 if signature == self._last_signature else 1
        self._last_signature = signature
        if self.max_repeated_failures and self._repeats >= self.max_repeated_failures:
            return Verdict.GIVE_UP
        return Verdict.COUNT


def _headline(failure: Any) -> str:
    """The error line of one process failure ("" when the worker wrote no error file)."""
    message = getattr(failure, "message", "") or ""
    if isinstance(message, dict):
        message = message.get("message", "")
    message = str(message)
    if message.startswith(_NO_ERROR_FILE):
        return ""
    return message.strip().splitlines()[0] if message.strip() else ""


def failure_signature(failures: Mapping[int, Any]) -> str:
    """What a failure looked like, independent of pids, times and ranks: two starts that fail
    the same way have the same signature."""
    parts = sorted({f"{getattr(f, 'exitcode', '?')}:{_headline(f)}" for f in failures.values()})
    return "|".join(parts) or "no failure details"


def _traceback_tail(failure: Any) -> list[str]:
    data = getattr(failure, "error_file_data", None) or {}
    message = data.get("message") if isinstance(data, dict) else None
    stack = ""
    if isinstance(message, dict):
        stack = str((message.get("extraInfo") or {}).get("py_callstack", ""))
    lines = [line.strip() for line in stack.splitlines() if line.strip()]
    return lines[-TRACEBACK_TAIL_LINES:]


def root_cause(failures: Mapping[int, Any]) -> tuple[int, Any]:
    """The failed rank whose error it is: one that says what went wrong, then the earliest
    (torch's choice); ``(rank, failure)``. ``failures`` must not be empty."""
    return min(
        failures.items(),
        key=lambda item: (not _headline(item[1]), getattr(item[1], "timestamp", 0), item[0]),
    )


def is_fatal_failure(failures: Mapping[int, Any]) -> bool:
    """A rank failed with an error no restart can fix (``failure_budget.FATAL_ERRORS``)."""
    return any(is_fatal(_headline(f)) for f in failures.values())


def is_own_error(failures: Mapping[int, Any]) -> bool:
    """The root cause's error is the worker's own: it wrote an error file, and the error is not
    a peer's failure seen in a collective (:data:`PEER_ERROR_MARKS`)."""
    if not failures:
        return False
    headline = _headline(root_cause(failures)[1])
    return bool(headline) and not any(mark in headline for mark in PEER_ERROR_MARKS)


def is_peers_error(failures: Mapping[int, Any]) -> bool:
    """The root cause's error file holds a peer's failure seen in a collective
    (:data:`PEER_ERROR_MARKS`): the failing rank's agent has the error itself."""
    if not failures:
        return False
    headline = _headline(root_cause(failures)[1])
    return bool(headline) and any(mark in headline for mark in PEER_ERROR_MARKS)


def after_budget(verdict: Verdict, budget: FailureBudget) -> Verdict:
    """The agent's verdict once its counted failure is in the job's budget: a spent budget (too
    many failures, or a fatal one) ends the agent's restarts in place; a free failure is never
    counted, so the budget does not change it."""
    if verdict != Verdict.FREE and budget.spent() is not None:
        return Verdict.GIVE_UP
    return verdict


def error_text(failures: Mapping[int, Any]) -> str:
    """One line for people: the first failed rank's error and traceback tail, bounded."""
    if not failures:
        return "no failure details"
    rank, failure = root_cause(failures)
    code = getattr(failure, "exitcode", "?")
    headline = _headline(failure) or "the worker wrote no error file"
    text = f"{headline} (rank {rank}, exit code {code})"
    tail = _traceback_tail(failure)
    if tail:
        text += "; traceback tail: " + " | ".join(tail)
    if len(failures) > 1:
        text += f"; {len(failures)} ranks failed"
    if len(text) > ERROR_TEXT_MAX_CHARS:
        text = text[: ERROR_TEXT_MAX_CHARS // 3] + " ... " + text[-(ERROR_TEXT_MAX_CHARS // 2) :]
    return text


# -- torch glue -------------------------------------------------------------------------------
class FailureJudge(Protocol):
    def on_worker_failure(self, failures: Mapping[int, Any]) -> Verdict: ...


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

    def monitor_judging_failures(self: Any, worker_group: Any) -> Any:
        result = original(self, worker_group)
        if result.state not in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            return result
        handler = getattr(worker_group.spec, "rdzv_handler", None)
        judge = getattr(handler, "on_worker_failure", None)
        if judge is None:
            return result
        verdict = judge(result.failures)
        if verdict == Verdict.FREE:
            return RunResult(state=WorkerState.HEALTHY)
        if verdict == Verdict.GIVE_UP:
            self._remaining_restarts = 0  # the agent's loop stops the workers and fails
        return result

    monitor_judging_failures.__wrapped__ = original  # type: ignore[attr-defined]
    return monitor_judging_failures


def install() -> None:
    """Wrap torchrun's ``LocalElasticAgent._monitor_workers`` once per process."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    wrap_once(LocalElasticAgent, "_monitor_workers", _wrap)
