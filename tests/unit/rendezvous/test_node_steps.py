"""The rendezvous node's state machine (node_steps.next_step) as a pure function: no etcd, no
clocks. Each test walks a node through snapshots the way the handler's executor would."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kfp_elastic.contract.rendezvous_config import Endpoint, EtcdSettings, RendezvousConfig
from kfp_elastic.rendezvous.membership_view import Status
from kfp_elastic.rendezvous.node_steps import (
    LEADER_GRACE_S,
    MAX_WAIT_SLICE_S,
    Action,
    NodeSnapshot,
    Step,
    WaitProgress,
    needs_records,
    next_step,
)
from kfp_elastic.rendezvous.round_formation import (
    NO_ROUND,
    LeaderRecord,
    NodeRecord,
    RoundRecord,
    waiting_nodes,
)

CONFIG = RendezvousConfig(
    etcd=EtcdSettings(endpoints=(Endpoint("127.0.0.1", 2379),)),
    run_id="job",
    min_nodes=2,
    max_nodes=3,
    join_timeout=600.0,
    last_call_timeout=1.0,
    rejoin_timeout=30.0,
)


def record(node_id: str, rev: int, after: int = 0, waiting: bool = True) -> NodeRecord:
    return NodeRecord(node_id, rev, waiting=waiting, after_round=after)


def snapshot(
    node_id: str,
    now: float,
    live: list[NodeRecord],
    current: RoundRecord = NO_ROUND,
    leader: str | None = None,
    follows_all: bool | None = None,
    progress: WaitProgress | None = None,
    **flags: bool,
) -> NodeSnapshot:
    """What ``Membership.status`` would give: a narrowed view (our record only) unless we lead
    or ``follows_all``; every record when ``needs_records`` says the step reads them."""
    leader_record = LeaderRecord(leader) if leader else None
    if follows_all is None:
        follows_all = leader == node_id
    seen = live if follows_all else [r for r in live if r.node_id == node_id]
    me = next((r for r in seen if r.node_id == node_id), None)
    view = Status(1, current, me, leader_record, len(waiting_nodes(seen, current)), follows_all)
    deadline = (progress or WaitProgress(0)).deadline
    wanted = needs_records(view, node_id, deadline, now, CONFIG.min_nodes, CONFIG.max_nodes)
    if wanted:
        view = replace(view, live=tuple(seen))
    return NodeSnapshot(node_id, now, view, **flags)


def published(now: float = 0.0, after_round: int = 0) -> WaitProgress:
    return WaitProgress(
        last_round=after_round,
        published=True,
        after_round=after_round,
        deadline=now + CONFIG.join_timeout,
    )


def step(snap: NodeSnapshot, progress: WaitProgress) -> Step:
    return next_step(snap, progress, CONFIG)


def test_first_step_publishes_and_sets_the_join_deadline() -> None:
    result = step(snapshot("a", 5.0, []), WaitProgress(last_round=0))
    assert result.action is Action.PUBLISH
    assert result.narrow  # a waiter that holds no leader key follows only its own record
    assert result.progress.published
    assert result.progress.deadline == 5.0 + CONFIG.join_timeout


def test_publish_after_a_round_waits_for_a_newer_one() -> None:
    current = RoundRecord(4, ("a", "b"))
    result = step(snapshot("a", 0.0, [], current), WaitProgress(last_round=3))
    assert result.action is Action.PUBLISH and result.progress.after_round == 4
    # a leader that still holds its key keeps following every node
    kept = step(snapshot("a", 0.0, [], holds_leader_key=True), WaitProgress(last_round=0))
    assert not kept.narrow


def test_register_when_our_record_or_lease_is_gone() -> None:
    progress = published()
    assert step(snapshot("a", 1.0, []), progress).action is Action.REGISTER
    lost = snapshot("a", 1.0, [record("a", 1)], leader="a", lease_lost=True)
    assert step(lost, progress).action is Action.REGISTER


def test_left_and_closed_fail_before_anything_else() -> None:
    progress = published()
    left = step(snapshot("a", 1.0, [record("a", 1)], left=True, closed=True), progress)
    assert left.action is Action.FAIL_LEFT and "has left" in left.reason
    closed = step(snapshot("a", 1.0, [record("a", 1)], closed=True), progress)
    assert closed.action is Action.FAIL_CLOSED and "job is closed" in closed.reason
    assert "choose another --rdzv-id, or delete that run's keys first: kfp-elastic forget job" in (
        closed.reason
    )
    unpublished = step(snapshot("a", 1.0, [], closed=True), WaitProgress(0))
    assert unpublished.action is Action.FAIL_CLOSED


def test_a_run_that_completed_ends_a_late_node_without_failing_it() -> None:
    late = step(snapshot("c", 1.0, [], closed=True, completed=True), WaitProgress(0))
    assert late.action is Action.EXIT_COMPLETED and "completed before node c" in late.reason
    assert "was used by a finished run: choose another --rdzv-id" in late.reason
    assert "kfp-elastic forget job --etcd ENDPOINT" in late.reason
    leaving = step(snapshot("c", 1.0, [], left=True, closed=True, completed=True), WaitProgress(0))
    assert leaving.action is Action.FAIL_LEFT


def test_no_leader_key_waits_the_grace_then_tries_to_lead() -> None:
    live = [record("b", 2)]
    first = step(snapshot("b", 10.0, live), published(10.0))
    assert first.action is Action.AWAIT_LEADER
    assert first.wait_s == pytest.approx(LEADER_GRACE_S)
    again = step(snapshot("b", 10.05, live), first.progress)
    assert again.action is Action.AWAIT_LEADER
    assert again.wait_s == pytest.approx(LEADER_GRACE_S - 0.05)
    late = step(snapshot("b", 10.0 + LEADER_GRACE_S, live), again.progress)
    assert late.action is Action.TRY_LEAD and late.wait_s == MAX_WAIT_SLICE_S
    # once a leader shows up the grace starts over the next time it is gone
    led = step(snapshot("b", 11.0, live, leader="a"), late.progress)
    assert led.action is Action.WAIT and led.progress.leaderless_since is None


def test_register_wait_lead_form_last_call() -> None:
    """a registers and leads (its publish took the key), b joins; the first round forms when
    the last call after MIN ends."""
    progress = step(snapshot("a", 0.0, []), WaitProgress(0)).progress
    alone = [record("a", 1)]
    narrowed = step(snapshot("a", 0.1, alone, leader="a", follows_all=False), progress)
    assert narrowed.action is Action.FOLLOW_ALL
    below_min = step(snapshot("a", 0.2, alone, leader="a"), narrowed.progress)
    assert below_min.action is Action.WAIT
    assert below_min.progress.last_call.min_reached_at is None
    assert below_min.wait_s == MAX_WAIT_SLICE_S
    both = [record("a", 1), record("b", 2)]
    last_call = step(snapshot("a", 0.5, both, leader="a"), below_min.progress)
    assert last_call.action is Action.WAIT
    assert last_call.progress.last_call.min_reached_at == 0.5
    assert last_call.wait_s == pytest.approx(CONFIG.last_call_timeout)  # until the call ends
    formed = step(snapshot("a", 1.5, both, leader="a"), last_call.progress)
    assert formed.action is Action.FORM_ROUND
    assert formed.participants == ("a", "b") and "last call" in formed.reason
    # b meanwhile waits on its narrowed view, then returns the round that lists it
    b_progress = published(0.5)
    assert step(snapshot("b", 1.0, both, leader="a"), b_progress).action is Action.WAIT
    round1 = RoundRecord(1, formed.participants)
    entered = step(snapshot("b", 1.6, both, round1), b_progress)
    assert entered.action is Action.RETURN_ROUND


def test_max_nodes_waiting_form_at_once() -> None:
    live = [record("a", 1), record("b", 2), record("c", 3)]
    result = step(snapshot("a", 0.0, live, leader="a"), published())
    assert result.action is Action.FORM_ROUND and result.participants == ("a", "b", "c")


def test_a_member_lost_while_waiting_reforms_at_once() -> None:
    """Round 3 had a, b, c; c died; a and b wait again: every live node waits, form now."""
    current = RoundRecord(3, ("a", "b", "c"))
    live = [record("a", 1, after=3), record("b", 2, after=3)]
    result = step(snapshot("a", 0.0, live, current, leader="a"), published(0.0, 3))
    assert result.action is Action.FORM_ROUND
    assert result.participants == ("a", "b") and "every live node" in result.reason


def test_a_member_still_running_is_awaited_until_rejoin_timeout() -> None:
    current = RoundRecord(3, ("a", "b", "c"))
    live = [record("a", 1, after=3), record("b", 2, after=3), record("c", 3, after=2)]
    waiting = step(snapshot("a", 0.0, live, current, leader="a"), published(0.0, 3))
    assert waiting.action is Action.WAIT
    hung = step(snapshot("a", CONFIG.rejoin_timeout, live, current, leader="a"), waiting.progress)
    assert hung.action is Action.FORM_ROUND and hung.participants == ("a", "b")


def test_rejoin_after_a_round_returns_only_a_newer_round() -> None:
    """A node that ran round 2 and called next_rendezvous again is not admitted by round 2."""
    current = RoundRecord(2, ("a", "b"))
    progress = step(snapshot("a", 0.0, [], current), WaitProgress(last_round=2)).progress
    me = [record("a", 1, after=progress.after_round)]
    assert step(snapshot("a", 0.1, me, current, leader="b"), progress).action is Action.WAIT
    newer = RoundRecord(3, ("b", "a"))
    assert step(snapshot("a", 0.2, me, newer), progress).action is Action.RETURN_ROUND


def test_spare_past_max_waits_without_a_deadline_while_the_full_round_runs() -> None:
    current = RoundRecord(1, ("a", "b", "c"))
    me = [record("z", 9, after=0)]
    late = CONFIG.join_timeout + 100.0
    spare = step(snapshot("z", late, me, current, leader="z", follows_all=False), published())
    # a spare that leads reads everything first
    assert spare.action is Action.FOLLOW_ALL
    waiting = step(snapshot("z", late, me, current, leader="x"), published())
    assert waiting.action is Action.WAIT_AS_SPARE
    assert waiting.progress.deadline == late + CONFIG.join_timeout
    # the leading spare sees the full round healthy: still a spare
    running = [record(n, i, after=0, waiting=False) for i, n in enumerate("abc")]
    leading = step(snapshot("z", late, running + me, current, leader="z"), published())
    assert leading.action is Action.WAIT_AS_SPARE


def test_spare_takes_a_freed_place() -> None:
    current = RoundRecord(1, ("a", "b", "c"))
    live = [
        record("a", 1, after=1),  # restarting after c died
        record("b", 2, after=1),
        record("z", 9, after=0),
    ]
    result = step(snapshot("z", 5.0, live, current, leader="z"), published())
    assert result.action is Action.FORM_ROUND and result.participants == ("a", "b", "z")


def test_join_timeout_fails_with_what_the_node_saw() -> None:
    progress = published(0.0)
    live = [record("a", 1)]
    result = step(snapshot("a", CONFIG.join_timeout, live, leader="a", progress=progress), progress)
    assert result.action is Action.FAIL_TIMEOUT
    assert "join_timeout=600.0s (1 waiting, 1 live)" in result.reason
    follower = step(snapshot("b", CONFIG.join_timeout, [record("b", 2)], leader="a"), progress)
    assert follower.action is Action.FAIL_TIMEOUT and "(leader a)" in follower.reason


def test_waits_never_pass_the_deadline() -> None:
    progress = published(0.0)
    result = step(snapshot("b", CONFIG.join_timeout - 0.25, [record("b", 2)], leader="a"), progress)
    assert result.action is Action.WAIT and result.wait_s == pytest.approx(0.25)


def test_a_step_that_needs_every_record_refuses_a_snapshot_without_them() -> None:
    live = [record("a", 1), record("b", 2)]
    snap = snapshot("a", 0.0, live, leader="a")
    assert snap.view.live is not None
    with pytest.raises(ValueError, match="needs_records"):
        step(replace(snap, view=replace(snap.view, live=None)), published())


def test_records_are_read_only_when_a_step_uses_them() -> None:
    view = Status(1, NO_ROUND, record("a", 1), LeaderRecord("a"), 1, True)
    assert not needs_records(view, "a", 600.0, 0.0, 2, 3)  # leader below MIN: O(1)
    assert needs_records(replace(view, waiting_count=2), "a", 600.0, 0.0, 2, 3)
    assert not needs_records(replace(view, waiting_count=2), "b", 600.0, 0.0, 2, 3)
    assert needs_records(view, "a", 600.0, 600.0, 2, 3)  # timeout message counts them
    assert not needs_records(replace(view, follows_all=False), "a", 0.0, 1.0, 2, 3)
