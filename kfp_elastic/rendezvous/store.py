"""The c10d ``Store`` torchrun's agent needs, kept in etcd under one round's prefix.

Blocking calls (``get``, ``wait``) wait on an etcd watch, not a sleep loop. Keys carry the round
number in their prefix, so a late writer from an old round can never corrupt a new one. Values
are stored as the bytes torch gives us; counters of ``add`` are decimal text like TCPStore's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from pyetcd.client import MultiEndpointEtcd3Client

from kfp_elastic.contract.rendezvous_config import DEFAULT_STORE_TIMEOUT_S
from kfp_elastic.etcd.keys import prefix_range_end
from kfp_elastic.etcd.transactions import unchanged_since

log = logging.getLogger("kfp_elastic.rendezvous.store")


class RoundBrokenError(dist.DistStoreError):
    """A wait for keys ended because the round broke (a node left or joined): the keys of a node
    that left never come. ``broken_round.py`` has torchrun join the next round on it."""


DEFAULT_STORE_TIMEOUT = timedelta(seconds=DEFAULT_STORE_TIMEOUT_S)
# How often a blocked wait asks whether its round broke.
ABORT_CHECK_S = 0.2
# The keys of torch's exit barrier (``torch.distributed.elastic``: ``_TERMINAL_STATE_SYNC_ID``
# and ``store.barrier``'s suffixes): an agent whose workers ended adds itself to num_members,
# the last one sets last_member, and every agent waits for that key.
EXIT_BARRIER_PREFIX = "torchelastic/agent/terminal_state"
EXIT_BARRIER_MEMBERS = EXIT_BARRIER_PREFIX + "/num_members"
EXIT_BARRIER_DONE = EXIT_BARRIER_PREFIX + "/last_member"
_FINISHED = EXIT_BARRIER_PREFIX + "/finished/"


@dataclass(frozen=True)
class ExitBarrier:
    """This node and its round, for a bounded exit barrier that names who did not finish.

    torch waits up to 300 s there for every other agent; a node whose worker hangs at its end
    would hold a finished job for 5 minutes. ``timeout_s`` is ``exit_barrier_timeout``."""

    node_id: str
    participants: tuple[str, ...]
    timeout_s: float


def unfinished(participants: Sequence[str], finished: set[str]) -> list[str]:
    """The round's nodes that have not reached the exit barrier, in rank order."""
    return [node for node in participants if node not in finished]


