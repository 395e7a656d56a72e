"""A leader key, and writes guarded by holding it (like etcd's ``clientv3/concurrency`` election).

A candidate *campaigns* by creating the key, bound to its own lease, in a transaction that
succeeds only if nobody holds it (plus the caller's own compares and operations in the same
transaction). The key's value names the holder. A *guarded* write runs only while the key still
holds that value: a holder whose lease expired (the key vanished with it) or who was replaced
cannot overwrite its successor's writes. Resigning deletes the key, or revokes the lease.

Two elections use it. The master's (``master/state.py``): one leader per run; a master blocks
in :meth:`LeaderKey.wait_until_vacant` until it may try again, and every write of its state is
guarded (:meth:`LeaderKey.write`, which tells a failed compare of its own from a lost key). The
rendezvous' (``rendezvous/membership.py``): one deciding node per round; a node tries once per
step, with its record or the round it saw in the same transaction, and hands the key on
(:meth:`LeaderKey.resign_op`) in the transaction that writes the round.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Sequence
from typing import Any

from pyetcd.client import MultiEndpointEtcd3Client
from pyetcd.events import DeleteEvent

from kfp_elastic.etcd.transactions import absent

# How often :meth:`LeaderKey.wait_until_vacant` reads the key besides watching it: a broken
# watch must not hang a waiting candidate.
VACANCY_POLL_S = 1.0


class WriteOutcome(enum.Enum):
    WRITTEN = "written"
    REFUSED = "refused"  # one of the caller's own compares failed; the key is still ours
    NOT_HOLDER = "not holder"  # the key is gone or holds another value


class LeaderKey:
    """The leader key ``key`` of one election."""

    def __init__(self, client: MultiEndpointEtcd3Client, key: str) -> None:
        self.client = client
        self.key = key

    # -- compares and operations, for transactions that do more than the election -------------
    def vacant(self) -> Any:
        """The compare "nobody holds the key"."""
        return absent(self.client, self.key)

    def held_by(self, value: str) -> Any:
        """The compare "the key holds ``value``" (its holder is still the one we know)."""
        return self.client.transactions.value(self.key) == value

    def claim_op(self, value: str, lease: int) -> Any:
        """The operation that takes the key for ``value``, bound to ``lease``."""
        return self.client.transactions.put(self.key, value, lease=lease)

    def resign_op(self) -> Any:
        """The operation that gives the key up (the next candidate may take it)."""
        return self.client.transactions.delete(self.key)

    def read_op(self) -> Any:
        return self.client.transactions.get(self.key)

    # -- whole transactions -------------------------------------------------------------------
    def campaign(
        self,
        value: str,
        lease: int,
        *,
        compare: Sequence[Any] = (),
        success: Sequence[Any] = (),
        failure: Sequence[Any] = (),
    ) -> tuple[bool, list[Any]]:
        """One transaction: if the key is vacant and ``compare`` holds, run ``success`` and take
        the key (its response is the last); else ``failure``. Returns (won, responses)."""
        return self.client.transaction(
            compare=[self.vacant(), *compare],
            success=[*success, self.claim_op(value, lease)],
            failure=list(failure),
        )

    def guarded(
        self,
        value: str,
        success: Sequence[Any],
        *,
        compare: Sequence[Any] = (),
        failure: Sequence[Any] = (),
    ) -> tuple[bool, list[Any]]:
        """One transaction: ``success`` if the key still holds ``value`` and ``compare`` holds,
        else ``failure``. Returns (succeeded, responses)."""
        return self.client.transaction(
            compare=[self.held_by(value), *compare],
            success=list(success),
            failure=list(failure),
        )

    def write(
        self, value: str, success: Sequence[Any], compare: Sequence[Any] = ()
    ) -> WriteOutcome:
        """:meth:`guarded`, reading the key back when it fails: tells a compare of the caller's
        that failed (``REFUSED``) from a key that is no longer ours (``NOT_HOLDER``)."""
        ok, responses = self.guarded(value, success, compare=compare, failure=[self.read_op()])
        if ok:
            return WriteOutcome.WRITTEN
        rows = responses[0] if responses else []
        if not rows or rows[0][0].decode() != value:
            return WriteOutcome.NOT_HOLDER
        return WriteOutcome.REFUSED

    def holder(self) -> bytes | None:
        """The key's value now (None: vacant)."""
        return self.client.get(self.key)[0]

    def wait_until_vacant(
        self, after_revision: int, stop: threading.Event, deadline: float | None
    ) -> bool:
        """Watch the key from after ``after_revision`` (the holder's write we saw) until it is
        deleted; False on ``stop`` or at ``deadline`` (``time.monotonic()``). Every
        ``VACANCY_POLL_S`` the key is read as well (a broken watch must not hang us)."""
        gone = threading.Event()

        def on_event(response: Any) -> None:
            if isinstance(response, BaseException) or response is None:
                gone.set()  # watch broken: re-check by reading
                return
            if any(isinstance(e, DeleteEvent) for e in response.events):
                gone.set()

        watch_id = self.client.add_watch_callback(
            self.key, on_event, start_revision=after_revision + 1
        )
        try:
            while not gone.is_set():
                if stop.is_set() or (deadline is not None and time.monotonic() >= deadline):
                    return False
                if gone.wait(VACANCY_POLL_S):
                    break
                if self.holder() is None:
                    break
            return True
        finally:
            try:
                self.client.cancel_watch(watch_id)
            except Exception:  # noqa: BLE001 - a broken stream has nothing to cancel
                pass
