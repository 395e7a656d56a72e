"""One node's membership in a run: its lease and record, the run lease, rounds, closing.

This is the I/O edge of the rendezvous: everything it decides comes from ``round_formation``;
everything it reads comes from the watched cache.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading

import grpc
from pyetcd.client import MultiEndpointEtcd3Client

from .cache import WatchedPrefix
from .config import RendezvousConfig
from .keys import RunKeys, prefix_range_end
from .leases import LeaseKeeper, grant
from .probe import PeerProbe, ProbeTarget, ring_successors
from .round_formation import NO_ROUND, NodeRecord, RoundRecord

log = logging.getLogger(__name__)


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
        self._cache = WatchedPrefix(client, keys.rdzv)
        self._view_lock = threading.Lock()
        self._view_revision = -1
        self._parsed: dict[str, tuple[int, NodeRecord]] = {}
        self._view_live: list[NodeRecord] = []
        self._view_round = NO_ROUND
        self._cache.start()
        self._keeper = LeaseKeeper(client, config.lease_ttl / 3, self._on_lease_lost)
        self._probe: PeerProbe | None = None
        self._left = False
        self._probe_dirty = threading.Event()
        if config.peer_probe:
            self._probe = PeerProbe("0.0.0.0", self._on_peer_dead)
            self._cache.add_listener(self._probe_dirty.set)
            threading.Thread(target=self._probe_loop, daemon=True, name="probe-targets").start()

    # -- views from the cache -----------------------------------------------------------------
    @property
    def revision(self) -> int:
        return self._cache.revision

    def wait_for_change(self, after_revision: int, timeout: float) -> None:
        self._cache.wait_for_change(after_revision, timeout)

    def view(self) -> tuple[list[NodeRecord], RoundRecord]:
        """Live nodes and the current round, parsed once per revision of each key."""
        revision, entries = self._cache.snapshot()
        with self._view_lock:
            if revision == self._view_revision:
                return list(self._view_live), self._view_round
            parsed: dict[str, tuple[int, NodeRecord]] = {}
            current = NO_ROUND
            for key, entry in entries.items():
                if key.startswith(self._keys.nodes):
                    known = self._parsed.get(key)
                    if known is not None and known[0] == entry.mod_revision:
                        parsed[key] = known
                        continue
                    with contextlib.suppress(ValueError, KeyError):
                        record = NodeRecord.from_json(key[len(self._keys.nodes):],
                                                      entry.create_revision, entry.value)
                        parsed[key] = (entry.mod_revision, record)
                elif key == self._keys.round:
                    current = RoundRecord.from_json(entry.value)
            self._parsed = parsed
            self._view_revision = revision
            self._view_live = [record for _, record in parsed.values()]
            self._view_round = current
            return list(self._view_live), current

    def my_record(self) -> NodeRecord | None:
        entry = self._cache.get(self._keys.node(self.node_id))
        if entry is None or entry.lease != self._node_lease:
            return None
        return NodeRecord.from_json(self.node_id, entry.create_revision, entry.value)

    def closed(self) -> bool:
        return self._cache.get(self._keys.closed) is not None

    # -- registration -------------------------------------------------------------------------
    def register(self) -> None:
        """(Re)join the run under a fresh node lease; the run lease is shared or created."""
        self._ensure_run_lease()
        if self._node_lease:
            self._keeper.forget(self._node_lease)
        self._node_lease = grant(self._client, self._config.lease_ttl)
        self._keeper.keep(self._node_lease)
        self.node_lease_lost = False
        log.info("registered node=%s lease=%x run=%s", self.node_id, self._node_lease,
                 self._config.run_id)

    def publish(self, waiting: bool, after_round: int) -> None:
        """Write our record and wait until the cache shows it (so absence later means loss)."""
        if not self._node_lease:
            self.register()
        probe = self._probe.address.replace("0.0.0.0", self._addr) if self._probe else ""
        self._record = NodeRecord(self.node_id, 0, waiting, after_round, self._addr, probe,
                                  self._node_lease)
        try:
            response = self._client.put(self._keys.node(self.node_id), self._record.to_json(),
                                        lease=self._node_lease)
        except grpc.RpcError as error:
            if "lease not found" not in str(error.details()):
                raise
            self.register()
            self.publish(waiting, after_round)
            return
        self._cache.wait_for_change(response.header.revision - 1, self._config.request_timeout)

    def _ensure_run_lease(self) -> int:
        entry = self._cache.get(self._keys.run)
        if entry is not None:
            lease = int(json.loads(entry.value)["lease"])
            if lease == self._run_lease:
                return lease
        else:
            lease = grant(self._client, self._config.close_timeout)
            tx = self._client.transactions
            created, _ = self._client.transaction(
                failure=[],
                compare=[tx.version(self._keys.run) == 0],
                success=[tx.put(self._keys.run, json.dumps({"lease": lease}), lease=lease)],
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

    def _on_lease_lost(self, lease_id: int) -> None:
        if lease_id == self._node_lease:
            self.node_lease_lost = True
        elif lease_id == self._run_lease:
            self._run_lease = 0

    # -- rounds -------------------------------------------------------------------------------
    def form_round(self, current: RoundRecord, participants: tuple[str, ...]) -> bool:
        """Write round ``current.number + 1`` if nothing changed since we read ``current``."""
        entry = self._cache.get(self._keys.round)
        cached_number = RoundRecord.from_json(entry.value).number if entry is not None else 0
        if cached_number != current.number:
            return False  # decided on an outdated view
        run_lease = self._ensure_run_lease()
        tx = self._client.transactions
        guard = (tx.mod(self._keys.round) == entry.mod_revision if entry is not None
                 else tx.version(self._keys.round) == 0)
        alive = [tx.version(self._keys.node(n)) > 0 for n in participants]
        new_round = RoundRecord(current.number + 1, participants, run_lease)
        old_store = self._keys.store(current.number)
        try:
            ok, _ = self._client.transaction(
                failure=[],
                compare=[guard, *alive],
                success=[
                    tx.put(self._keys.round, new_round.to_json(), lease=run_lease),
                    tx.delete(old_store, range_end=prefix_range_end(old_store)),
                ],
            )
        except grpc.RpcError as error:
            log.warning("round write failed round=%d error=%s", new_round.number, error.details())
            self._run_lease = 0
            return False
        return bool(ok)

    def close_run(self) -> None:
        run_lease = self._ensure_run_lease()
        self._client.put(self._keys.closed, json.dumps({"by": self.node_id}), lease=run_lease)

    def leave(self) -> None:
        if self._left:
            return
        self._left = True
        self._probe_dirty.set()
        if self._probe is not None:
            self._probe.stop()
        self._keeper.stop()
        self._cache.stop()
        if self._node_lease:
            with contextlib.suppress(Exception):
                self._client.revoke_lease(self._node_lease)

    # -- probes -------------------------------------------------------------------------------
    def _probe_loop(self) -> None:
        while self._probe_dirty.wait() and not self._left:
            self._probe_dirty.clear()
            try:
                self._update_probes()
            except Exception:  # noqa: BLE001 - probing is an optimisation; the lease decides
                log.exception("probe update failed node=%s", self.node_id)

    def _update_probes(self) -> None:
        if self._probe is None or self._left:
            return
        live, _ = self.view()
        order = [n.node_id for n in sorted(live, key=lambda n: n.create_revision)]
        by_id = {n.node_id: n for n in live}
        targets = [ProbeTarget(n, by_id[n].probe, by_id[n].lease)
                   for n in ring_successors(order, self.node_id, self._config.probe_fanout)
                   if by_id[n].probe and by_id[n].lease]
        self._probe.watch(targets)

    def _on_peer_dead(self, target: ProbeTarget) -> None:
        try:
            self._client.revoke_lease(target.lease)
            log.warning("revoked lease of dead peer node=%s lease=%x", target.node_id,
                        target.lease)
        except Exception as error:  # noqa: BLE001 - already gone is fine
            log.info("peer lease already gone node=%s error=%r", target.node_id, error)