def _as_bytes(value: str | bytes | Sequence[int]) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class EtcdStore(dist.Store):
    def __init__(
        self,
        client: MultiEndpointEtcd3Client,
        prefix: str,
        lease_id: int = 0,
        timeout: timedelta = DEFAULT_STORE_TIMEOUT,
        abort_if: Callable[[], bool] | None = None,
        exit_barrier: ExitBarrier | None = None,
    ) -> None:
        """``abort_if()`` true ends a blocking wait early (the round it belongs to broke);
        ``exit_barrier`` bounds torch's exit barrier and names the nodes it waited for."""
        super().__init__()
        self._client = client
        self._abort_if = abort_if
        self._exit_barrier = exit_barrier
        self._prefix = prefix
        self._lease = lease_id or None
        self.set_timeout(timeout)

    @property
    def prefix(self) -> str:
        return self._prefix

    def _key(self, key: str) -> str:
        return self._prefix + key

    # -- writes -------------------------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self._client.put(self._key(key), _as_bytes(value), lease=self._lease)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        tx = self._client.transactions
        self._client.transaction(
            failure=[],
            compare=[],
            success=[
                tx.put(self._key(k), _as_bytes(v), lease=self._lease)
                for k, v in zip(keys, values, strict=True)
            ],
        )

    def add(self, key: str, amount: int) -> int:
        full_key, tx = self._key(key), self._client.transactions
        while True:
            value, meta = self._client.get(full_key)
            current = int(value) if value is not None else 0
            new = current + amount
            guard = unchanged_since(
                self._client, full_key, meta.mod_revision if meta is not None else 0
            )
            ok, _ = self._client.transaction(
                failure=[], compare=[guard], success=[tx.put(full_key, str(new), lease=self._lease)]
            )
            if ok:
                if key == EXIT_BARRIER_MEMBERS and self._exit_barrier is not None:
                    self.set(_FINISHED + self._exit_barrier.node_id, b"")
                return new

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        full_key, tx = self._key(key), self._client.transactions
        expected_b, desired_b = _as_bytes(expected), _as_bytes(desired)
        while True:
            value, meta = self._client.get(full_key)
            if value is None:
                if expected_b:
                    return expected_b
            elif value != expected_b:
                return value
            guard = unchanged_since(
                self._client, full_key, meta.mod_revision if value is not None else 0
            )
            ok, _ = self._client.transaction(
                failure=[],
                compare=[guard],
                success=[tx.put(full_key, desired_b, lease=self._lease)],
            )
            if ok:
                return desired_b

    def delete_key(self, key: str) -> bool:
        response = self._client.delete(self._key(key), return_response=True)
        return response.deleted > 0

    # -- reads --------------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        return self._wait_for([key], None)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._wait_for(keys, None)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_for(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        present, _ = self._read(keys)
        return all(self._key(k) in present for k in keys)

    def num_keys(self) -> int:
        response = self._client.get_range_response(
            self._prefix, prefix_range_end(self._prefix), keys_only=True
        )
        return len(response.kvs)

    def _read(self, keys: list[str]) -> tuple[dict[str, bytes], int]:
        response = self._client.get_range_response(self._prefix, prefix_range_end(self._prefix))
        wanted = {self._key(k) for k in keys}
        present = {kv.key.decode(): kv.value for kv in response.kvs if kv.key.decode() in wanted}
        return present, response.header.revision

    def _wait_for(self, keys: list[str], timeout: timedelta | None) -> list[bytes]:
        limit = (timeout or self.timeout).total_seconds()
        if keys == [EXIT_BARRIER_DONE] and self._exit_barrier is not None:
            limit = min(limit, self._exit_barrier.timeout_s)
            try:
                return self._wait_until(keys, limit)
            except dist.DistStoreError:
                raise self._exit_barrier_error() from None
        return self._wait_until(keys, limit)

    def _exit_barrier_error(self) -> dist.DistStoreError:
        assert self._exit_barrier is not None
        response = self._client.get_range_response(
            self._key(_FINISHED), prefix_range_end(self._key(_FINISHED)), keys_only=True
        )
        finished = {kv.key.decode()[len(self._key(_FINISHED)) :] for kv in response.kvs}
        missing = unfinished(self._exit_barrier.participants, finished)
        message = (
            f"elastic-etcd: this node's workers finished, but node(s) {', '.join(missing)} did "
            f"not finish within exit_barrier_timeout={self._exit_barrier.timeout_s:g}s (or the "
            "round broke); not waiting longer"
        )
        log.warning(
            "exit barrier: not finished nodes=%s node=%s",
            ",".join(missing),
            self._exit_barrier.node_id,
        )
        return dist.DistStoreError(message)

    def _wait_until(self, keys: list[str], limit: float) -> list[bytes]:
        deadline = time.monotonic() + limit
        while True:
            present, revision = self._read(keys)
            if all(self._key(k) in present for k in keys):
                return [present[self._key(k)] for k in keys]
            changed = threading.Event()
            watch_id = self._client.add_watch_prefix_callback(
                self._prefix,
                lambda _response, event=changed: event.set(),
                start_revision=revision + 1,
            )
            try:
                while not changed.wait(min(ABORT_CHECK_S, max(0.0, deadline - time.monotonic()))):
                    missing = [k for k in keys if self._key(k) not in present]
                    if self._abort_if is not None and self._abort_if():
                        raise RoundBrokenError(
                            f"elastic-etcd store: round of {self._prefix} broke (a node left or "
                            f"joined) while waiting for keys {missing}"
                        )
                    if time.monotonic() >= deadline:
                        raise dist.DistStoreError(
                            f"elastic-etcd store: keys {missing} under {self._prefix} not set "
                            f"within {limit:.0f}s"
                        )
            finally:
                self._client.cancel_watch(watch_id)
