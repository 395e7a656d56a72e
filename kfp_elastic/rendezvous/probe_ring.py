"""Which peers a node probes: its ring successors, and the leader while it waits.

Recomputed on one background thread whenever the watched cache changes (debounced: N nodes
registering at once cost one update, not N), and only when something the ring depends on moved
(registration order, leases, probe addresses, the leader, the follow-all switch).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kfp_elastic.rendezvous.probe import PeerProbe, ProbeTarget, ring_successors
from kfp_elastic.rendezvous.round_formation import LeaderRecord, NodeRecord

log = logging.getLogger(__name__)

# Changes of the watched keys come in bursts (a round's records, leases): the ring is
# recomputed once per burst, this long after its first change. Short against any detection
# time the probe offers (internal, not a setting).
PROBE_DEBOUNCE_S = 0.05


@dataclass(frozen=True)
class RingInputs:
    version: tuple[object, ...]  # changes whenever any of the rest changes
    live: Sequence[NodeRecord]
    leader: LeaderRecord | None
    follows_all: bool


class ProbeRing:
    def __init__(
        self, probe: PeerProbe, node_id: str, fanout: int, inputs: Callable[[], RingInputs]
    ) -> None:
        self._probe = probe
        self._node_id = node_id
        self._fanout = fanout
        self._inputs = inputs
        self._ring: list[ProbeTarget] = []  # ring successors, from the last full view
        self._dirty = threading.Event()
        self._stopped = threading.Event()
        threading.Thread(target=self._loop, daemon=True, name="probe-targets").start()

    def changed(self) -> None:
        """Something may have moved (a cache listener: quick, on the watch thread)."""
        self._dirty.set()

    def stop(self) -> None:
        self._stopped.set()
        self._dirty.set()

    def _loop(self) -> None:
        seen: tuple[object, ...] | None = None
        while self._dirty.wait() and not self._stopped.is_set():
            self._stopped.wait(PROBE_DEBOUNCE_S)
            self._dirty.clear()
            if self._stopped.is_set():
                return
            try:
                inputs = self._inputs()
                if inputs.version == seen:
                    continue  # e.g. records flipping "waiting": the ring did not move
                seen = inputs.version
                self._update(inputs)
            except Exception:  # noqa: BLE001 - probing is an optimisation; the lease decides
                log.exception("probe update failed node=%s", self._node_id)

    def _update(self, inputs: RingInputs) -> None:
        if inputs.follows_all:
            order = [n.node_id for n in sorted(inputs.live, key=lambda n: n.create_revision)]
            by_id = {n.node_id: n for n in inputs.live}
            self._ring = [
                ProbeTarget(n, by_id[n].probe, by_id[n].lease)
                for n in ring_successors(order, self._node_id, self._fanout)
                if by_id[n].probe and by_id[n].lease
            ]
        # Waiting without the full view: keep the last ring and probe the leader, so that a
        # dead leader is replaced at once (a dead waiter is found by the leader's ring, by
        # the members of the round it gets into, or by its lease).
        targets = {t.node_id: t for t in self._ring}
        leader = inputs.leader
        if not inputs.follows_all and leader and leader.node_id != self._node_id and leader.probe:
            targets[leader.node_id] = ProbeTarget(leader.node_id, leader.probe, leader.lease)
        self._probe.watch(list(targets.values()))
