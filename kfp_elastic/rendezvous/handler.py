"""The ``elastic-etcd`` torchrun rendezvous handler (etcd v3, leases, watches, no agent store).

torchrun finds it through the ``torchrun.handlers`` entry point ``elastic-etcd``:

    torchrun --rdzv-backend=elastic-etcd --rdzv-endpoint=HOST:PORT[,HOST:PORT] \
             --rdzv-id=JOB --nnodes=MIN:MAX --rdzv-conf=lease_ttl=5,... train.py
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from kfp_elastic.contract import worker_end
from kfp_elastic.contract.failure_budget import (
    SOURCE_AGENT,
    CountedFailure,
    FailureBudget,
    agent_incident,
    read_failures,
    record_failure,
)
from kfp_elastic.contract.nccl_env import set_nccl_error_handling
from kfp_elastic.contract.rendezvous_config import RendezvousConfig, config_from_torch_params
from kfp_elastic.etcd.client import EtcdConnectionError, connect
from kfp_elastic.etcd.keys import CLOSED_FAILED, CLOSED_SUCCEEDED, CLOSED_UNKNOWN, RunKeys
from kfp_elastic.job_env import ROUND_ENV, worker_name
from kfp_elastic.rendezvous import broken_round, orphan, peer_failures, warm_start
from kfp_elastic.rendezvous import leave as leave_hook
from kfp_elastic.rendezvous.membership import Membership
from kfp_elastic.rendezvous.membership_view import Status
from kfp_elastic.rendezvous.node_steps import (
    Action,
    NodeSnapshot,
    Step,
    WaitProgress,
    needs_records,
    next_step,
)
from kfp_elastic.rendezvous.peer_failures import (
    MembershipChange,
    RestartPolicy,
    Verdict,
    after_budget,
    error_text,
    failure_signature,
    is_fatal_failure,
    is_own_error,
    is_peers_error,
    membership_change,
    root_cause,
)
from kfp_elastic.rendezvous.round_formation import (
    MasterRecord,
    NodeRecord,
    RoundRecord,
    nodes_waiting_count,
)
from kfp_elastic.rendezvous.store import EtcdStore, ExitBarrier

log = logging.getLogger(__name__)

BACKEND_NAME = "elastic-etcd"
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


class RunCompletedError(RendezvousClosedError):
    """The run was closed by an agent whose workers all succeeded: the job is done and this node
    (a replacement or a spare that arrived late) has nothing to do. ``kfp-elastic agent`` exits
    0 on it; under plain torchrun it ends the agent like any closed run (torch exits 1)."""


def new_node_id() -> str:
    """This agent's rendezvous identity: ``{hostname}-{pid}-{random}`` (unique per process; the
    pid lets a test match a round's participants to the local processes it started)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def node_id_pid(node_id: str) -> int | None:
    """The agent's pid in a :func:`new_node_id` identity (None for another format)."""
    parts = node_id.rsplit("-", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


class ElasticEtcdRendezvousHandler(RendezvousHandler):
    """One torchrun agent's view of the job. See docs/rendezvous.md for the protocol."""

    def __init__(self, config: RendezvousConfig) -> None:
        # The workers torchrun starts inherit this process's environment: a user's own script
        # creates its NCCL group itself, so the setting its abort needs is made here.
        set_nccl_error_handling()
        self._config = config
        self._keys = RunKeys(config.run_prefix)
        self.node_id = new_node_id()
        self._addr = _advertised_addr(config.local_addr)
        if config.warm_start:  # before connect(): the zygote may be forked only without threads
            warm_start.install(warm_start.DEFAULT_PRELOAD + config.preload_modules)
        try:
            self._client = connect(config.etcd)
        except EtcdConnectionError as error:
            raise RendezvousConnectionError(str(error)) from error
        self._membership = Membership(self._client, self._keys, config, self.node_id, self._addr)
        self._round: RoundRecord | None = None
        # Participants' leases as first seen in the current round (a new lease = a lost one).
        self._round_leases: dict[str, int] = {}
        self._restarts = RestartPolicy(
            config.max_free_restarts, config.free_restart_window, config.max_repeated_failures
        )
        self._waiting_memo: tuple[int, int, int] | None = None  # (revision, round, answer)
        self._left = threading.Event()
        self._lock = threading.Lock()
        self._master_watch: orphan.MasterWatch | None = None
        leave_hook.register(self)
        peer_failures.install()
        broken_round.install()
        atexit.register(self.leave, "process exit")
        if config.orphan_timeout is not None:
            # Workers a master started stop on their own once it has been gone for long.
            self._master_watch = orphan.MasterWatch(
                self._client,
                self._keys.master.leader,
                config.orphan_timeout,
                on_orphaned=self._stop_orphaned,
                where=f"node={self.node_id} run={config.run_id}",
            ).start()
        log.info(
            "elastic-etcd handler ready node=%s run=%s endpoints=%s nnodes=%d:%d",
            self.node_id,
            config.run_id,
            ",".join(map(str, config.endpoints)),
            config.min_nodes,
            config.max_nodes,
        )

    def _stop_orphaned(self, gone_s: float) -> None:
        """Say why this node's worker ends, for a master that finds its pod already gone (a
        later KFP retry: ``master.job.vanished_status``), then stop as a SIGTERM would."""
        worker = worker_name()
        if worker:
            message = f"no master for {gone_s:.0f} s"
            end = worker_end.WorkerEnd(worker_end.END_ORPHANED, time.time(), message=message)
            worker_end.record_end(self._client, self._config.run_prefix, worker, end)
        orphan.stop_agent(gone_s)

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
        self._membership.close_run(CLOSED_UNKNOWN)

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
        self._remember_leases(live, current_round)
        count = nodes_waiting_count(live, latest, self._config.max_nodes)
        if latest.number != current_round.number:
            count = max(1, count)
        self._waiting_memo = (revision, current_round.number, count)
        return count

    def membership_change(self) -> MembershipChange | None:
        """How the current round's membership changed (None: not a member, or no full view)."""
        current_round = self._round
        if current_round is None or self._left.is_set():
            return None
        if self._membership.node_lease_lost:
            return MembershipChange(lost=(self.node_id,))  # peers declared us dead
        if not self._membership.follows_all:
            return None
        live, _ = self._membership.view()
        self._remember_leases(live, current_round)
        return membership_change(live, current_round, self._round_leases)

    def _remember_leases(self, live: list[NodeRecord], current_round: RoundRecord) -> None:
        if not self._round_leases:  # the first full view of this round
            self._round_leases = {
                n.node_id: n.lease for n in live if n.node_id in current_round.participants
            }

    def wait_for_peer_loss(self, timeout: float) -> MembershipChange | None:
        """The round's membership change once a participant is lost, or as it is after
        ``timeout`` seconds (a re-round alone is no loss: a peer's lease may go a moment later
        than that peer's own workers' failure made it re-round)."""
        deadline = time.monotonic() + timeout
        while True:
            change = self.membership_change()
            if (change is not None and change.peer_lost) or time.monotonic() >= deadline:
                return change
            time.sleep(MEMBERSHIP_POLL_S)

    def on_worker_failure(self, failures: Mapping[int, Any]) -> Verdict:
        """torchrun's agent saw our workers fail: restart for free, count it, or give up
        (``peer_failures.RestartPolicy``). A failure that is not free is counted in the job's
        failure budget (``failure_budget``), which may end the restarts (``after_budget``),
        and leaves its error in etcd."""
        change = (
            self.wait_for_peer_loss(self._config.peer_failure_grace)
            if self._config.peer_failure_grace > 0
            else None
        )
        signature = failure_signature(failures)
        verdict = self._restarts.decide(change, signature, time.monotonic())
        text = error_text(failures)
        round_number = self._round.number if self._round else 0
        budget = None
        if verdict != Verdict.FREE:
            budget = self._count_failure(failures, round_number, text)
            if budget is not None:
                verdict = after_budget(verdict, budget)
        elif is_own_error(failures):
            # Free here (a peer left within the grace: often one that gave up on this very
            # round), yet the error is our worker's own: where a peer counted the round with
            # what it saw of it, the round's account gets the error itself (not counted again).
            self._count_failure(failures, round_number, text, count=False)
        log.log(
            logging.INFO if verdict == Verdict.FREE else logging.WARNING,
            "worker failure node=%s round=%d verdict=%s repeats=%d counted=%s change=%s error=%s",
            self.node_id,
            round_number,
            verdict.value,
            self._restarts.repeats,
            "?" if budget is None else budget.count,
            change.describe() if change is not None else "unknown",
            text,
        )
        if verdict != Verdict.FREE:
            self._record_worker_error(round_number, verdict, text)
        return verdict

    def _worker_name(self) -> str:
        """The master's name for this node's worker; without a master, the node id."""
        return worker_name() or self.node_id

    def _count_failure(
        self, failures: Mapping[int, Any], round_number: int, text: str, count: bool = True
    ) -> FailureBudget | None:
        """Count this round's failure in the job's budget (once, whichever agent of the round
        comes first) and return the budget as it is now (None: etcd could not be reached; the
        failure still reaches the agent's log, and torchrun's restarts go on)."""
        run_lease = self._round.run_lease if self._round else 0
        rank = root_cause(failures)[0] if failures else None
        failure = CountedFailure(
            incident=agent_incident(round_number, run_lease),
            source=SOURCE_AGENT,
            error=text,
            worker=self._worker_name(),
            node=self.node_id,
            rank=rank,
            round=round_number,
            fatal=is_fatal_failure(failures),
            own_error=is_own_error(failures),
            peers_error=is_peers_error(failures),
        )
        try:
            record_failure(self._client, self._config.run_prefix, failure, count=count)
            counted = read_failures(self._client, self._config.run_prefix)
        except Exception as error:  # noqa: BLE001 - counting must not break the restart
            log.warning("could not count worker failure node=%s error=%r", self.node_id, error)
            return None
        return FailureBudget(self._config.max_failures, counted)

    def _record_worker_error(self, round_number: int, verdict: Verdict, text: str) -> None:
        worker = self._worker_name()
        record = {
            "worker": worker,
            "node": self.node_id,
            "round": round_number,
            "verdict": verdict.value,
            "repeats": self._restarts.repeats,
            "failures": self._restarts.counted,
            "error": text,
        }
        try:
            self._client.put(self._keys.worker_error(worker), json.dumps(record))
        except Exception as error:  # noqa: BLE001 - the error still reaches the agent's log
            log.warning("could not record worker error node=%s error=%r", self.node_id, error)

    def next_rendezvous(self) -> RendezvousInfo:
        # A node that left, or a closed run, fails at the first step (FAIL_LEFT, FAIL_CLOSED).
        started = time.monotonic()
        while True:
            current = self._wait_for_round()
            info = self._enter_round(current)
            if info is not None:
                # Inherited by the workers started for this round (``worker/peer_loss.py``).
                os.environ[ROUND_ENV] = str(current.number)
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
        failing = sys.exc_info()[0] is not None
        if failing and not self._config.close_on_failure:
            log.warning(
                "agent failing: leaving without closing run=%s node=%s",
                self._config.run_id,
                self.node_id,
            )
            self.leave("agent failed")
            return True
        try:
            self._membership.close_run(CLOSED_FAILED if failing else CLOSED_SUCCEEDED)
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
        if self._master_watch is not None:
            self._master_watch.stop()
        log.info("leaving run node=%s run=%s reason=%s", self.node_id, self._config.run_id, reason)
        self._membership.leave()
        self._client.close()

    # -- rounds -------------------------------------------------------------------------------
    def _wait_for_round(self) -> RoundRecord:
        """The executor of ``node_steps``: snapshot, ask ``next_step``, apply its action."""
        config = self._config
        membership = self._membership
        progress = WaitProgress(last_round=self._round.number if self._round else 0)
        while True:
            now = time.monotonic()
            deadline = progress.deadline
            view = membership.status(
                records_if=lambda status, deadline=deadline, now=now: needs_records(
                    status, self.node_id, deadline, now, config.min_nodes, config.max_nodes
                )
            )
            snapshot = NodeSnapshot(
                self.node_id,
                now,
                view,
                left=self._left.is_set(),
                closed=membership.closed(),
                completed=membership.completed(),
                lease_lost=membership.node_lease_lost,
                holds_leader_key=membership.is_leader(),
            )
            step = next_step(snapshot, progress, config)
            progress = step.progress
            if step.action is Action.RETURN_ROUND:
                return view.round
            self._apply(step, view)

    def _apply(self, step: Step, view: Status) -> None:
        """The I/O of one ``node_steps.Action`` (all but RETURN_ROUND)."""
        membership = self._membership
        action = step.action
        if action is Action.EXIT_COMPLETED:
            log.info("run completed, nothing to do node=%s reason=%s", self.node_id, step.reason)
            raise RunCompletedError(step.reason)
        if action in (Action.FAIL_LEFT, Action.FAIL_CLOSED):
            raise RendezvousClosedError(step.reason)
        if action is Action.FAIL_TIMEOUT:
            raise RendezvousTimeoutError(step.reason)
        if action is Action.PUBLISH:
            if step.narrow:
                membership.follow_all(False)  # a waiter follows only what tells it to go on
            membership.publish(waiting=True, after_round=step.progress.after_round)
            log.info(
                "waiting for round node=%s after_round=%d", self.node_id, step.progress.after_round
            )
        elif action is Action.REGISTER:
            membership.register()
            membership.publish(waiting=True, after_round=step.progress.after_round)
        elif action is Action.FOLLOW_ALL:
            membership.follow_all(True)
        elif action is Action.TRY_LEAD:
            if not membership.try_lead():
                membership.wait_for_change(view.revision, step.wait_s)
        elif action is Action.FORM_ROUND:
            formed = membership.form_round(view.round, step.participants)
            if formed:
                log.info(
                    "formed round round=%d leader=%s world=%d reason=%s",
                    formed,
                    self.node_id,
                    len(step.participants),
                    step.reason,
                )
            else:
                membership.wait_for_change(view.revision, step.wait_s)
        else:  # AWAIT_LEADER, WAIT, WAIT_AS_SPARE
            membership.wait_for_change(view.revision, step.wait_s)

    def _enter_round(self, current: RoundRecord) -> RendezvousInfo | None:
        rank = current.rank_of(self.node_id)
        assert rank is not None
        membership = self._membership
        self._round = current
        self._round_leases = {}
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
            timeout=timedelta(seconds=self._config.store_timeout),
            abort_if=self._round_broken,
            exit_barrier=ExitBarrier(
                self.node_id, tuple(current.participants), self._config.exit_barrier_timeout
            ),
        )
        bootstrap = RendezvousStoreInfo(master.addr, master.port)
        return RendezvousInfo(store, rank, len(current.participants), bootstrap)

    def _wait_for_master(self, current: RoundRecord) -> MasterRecord | None:
        """Rank 0's MASTER_ADDR/PORT for ``current`` (``bootstrap.py``); None if the round
        broke first (rank 0 died before publishing it, or a newer round replaced it)."""
        membership = self._membership
        timeout = self._config.store_timeout
        deadline = time.monotonic() + timeout
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
                    f"MASTER_ADDR/PORT within store_timeout={timeout}s"
                )
            membership.wait_for_change(position, min(BROKEN_CHECK_S, deadline - now))

    def _round_broken(self) -> bool:
        return self.num_nodes_waiting() > 0 or self._left.is_set()


def create_handler(params: RendezvousParameters) -> ElasticEtcdRendezvousHandler:
    """A handler for torch's ``RendezvousParameters`` (``ValueError`` for bad settings)."""
    return ElasticEtcdRendezvousHandler(config_from_torch_params(params))
