"""The rendezvous node as a named state machine: what a node waiting for a round does next.

``next_step`` is pure: given a ``NodeSnapshot`` (what the node knows: its watched cache's view,
whether it left or the run closed, and its own monotonic ``now``) and the ``WaitProgress`` it
carries from its previous steps, it names the ``Action`` to take and its parameters. No I/O and
no clock reads. The handler's executor (``ElasticEtcdRendezvousHandler._wait_for_round``) takes
a snapshot, asks ``next_step``, applies the action with etcd I/O and waits on the cache's watch;
the same split as torch's ``dynamic_rendezvous`` (``_RendezvousJoinOp`` returns an ``_Action``,
``_RendezvousOpExecutor`` applies it). docs/rendezvous.md has the table and the transitions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import Enum

from kfp_elastic.contract.rendezvous_config import RendezvousConfig
from kfp_elastic.rendezvous.membership_view import Status
from kfp_elastic.rendezvous.round_formation import (
    LastCallClock,
    NodeRecord,
    decide,
    is_admitted,
    is_full_and_healthy,
    waiting_nodes,
)

# Longest wait for a change before the node looks again: deadlines and the leaving flag (not in
# the cache) are checked at least this often; every cache change wakes the node earlier.
MAX_WAIT_SLICE_S = 1.0
# How long a waiter that sees no leader key waits for its cache to catch up before it tries to
# take the key: a narrowed cache may show the key deleted before the round written with that
# deletion (another watch), and a transaction then would only lose. A dead leader is replaced
# this much later; the publish transaction normally takes the key when there is none.
LEADER_GRACE_S = 0.1


class Action(Enum):
    """What the node does next; the executor's I/O for each is in docs/rendezvous.md."""

    FAIL_LEFT = "fail_left"  # this node left the run (SIGTERM, shutdown): RendezvousClosedError
    FAIL_CLOSED = "fail_closed"  # the run is closed: RendezvousClosedError
    EXIT_COMPLETED = "exit_completed"  # closed by a node whose workers succeeded: RunCompletedError
    PUBLISH = "publish"  # first step: write our record (waiting, after_round), maybe lead
    REGISTER = "register"  # our lease or record is gone: a fresh lease, our record again
    RETURN_ROUND = "return_round"  # the round in the view admits us: enter it
    AWAIT_LEADER = "await_leader"  # no leader key for < LEADER_GRACE_S: let the cache catch up
    TRY_LEAD = "try_lead"  # still no leader key: create it (if lost, wait for the change)
    FOLLOW_ALL = "follow_all"  # we lead with a narrowed view: read every node's record first
    FORM_ROUND = "form_round"  # we lead and decide() says form: write the round after ours
    WAIT = "wait"  # wait for a change (or the last call's end, or a deadline)
    WAIT_AS_SPARE = "wait_as_spare"  # past MAX beside a full round: wait, join deadline pushed
    FAIL_TIMEOUT = "fail_timeout"  # join_timeout passed without a round: RendezvousTimeoutError


@dataclass(frozen=True)
class WaitProgress:
    """What the node carries from one step to the next within one ``next_rendezvous``."""

    last_round: int  # the round this node ran before (0: none)
    published: bool = False
    after_round: int = 0  # the round our record says we left; set by PUBLISH
    deadline: float = math.inf  # join deadline (monotonic); set by PUBLISH, pushed for spares
    leaderless_since: float | None = None  # when we first saw no leader key
    last_call: LastCallClock = field(default_factory=LastCallClock)  # while we lead


@dataclass(frozen=True)
class NodeSnapshot:
    node_id: str
    now: float  # the node's monotonic clock
    view: Status  # round, own record, leader, waiting count, records if needed, at one position
    left: bool = False
    closed: bool = False
    completed: bool = False  # closed by a node whose workers succeeded: the job is done
    lease_lost: bool = False  # our node lease expired or was revoked (peers think we died)
    holds_leader_key: bool = False  # we wrote the leader key and have not handed it on

    @property
    def leading(self) -> bool:
        return leads(self.view, self.node_id)


@dataclass(frozen=True)
class Step:
    action: Action
    progress: WaitProgress  # carry into the next snapshot
    # FORM_ROUND: the round's participants in rank order.
    participants: tuple[str, ...] = ()
    # AWAIT_LEADER, WAIT, WAIT_AS_SPARE: longest wait for a change; TRY_LEAD, FORM_ROUND: how
    # long to wait for the change that beat us if the transaction loses.
    wait_s: float = 0.0
    # PUBLISH: leave other nodes' records out of the view (we wait without leading).
    narrow: bool = False
    # FORM_ROUND: why (decide()'s reason); FAIL_*: the error message.
    reason: str = ""


def leads(view: Status, node_id: str) -> bool:
    """Whether the leader key in ``view`` is ``node_id``'s."""
    return view.leader is not None and view.leader.node_id == node_id


