"""A local copy of one etcd prefix, kept current by a watch.

Reads never go to the network (``num_nodes_waiting`` is called every monitor interval). If the
watch breaks (etcd restarted) or its start revision was compacted, the copy is read again and the
watch resumes from the revision of that read, so no change is ever missed silently.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pyetcd import exceptions as etcd_errors
from pyetcd.client import MultiEndpointEtcd3Client
from pyetcd.events import DeleteEvent

from .keys import prefix_range_end

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
    def __init__(self, client: MultiEndpointEtcd3Client, prefix: str) -> None:
        self._client = client
        self._prefix = prefix
        self._entries: dict[str, CachedKey] = {}
        self._revision = 0
        self._changed = threading.Condition()
        self._watch_id: int | None = None
        self._resync_needed = threading.Event()
        self._stopped = threading.Event()
        self._listeners: list[Callable[[], None]] = []
        self._resyncs = 0
        self._thread: threading.Thread | None = None
        # (mod_revision, key) of applied changes, oldest first; complete above _log_floor.
        self._log: deque[tuple[int, str]] = deque(maxlen=CHANGE_LOG_SIZE)
        self._log_floor = 0

    # -- reading ------------------------------------------------------------------------------
    def snapshot(self) -> tuple[int, dict[str, CachedKey]]:
        with self._changed:
            return self._revision, dict(self._entries)

    def get(self, key: str) -> CachedKey | None:
        with self._changed:
            return self._entries.get(key)

    @property
    def revision(self) -> int:
        with self._changed:
            return self._revision

    def changes_since(self, after_revision: int) -> tuple[int, dict[str, CachedKey | None] | None]:
        """(revision, {key: entry or None if deleted} changed after ``after_revision``).

        ``None`` instead of the dict: the changes are not all known (the copy was re-read, or
        the reader is more than CHANGE_LOG_SIZE changes behind); take a ``snapshot``. This is
        what lets N readers follow N writers in O(N) each instead of rescanning O(N) per change.
        """
        with self._changed:
            if after_revision < self._log_floor:
                return self._revision, None
            changed: dict[str, CachedKey | None] = {}
            for revision, key in reversed(self._log):
                if revision <= after_revision:
                    break
                if key not in changed:
                    changed[key] = self._entries.get(key)
            return self._revision, changed

    @property
    def resync_count(self) -> int:
        return self._resyncs

    def wait_for_change(self, after_revision: int, timeout: float) -> int:
        """Block until the cache moves past ``after_revision`` or ``timeout``; return revision."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._revision <= after_revision and not self._stopped.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._changed.wait(remaining)
            return self._revision

    def add_listener(self, listener: Callable[[], None]) -> None:
        """``listener()`` runs (on the watch thread) after every applied change; keep it quick."""
        self._listeners.append(listener)

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self, start_revision: int | None = None, timeout: float = 10.0) -> None:
        """Read the prefix and watch it. ``start_revision`` (tests) watches from an older point."""
        try:
            self._load_and_watch(start_revision)
        except etcd_errors.RevisionCompactedError as error:
            log.info("watch start revision compacted, re-reading prefix=%s compacted=%s",
                     self._prefix, error.compacted_revision)
            self._load_and_watch()
        self._thread = threading.Thread(target=self._resync_loop, daemon=True,
                                        name=f"watch{self._prefix}")
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._resync_needed.set()
        self._cancel_watch()
        with self._changed:
            self._changed.notify_all()

    # -- internals ----------------------------------------------------------------------------
    def _load_and_watch(self, start_revision: int | None = None) -> None:
        response = self._client.get_range_response(self._prefix, prefix_range_end(self._prefix))
        revision = response.header.revision
        entries = {
            kv.key.decode(): CachedKey(kv.value, kv.create_revision, kv.mod_revision, kv.lease)
            for kv in response.kvs
        }
        with self._changed:
            self._entries = entries
            self._revision = revision
            self._log.clear()
            self._log_floor = revision
            self._changed.notify_all()
        watch_from = revision + 1 if start_revision is None else start_revision
        self._cancel_watch()
        self._watch_id = self._client.add_watch_prefix_callback(
            self._prefix, self._on_watch, start_revision=watch_from
        )
        self._notify_listeners()

    def _cancel_watch(self) -> None:
        if self._watch_id is not None:
            try:
                self._client.cancel_watch(self._watch_id)
            except Exception:  # noqa: BLE001 - a dead stream has no watch to cancel
                pass
            self._watch_id = None

    def _on_watch(self, response: object) -> None:
        if isinstance(response, BaseException) or response is None:
            if not self._stopped.is_set():
                log.info("watch lost, re-reading prefix=%s error=%r", self._prefix, response)
                self._resync_needed.set()
            return
        with self._changed:
            for event in response.events:  # type: ignore[attr-defined]
                if event.mod_revision <= self._revision:
                    continue  # already in the copy (read after the watch started)
                key = event.key.decode()
                if len(self._log) == self._log.maxlen:
                    self._log_floor = self._log[0][0]  # about to be forgotten
                self._log.append((event.mod_revision, key))
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
                try:
                    self._load_and_watch()
                    self._resyncs += 1
                    log.info("watch resumed prefix=%s revision=%d", self._prefix, self.revision)
                    break
                except Exception as error:  # noqa: BLE001 - etcd down: try again later
                    delay = RESYNC_BACKOFF_S[min(attempt, len(RESYNC_BACKOFF_S) - 1)]
                    log.debug("re-read failed prefix=%s error=%r", self._prefix, error)
                    self._stopped.wait(delay)
