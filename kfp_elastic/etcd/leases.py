"""Keeping etcd leases alive from one background thread (the rendezvous, the master).

A node keeps two leases alive: its own (its liveness) and the run's shared lease (which holds
the round record and the store, so they vanish ``close_timeout`` after the last node left).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable

from pyetcd.client import MultiEndpointEtcd3Client

log = logging.getLogger(__name__)

# Keep-alives per lease TTL: two in a row may fail (etcd busy, a failover) before it expires.
KEEPALIVES_PER_TTL = 3
# How long ``stop`` waits for the keeper thread; a refresh in flight is bounded by the client's
# request timeout, and the thread is a daemon, so a slow one never holds the process.
STOP_JOIN_TIMEOUT_S = 2.0


def grant(client: MultiEndpointEtcd3Client, ttl: float) -> int:
    return int(client.lease(int(math.ceil(ttl))).id)


class LeaseKeeper:
    """Refreshes leases every ``interval`` (``ttl / KEEPALIVES_PER_TTL``); calls
    ``on_lost(lease_id)`` once one is gone."""

    def __init__(
        self,
        client: MultiEndpointEtcd3Client,
        interval: float,
        on_lost: Callable[[int], None],
    ) -> None:
        self._client = client
        self._interval = interval
        self._on_lost = on_lost
        self._leases: set[int] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="lease-keeper")
        self._thread.start()

    def keep(self, lease_id: int) -> None:
        with self._lock:
            self._leases.add(lease_id)

    def forget(self, lease_id: int) -> None:
        with self._lock:
            self._leases.discard(lease_id)

    def refresh_now(self, lease_id: int) -> bool:
        """One keep-alive; False when etcd says the lease no longer exists."""
        responses = list(self._client.refresh_lease(lease_id))
        return bool(responses) and responses[0].TTL > 0

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=STOP_JOIN_TIMEOUT_S)

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            with self._lock:
                leases = list(self._leases)
            for lease_id in leases:
                try:
                    alive = self.refresh_now(lease_id)
                except Exception as error:  # noqa: BLE001 - etcd away: the TTL decides
                    log.warning("lease refresh failed lease=%x error=%r", lease_id, error)
                    continue
                if not alive:
                    self.forget(lease_id)
                    log.warning("lease gone (expired or revoked) lease=%x", lease_id)
                    self._on_lost(lease_id)
