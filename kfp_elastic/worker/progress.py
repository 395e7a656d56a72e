"""Training progress in etcd: the shard manifest, the committed position, the shard queues.

Keys: ``{run}/progress/...`` and ``{run}/shards/...`` of the one key schema,
``kfp_elastic.etcd.keys`` (``ProgressKeys``; JSON values, no leases: they outlive every process).

The committed record is the truth: it names the snapshot the model can be restored to and the
data position saved inside that snapshot. The queues are its projection (``queue_state``); they
move in the same transaction as the record, so ``etcdctl get --prefix`` shows the same story.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field, fields, replace

from pyetcd.client import MultiEndpointEtcd3Client

from kfp_elastic.contract.data_plan import (
    Manifest,
    manifest_from_shards,
    shards_for_length,
)
from kfp_elastic.etcd.client import TRANSIENT_ERRORS
from kfp_elastic.etcd.keys import QUEUE_STATES, ProgressKeys
from kfp_elastic.etcd.settings import DEFAULT_OUTAGE_WAIT_S
from kfp_elastic.etcd.transactions import absent, put_if_absent, unchanged_since

log = logging.getLogger(__name__)

# etcd refuses transactions with more than 128 operations by default (--max-txn-ops).
MAX_TXN_OPS = 120


@dataclass(frozen=True)
class Committed:
    step: int  # optimizer steps since the start of the job
    epoch: int
    position: int  # samples of ``epoch`` consumed
    snapshot: str = ""  # file name of the snapshot holding this state ("" = initial state)
    world_size: int = 0
    global_batch: int = 0  # effective batch of the steps since the last commit (policy)
    lr: float = 0.0
    complete: bool = False
    losses: tuple[float, ...] = field(default=())  # mean loss of the steps since last commit
    rescued: bool = False  # the state a survivor saved when its world broke (worker/rescue.py)
    stopping: bool = False  # its world's last step before it stopped (SIGTERM): nothing lost
    at: float = 0.0  # rank 0's unix time of the commit (0.0: an older writer)
    round: int = 0  # the rendezvous round of the world that committed (0: not known)
    # The last RECENT_COMMITS commits, this one included, oldest first (``CommitEntry``): what
    # a master that was away puts on the timeline (``master/observer.py``).
    recent: tuple[CommitEntry, ...] = ()

    def to_json(self) -> str:
        data = asdict(self)
        data["losses"] = list(self.losses)
        data["recent"] = [entry.to_list() for entry in self.recent]
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: bytes | str) -> Committed:
        data = json.loads(text)
        data["losses"] = tuple(data.get("losses", ()))
        data["recent"] = tuple(CommitEntry.from_list(row) for row in data.get("recent", ()))
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})  # newer writers may add


#: Commits a committed record keeps in ``recent``. About 40 bytes each in the record that every
#: commit writes anyway (no extra write per step); at one commit per snapshot this covers
#: minutes of commits, more than a master retry takes.
RECENT_COMMITS = 64


@dataclass(frozen=True)
class CommitEntry:
    """One commit as the record's ``recent`` keeps it: ``[round, step, at, world_size, flags]``
    in JSON (flags: 1 rescued, 2 stopping, 4 complete)."""

    round: int
    step: int
    at: float
    world_size: int = 0
    rescued: bool = False
    stopping: bool = False
    complete: bool = False

    def to_list(self) -> list[int | float]:
        flags = int(self.rescued) | 2 * int(self.stopping) | 4 * int(self.complete)
        return [self.round, self.step, round(self.at, 3), self.world_size, flags]

    @classmethod
    def from_list(cls, row: list[int | float]) -> CommitEntry:
        number, step, at, world, flags = (list(row) + [0, 0])[:5]
        bits = int(flags)
        return cls(
            int(number),
            int(step),
            float(at),
            int(world),
            bool(bits & 1),
            bool(bits & 2),
            bool(bits & 4),
        )


def recorded(previous: Committed | None, new: Committed, round_number: int, at: float) -> Committed:
    """``new`` stamped with its time and round, its entry appended to ``previous``'s recent
    commits (pure; the committer calls it before the compare-and-swap)."""
    at = round(at, 3)  # as the JSON of ``recent`` keeps it: the record's time matches its entry
    entry = CommitEntry(
        round_number, new.step, at, new.world_size, new.rescued, new.stopping, new.complete
    )
    recent = (*(previous.recent if previous else ()), entry)[-RECENT_COMMITS:]
    return replace(new, at=at, round=round_number, recent=recent)


INITIAL = Committed(step=0, epoch=0, position=0)


class Progress:
    """Reads and commits progress for one run. All writes are compare-and-swap transactions."""

    def __init__(self, client: MultiEndpointEtcd3Client, run_prefix: str) -> None:
        self._client = client
        self.keys = ProgressKeys(run_prefix)
        self._orders: dict[tuple, list[int]] = {}

    def close(self) -> None:
        """Close the etcd connection (this object is unusable afterwards)."""
        self._client.close()

    # -- manifest -----------------------------------------------------------------------------
    def publish_manifest(self, manifest: Manifest) -> Manifest:
        """Write the manifest and every epoch's TODO queue once; return the one in etcd."""
        put_if_absent(self._client, self.keys.manifest, manifest.to_json())
        stored = self.manifest()
        assert stored is not None
        if self.committed_record()[0] is None:
            for epoch in range(stored.epochs):
                self._ensure_todo(stored, epoch)
        return stored

    def _ensure_todo(self, manifest: Manifest, epoch: int) -> None:
        tx = self._client.transactions
        ops = []
        for shard in manifest.shards:
            keys = [self.keys.queue(epoch, state, shard.shard_id) for state in QUEUE_STATES]
            ops.append(([absent(self._client, k) for k in keys], [tx.put(keys[0], "{}")]))
        for compare, success in ops:  # one small txn per shard: idempotent, never too big
            self._client.transaction(compare=compare, success=success, failure=[])

    def manifest(self) -> Manifest | None:
        value, _ = self._client.get(self.keys.manifest)
        return Manifest.from_json(value) if value is not None else None

    # -- committed position -------------------------------------------------------------------
    def committed_record(self) -> tuple[Committed | None, int]:
        """The committed record and its mod revision (0 when none)."""
        value, meta = self._client.get(self.keys.committed)
        if value is None:
            return None, 0
        return Committed.from_json(value), meta.mod_revision

    def commit(
        self, manifest: Manifest, previous: Committed | None, previous_revision: int, new: Committed
    ) -> int:
        """Move from ``previous`` to ``new`` if nobody else committed since; queues follow.

        Returns the new record's mod revision (for the next compare-and-swap), 0 if the swap
        lost: read back in the same transaction, which saves a request per snapshot."""
        tx = self._client.transactions
        guard = unchanged_since(self._client, self.keys.committed, previous_revision)
        moves = self._queue_moves(manifest, previous or INITIAL, new)
        first, rest = moves[: MAX_TXN_OPS - 2], moves[MAX_TXN_OPS - 2 :]
        ok, responses = self._client.transaction(
            compare=[guard],
            success=[
                tx.put(self.keys.committed, new.to_json()),
                *first,
                tx.get(self.keys.committed),
            ],
            failure=[],
        )
        if not ok:
            return 0
        for start in range(0, len(rest), MAX_TXN_OPS):
            self._client.transaction(
                compare=[], success=rest[start : start + MAX_TXN_OPS], failure=[]
            )
        ((_, metadata),) = responses[-1]
        return int(metadata.mod_revision)

    def reconcile_queues(self, manifest: Manifest, at: Committed) -> int:
        """Make the queues of ``at``'s epoch and the one before agree with ``at``; returns how
        many keys had to change (0 normally).

        A commit moves up to MAX_TXN_OPS - 2 queue keys atomically with the record and the
        rest in follow-up transactions; a rank 0 killed in between, or an etcd error there,
        leaves those behind. The record is the truth and the queues are derived from it, so
        the next restore (or the commit's retry) repairs them here, idempotently."""
        epoch = _epoch_of(at, manifest.epochs - 1)
        epochs = range(max(0, epoch - 1), epoch + 1)
        expected = {}
        for (number, shard_id), (state, consumed) in self._placement(manifest, at, epochs).items():
            expected[self.keys.queue(number, state, shard_id)] = _queue_value(state, consumed)
        actual: dict[str, str] = {}
        for number in epochs:
            for value, meta in self._client.get_prefix(self.keys.epoch(number)):
                actual[meta.key.decode()] = value.decode()
        tx = self._client.transactions
        ops = [tx.delete(key) for key in actual if key not in expected]
        ops += [tx.put(key, value) for key, value in expected.items() if actual.get(key) != value]
        for start in range(0, len(ops), MAX_TXN_OPS):
            self._client.transaction(
                compare=[], success=ops[start : start + MAX_TXN_OPS], failure=[]
            )
        return len(ops)

    def _queue_moves(self, manifest: Manifest, old: Committed, new: Committed) -> list:
        """Puts and deletes that turn the queues of ``old`` into those of ``new``.

        Only epochs between the two positions can differ (a rollback swaps old and new), so
        the work per commit does not grow with the number of epochs."""
        tx = self._client.transactions
        last = manifest.epochs - 1
        low = min(_epoch_of(old, last), _epoch_of(new, last))
        high = max(_epoch_of(old, last), _epoch_of(new, last))
        epochs = range(low, high + 1)
        before = self._placement(manifest, old, epochs)
        after = self._placement(manifest, new, epochs)
        ops: list = []
        for (epoch, shard_id), (state, consumed) in after.items():
            old_state = before[(epoch, shard_id)]
            if old_state == (state, consumed):
                continue
            if old_state[0] != state:
                ops.append(tx.delete(self.keys.queue(epoch, old_state[0], shard_id)))
            ops.append(
                tx.put(self.keys.queue(epoch, state, shard_id), _queue_value(state, consumed))
            )
        return ops

    def _placement(
        self, manifest: Manifest, at: Committed, epochs: range
    ) -> dict[tuple[int, int], tuple]:
        """(epoch, shard) → (queue, samples consumed) for ``epochs``."""
        sizes = {s.shard_id: s.size for s in manifest.shards}
        placement: dict[tuple[int, int], tuple] = {}
        for epoch in epochs:
            if epoch < at.epoch or at.complete:
                position = manifest.num_samples
            elif epoch == at.epoch:
                position = at.position
            else:
                position = 0
            consumed = 0
            for shard_id in self._visit_order(manifest, epoch):
                begins, consumed = consumed, consumed + sizes[shard_id]
                if consumed <= position:
                    placement[(epoch, shard_id)] = ("done", 0)
                elif begins < position:
                    placement[(epoch, shard_id)] = ("doing", position - begins)
                else:
                    placement[(epoch, shard_id)] = ("todo", 0)
        return placement

    def _visit_order(self, manifest: Manifest, epoch: int) -> list[int]:
        key = (manifest.seed, manifest.shuffle, len(manifest.shards), epoch)
        order = self._orders.get(key)
        if order is None:
            order = self._orders[key] = manifest.visit_order(epoch)
        return order

    def base_world_size(self, proposed: int) -> int:
        """The world size the batch policy scales from: the first proposal wins, for good."""
        put_if_absent(self._client, self.keys.base_world_size, str(proposed))
        value, _ = self._client.get(self.keys.base_world_size)
        return int(value)

    def queue_counts(self, epoch: int) -> dict[str, int]:
        counts = {}
        for state in QUEUE_STATES:
            response = self._client.get_prefix_response(
                self.keys.queue(epoch, state), keys_only=True, count_only=True
            )
            counts[state] = int(response.count)
        return counts


