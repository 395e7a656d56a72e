"""What the workers do, as the master sees it in etcd: rounds formed and committed progress.

Two watched keys (``etcd.watched_prefix.WatchedPrefix``, so reading them costs no request):
``{run}/rdzv/round`` (written by the rendezvous leader, see docs/rendezvous.md) and
``{run}/progress/committed`` (written by the worker runtime, see ``worker/progress.py``). Each
change becomes timeline events (``RoundFormed``, ``Committed``, ``EpochEnd``). Both records
carry their recent past (the round record its earlier rounds with the time each formed, the
committed record its recent commits with rank 0's time and round), so the events come from the
workers' records, not from what this master happened to see: commits that landed between two
reads, and everything while no master ran (a crash, a KFP retry), are put on the timeline in
the order they happened (:func:`missed_events`, pure). What was already put on the timeline is
kept in ``{run}/master/observed`` and in the timeline itself, so a recovered master does not
repeat it.
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
from kfp_elastic.etcd.watched_prefix import WatchedPrefix
from kfp_elastic.master import timeline
from kfp_elastic.master.metrics import TimelineStats
from kfp_elastic.master.state import MasterState
from kfp_elastic.master.timeline import EpochEnd, Event, RoundFormed
from kfp_elastic.rendezvous.round_formation import RoundRecord
from kfp_elastic.worker.progress import CommitEntry, Committed, Manifest, Progress

log = logging.getLogger(__name__)

# The shard queues' sizes are metrics only (range reads of the current epoch): read at most
# this often, however often /metrics is scraped (internal, not a setting).
QUEUE_REFRESH_S = 2.0
# A key of the watched copy is also read from etcd this often, a safety net should a watch
# stop silently: one small read per key, far below any decision's time scale (internal).
DIRECT_READ_S = 5.0


def _timeline_commit(committed: Committed) -> timeline.Committed:
    return timeline.Committed(
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
        at=committed.at,
        round=committed.round,
    )


def new_rounds(
    record: RoundRecord | None, last_round: int | None, nproc_per_worker: int
) -> list[RoundFormed]:
    """The rounds of ``record`` (its history, then itself) after round ``last_round`` (the
    last one on the timeline), each stamped with the time it formed. A record numbered below
    ``last_round`` is a new numbering (the run's keys expired): all of its rounds are new."""
    if record is None or (last_round is not None and record.number == last_round):
        return []
    rounds = [(n, t, nodes, ()) for n, t, nodes in record.history]
    rounds.append((record.number, record.formed_at, len(record.participants), record.participants))
    restarted = last_round is not None and record.number < last_round
    return [
        RoundFormed(
            round=number,
            nodes=nodes,
            world_size=nodes * nproc_per_worker,
            participants=tuple(participants),
            formed_at=formed_at,
        )
        for number, formed_at, nodes, participants in rounds
        if restarted or last_round is None or number > last_round
    ]


def new_commits(
    committed: Committed | None, last_commit: tuple[int, float] | None
) -> list[timeline.Committed]:
    """The commits of ``committed`` (its recent ones, then itself) after ``last_commit`` ((step,
    at) of the last one on the timeline; None: none yet). The record itself becomes a full
    event; the earlier ones carry what the record keeps of them (step, time, round, world
    size, rescued, stopping, complete)."""
    if committed is None:
        return []
    if not committed.recent or not committed.at:  # an older writer: the record alone
        return (
            [] if last_commit == (committed.step, committed.at) else [_timeline_commit(committed)]
        )
    entries = list(committed.recent)
    keys = [(e.step, e.at) for e in entries]
    if last_commit in keys:
        entries = entries[keys.index(last_commit) + 1 :]
    elif last_commit is not None:
        entries = [e for e in entries if e.at > last_commit[1]]
        if len(entries) == len(committed.recent):
            log.warning(
                "commits missed: the record keeps the last %d, all newer than the last one on "
                "the timeline (step %d); the numbers of the gap are estimates",
                len(entries),
                last_commit[0],
            )
    events: list[timeline.Committed] = []
    for entry in entries:
        if (entry.step, entry.at) == (committed.step, committed.at):
            events.append(_timeline_commit(committed))
        else:
            events.append(_entry_commit(entry))
    return events


def _entry_commit(entry: CommitEntry) -> timeline.Committed:
    return timeline.Committed(
        step=entry.step,
        world_size=entry.world_size,
        rescued=entry.rescued,
        stopping=entry.stopping,
        complete=entry.complete,
        at=entry.at,
        round=entry.round,
    )


def missed_events(
    round_record: RoundRecord | None,
    committed: Committed | None,
    last_round: int | None,
    last_commit: tuple[int, float] | None,
    nproc_per_worker: int,
) -> list[Event]:
    """Rounds and commits of the workers' records not on the timeline yet, in the order they
    happened (the workers' times). A master that watched every change and one that was away
    put the same events, with the same worker times, on the timeline (pure)."""
    rounds: list[Event] = list(new_rounds(round_record, last_round, nproc_per_worker))
    commits: list[Event] = list(new_commits(committed, last_commit))
    merged = [(e.formed_at, 0, i, e) for i, e in enumerate(rounds) if isinstance(e, RoundFormed)]
    merged += [(e.at, 1, i, e) for i, e in enumerate(commits) if isinstance(e, timeline.Committed)]
    if any(not key for key, *_ in merged):  # an older writer's record has no time: as before
        return rounds + commits
    return [event for *_, event in sorted(merged, key=lambda row: row[:3])]


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
            round_value, round_revision = self._read(self._rounds, self._round_key)
            commit_value, commit_revision = self._read(
                self._committed, self.progress.keys.committed
            )
            record = None
            if round_value is not None and round_revision != self._observed.get("round_revision"):
                try:
                    record = RoundRecord.from_json(round_value)
                except (ValueError, TypeError, KeyError) as error:
                    log.warning("unreadable round record error=%r", error)
            committed = None
            if commit_value is not None and commit_revision != self._observed.get(
                "commit_revision"
            ):
                try:
                    committed = Committed.from_json(commit_value)
                except (ValueError, TypeError, KeyError) as error:
                    log.warning("unreadable committed record error=%r", error)
            revisions = {"round_revision": round_revision, "commit_revision": commit_revision}
            if record is None and committed is None:
                if any(v and v != self._observed.get(k) for k, v in revisions.items()):
                    self._observed.update({k: v for k, v in revisions.items() if v})
                    self._state.set_observed(self._observed)  # unreadable: not again
                return
            for event in missed_events(
                record, committed, self.stats.last_round, self.stats.last_commit, self._nproc
            ):
                self._append(event)
                if isinstance(event, RoundFormed):
                    log.info(
                        "round formed round=%d nodes=%d world_size=%d formed_at=%.3f",
                        event.round,
                        event.nodes,
                        event.world_size,
                        event.formed_at,
                    )
            if committed is not None:
                self.committed = committed
                self._end_epochs(committed)
            self._observed.update({k: v for k, v in revisions.items() if v})
            self._state.set_observed(self._observed)

    def _append(self, event: Event) -> None:
        self.stats.add(self._state.append_event(event))

    def _end_epochs(self, committed: Committed) -> None:
        manifest = self.load_manifest()
        ended = int(self._observed.get("epochs_ended", 0))
        upto = committed.epoch
        if committed.complete:
            upto = manifest.epochs if manifest else committed.epoch + (committed.position > 0)
        for epoch in range(ended, upto):
            self._append(EpochEnd(epoch=epoch, step=committed.step))
            log.info("epoch ended epoch=%d step=%d", epoch, committed.step)
        self._observed["epochs_ended"] = max(ended, upto)

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
