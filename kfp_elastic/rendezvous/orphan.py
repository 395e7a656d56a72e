"""No orphans: a worker whose run has had no master for ``orphan_timeout`` seconds stops itself.

Worker pods carry no ownerReference, on purpose: a KFP retry's new master adopts the running
workers instead of starting them again. The master and the pipeline's exit handler
(``stop_workers``) delete them at the end; a run terminated in the KFP UI, or a pipeline whose
exit handler never runs, would leave them holding their GPUs forever. So each agent of a job a
master started (``--rdzv-conf orphan_timeout=S``, from the job's ``orphan_timeout_s``) watches
the master's liveness record: the leader key ``{run}/master/leader``
(``kfp_elastic.etcd.keys.MasterKeys.leader``), bound to the master's lease and kept alive by it
(``master/state.py``). The key vanishes ``leader_ttl_s`` after the master died, at once when it
stepped down; a new master (a KFP retry) writes it again when it takes the leadership over.

The agent reads the key every :func:`poll_interval`. Once it has been absent for S seconds
(:func:`master_gone_since`, :func:`orphaned`) the agent logs ``no master for N s: stopping``
and stops the way a SIGTERM stops it (a preemption, a master stepping down): it leaves the
rendezvous, torchrun sends its workers SIGTERM, they agree on a step, commit a snapshot (no step
lost) and exit; then the agent exits :data:`ORPHANED_EXIT_CODE`, so its pod ends Failed with
that code. A later master (a retry) counts such a worker as a disruption, not a failure
(``master/pod_status.py``, ``master/local_launcher.py``), starts new ones and they resume from
the snapshot. A master that comes back within S seconds keeps the workers (adoption unchanged).

An etcd that does not answer is no evidence either way: the clock neither starts nor resets,
and the stop waits for an answer that still finds no master.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the agent imports this module before torch: no gRPC on its start path
    from pyetcd.client import MultiEndpointEtcd3Client

log = logging.getLogger(__name__)

#: The exit code of an agent (a worker pod's container) that stopped because its run had no
#: master: sysexits' EX_TEMPFAIL ("try again later": a retry of the run resumes it).
ORPHANED_EXIT_CODE = 75
#: Reads of the leader key per ``orphan_timeout``, within [MIN_POLL_S, MAX_POLL_S] seconds apart:
#: a stop comes at most a tenth of the timeout late, and a 5-minute timeout costs one small
#: read per agent every 10 s.
POLLS_PER_TIMEOUT = 10
MIN_POLL_S = 0.2
MAX_POLL_S = 10.0


def poll_interval(timeout: float) -> float:
    """Seconds between two reads of the master's leader key."""
    return min(MAX_POLL_S, max(MIN_POLL_S, timeout / POLLS_PER_TIMEOUT))


def master_gone_since(present: bool | None, gone_since: float | None, now: float) -> float | None:
    """Since when the master has been gone, after one look at its leader key: ``present`` (True:
    the key is there, False: it is not, None: etcd did not answer) at time ``now``; None while
    a master is there."""
    if present is None:
        return gone_since
    if present:
        return None
    return now if gone_since is None else gone_since


def orphaned(gone_since: float | None, now: float, timeout: float) -> bool:
    """Whether a worker whose master has been gone since ``gone_since`` (None: it is there)
    must stop at ``now``."""
    return gone_since is not None and now - gone_since >= timeout


_stopped_after: float | None = None


def stopped_after() -> float | None:
    """Seconds without a master after which this process stopped itself (None: it did not)."""
    return _stopped_after


def stop_agent(gone_s: float) -> None:
    """Stop this agent as a SIGTERM from the kubelet would (``rendezvous/leave.py``, torchrun's
    handler: leave the rendezvous, SIGTERM the workers, which snapshot and exit);
    ``rendezvous/agent.py`` then exits ``ORPHANED_EXIT_CODE``."""
    global _stopped_after
    _stopped_after = gone_s
    os.kill(os.getpid(), signal.SIGTERM)


class MasterWatch:
    """A daemon thread that reads ``leader_key`` every ``poll_interval(timeout)`` and calls
    ``on_orphaned(seconds without a master)`` once, when :func:`orphaned` says so."""

    def __init__(
        self,
        client: MultiEndpointEtcd3Client,
        leader_key: str,
        timeout: float,
        on_orphaned: Callable[[float], None] = stop_agent,
        *,
        where: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``where``: names this node and run in the log lines."""
        self._client = client
        self._key = leader_key
        self.timeout = timeout
        self._on_orphaned = on_orphaned
        self._where = where
        self._clock = clock
        self.gone_since: float | None = None
        self.fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="master-watch")

    def start(self) -> MasterWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _present(self) -> bool | None:
        try:
            return self._client.get(self._key)[0] is not None
        except Exception as error:  # noqa: BLE001 - etcd away or the client closed: unknown
            log.debug("master watch: leader key not read %s error=%r", self._where, error)
            return None

    def check(self) -> bool:
        """One look at the leader key; True when it called ``on_orphaned`` (once only)."""
        if self.fired:
            return False
        present = self._present()
        now = self._clock()
        before = self.gone_since
        self.gone_since = master_gone_since(present, before, now)
        if before is None and self.gone_since is not None:
            log.warning(
                "no master (leader key absent); stopping in %gs unless one comes %s",
                self.timeout,
                self._where,
            )
        elif before is not None and self.gone_since is None:
            log.info("a master is back after %.0fs %s", now - before, self._where)
        # Only on an answer: a stop commits a snapshot, which needs etcd too.
        if present is not False or not orphaned(self.gone_since, now, self.timeout):
            return False
        assert self.gone_since is not None
        gone_s = now - self.gone_since
        self.fired = True
        # The line a user finds in the pod's log (docs/troubleshooting.md).
        log.error("no master for %.0f s: stopping %s", gone_s, self._where)
        self._on_orphaned(gone_s)
        return True

    def _run(self) -> None:
        interval = poll_interval(self.timeout)
        while not self._stop.is_set():
            if self.check():
                return
            self._stop.wait(interval)
