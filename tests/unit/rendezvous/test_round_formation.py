"""Round formation rules as pure functions: no etcd, no clocks."""

from kfp_elastic.rendezvous.round_formation import (
    NO_ROUND,
    LastCallClock,
    NodeRecord,
    RoundRecord,
    decide,
    is_waiting,
    leader_of,
    nodes_waiting_count,
)


def node(node_id: str, rev: int, waiting: bool = True, after: int = 0) -> NodeRecord:
    return NodeRecord(node_id, rev, waiting=waiting, after_round=after)


def test_fewer_than_min_waiting_does_not_form() -> None:
    decision = decide(
        [node("a", 1)], NO_ROUND, 2, 3, now=10, min_reached_at=None, last_call_timeout=1
    )
    assert not decision.form
    assert "1 of min 2" in decision.reason


def test_max_waiting_forms_at_once_in_registration_order() -> None:
    live = [node("c", 30), node("a", 10), node("b", 20)]
    decision = decide(live, NO_ROUND, 2, 3, now=0, min_reached_at=0, last_call_timeout=30)
    assert decision.form
    assert decision.participants == ("a", "b", "c")


def test_first_round_waits_for_last_call_then_forms() -> None:
    live = [node("a", 1), node("b", 2)]
    early = decide(live, NO_ROUND, 2, 3, now=5.0, min_reached_at=5.0, last_call_timeout=1)
    assert not early.form and early.recheck_at == 6.0
    late = decide(live, NO_ROUND, 2, 3, now=6.0, min_reached_at=5.0, last_call_timeout=1)
    assert late.form and late.participants == ("a", "b")


def test_reformation_with_every_live_node_waiting_skips_last_call() -> None:
    current = RoundRecord(3, ("a", "b", "c"))
    live = [node("a", 1, after=3), node("b", 2, after=3)]  # c is gone
    decision = decide(live, current, 2, 3, now=0, min_reached_at=0, last_call_timeout=30)
    assert decision.form and decision.participants == ("a", "b")


def test_reformation_waits_while_a_member_still_runs() -> None:
    current = RoundRecord(3, ("a", "b", "c"))
    live = [node("a", 1, after=3), node("b", 2, after=3), node("c", 3, waiting=True, after=2)]
    # c was admitted to round 3 (after_round 2 < 3) so it is running, not waiting.
    assert not is_waiting(live[2], current)
    decision = decide(
        live, current, 2, 4, now=0, min_reached_at=0, last_call_timeout=1, rejoin_timeout=30
    )
    assert not decision.form and decision.recheck_at == 30
    hung = decide(
        live, current, 2, 4, now=31, min_reached_at=0, last_call_timeout=1, rejoin_timeout=30
    )
    assert hung.form and hung.participants == ("a", "b") and "did not rejoin" in hung.reason


def test_previous_participants_keep_their_places_past_max() -> None:
    current = RoundRecord(1, ("b", "c"))
    live = [node("a", 1, after=1), node("b", 2, after=1), node("c", 3, after=1)]
    decision = decide(live, current, 1, 2, now=0, min_reached_at=0, last_call_timeout=1)
    assert decision.participants == ("b", "c")


def test_leader_is_earliest_registered_waiting_node() -> None:
    current = RoundRecord(1, ("a",))
    live = [node("a", 1, after=0), node("b", 5), node("c", 3)]
    assert leader_of(live, current) == "c"  # a is admitted (running), c registered before b


def test_num_nodes_waiting_counts_lost_participants() -> None:
    current = RoundRecord(2, ("a", "b", "c"))
    live = [node("a", 1, after=1), node("b", 2, after=1)]
    assert nodes_waiting_count(live, current, max_nodes=3) == 1


def test_num_nodes_waiting_counts_restarting_members_and_newcomers() -> None:
    current = RoundRecord(2, ("a", "b"))
    live = [node("a", 1, after=2), node("b", 2, after=1), node("d", 9, after=2)]
    assert nodes_waiting_count(live, current, max_nodes=2) == 2  # a restarting, d new


def test_newcomers_past_max_wait_on_the_redundancy_list() -> None:
    current = RoundRecord(2, ("a", "b"))
    live = [node("a", 1, after=1), node("b", 2, after=1), node("z", 9, after=2)]
    assert nodes_waiting_count(live, current, max_nodes=2) == 0
    assert nodes_waiting_count(live, current, max_nodes=3) == 1


def test_last_call_clock_resets_when_nodes_drop_below_min() -> None:
    clock = LastCallClock().observed(True, 1.0)
    assert clock.min_reached_at == 1.0
    clock = clock.observed(True, 2.0)
    assert clock.min_reached_at == 1.0
    clock = clock.observed(False, 3.0)
    assert clock.min_reached_at is None
    assert clock.observed(True, 4.0).min_reached_at == 4.0


def test_records_round_trip_as_json() -> None:
    record = RoundRecord(4, ("a", "b"), run_lease=7)
    assert RoundRecord.from_json(record.to_json()) == record
    n = NodeRecord("a", 3, True, 2, "10.0.0.1", "10.0.0.1:5000", 99)
    assert NodeRecord.from_json("a", 3, n.to_json()) == n


def test_spares_never_form_a_round_over_a_full_healthy_one() -> None:
    current = RoundRecord(1, ("a", "b"))
    live = [node("a", 1, after=0), node("b", 2, after=0), node("z", 9, after=1)]
    decision = decide(live, current, 1, 2, now=100, min_reached_at=0, last_call_timeout=1)
    assert not decision.form and "full and healthy" in decision.reason
