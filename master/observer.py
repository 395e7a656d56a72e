"""What the workers do, as the master sees it in etcd: rounds formed and committed progress.

Two watched keys (``rendezvous.cache.WatchedPrefix``, so reading them costs no request):
``{run}/rdzv/round`` (written by the rendezvous leader, see docs/rendezvous.md) and
``{run}/progress/committed`` (written by the worker runtime, see ``worker/progress.py``). Each
change becomes timeline events (``RoundFormed``, ``Committed``, ``EpochEnd``); what was
already put on the timeline is kept in ``{run}/master/observed`` so that a recovered master
does not repeat it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pyetcd.client import MultiEndpointEtcd3Client

from kfp_elastic.etcd.keys import RunKeys
from kfp_elastic.master import timeline
from kfp_elastic.master.metrics import TimelineStats
from kfp_elastic.master.state import MasterState
from kfp_elastic.master.timeline import EpochEnd, Event, RoundFormed
from kfp_elastic.rendezvous.cache import WatchedPrefix
from kfp_elastic.worker.progress import Committed, Manifest, Progress

log = logging.getLogger(__name__)

QUEUE_REFRESH_S = 2.0
DIRECT_READ_S = 5.0


class Observer:
    def __init__(
        self,
        client: MultiEndpointEtcd3Client,
        state: MasterState,
        nproc_per_worker: int,
        stats: TimelineStats,
        on_change: Callable[[], None],
    ) -> None:
        self._client = client
        self._direct_at: dict[str, float] = {}
        self._state = state
        self._nproc = nproc_per_worker
        self.stats = stats
        self.progress = Progress(client, state.keys.run_prefix)
        self._round_key = RunKeys(state.keys.run_prefix).round
        self._rounds = WatchedPrefix(client, self._round_key)
        self._committed = WatchedPrefix(client, self.progress.keys.committed)
        for cache in (self._rounds, self._committed):
            cache.add_listener(on_change)
        self._observed: dict[str, Any] = state.observed()
        self.manifest: Manifest | None = None
        self.committed: Committed | None = None
        self._queues: dict[tuple[int, str], int] = {}
        self._queues_at = 0.0
        self._lock = threading.Lock()

    def start(self) -> None:
        self._rounds.start()
        self._committed.start()

    def stop(self) -> None:
        self._rounds.stop()
        self._committed.stop()

    @property
    def complete(self) -> bool:
        return self.committed is not None and self.committed.complete

    def world_size(self) -> int:
        value, _ = self._read(self._rounds, self._round_key)
        if value is None:
            return 0
        return len(json.loads(value).get("participants", ())) * self._nproc

    def _read(self, cache: WatchedPrefix, key: str) -> tuple[bytes | None, int]:
        """(value, mod revision) from the watched copy; every ``DIRECT_READ_S`` also from etcd,
        which wins when newer (a safety net should a watch ever stop silently)."""
        entry = cache.get(key)
        value, revision = (entry.value, entry.mod_revision) if entry else (None, 0)
        now = time.monotonic()
        if now - self._direct_at.get(key, 0.0) >= DIRECT_READ_S:
            self._direct_at[key] = now
            direct, meta = self._client.get(key)
            if direct is not None and meta.mod_revision > revision:
                if entry is not None:
                    log.info(
                        "watch behind etcd key=%s watched=%d etcd=%d",
                        key,
                        revision,
                        meta.mod_revision,
                    )
                value, revision = direct, meta.mod_revision
        return value, revision

    def observe(self) -> None:
        """Put new rounds and commits on the timeline (fenced writes of the leader)."""
        with self._lock:
            changed = self._observe_round() | self._observe_commit()
            if changed:
                self._state.set_observed(self._observed)

    def _append(self, event: Event) -> None:
        self.stats.add(self._state.append_event(event))

    def _observe_round(self) -> bool:
        value, revision = self._read(self._rounds, self._round_key)
        if value is None or revision == self._observed.get("round_revision"):
            return False
        record = json.loads(value)
        participants = list(record.get("participants", ()))
        number = int(record.get("round", 0))
        self._append(
            RoundFormed(
                round=number,
                nodes=len(participants),
                world_size=len(participants) * self._nproc,
                participants=tuple(participants),
            )
        )
        log.info(
            "round formed round=%d nodes=%d world_size=%d",
            number,
            len(participants),
            len(participants) * self._nproc,
        )
        self._observed["round_revision"] = revision
        return True

    def _observe_commit(self) -> bool:
        value, revision = self._read(self._committed, self.progress.keys.committed)
        if value is None or revision == self._observed.get("commit_revision"):
            return False
        try:
            committed = Committed.from_json(value)
        except (ValueError, TypeError, KeyError) as error:
            log.warning("unreadable committed record error=%r", error)
            self._observed["commit_revision"] = revision
            return True
        self.committed = committed
        self._append(
            timeline.Committed(
                step=committed.step,
                epoch=committed.epoch,
                position=committed.position,
                world_size=committed.world_size,
                losses=tuple(committed.losses),
                complete=committed.complete,
                snapshot=committed.snapshot,
                rescued=committed.rescued,
                stopping=committed.stopping,
                global_batch=committed.global_batch,
                lr=committed.lr,
            )
        )
        manifest = self.load_manifest()
        ended = int(self._observed.get("epochs_ended", 0))
        upto = committed.epoch
        if committed.complete:
            upto = manifest.epochs if manifest else committed.epoch + (committed.position > 0)
        for epoch in range(ended, upto):
            self._append(EpochEnd(epoch=epoch, step=committed.step))
            log.info("epoch ended epoch=%d step=%d", epoch, committed.step)
        self._observed["epochs_ended"] = max(ended, upto)
        self._observed["commit_revision"] = revision
        return True

    def load_manifest(self) -> Manifest | None:
        if self.manifest is None:
            self.manifest = self.progress.manifest()
        return self.manifest

    def shard_queues(self) -> dict[tuple[int, str], int]:
        """Queue sizes per (epoch, state): the current epoch read from etcd (every 2 s at
        most), earlier epochs all done, later ones all to do."""
        manifest = self.load_manifest()
        if manifest is None:
            return {}
        now = time.monotonic()
        if now - self._queues_at < QUEUE_REFRESH_S:
            return self._queues
        committed = self.committed
        current = committed.epoch if committed else 0
        shards = len(manifest.shards)
        queues: dict[tuple[int, str], int] = {}
        for epoch in range(manifest.epochs):
            if epoch == current and not (committed and committed.complete):
                counts = self.progress.queue_counts(epoch)
            else:
                done = epoch < current or bool(committed and committed.complete)
                counts = {"todo": 0 if done else shards, "doing": 0, "done": shards if done else 0}
            for state, count in counts.items():
                queues[(epoch, state)] = count
        self._queues, self._queues_at = queues, now
        return queues
