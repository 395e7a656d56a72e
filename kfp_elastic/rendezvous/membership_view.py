"""A node's parsed view of the rendezvous keys, updated change by change.

Each of N agents sees every one of N registrations; re-parsing and re-sorting all N records at
each of them made forming a round O(N^2) per agent (128 agents on 2 cores did not form in
60 s). This view applies only the keys that changed and keeps the waiting nodes ordered by
registration, so the leader's "are MIN nodes waiting" is O(1) per change. A waiting node that
does not lead sees only its own record and the round, leader and closed keys (a narrowed
``WatchedPrefix``). No I/O: it is fed by ``WatchedPrefix.changes_since`` / ``snapshot``.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from kfp_elastic.etcd.keys import RunKeys
from kfp_elastic.rendezvous.round_formation import (
    NO_ROUND,
    LeaderRecord,
    NodeRecord,
    RoundRecord,
    is_waiting,
)


class Entry(Protocol):
    value: bytes
    create_revision: int


@dataclass(frozen=True)
class Status:
    """What a node sees at one cache position (``revision``)."""

    revision: int
    round: RoundRecord
    me: NodeRecord | None
    leader: LeaderRecord | None
    waiting_count: int = 0  # nodes waiting among the records seen (``waiting_count``)
    follows_all: bool = False  # the records seen are every node's, not only ours
    live: tuple[NodeRecord, ...] | None = None  # every record seen, when asked for (O(N))


class MembershipView:
    def __init__(self, keys: RunKeys) -> None:
        self._keys = keys
        self.revision = -1
        self.round = NO_ROUND
        self.records: dict[str, NodeRecord] = {}
        self.leader: LeaderRecord | None = None
        # (create_revision, node_id) of waiting nodes (is_waiting under self.round), sorted.
        self._waiting: list[tuple[int, str]] = []
        self.live_version = 0

    def waiting_count(self) -> int:
        """Nodes waiting (``round_formation.waiting_nodes``) among the records seen, in O(1)."""
        return len(self._waiting)

    def reset(self, revision: int, entries: Mapping[str, Entry]) -> None:
        self.records = {}
        self.round = NO_ROUND
        self.leader = None
        for key, entry in entries.items():
            self._apply_one(key, entry)
        self.live_version += 1
        self._rebuild_waiting()
        self.revision = revision

    def apply(self, revision: int, changed: Mapping[str, Entry | None]) -> None:
        previous_round = self.round
        for key, entry in changed.items():
            self._apply_one(key, entry)
        if self.round != previous_round:
            self._rebuild_waiting()
        self.revision = revision

    # -- internals ----------------------------------------------------------------------------
    def _apply_one(self, key: str, entry: Entry | None) -> None:
        if key == self._keys.round:
            if entry is None:
                self.round = NO_ROUND
            else:
                with contextlib.suppress(ValueError, KeyError):
                    self.round = RoundRecord.from_json(entry.value)
            return
        if key == self._keys.leader:
            self.leader = None
            if entry is not None:
                with contextlib.suppress(ValueError, KeyError):
                    self.leader = LeaderRecord.from_json(entry.value)
            return
        if not key.startswith(self._keys.nodes):
            return
        node_id = key[len(self._keys.nodes) :]
        old = self.records.pop(node_id, None)
        if old is not None:
            self._unlist(old)
        new = None
        if entry is not None:
            with contextlib.suppress(ValueError, KeyError):
                new = NodeRecord.from_json(node_id, entry.create_revision, entry.value)
        if new is not None:
            self.records[node_id] = new
            self._list(new)
        if _ring_key(old) != _ring_key(new):
            self.live_version += 1

    def _list(self, record: NodeRecord) -> None:
        if is_waiting(record, self.round):
            bisect.insort(self._waiting, (record.create_revision, record.node_id))

    def _unlist(self, record: NodeRecord) -> None:
        item = (record.create_revision, record.node_id)
        index = bisect.bisect_left(self._waiting, item)
        if index < len(self._waiting) and self._waiting[index] == item:
            del self._waiting[index]

    def _rebuild_waiting(self) -> None:
        self._waiting = sorted(
            (r.create_revision, r.node_id)
            for r in self.records.values()
            if is_waiting(r, self.round)
        )


def _ring_key(record: NodeRecord | None) -> tuple[int, int, str] | None:
    """What the probe ring depends on: registration order, lease, probe address."""
    return None if record is None else (record.create_revision, record.lease, record.probe)
