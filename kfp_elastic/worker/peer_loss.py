"""A worker's own news of a lost peer: the watch that tells ``StallAbort`` its round broke.

A NCCL rank whose peer was SIGKILLed (or whose host vanished) sits in a collective until the
collective timeout. The rendezvous knows within milliseconds (``rendezvous/probe.py`` revokes
the dead node's lease, deleting its record), and the agent then stops its workers with SIGTERM,
which ``StallAbort`` already turns into an abort. This watch does not depend on the agent: each
NCCL worker process follows its run's rendezvous keys (``{run}/rdzv/``, one etcd watch, the
same ``WatchedPrefix`` the handler uses) and calls ``StallAbort.round_broken`` when the round it
was started in (``KFP_ELASTIC_RDZV_ROUND``, set by the agent's handler) loses a participant's
record, sees a participant restart, or is replaced by a newer round. Newcomers waiting to join
do not count: they break no collective, and the agreed stop handles them.

Both ways in use ``watch_stalls`` through the loop they share (``worker/loop.py``): the runtime
(``worker/runner.py``) and the script API (``worker/elastic.py``). Without the round variable (a
plain run, not under the ``elastic-etcd`` rendezvous) or without etcd, only SIGTERM starts the
abort.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Mapping

from pyetcd.client import MultiEndpointEtcd3Client

from kfp_elastic.etcd.client import connect
from kfp_elastic.etcd.keys import RunKeys
from kfp_elastic.etcd.settings import EtcdSettings
from kfp_elastic.etcd.watched_prefix import WatchedPrefix
from kfp_elastic.job_env import ROUND_ENV, rendezvous_round
from kfp_elastic.rendezvous.membership_view import MembershipView
from kfp_elastic.rendezvous.round_formation import NO_ROUND, NodeRecord, RoundRecord, is_waiting
from kfp_elastic.worker.device import StallAbort, abort_process_group

log = logging.getLogger(__name__)

# How long a worker waits for its first read of the round keys before it trains without them.
WATCH_START_TIMEOUT_S = 10.0


def broken_reason(
    own_round: int, latest: RoundRecord | None, live: Mapping[str, NodeRecord]
) -> str | None:
    """Why round ``own_round`` can no longer finish a collective (None: it can), given the
    latest round record and the live nodes' records by node id."""
    if latest is None:
        return f"round {own_round} record gone"
    if latest.number != own_round:
        return f"round {own_round} replaced by round {latest.number}"
    lost = [node for node in latest.participants if node not in live]
    if lost:
        return f"participant(s) lost: {', '.join(lost)}"
    restarted = [
        node for node in latest.participants if node in live and is_waiting(live[node], latest)
    ]
    if restarted:
        return f"participant(s) restarted: {', '.join(restarted)}"
    return None


class RoundWatch:
    """Calls ``on_broken(reason)`` once, on the watch thread, when round ``own_round`` of the
    run under ``run_prefix`` breaks (``broken_reason``)."""

    def __init__(
        self,
        client: MultiEndpointEtcd3Client,
        run_prefix: str,
        own_round: int,
        on_broken: Callable[[str], None],
    ) -> None:
        self._keys = RunKeys(run_prefix)
        self._own_round = own_round
        self._on_broken = on_broken
        self._reported = False
        self._lock = threading.Lock()
        self._cache = WatchedPrefix(client, self._keys.rdzv)
        self._cache.add_listener(self._check)
        self._started = False

    def start(self, timeout: float = WATCH_START_TIMEOUT_S) -> None:
        self._cache.start(timeout=timeout)
        self._started = True
        self._check()

    def close(self) -> None:
        self._cache.stop()

    def _check(self) -> None:
        if not self._started:
            return  # the first read is not complete yet
        with self._lock:
            if self._reported:
                return
            revision, entries = self._cache.snapshot()
            view = MembershipView(self._keys)  # the handler's parser of the same keys
            view.reset(revision, entries)
            latest = None if view.round == NO_ROUND else view.round
            reason = broken_reason(self._own_round, latest, view.records)
            if reason is None:
                return
            self._reported = True
        log.warning("round broken pid=%d round=%d %s", os.getpid(), self._own_round, reason)
        self._on_broken(reason)


def watch_stalls(
    backend: str,
    grace_s: float,
    etcd: EtcdSettings | None,
    run_id: str,
    environ: Mapping[str, str] | None = None,
    abort: Callable[[], None] = abort_process_group,
) -> StallAbort | None:
    """The stall abort of a worker process whose collectives use ``backend`` (NCCL only: Gloo's
    fail by themselves when a peer goes), told to stop by SIGTERM and, under the elastic-etcd
    rendezvous, by its round breaking. Call from the main thread, after the SIGTERM handler is
    installed; ``close()`` it when training ends."""
    if backend != "nccl":
        return None
    stall = StallAbort(grace_s, abort)
    environ = os.environ if environ is None else environ
    round_number = rendezvous_round(environ)
    if round_number is None or etcd is None:
        log.info("no round watch (%s unset or no etcd): the abort waits for SIGTERM", ROUND_ENV)
        return stall
    client = None
    try:
        client = connect(etcd)
        watch = RoundWatch(client, etcd.run_prefix(run_id), round_number, stall.round_broken)
        watch.start()
    except Exception as error:  # noqa: BLE001 - SIGTERM still starts the abort
        log.warning("no round watch (the abort waits for SIGTERM) error=%r", error)
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
        return stall
    stall.on_close(watch.close)
    stall.on_close(client.close)
    return stall