def needs_records(
    view: Status, node_id: str, deadline: float, now: float, min_nodes: int, max_nodes: int
) -> bool:
    """Whether ``next_step`` will read every node's record (``view.live``): O(N) to copy, so
    the executor takes them only then (leading with MIN waiting, a full round, a timeout).
    A narrowed view has only our own record: nothing to read."""
    if not view.follows_all:
        return False
    return (
        (leads(view, node_id) and view.waiting_count >= min_nodes)
        or len(view.round.participants) >= max_nodes
        or now >= deadline
    )


def next_step(snapshot: NodeSnapshot, progress: WaitProgress, config: RendezvousConfig) -> Step:
    """The node's next action; see the module docstring and docs/rendezvous.md."""
    view, now = snapshot.view, snapshot.now
    if snapshot.left:
        return Step(Action.FAIL_LEFT, progress, reason=f"node {snapshot.node_id} has left the run")
    if snapshot.completed:
        return Step(
            Action.EXIT_COMPLETED,
            progress,
            reason=f"run {config.run_id} completed before node {snapshot.node_id} joined a "
            f"round: nothing to do. {closed_run_hint(config)}",
        )
    if snapshot.closed:
        return Step(
            Action.FAIL_CLOSED,
            progress,
            reason=f"run {config.run_id} is closed (an agent ended it). {closed_run_hint(config)}",
        )
    if not progress.published:
        progress = replace(
            progress,
            published=True,
            after_round=max(progress.last_round, view.round.number),
            deadline=now + config.join_timeout,
        )
        return Step(Action.PUBLISH, progress, narrow=not snapshot.holds_leader_key)
    if snapshot.lease_lost or view.me is None:
        return Step(Action.REGISTER, progress)
    if is_admitted(view.me, view.round):
        return Step(Action.RETURN_ROUND, progress)
    if view.leader is None:
        since = now if progress.leaderless_since is None else progress.leaderless_since
        progress = replace(progress, leaderless_since=since)
        if now < since + LEADER_GRACE_S:
            return Step(Action.AWAIT_LEADER, progress, wait_s=since + LEADER_GRACE_S - now)
        return Step(Action.TRY_LEAD, progress, wait_s=MAX_WAIT_SLICE_S)
    progress = replace(progress, leaderless_since=None)
    recheck_at: float | None = None
    if snapshot.leading:
        if not view.follows_all:
            return Step(Action.FOLLOW_ALL, progress)
        enough = view.waiting_count >= config.min_nodes
        progress = replace(progress, last_call=progress.last_call.observed(enough, now))
        if enough:  # else decide() would say the same, without O(N) work
            decision = decide(
                _records(view),
                view.round,
                config.min_nodes,
                config.max_nodes,
                now,
                progress.last_call.min_reached_at,
                config.last_call_timeout,
                config.rejoin_timeout,
            )
            if decision.form:
                return Step(
                    Action.FORM_ROUND,
                    progress,
                    participants=decision.participants,
                    reason=decision.reason,
                    wait_s=_slice(now, progress.deadline, None),
                )
            recheck_at = decision.recheck_at
    spare = len(view.round.participants) >= config.max_nodes and (
        not view.follows_all  # the leader watches the round's health
        or is_full_and_healthy(_records(view), view.round, config.max_nodes)
    )
    if spare:  # on the redundancy list: wait for a place as long as the full round runs
        progress = replace(progress, deadline=now + config.join_timeout)
    if now >= progress.deadline:
        return Step(Action.FAIL_TIMEOUT, progress, reason=_timeout_message(snapshot, config))
    return Step(
        Action.WAIT_AS_SPARE if spare else Action.WAIT,
        progress,
        wait_s=_slice(now, progress.deadline, recheck_at),
    )


def closed_run_hint(config: RendezvousConfig) -> str:
    """What a node that finds its run closed tells a user who started a new job: its run id
    is a finished run's, whose progress (no lease) would be continued even after the
    rendezvous keys expired."""
    return (
        f"If this is a new job, --rdzv-id {config.run_id} was used by a finished run: choose "
        f"another --rdzv-id, or delete that run's keys first: kfp-elastic forget "
        f"{config.run_id} --etcd ENDPOINT"
    )


def _slice(now: float, deadline: float, recheck_at: float | None) -> float:
    end = min(deadline, now + MAX_WAIT_SLICE_S)
    if recheck_at is not None:
        end = min(end, recheck_at)
    return max(0.0, end - now)


def _records(view: Status) -> tuple[NodeRecord, ...]:
    if view.live is None:
        raise ValueError("snapshot without every node's record: build it with needs_records()")
    return view.live


def _timeout_message(snapshot: NodeSnapshot, config: RendezvousConfig) -> str:
    view = snapshot.view
    if view.follows_all:
        live = _records(view)
        counts = f"{len(waiting_nodes(live, view.round))} waiting, {len(live)} live"
    else:
        counts = f"leader {view.leader.node_id if view.leader else '-'}"
    return (
        f"node {snapshot.node_id}: no round with >= {config.min_nodes} nodes formed "
        f"within join_timeout={config.join_timeout}s ({counts})"
    )
