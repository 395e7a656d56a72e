"""Do not spend one of ``--max-restarts`` on a worker that failed because a peer node died.

When a node dies, the survivors' workers often fail first (gloo sees the peer's sockets reset)
and torchrun's agent then counts a failure: it spends one of ``--max-restarts`` (with torchrun's
default of 0 the surviving agent gives up, so one lost node takes a second one with it). A
membership change is not the survivors' failure, and torchrun already restarts for free when
``num_nodes_waiting() > 0``. So the agent's ``_monitor_workers`` is wrapped: a failed result is
reported as healthy when the handler sees the round's membership change within
``peer_failure_grace`` seconds; the agent then asks ``num_nodes_waiting()`` and restarts its
workers without spending a restart. A failure with no membership change counts as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger(__name__)


class MembershipWatcher(Protocol):
    def wait_for_membership_change(self, timeout: float) -> bool: ...


_install_lock = threading.Lock()
_installed = False


def _describe(failures: dict[int, Any]) -> str:
    return (
        ", ".join(
            f"local_rank={rank} exitcode={getattr(failure, 'exitcode', '?')}"
            for rank, failure in sorted(failures.items())
        )
        or "no failure details"
    )


def _wrap(original: Callable[..., Any], grace_s: float) -> Callable[..., Any]:
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

    def monitor_forgiving_peer_loss(self: Any, worker_group: Any) -> Any:
        result = original(self, worker_group)
        if result.state not in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            return result
        handler = getattr(worker_group.spec, "rdzv_handler", None)
        wait = getattr(handler, "wait_for_membership_change", None)
        if wait is None or not wait(grace_s):
            return result
        log.info(
            "worker failure follows a membership change; restarting without spending a restart: %s",
            _describe(result.failures),
        )
        return RunResult(state=WorkerState.HEALTHY)

    monitor_forgiving_peer_loss.__wrapped__ = original  # type: ignore[attr-defined]
    return monitor_forgiving_peer_loss


def install(grace_s: float) -> None:
    """Wrap torchrun's ``LocalElasticAgent._monitor_workers`` once per process."""
    global _installed
    with _install_lock:
        if _installed:
            return
        _installed = True
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

        LocalElasticAgent._monitor_workers = _wrap(  # type: ignore[method-assign]
            LocalElasticAgent._monitor_workers, grace_s
        )
