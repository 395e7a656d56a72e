"""Pure round-formation rules: who is waiting, who leads, when a round forms and with whom.

No I/O and no clocks of their own: the caller passes a view of etcd (from its watched cache)
and its own monotonic ``now``. Host clocks are never compared.

Vocabulary
- A *node* is one torchrun agent, registered under its own etcd lease (live while the key exists).
- A node *waits* from the moment it calls ``next_rendezvous`` until a round newer than the one
  it left (``after_round``) lists it.
- A *round* is numbered from 1; its participant list gives the ranks (index = group rank).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeRecord:
    node_id: str
    create_revision: int  # registration order: earlier registered, lower revision
    waiting: bool
    after_round: int
    addr: str = ""
    probe: str = ""  # "host:port" of the node's liveness probe listener, "" if none
    lease: int = 0

    def to_json(self) -> str:
        return json.dumps(
            {
                "waiting": self.waiting,
                "after_round": self.after_round,
                "addr": self.addr,
                "probe": self.probe,
                "lease": self.lease,
            }
        )

    @classmethod
    def from_json(cls, node_id: str, create_revision: int, text: bytes | str) -> NodeRecord:
        data = json.loads(text)
        return cls(
            node_id=node_id,
            create_revision=create_revision,
            waiting=bool(data["waiting"]),
            after_round=int(data["after_round"]),
            addr=str(data.get("addr", "")),
            probe=str(data.get("probe", "")),
            lease=int(data.get("lease", 0)),
        )


#: Earlier rounds a round record keeps (``RoundRecord.history``): enough for a master that was
#: away to put every round on the timeline with the time it formed.
ROUND_HISTORY = 16


@dataclass(frozen=True)
class RoundRecord:
    number: int
    participants: tuple[str, ...]
    run_lease: int = 0
    # The forming leader's unix time: the timeline stamps the round with it, not with when a
    # master first saw the round (``master/observer.py``). 0.0: written by an older leader.
    formed_at: float = 0.0
    # (number, formed_at, nodes) of the rounds before this one, oldest first (ROUND_HISTORY).
    history: tuple[tuple[int, float, int], ...] = ()

    def followed_by(
        self, number: int, participants: tuple[str, ...], run_lease: int, formed_at: float
    ) -> RoundRecord:
        """The round after this one (which joins the history, unless it is no round)."""
        history = self.history
        if self.number:
            history = (*history, (self.number, self.formed_at, len(self.participants)))
        return RoundRecord(number, participants, run_lease, formed_at, history[-ROUND_HISTORY:])

    def to_json(self) -> str:
        return json.dumps(
            {
                "round": self.number,
                "participants": list(self.participants),
                "run_lease": self.run_lease,
                "t": self.formed_at,
                "history": [list(entry) for entry in self.history],
            }
        )

    @classmethod
    def from_json(cls, text: bytes | str) -> RoundRecord:
        data = json.loads(text)
        return cls(
            number=int(data["round"]),
            participants=tuple(data["participants"]),
            run_lease=int(data.get("run_lease", 0)),
            formed_at=float(data.get("t", 0.0)),
            history=tuple(
                (int(n), float(t), int(nodes)) for n, t, nodes in data.get("history", ())
            ),
        )

    def rank_of(self, node_id: str) -> int | None:
        try:
            return self.participants.index(node_id)
        except ValueError:
            return None


NO_ROUND = RoundRecord(number=0, participants=())


@dataclass(frozen=True)
class LeaderRecord:
    """The waiting node that decides (it created the leader key, bound to its lease)."""

    node_id: str
    lease: int = 0
    probe: str = ""  # waiting nodes probe the leader: a dead one is replaced at once

    def to_json(self) -> str:
        return json.dumps({"node": self.node_id, "lease": self.lease, "probe": self.probe})

    @classmethod
    def from_json(cls, text: bytes | str) -> LeaderRecord:
        data = json.loads(text)
        return cls(
            node_id=str(data["node"]),
            lease=int(data.get("lease", 0)),
            probe=str(data.get("probe", "")),
        )


@dataclass(frozen=True)
class MasterRecord:
    """Where round ``round``'s workers bootstrap (MASTER_ADDR/PORT): rank 0's host and a port
    free there; the value of ``rdzv/rank0`` (``bootstrap.py``)."""

    round: int
    node_id: str  # rank 0, who picked the port on its host
    addr: str
    port: int

    def to_json(self) -> str:
        return json.dumps(
            {"round": self.round, "node": self.node_id, "addr": self.addr, "port": self.port}
        )

    @classmethod
    def from_json(cls, text: bytes | str) -> MasterRecord:
        data = json.loads(text)
        return cls(
            round=int(data["round"]),
            node_id=str(data["node"]),
            addr=str(data["addr"]),
            port=int(data["port"]),
        )


def is_admitted(node: NodeRecord, current: RoundRecord) -> bool:
    return current.number > node.after_round and node.node_id in current.participants


def is_waiting(node: NodeRecord, current: RoundRecord) -> bool:
    return node.waiting and not is_admitted(node, current)


def waiting_nodes(live: Iterable[NodeRecord], current: RoundRecord) -> list[NodeRecord]:
    return sorted((n for n in live if is_waiting(n, current)), key=lambda n: n.create_revision)


def leader_of(live: Iterable[NodeRecord], current: RoundRecord) -> str | None:
    """The earliest-registered waiting node decides; there is at most one at any view."""
    waiting = waiting_nodes(live, current)
    return waiting[0].node_id if waiting else None


def nodes_waiting_count(live: Sequence[NodeRecord], current: RoundRecord, max_nodes: int) -> int:
    """What a running member's ``num_nodes_waiting()`` answers: > 0 means "restart now".

    A participant that lost its lease or restarted forces a new round; newcomers force one only
    while the round has room (past max they wait on the redundancy list).
    """
    live_ids = {n.node_id for n in live}
    lost = [p for p in current.participants if p not in live_ids]
    waiting = waiting_nodes(live, current)
    restarting = [n for n in waiting if n.node_id in current.participants]
    newcomers = [n for n in waiting if n.node_id not in current.participants]
    if lost or restarting:
        return len(lost) + len(restarting) + len(newcomers)
    return len(newcomers) if len(current.participants) < max_nodes else 0


def is_full_and_healthy(live: Sequence[NodeRecord], current: RoundRecord, max_nodes: int) -> bool:
    """Every place of the round is taken by a live node that is still running in it."""
    running = {n.node_id for n in live if not is_waiting(n, current)}
    return len(current.participants) >= max_nodes and all(
        p in running for p in current.participants
    )


@dataclass(frozen=True)
class Decision:
    form: bool
    participants: tuple[str, ...] = ()
    reason: str = ""
    # Leader's monotonic time at which to decide again (last call ends); None: on next change.
    recheck_at: float | None = None


@dataclass(frozen=True)
class LastCallClock:
    """The leader's own record of when enough nodes first waited (monotonic seconds)."""

    min_reached_at: float | None = None

    def observed(self, enough: bool, now: float) -> LastCallClock:
        """The clock after seeing whether MIN nodes wait at ``now``."""
        if not enough:
            return LastCallClock(None)
        return self if self.min_reached_at is not None else LastCallClock(now)