def _queue_value(state: str, consumed: int) -> str:
    return json.dumps({"consumed": consumed}) if state == "doing" else "{}"


def _epoch_of(at: Committed, last_epoch: int) -> int:
    """The epoch whose queues ``at`` is inside (the last one once training is complete)."""
    return last_epoch if at.complete else min(at.epoch, last_epoch)


def ensure_manifest(
    progress: Progress, length: int, shard_size: int, epochs: int, seed: int, shuffle: bool = True
) -> Manifest:
    """The run's shard manifest: the one in etcd (the master's, or an earlier rank 0's), else
    one of ``length`` samples published now; ``ValueError`` when it does not cover ``length``
    samples (the dataset is not the one the manifest was made for)."""
    existing = progress.manifest()
    if existing is None:
        shards = shards_for_length(length, shard_size or max(1, length // 64))
        existing = progress.publish_manifest(manifest_from_shards(shards, epochs, seed, shuffle))
    if existing.num_samples != length:
        raise ValueError(
            f"shard manifest covers {existing.num_samples} samples but the training dataset "
            f"has {length}"
        )
    return existing


def commit_with_retry(
    progress: Progress,
    manifest: Manifest,
    previous: Committed,
    previous_revision: int,
    new: Committed,
    retry_s: float = DEFAULT_OUTAGE_WAIT_S,
) -> int:
    """CAS ``previous`` → ``new``; returns the new revision. A slow or restarting etcd is
    waited out (``retry_s``: ``--etcd-outage-wait``), not fatal to training; a lost race raises
    ``RuntimeError``."""
    deadline = time.monotonic() + retry_s
    delay = 0.1
    while True:
        try:
            revision = progress.commit(manifest, previous, previous_revision, new)
            if not revision:
                current, revision = progress.committed_record()
                if current != new:  # an earlier attempt of ours did not land either
                    raise RuntimeError(
                        f"commit of step {new.step} lost a race; another rank 0 exists"
                    )
                # Ours landed but its answer was lost: its follow-up queue moves may not.
                progress.reconcile_queues(manifest, new)
            return revision
        except TRANSIENT_ERRORS as error:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("commit of step %d failed, retrying error=%r", new.step, error)
            time.sleep(delay)
            delay = min(2 * delay, 2.0)
