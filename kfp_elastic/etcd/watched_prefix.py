"""A local copy of one etcd prefix, kept current by a watch.

Reads never go to the network (``num_nodes_waiting`` is called every monitor interval). If the
watch breaks (etcd restarted) or its start revision was compacted, the copy is read again and the
watch resumes from the revision of that read, so no change is ever missed silently.

A copy can be *narrowed*: it then leaves out one sub-prefix except one key under it (a waiting
node follows the round, leader and closed keys and its own record, not every other node's:
N nodes each following all N registrations cost N^2 watch events, ~150 us of gRPC + Python
each, which made a round of 128 nodes take seconds on 2 cores).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pyetcd import exceptions as etcd_errors
from pyetcd.client import MultiEndpointEtcd3Client
from pyetcd.events import DeleteEvent

from kfp_elastic.etcd.keys import prefix_range_end

log = logging.getLogger(__name__)

RESYNC_BACKOFF_S = (0.05, 0.1, 0.2, 0.5, 1.0)
# Changes remembered for ``changes_since``; a reader further behind re-reads the whole copy.
CHANGE_LOG_SIZE = 8192


@dataclass(frozen=True)
class CachedKey:
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


class WatchedPrefix:
    def __init__(
        self,
        client: MultiEndpointEtcd3Client,
        prefix: str,
        hidden: str | None = None,
        shown: str | None = None,
    ) -> None:
        """``hidden``: a sub-prefix left out while narrowed (from the start if given),
        except the key ``shown``."""
        self._client = client
        self._prefix = prefix
        self._hidden = hidden
        self._shown = shown
        self._narrow = hidden is not None  # wanted
        self._loaded_narrow = self._narrow  # what the copy holds
        self._load_lock = threading.Lock()
        self._watch_ids: list[int] = []
        # Bumped by every (re)load: callbacks of earlier watches are ignored.
        self._generation = 0
        self._entries: dict[str, CachedKey] = {}
        self._revision = 0  # highest etcd revision seen
        self._loaded_at = 0  # etcd revision of the last read: older events are in the copy
        # Counts applied changes and loads. Readers follow this, not etcd revisions: the
        # watches of a narrowed copy may deliver their events out of revision order.
        self._position = 0
        self._changed = threading.Condition()
        self._resync_needed = threading.Event()
        self._stopped = threading.Event()
        self._listeners: list[Callable[[], None]] = []
        self._resyncs = 0
        self._thread: threading.Thread | None = None
        # (position, key) of applied changes, oldest first; complete above _log_floor.
        self._log: deque[tuple[int, str]] = deque(maxlen=CHANGE_LOG_SIZE)
        self._log_floor = 0

    # -- reading ------------------------------------------------------------------------------
    def snapshot(self) -> tuple[int, dict[str, CachedKey]]:
        """(position, copy of every entry)."""
        with self._changed:
            return self._position, dict(self._entries)

    def get(self, key: str) -> CachedKey | None:
        with self._changed:
            return self._entries.get(key)

    @property
    def revision(self) -> int:
        """The highest etcd revision the copy has seen."""
        with self._changed:
            return self._revision

    @property
    def position(self) -> int:
        """Moves with every applied change (and every re-read)."""
        with self._changed:
            return self._position

    def changes_since(self, after_position: int) -> tuple[int, dict[str, CachedKey | None] | None]:
        """(position, {key: entry or None if deleted} changed after ``after_position``).

        ``None`` instead of the dict: the changes are not all known (the copy was re-read, or
        the reader is more than CHANGE_LOG_SIZE changes behind); take a ``snapshot``. This is
        what lets N readers follow N writers in O(N) each instead of rescanning O(N) per change.
        """
        with self._changed:
            if after_position < self._log_floor:
                return self._position, None
            changed: dict[str, CachedKey | None] = {}
            for position, key in reversed(self._log):
                if position <= after_position:
                    break
                if key not in changed:
                    changed[key] = self._entries.get(key)
            return self._position, changed

    @property
    def narrow(self) -> bool:
        """Whether the copy leaves the hidden sub-prefix out (as loaded, not as wanted)."""
        return self._loaded_narrow

    def set_narrow(self, narrow: bool, wait: bool = True) -> None:
        """Follow everything (``False``) or leave the hidden sub-prefix out (``True``);
        switching re-reads the copy (one read per range) and watches from that revision.
        If etcd cannot be read now, or ``wait`` is false, the resync loop switches as soon
        as it can (``narrow`` tells what the copy holds until then)."""
        if self._hidden is None or self._stopped.is_set():
            return
        if narrow == self._narrow and narrow == self._loaded_narrow:
            return
        self._narrow = narrow
        if not wait:
            self._resync_needed.set()
            return
        try:
            self._load_and_watch()
        except Exception as error:  # noqa: BLE001 - etcd away: retried like a lost watch
            log.warning("re-read failed, retrying prefix=%s error=%r", self._prefix, error)
            self._resync_needed.set()

    @property
    def resync_count(self) -> int:
        return self._resyncs

    def wait_for_change(self, after_position: int, timeout: float) -> int:
        """Block until the copy moves past ``after_position`` or ``timeout``; return position."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._position <= after_position and not self._stopped.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._changed.wait(remaining)
            return self._position

    def wait_for_key(self, key: str, mod_revision: int, timeout: float) -> bool:
        """Block until the copy has ``key`` at ``mod_revision`` or later (our own write)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not self._stopped.is_set():
                entry = self._entries.get(key)
                if entry is not None and entry.mod_revision >= mod_revision:
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._changed.wait(remaining)
            return False

    def add_listener(self, listener: Callable[[], None]) -> None:
        """``listener()`` runs (on the watch thread) after every applied change; keep it quick."""
        self._listeners.append(listener)

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self, start_revision: int | None = None, timeout: float = 10.0) -> None:
        """Read the prefix and watch it. ``start_revision`` (tests) watches from an older point."""
        try:
            self._load_and_watch(start_revision)
        except etcd_errors.RevisionCompactedError as error:
            log.info(
                "watch start revision compacted, re-reading prefix=%s compacted=%s",
                self._prefix,
                error.compacted_revision,
            )
            self._load_and_watch()
        self._thread = threading.Thread(
            target=self._resync_loop, daemon=True, name=f"watch{self._prefix}"
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop following etcd. Never waits for a load in progress: the agent's SIGTERM handler
        calls this (``leave.py``), and the load may be the very frame the signal interrupted on
        the same thread, holding the lock until the handler returns (a 30 s hang until the
        kubelet's SIGKILL, seen in a preemption). Such a load cancels its watches itself when
        it sees the stop (``_cancel_if_stopped``)."""
        self._stopped.set()
        self._resync_needed.set()
        self._cancel_if_stopped()
        with self._changed:
            self._changed.notify_all()

    # -- internals ----------------------------------------------------------------------------
    def _ranges(self) -> list[tuple[str, str | None]]:
        end = prefix_range_end(self._prefix)
        if not self._narrow or self._hidden is None:
            return [(self._prefix, end)]
        ranges: list[tuple[str, str | None]] = [
            (self._prefix, self._hidden),
            (prefix_range_end(self._hidden), end),
        ]
        return ranges + ([(self._shown, None)] if self._shown else [])

    def _load_and_watch(self, start_revision: int | None = None, resync: bool = False) -> None:
        """``resync``: this load replaces a lost watch; counted as the new copy is published,
        so a reader that sees the re-read data also sees the count."""
        try:
            self._load(start_revision, resync)
        finally:
            self._cancel_if_stopped()  # a stop during the load did not cancel what it started
        self._notify_listeners()

    def _load(self, start_revision: int | None, resync: bool) -> None:
        with self._load_lock:
            self._cancel_watches()
            if self._stopped.is_set():
                return
            narrow = self._narrow
            ranges = self._ranges()
            revision = 0
            entries: dict[str, CachedKey] = {}
            for start, end in ranges:  # all at the revision of the first read
                response = self._client.get_range_response(
                    start, end, **({"revision": revision} if revision else {})
                )
                revision = revision or response.header.revision
                entries.update(
                    {
                        kv.key.decode(): CachedKey(
                            kv.value, kv.create_revision, kv.mod_revision, kv.lease
                        )
                        for kv in response.kvs
                    }
                )
            with self._changed:
                self._generation += 1
                generation = self._generation
                self._entries = entries
                self._revision = max(self._revision, revision)
                self._loaded_at = revision
                self._loaded_narrow = narrow
                self._resyncs += int(resync)
                self._position += 1
                self._log.clear()
                self._log_floor = self._position
                self._changed.notify_all()
            watch_from = revision + 1 if start_revision is None else start_revision
            callback = functools.partial(self._on_watch, generation)
            for start, end in ranges:
                self._watch_ids.append(
                    self._client.add_watch_callback(
                        start, callback, range_end=end, start_revision=watch_from
                    )
                )

    def _cancel_if_stopped(self) -> None:
        """Cancel the watches once stopped, unless a load holds the lock: that load calls
        this again when it has let go of it, so no watch outlives a stop."""
        if self._stopped.is_set() and self._load_lock.acquire(blocking=False):
            try:
                self._cancel_watches()
            finally:
                self._load_lock.release()

    def _cancel_watches(self) -> None:
        while self._watch_ids:
            watch_id = self._watch_ids.pop()
            try:
                self._client.cancel_watch(watch_id)
            except Exception:  # noqa: BLE001 - a dead stream has no watch to cancel
                pass

    def _on_watch(self, generation: int, response: object) -> None:
        if generation != self._generation:
            return  # a watch of an earlier load (cancelled, or broken and replaced)
        if isinstance(response, BaseException) or response is None:
            if not self._stopped.is_set():
                log.info("watch lost, re-reading prefix=%s error=%r", self._prefix, response)
                self._resync_needed.set()
            return
        with self._changed:
            if generation != self._generation:
                return
            for event in response.events:  # type: ignore[attr-defined]
                if event.mod_revision <= self._loaded_at:
                    continue  # already in the copy (read after the watch started)
                key = event.key.decode()
                if len(self._log) == self._log.maxlen:
                    self._log_floor = self._log[0][0]  # about to be forgotten
                self._position += 1
                self._log.append((self._position, key))
                if isinstance(event, DeleteEvent):
                    self._entries.pop(key, None)
                else:
                    self._entries[key] = CachedKey(
                        event.value, event.create_revision, event.mod_revision, event.lease
                    )
            header_revision = response.header.revision  # type: ignore[attr-defined]
            self._revision = max(self._revision, header_revision)
            self._changed.notify_all()
        self._notify_listeners()

    def _notify_listeners(self) -> None:
        for listener in list(self._listeners):
            try:
                listener()
            except Exception:  # noqa: BLE001 - a listener must not kill the watch thread
                log.exception("cache listener failed prefix=%s", self._prefix)

    def _resync_loop(self) -> None:
        while not self._stopped.is_set():
            self._resync_needed.wait()
            if self._stopped.is_set():
                return
            self._resync_needed.clear()
            for attempt in range(10**9):
                if self._stopped.is_set():
                    return
                switching = self._narrow != self._loaded_narrow  # asked for, not a lost watch
                try:
                    self._load_and_watch(resync=not switching)
                    if not switching:
                        log.info("watch resumed prefix=%s revision=%d", self._prefix, self.revision)
                    break
                except Exception as error:  # noqa: BLE001 - etcd down: try again later
                    delay = RESYNC_BACKOFF_S[min(attempt, len(RESYNC_BACKOFF_S) - 1)]
                    log.debug("re-read failed prefix=%s error=%r", self._prefix, error)
                    self._stopped.wait(delay)