def decide(
    live: Sequence[NodeRecord],
    current: RoundRecord,
    min_nodes: int,
    max_nodes: int,
    now: float,
    min_reached_at: float | None,
    last_call_timeout: float,
    rejoin_timeout: float = 30.0,
) -> Decision:
    """Should the leader form round ``current.number + 1`` now, and with whom?

    - fewer than min waiting, or the round is full and every member still runs in it: wait;
    - max waiting: form at once;
    - first round: form when the last call (``last_call_timeout`` after min was reached) ends;
    - later rounds: members still running the old round have been told to restart
      (``num_nodes_waiting``), so wait for them, at most ``rejoin_timeout`` (a hung member);
      once every live node waits, form at once: nobody else is coming. This is what makes
      recovery after a loss fast.
    Previous participants come first, then by registration order; past max, nodes stay waiting.
    """
    waiting = waiting_nodes(live, current)
    if len(waiting) < min_nodes:
        return Decision(False, reason=f"{len(waiting)} of min {min_nodes} nodes waiting")
    if is_full_and_healthy(live, current, max_nodes):
        return Decision(False, reason=f"round {current.number} is full and healthy")
    previous = set(current.participants)
    ordered = sorted(waiting, key=lambda n: (n.node_id not in previous, n.create_revision))
    chosen = tuple(n.node_id for n in ordered[:max_nodes])
    if len(waiting) >= max_nodes:
        return Decision(True, chosen, reason=f"max {max_nodes} nodes waiting")
    if current.number > 0 and len(waiting) == len(live):
        return Decision(True, chosen, reason="every live node is waiting")
    started = now if min_reached_at is None else min_reached_at
    if current.number == 0:
        timeout, why = last_call_timeout, f"last call of {last_call_timeout}s ended"
    else:
        timeout, why = rejoin_timeout, f"members did not rejoin within {rejoin_timeout}s"
    if now >= started + timeout:
        return Decision(True, chosen, reason=why)
    return Decision(
        False,
        reason="last call" if current.number == 0 else "members rejoining",
        recheck_at=started + timeout,
    )
