"""One node's membership in a run: its lease and record, the run lease, rounds, closing.

This is the I/O edge of the rendezvous: everything it decides comes from ``round_formation``;
everything it reads comes from the watched cache. The leader key is an election of
``kfp_elastic.etcd.election`` (one deciding node per round).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import grpc
from pyetcd.client import MultiEndpointEtcd3Client

from kfp_elastic.contract.rendezvous_config import RendezvousConfig
from kfp_elastic.etcd.election import LeaderKey
from kfp_elastic.etcd.keys import CLOSED_SUCCEEDED, CLOSED_UNKNOWN, RunKeys, prefix_range_end
from kfp_elastic.etcd.leases import KEEPALIVES_PER_TTL, LeaseKeeper, grant
from kfp_elastic.etcd.records import decode_record
from kfp_elastic.etcd.transactions import put_if_absent, unchanged_since
from kfp_elastic.etcd.watched_prefix import CachedKey, WatchedPrefix
from kfp_elastic.rendezvous.bootstrap import cached_master, master_ops
from kfp_elastic.rendezvous.membership_view import MembershipView, Status
from kfp_elastic.rendezvous.probe import PeerProbe, ProbeTarget
from kfp_elastic.rendezvous.probe_ring import ProbeRing, RingInputs
from kfp_elastic.rendezvous.round_formation import (
    LeaderRecord,
    MasterRecord,
    NodeRecord,
    RoundRecord,
    is_admitted,
)

log = logging.getLogger(__name__)

# etcd refuses a transaction with more than --max-txn-ops compares (default 128): larger rounds
# check their participants with one read instead of one compare each.
MAX_ALIVE_COMPARES = 64


class Membership:
    def __init__(
        self,
        client: MultiEndpointEtcd3Client,
        keys: RunKeys,
        config: RendezvousConfig,
        node_id: str,
        addr: str,
    ) -> None:
        self._client = client
        self._keys = keys
        self._config = config
        self.node_id = node_id
        self._addr = addr
        self._node_lease = 0
        self._run_lease = 0
        self.node_lease_lost = False
        self._record = NodeRecord(node_id, 0, waiting=False, after_round=0, addr=addr)
        # Narrowed (own record + round/leader/closed/run keys) while we wait and do not lead;
        # everything while we lead or are a member (see ``follow_all``).
        self._cache = WatchedPrefix(client, keys.rdzv, hidden=keys.nodes, shown=keys.node(node_id))
        self._election = LeaderKey(client, keys.leader)
        self._leader_value = ""  # the leader key's value while we hold it
        self._view_lock = threading.Lock()
        self._view = MembershipView(keys)
        self._cache.start()
        self._keeper = LeaseKeeper(
            client, config.lease_ttl / KEEPALIVES_PER_TTL, self._on_lease_lost
        )
        self._probe: PeerProbe | None = None
        self._ring: ProbeRing | None = None
        self._left = False
        if config.peer_probe:
            self._probe = PeerProbe(
                "0.0.0.0", self._on_peer_dead, connect_timeout=config.probe_connect_timeout
            )
            self._ring = ProbeRing(self._probe, node_id, config.probe_fanout, self._ring_inputs)
            self._cache.add_listener(self._ring.changed)

    # -- views from the cache -----------------------------------------------------------------
    @property
    def revision(self) -> int:
        """Position of the cache (moves with every change seen; not an etcd revision)."""
        return self._cache.position

    def wait_for_change(self, after_revision: int, timeout: float) -> None:
        self._cache.wait_for_change(after_revision, timeout)

    @property
    def follows_all(self) -> bool:
        """Whether the view has every node's record (leader, member) or only ours."""
        return not self._cache.narrow

    def follow_all(self, everything: bool, wait: bool = True) -> None:
        """Follow every node (to lead, or as a member: ``num_nodes_waiting``) or, while
        waiting without leading, only our record and the round/leader/closed keys: N waiting
        nodes then cost O(N) watch events in all, not N^2. ``wait=False``: switch on the
        cache's thread (``follows_all`` says when it is done)."""
        if self._cache.narrow == (not everything):
            return
        self._cache.set_narrow(not everything, wait)
        if self._ring is not None:
            self._ring.changed()

    def _synced(self) -> MembershipView:
        """The view brought up to the cache's revision (call with ``_view_lock`` held)."""
        view = self._view
        revision, changed = self._cache.changes_since(view.revision)
        if revision != view.revision:
            if changed is None:
                revision, entries = self._cache.snapshot()
                view.reset(revision, entries)
            else:
                view.apply(revision, changed)
        return view

    def view(self) -> tuple[list[NodeRecord], RoundRecord]:
        """Live nodes and the current round (O(live nodes): for deciders, not for waiters).
        Only our own record unless ``follows_all``."""
        with self._view_lock:
            view = self._synced()
            return list(view.records.values()), view.round

    def status(self, records_if: Callable[[Status], bool] | None = None) -> Status:
        """The round, our record, the leader and the waiting count at one revision, in O(1)
        (+ changes seen); with every record seen (O(N)) when ``records_if(status)`` says so."""
        with self._view_lock:
            view = self._synced()
            me = view.records.get(self.node_id)
            if me is not None and me.lease != self._node_lease:
                me = None  # a record of our previous lease, about to expire
            status = Status(
                view.revision,
                view.round,
                me,
                view.leader,
                view.waiting_count(),
                not self._cache.narrow,
            )
            if records_if is not None and records_if(status):
                status = replace(status, live=tuple(view.records.values()))
            return status

    def _ring_inputs(self) -> RingInputs:
        """What the probe ring depends on; ``version`` changes whenever a node appears,
        vanishes or changes lease/probe address, the leader changes, or we start or stop
        following every node."""
        with self._view_lock:
            view = self._synced()
            follows_all = self.follows_all
            return RingInputs(
                (view.live_version, view.leader, follows_all),
                list(view.records.values()),
                view.leader,
                follows_all,
            )

    def my_record(self) -> NodeRecord | None:
        return self.status().me

    def closed(self) -> bool:
        return self._cache.get(self._keys.closed) is not None

    def completed(self) -> bool:
        """Closed by a node whose workers all succeeded (``close_run(CLOSED_SUCCEEDED)``)."""
        entry = self._cache.get(self._keys.closed)
        record = decode_record(entry.value) if entry is not None else None
        return record is not None and record.get("outcome") == CLOSED_SUCCEEDED

    # -- registration -------------------------------------------------------------------------
    def register(self) -> None:
        """(Re)join the run under a fresh node lease.

        The run lease is not needed to wait: the leader creates it with the first round and
        members keep it alive from then on (``keep_run_lease``). Leaving it out here saves a
        grant, a transaction and, for all but one of N nodes starting at once, a revoke."""
        if self._node_lease:
            self._keeper.forget(self._node_lease)
        self._leader_value = ""  # bound to the old lease
        self._node_lease = grant(self._client, self._config.lease_ttl)
        self._keeper.keep(self._node_lease)
        self.node_lease_lost = False
        log.info(
            "registered node=%s lease=%x run=%s",
            self.node_id,
            self._node_lease,
            self._config.run_id,
        )

    def publish(self, waiting: bool, after_round: int) -> None:
        """Write our record and wait until the cache shows it (so absence later means loss).

        The same transaction takes the leader key if nobody holds it (``try_lead``'s rule):
        one request per node instead of a put and, for every node that registers before the
        leader key reaches it, a second transaction."""
        if not self._node_lease:
            self.register()
        self._adopt_run_lease()
        self._record = NodeRecord(
            self.node_id,
            0,
            waiting,
            after_round,
            self._addr,
            self._probe_address(),
            self._node_lease,
        )
        tx = self._client.transactions
        node_key = self._keys.node(self.node_id)
        put_record = tx.put(node_key, self._record.to_json(), lease=self._node_lease)
        lead = self._lead_compare()
        leader = LeaderRecord(self.node_id, self._node_lease, self._probe_address())
        try:
            if lead is None:
                won, responses = self._client.transaction(
                    compare=[], success=[put_record], failure=[put_record]
                )
            else:
                won, responses = self._election.campaign(
                    leader.to_json(),
                    self._node_lease,
                    compare=lead,
                    success=[put_record],
                    failure=[put_record],
                )
        except grpc.RpcError as error:
            if "lease not found" not in str(error.details()):
                raise
            self.register()
            self.publish(waiting, after_round)
            return
        revision = responses[0].response_put.header.revision
        if won and lead is not None:
            self._leader_value = leader.to_json()
            log.info("leading node=%s run=%s", self.node_id, self._config.run_id)
            self._cache.wait_for_key(self._keys.leader, revision, self._config.request_timeout)
        self._cache.wait_for_key(node_key, revision, self._config.request_timeout)

    def _lead_compare(self) -> list[object] | None:
        """The compares under which we may take the leader key, besides nobody holding it: the
        round key is the one we saw; None if the round we see admits us already (the watches of
        a narrowed cache may show the leader key deleted before that round: same transaction)."""
        entry = self._cache.get(self._keys.round)
        if entry is not None and is_admitted(self._record, RoundRecord.from_json(entry.value)):
            return None
        return [self._round_unchanged(entry)]

    def _round_unchanged(self, entry: CachedKey | None) -> object:
        """The compare "the round key is as the cache shows it" (``entry``)."""
        return unchanged_since(
            self._client, self._keys.round, entry.mod_revision if entry is not None else 0
        )

    def is_leader(self) -> bool:
        return bool(self._leader_value)

    def try_lead(self) -> bool:
        """Create the leader key (bound to our lease) if nobody holds it; wait until the cache
        shows it. One request per waiting node when a leader is needed: O(N), not a watch of
        every node by every node."""
        record = LeaderRecord(self.node_id, self._node_lease, self._probe_address())
        tx = self._client.transactions
        lead = self._lead_compare()
        if lead is None:
            return False
        try:
            won, _ = self._election.campaign(
                record.to_json(),
                self._node_lease,
                compare=[*lead, tx.version(self._keys.node(self.node_id)) > 0],
            )
        except grpc.RpcError as error:
            if "lease not found" not in str(error.details()):
                raise
            return False  # our lease is gone: the caller re-registers
        if won:
            self._leader_value = record.to_json()
            log.info("leading node=%s run=%s", self.node_id, self._config.run_id)
            deadline = time.monotonic() + self._config.request_timeout
            while (self.status().leader or LeaderRecord("")).node_id != self.node_id:
                if time.monotonic() >= deadline:
                    break
                self._cache.wait_for_change(self._cache.position, deadline - time.monotonic())
        return bool(won)

    def _probe_address(self) -> str:
        return self._probe.address.replace("0.0.0.0", self._addr) if self._probe else ""

    def _ensure_run_lease(self) -> int:
        entry = self._cache.get(self._keys.run)
        if entry is not None:
            lease = int(json.loads(entry.value)["lease"])
            if lease == self._run_lease:
                return lease
        else:
            lease = grant(self._client, self._config.close_timeout)
            created, _ = put_if_absent(
                self._client, self._keys.run, json.dumps({"lease": lease}), lease=lease
            )
            if not created:
                self._client.revoke_lease(lease)
                value, _ = self._client.get(self._keys.run)
                lease = int(json.loads(value)["lease"]) if value else 0
        if self._run_lease and self._run_lease != lease:
            self._keeper.forget(self._run_lease)
        self._run_lease = lease
        self._keeper.keep(lease)
        return lease

    def _adopt_run_lease(self) -> None:
        """Keep the run's lease alive while we wait, once it exists (no request: the cache has
        it). Spares waiting for a place, or for MIN nodes, then keep the round record and the
        round numbering alive even after every member is gone for longer than close_timeout."""
        entry = self._cache.get(self._keys.run)
        if entry is not None:
            with contextlib.suppress(ValueError, KeyError):
                self.keep_run_lease(int(json.loads(entry.value)["lease"]))

    def keep_run_lease(self, lease_id: int) -> None:
        """Keep the lease of the round we are a member of alive (with the other members)."""
        if not lease_id or lease_id == self._run_lease:
            return
        if self._run_lease:
            self._keeper.forget(self._run_lease)
        self._run_lease = lease_id
        self._keeper.keep(lease_id)

    def _on_lease_lost(self, lease_id: int) -> None:
        if lease_id == self._node_lease:
            self.node_lease_lost = True
        elif lease_id == self._run_lease:
            self._run_lease = 0

    # -- rounds -------------------------------------------------------------------------------
    def form_round(self, current: RoundRecord, participants: tuple[str, ...]) -> int:
        """Write the round after ``current`` if nothing changed since we read ``current``;
        its number (normally ``current.number + 1``), 0 if not written."""
        entry = self._cache.get(self._keys.round)
        cached_number = RoundRecord.from_json(entry.value).number if entry is not None else 0
        if cached_number != current.number:
            return 0  # decided on an outdated view
        run_lease = self._ensure_run_lease()
        tx = self._client.transactions
        guard = self._round_unchanged(entry)
        if not self._leader_value:
            return 0
        # Only the holder of the leader key writes; a leader admitted by its own round hands
        # the key on (the waiting nodes left, spares, race for it).
        hand_on = [self._election.resign_op()] if self.node_id in participants else []
        if len(participants) <= MAX_ALIVE_COMPARES:
            alive = [tx.version(self._keys.node(n)) > 0 for n in participants]
        else:
            alive = []
            if not self._all_registered(participants):
                return 0
        # A round record that vanished (its lease expired) restarts at 0; numbering goes on
        # past every participant's after_round so that the round admits them at once.
        with self._view_lock:
            records = self._view.records
            floor = max((records[n].after_round for n in participants if n in records), default=0)
        new_round = current.followed_by(
            max(current.number, floor) + 1, participants, run_lease, time.time()
        )
        old_store = self._keys.store(current.number)
        # Rank 0 publishes where workers bootstrap; when that is us, with the round itself.
        master = (
            master_ops(
                self._client, self._keys, new_round.number, self.node_id, self._addr, run_lease
            )
            if participants[0] == self.node_id
            else []
        )
        try:
            ok, _ = self._election.guarded(
                self._leader_value,
                compare=[guard, *alive],
                success=[
                    tx.put(self._keys.round, new_round.to_json(), lease=run_lease),
                    tx.delete(old_store, range_end=prefix_range_end(old_store)),
                    *hand_on,
                    *master,
                ],
            )
        except grpc.RpcError as error:
            log.warning("round write failed round=%d error=%s", new_round.number, error.details())
            self._run_lease = 0
            return 0
        if ok and hand_on:
            self._leader_value = ""
        return new_round.number if ok else 0

    def _all_registered(self, participants: tuple[str, ...]) -> bool:
        """One keys-only read: every participant still has its node key (for rounds too large
        for one compare per participant; one that dies right after is caught by the round's
        members as a lost participant, like any later loss)."""
        response = self._client.get_range_response(
            self._keys.nodes, prefix_range_end(self._keys.nodes), keys_only=True
        )
        present = {kv.key.decode()[len(self._keys.nodes) :] for kv in response.kvs}
        missing = set(participants) - present
        if missing:
            log.info("round not written: participants gone nodes=%s", sorted(missing)[:5])
        return not missing

    # -- worker bootstrap (MASTER_ADDR/PORT: ``bootstrap.py``) ---------------------------------
    def master(self, round_number: int) -> MasterRecord | None:
        return cached_master(self._cache, self._keys, round_number)

    def publish_master(self, current: RoundRecord) -> None:
        """As rank 0 of ``current``, unless a newer round replaced it already."""
        entry = self._cache.get(self._keys.round)
        if entry is None or RoundRecord.from_json(entry.value).number != current.number:
            return
        self._client.transaction(
            compare=[self._round_unchanged(entry)],
            failure=[],
            success=master_ops(
                self._client,
                self._keys,
                current.number,
                self.node_id,
                self._addr,
                current.run_lease,
            ),
        )

    def close_run(self, outcome: str = CLOSED_UNKNOWN) -> None:
        if self.closed():
            return  # N nodes shutting down would otherwise send N^2 watch events
        run_lease = self._ensure_run_lease()
        record = {"by": self.node_id, "outcome": outcome}
        self._client.put(self._keys.closed, json.dumps(record), lease=run_lease)

    def leave(self) -> None:
        if self._left:
            return
        self._left = True
        if self._ring is not None:
            self._ring.stop()
        if self._probe is not None:
            self._probe.stop()
        self._keeper.stop()
        self._cache.stop()
        if self._node_lease:
            with contextlib.suppress(Exception):
                self._client.revoke_lease(self._node_lease)

    # -- probes -------------------------------------------------------------------------------
    def _on_peer_dead(self, target: ProbeTarget) -> None:
        try:
            self._client.revoke_lease(target.lease)
            log.warning("revoked lease of dead peer node=%s lease=%x", target.node_id, target.lease)
        except Exception as error:  # noqa: BLE001 - already gone is fine
            log.info("peer lease already gone node=%s error=%r", target.node_id, error)
