"""The incremental membership view agrees with the pure rules on every change sequence."""

from __future__ import annotations

import random
from dataclasses import dataclass

from kfp_elastic.etcd.keys import RunKeys
from kfp_elastic.rendezvous.membership_view import MembershipView
from kfp_elastic.rendezvous.round_formation import (
    LeaderRecord,
    NodeRecord,
    RoundRecord,
    waiting_nodes,
)

KEYS = RunKeys("/p/run")


@dataclass(frozen=True)
class FakeEntry:
    value: bytes
    create_revision: int


def node_entry(
    node_id: str, created: int, waiting: bool, after_round: int, lease: int = 1
) -> FakeEntry:
    record = NodeRecord(node_id, created, waiting, after_round, lease=lease)
    return FakeEntry(record.to_json().encode(), created)


def test_random_change_sequences_match_a_fresh_view() -> None:
    rng = random.Random(7)
    for _ in range(200):
        entries: dict[str, FakeEntry] = {}
        view = MembershipView(KEYS)
        revision = 0
        round_number = 0
        for _ in range(rng.randint(1, 30)):
            revision += 1
            changed: dict[str, FakeEntry | None] = {}
            for _ in range(rng.randint(1, 3)):
                node = f"n{rng.randint(0, 6)}"
                key = KEYS.node(node)
                action = rng.random()
                if action < 0.2:
                    entries.pop(key, None)
                    changed[key] = None
                elif action < 0.8:
                    # etcd gives each key created by its own put a revision of its own
                    created = (
                        entries[key].create_revision
                        if key in entries
                        else revision * 10 + len(changed)
                    )
                    entries[key] = node_entry(
                        node, created, rng.random() < 0.7, rng.randint(0, round_number)
                    )
                    changed[key] = entries[key]
                else:
                    round_number += 1
                    live = sorted(k[len(KEYS.nodes) :] for k in entries)
                    members = tuple(rng.sample(live, rng.randint(0, len(live))))
                    entries[KEYS.round] = FakeEntry(
                        RoundRecord(round_number, members).to_json().encode(), 1
                    )
                    changed[KEYS.round] = entries[KEYS.round]
            view.apply(revision, changed)
            fresh = MembershipView(KEYS)
            fresh.reset(revision, entries)
            assert view.records == fresh.records and view.round == fresh.round
            assert (
                view.waiting_count()
                == fresh.waiting_count()
                == len(waiting_nodes(fresh.records.values(), fresh.round))
            )


def test_live_version_moves_on_ring_changes_only() -> None:
    view = MembershipView(KEYS)
    view.reset(1, {})
    start = view.live_version
    view.apply(2, {KEYS.node("a"): node_entry("a", 2, waiting=True, after_round=0)})
    joined = view.live_version
    assert joined != start
    view.apply(3, {KEYS.node("a"): node_entry("a", 2, waiting=False, after_round=0)})
    assert view.live_version == joined  # "waiting" flipped: the probe ring is the same
    view.apply(4, {KEYS.node("a"): node_entry("a", 2, waiting=False, after_round=0, lease=9)})
    relet = view.live_version
    assert relet != joined  # a new lease: probes must revoke the new one
    view.apply(5, {KEYS.node("a"): None})
    assert view.live_version != relet


def test_the_leader_comes_from_the_leader_key() -> None:
    view = MembershipView(KEYS)
    view.reset(1, {KEYS.node("a"): node_entry("a", 2, waiting=True, after_round=0)})
    assert view.leader is None  # no earliest-node rule: only the key says who leads
    leader = LeaderRecord("b", lease=7, probe="127.0.0.1:9")
    view.apply(2, {KEYS.leader: FakeEntry(leader.to_json().encode(), 2)})
    assert view.leader == leader
    view.apply(3, {KEYS.leader: None})
    assert view.leader is None
