"""The ``elastic-etcd`` torchrun rendezvous handler (etcd v3, leases, watches, no agent store).

torchrun finds it through the ``torchrun.handlers`` entry point ``elastic-etcd``:

    torchrun --rdzv-backend=elastic-etcd --rdzv-endpoint=HOST:PORT[,HOST:PORT] \
             --rdzv-id=JOB --nnodes=MIN:MAX --rdzv-conf=lease_ttl=5,... train.py
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import threading
import time
import uuid
from datetime import timedelta

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from kfp_elastic.etcd.keys import RunKeys

from . import leave as leave_hook
from . import peer_failures, warm_start
from .config import RendezvousConfig, config_from_torch_params
from .etcd_client import EtcdConnectionError, connect
from .membership import Membership
from .round_formation import (
    LastCallClock,
    MasterRecord,
    RoundRecord,
    decide,
    is_admitted,
    is_full_and_healthy,
    nodes_waiting_count,
    waiting_nodes,
)
from .store import EtcdStore

log = logging.getLogger(__name__)

BACKEND_NAME = "elastic-etcd"
STORE_TIMEOUT = timedelta(seconds=300)
# Longest sleep between two looks at the cache while waiting (deadlines are checked this often).
MAX_WAIT_SLICE_S = 1.0
# How long a waiter that sees no leader key waits for its cache to catch up before it tries to
# take the key (a dead leader is replaced this much later; the publish transaction normally
# takes the key when there is none).
LEADER_GRACE_S = 0.1
# How often a node waiting for rank 0's MASTER_ADDR/PORT asks whether its round broke.
BROKEN_CHECK_S = 0.2
# How often a failed worker's agent looks for the membership change that explains the failure.
MEMBERSHIP_POLL_S = 0.02


def _advertised_addr(local_addr: str | None) -> str:
    if local_addr:
        return local_addr
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class ElasticEtcdRendezvousHandler(RendezvousHandler):
    """One torchrun agent's view of the job. See docs/rendezvous.md for the protocol."""

    def __init__(self, config: RendezvousConfig) -> None:
        self._config = config
        self._keys = RunKeys(config.run_prefix)
        self.node_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._addr = _advertised_addr(config.local_addr)
        if config.warm_start:  # before connect(): the zygote may be forked only without threads
            warm_start.install(warm_start.DEFAULT_PRELOAD + config.preload_modules)
        try:
            self._client = connect(config)
        except EtcdConnectionError as error:
            raise RendezvousConnectionError(str(error)) from error
        self._membership = Membership(self._client, self._keys, config, self.node_id, self._addr)
        self._round: RoundRecord | None = None
        self._waiting_memo: tuple[int, int, int] | None = None  # (revision, round, answer)
        self._left = threading.Event()
        self._lock = threading.Lock()
        leave_hook.register(self)
        if config.peer_failure_grace > 0:
            peer_failures.install(config.peer_failure_grace)
        atexit.register(self.leave, "process exit")
        log.info(
            "elastic-etcd handler ready node=%s run=%s endpoints=%s nnodes=%d:%d",
            self.node_id,
            config.run_id,
            ",".join(map(str, config.endpoints)),
            config.min_nodes,
            config.max_nodes,
        )

    # -- RendezvousHandler --------------------------------------------------------------------
    def get_backend(self) -> str:
        return BACKEND_NAME

    @property
    def use_agent_store(self) -> bool:
        # Workers bootstrap from MASTER_ADDR/PORT published through the etcd store; no agent
        # hosts a store the others depend on.
        return False

    def get_run_id(self) -> str:
        return self._config.run_id

    def is_closed(self) -> bool:
        return self._membership.closed()

    def set_closed(self) -> None:
        self._membership.close_run()

    def num_nodes_waiting(self) -> int:
        current_round = self._round
        if current_round is None or self._left.is_set():
            return 0
        if self._membership.node_lease_lost:
            return 1  # peers declared us dead; restart and re-join
        if not self._membership.follows_all:
            return 0  # not a member yet (``_enter_round`` switches to the full view first)
        revision = self._membership.revision
        memo = self._waiting_memo
        if memo is not None and memo[:2] == (revision, current_round.number):
            return memo[2]  # polled often (monitor loop, store waits): O(N) once per change
        live, latest = self._membership.view()
        count = nodes_waiting_count(live, latest, self._config.max_nodes)
        if latest.number != current_round.number:
            count = max(1, count)
        self._waiting_memo = (revision, current_round.number, count)
        return count

    def wait_for_membership_change(self, timeout: float) -> bool:
        """Whether the current round loses or gains a member within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self.num_nodes_waiting() == 0:
            if time.monotonic() >= deadline:
                return False
            time.sleep(MEMBERSHIP_POLL_S)
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        if self._left.is_set():
            raise RendezvousClosedError(f"node {self.node_id} has left the run")
        if self.is_closed():
            raise RendezvousClosedError(f"run {self._config.run_id} is closed")
        started = time.monotonic()
        while True:
            current = self._wait_for_round()
            info = self._enter_round(current)
            if info is not None:
                log.info(
                    "joined round node=%s round=%d rank=%d world=%d waited_s=%.2f",
                    self.node_id,
                    current.number,
                    info.rank,
                    info.world_size,
                    time.monotonic() - started,
                )
                return info

    def shutdown(self) -> bool:
        """Close the run for everyone, unless this agent is failing (then only leave).

        torchrun calls this on success and also when its agent gives up; closing on failure
        would end an elastic job for every other node because one failed.
        """
        if self._left.is_set():
            return True
        if sys.exc_info()[0] is not None and not self._config.close_on_failure:
            log.warning(
                "agent failing: leaving without closing run=%s node=%s",
                self._config.run_id,
                self.node_id,
            )
            self.leave("agent failed")
            return True
        try:
            self.set_closed()
        except Exception as error:  # noqa: BLE001 - still leave below
            log.warning("could not mark run closed run=%s error=%r", self._config.run_id, error)
        self.leave("shutdown")
        return True

    # -- leaving ------------------------------------------------------------------------------
    def leave(self, reason: str) -> None:
        """Revoke our lease now so peers re-form at once; safe to call many times."""
        with self._lock:
            if self._left.is_set():
                return
            self._left.set()
        log.info("leaving run node=%s run=%s reason=%s", self.node_id, self._config.run_id, reason)
        self._membership.leave()
        self._client.close()

    # -- rounds -------------------------------------------------------------------------------
    def _wait_for_round(self) -> RoundRecord:
        config = self._config
        membership = self._membership
        _, latest = membership.view()
        after_round = max(self._round.number if self._round else 0, latest.number)
        if not membership.is_leader():
            membership.follow_all(False)  # a waiter follows only what tells it to go on
        membership.publish(waiting=True, after_round=after_round)
        log.info("waiting for round node=%s after_round=%d", self.node_id, after_round)
        deadline = time.monotonic() + config.join_timeout
        clock = LastCallClock()
        leaderless_since = 0.0
        while True:
            if self._left.is_set():
                raise RendezvousClosedError(f"node {self.node_id} has left the run")
            if membership.closed():
                raise RendezvousClosedError(f"run {config.run_id} is closed")
            status = membership.status()
            revision, current = status.revision, status.round
            if membership.node_lease_lost or status.me is None:
                membership.register()
                membership.publish(waiting=True, after_round=after_round)
                continue
            if is_admitted(status.me, current):
                return current
            now = time.monotonic()
            if status.leader is None:
                # Our narrowed cache may show the leader key gone (or not yet there) before
                # the round written with its deletion (or the leader's put): wait for that
                # first instead of a transaction that would lose.
                leaderless_since = leaderless_since or now
                if now < leaderless_since + LEADER_GRACE_S:
                    membership.wait_for_change(revision, leaderless_since + LEADER_GRACE_S - now)
                elif not membership.try_lead():
                    membership.wait_for_change(revision, MAX_WAIT_SLICE_S)
                continue
            leaderless_since = 0.0
            recheck_at: float | None = None
            leading = status.leader.node_id == self.node_id
            if leading:
                membership.follow_all(True)
            if leading and membership.waiting_count() < config.min_nodes:
                clock.observe(False, now)  # decide() would say the same, without O(N) work
            elif leading:
                live, current = membership.view()
                waiting = waiting_nodes(live, current)
                min_reached_at = clock.observe(len(waiting) >= config.min_nodes, now)
                decision = decide(
                    live,
                    current,
                    config.min_nodes,
                    config.max_nodes,
                    now,
                    min_reached_at,
                    config.last_call_timeout,
                    config.rejoin_timeout,
                )
                formed = (
                    membership.form_round(current, decision.participants) if decision.form else 0
                )
                if formed:
                    log.info(
                        "formed round round=%d leader=%s world=%d reason=%s",
                        formed,
                        self.node_id,
                        len(decision.participants),
                        decision.reason,
                    )
                    continue
                recheck_at = decision.recheck_at
            if len(current.participants) >= config.max_nodes and (
                not membership.follows_all  # the leader watches the round's health
                or is_full_and_healthy(membership.view()[0], current, config.max_nodes)
            ):
                # On the redundancy list: wait for a place as long as the full round runs.
                deadline = now + config.join_timeout
            if now >= deadline:
                live, current = membership.view()
                counts = (
                    f"{len(waiting_nodes(live, current))} waiting, {len(live)} live"
                    if membership.follows_all
                    else f"leader {status.leader.node_id}"
                )
                raise RendezvousTimeoutError(
                    f"node {self.node_id}: no round with >= {config.min_nodes} nodes formed "
                    f"within join_timeout={config.join_timeout}s ({counts})"
                )
            slice_end = min(deadline, now + MAX_WAIT_SLICE_S)
            if recheck_at is not None:
                slice_end = min(slice_end, recheck_at)
            membership.wait_for_change(revision, max(0.0, slice_end - now))

    def _enter_round(self, current: RoundRecord) -> RendezvousInfo | None:
        rank = current.rank_of(self.node_id)
        assert rank is not None
        membership = self._membership
        self._round = current
        membership.keep_run_lease(current.run_lease)
        if rank == 0 and membership.master(current.number) is None:
            membership.publish_master(current)  # first: every other node waits for it
        # A member answers num_nodes_waiting from every node's record: follow them all again
        # (one read). On the cache's thread: torchrun can start the workers meanwhile, and
        # N nodes reading N records each is what kept N = 128 from returning sooner. Until
        # the read is done num_nodes_waiting() answers 0; a loss in between is in the read.
        membership.follow_all(True, wait=False)
        master = self._wait_for_master(current)
        if master is None:  # a peer vanished mid-bootstrap: next round
            log.info("round broke during bootstrap round=%d node=%s", current.number, self.node_id)
            return None
        store = EtcdStore(
            self._client,
            self._keys.store(current.number),
            lease_id=current.run_lease,
            timeout=STORE_TIMEOUT,
            abort_if=self._round_broken,
        )
        bootstrap = RendezvousStoreInfo(master.addr, master.port)
        return RendezvousInfo(store, rank, len(current.participants), bootstrap)

    def _wait_for_master(self, current: RoundRecord) -> MasterRecord | None:
        """Rank 0's MASTER_ADDR/PORT for ``current`` (``bootstrap.py``); None if the round
        broke first (rank 0 died before publishing it, or a newer round replaced it)."""
        membership = self._membership
        deadline = time.monotonic() + STORE_TIMEOUT.total_seconds()
        while True:
            position = membership.revision
            master = membership.master(current.number)
            if master is not None:
                return master
            if self._round_broken():
                return None
            now = time.monotonic()
            if now >= deadline:
                raise RendezvousTimeoutError(
                    f"node {self.node_id}: rank 0 of round {current.number} did not publish "
                    f"MASTER_ADDR/PORT within {STORE_TIMEOUT.total_seconds():.0f}s"
                )
            membership.wait_for_change(position, min(BROKEN_CHECK_S, deadline - now))

    def _round_broken(self) -> bool:
        return self.num_nodes_waiting() > 0 or self._left.is_set()


def create_handler(params: RendezvousParameters) -> ElasticEtcdRendezvousHandler:
    """A handler for torch's ``RendezvousParameters`` (``ValueError`` for bad settings)."""
    return ElasticEtcdRendezvousHandler(config_from_torch_params(params))
