"""Where a (re)started world's training state comes from, for the built-in runtime and the
script API alike: the newest state any rank holds — a survivor's rescue (``worker/rescue.py``)
newer than the committed step — else the committed snapshot, rolled back to an older readable
one when it is corrupt or missing. ``newest_state`` is collective: every rank calls it; the
state reaches the others as tensors (``collective.shared_state``), never pickled.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from kfp_elastic.worker.collective import shared, shared_state
from kfp_elastic.worker.progress import INITIAL, Committed, Manifest, Progress
from kfp_elastic.worker.rescue import Rescues, best_holder
from kfp_elastic.worker.snapshot import SnapshotError, Snapshotter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restored:
    committed: Committed  # the committed record the world goes on from
    revision: int  # its etcd revision (for the next compare-and-swap commit)
    state: dict[str, Any] | None  # None: the initial state (nothing committed yet)
    holder: int | None = None  # the rank whose rescue it is (then persist and commit it)

    @property
    def source(self) -> str:
        if self.holder is not None:
            return f"rescue of rank {self.holder}"
        return f"snapshot {self.committed.snapshot or '-'}"


def newest_state(
    rank: int,
    world: int,
    progress: Progress | None,
    manifest: Manifest,
    snapshots: Snapshotter,
    rescues: Rescues,
    reads_rescues: bool = True,
) -> Restored:
    """``progress``: rank 0's (None elsewhere). ``reads_rescues``: whether this rank looks for
    rescues of its own (one writer per node: the others' would be the same state)."""
    committed, revision = shared(committed_head(progress, manifest) if rank == 0 else None)
    mine = rescues.newest_after(committed.step) if reads_rescues else None
    steps: list[Any] = [None] * world
    dist.all_gather_object(steps, mine[0] if mine else -1)
    rescues.discard_up_to(committed.step)
    holder = best_holder(steps, committed.step)
    if holder is not None:
        state = shared_state(mine[1] if rank == holder and mine else None, src=holder)
        return Restored(committed, revision, state, holder)
    state = None
    if rank == 0:
        committed, revision, state = load_committed(
            progress, manifest, snapshots, committed, revision, world
        )
    committed, revision = shared((committed, revision))
    return Restored(committed, revision, shared_state(state))


def committed_head(progress: Progress | None, manifest: Manifest) -> tuple[Committed, int]:
    """The committed record (INITIAL if none), with the shard queues an interrupted commit
    left half-moved put right."""
    assert progress is not None, "rank 0 reads the committed record"
    committed, revision = progress.committed_record()
    if committed is not None:
        fixed = progress.reconcile_queues(manifest, committed)
        if fixed:
            log.warning("repaired %d shard queue keys left by an interrupted commit", fixed)
    return committed or INITIAL, revision


def load_committed(
    progress: Progress | None,
    manifest: Manifest,
    snapshots: Snapshotter,
    committed: Committed,
    revision: int,
    world: int,
) -> tuple[Committed, int, dict[str, Any] | None]:
    """The committed snapshot's state; when it is unreadable, the newest older readable one,
    committed in its place (its data position with it); ``SnapshotError`` when there is none."""
    assert progress is not None, "rank 0 loads the committed snapshot"
    if not committed.snapshot:
        return committed, revision, None
    try:
        return committed, revision, snapshots.load(committed.snapshot)
    except SnapshotError as error:
        log.error("%s; falling back to an older snapshot", error)
    for name in snapshots.available():
        if name >= committed.snapshot:
            continue
        try:
            state = snapshots.load(name)
        except SnapshotError:
            continue
        older = Committed(
            step=state["step"],
            epoch=state["epoch"],
            position=state["position"],
            snapshot=name,
            world_size=world,
        )
        if not progress.commit(manifest, committed, revision, older):
            raise SnapshotError("another process committed while rolling back; restart")
        log.warning("rolled back to older snapshot=%s step=%d", name, older.step)
        return older, progress.committed_record()[1], state
    raise SnapshotError(
        f"committed snapshot {committed.snapshot} is corrupt or missing in "
        f"{snapshots.persist_dir} and no older one is readable; nothing was overwritten: "
        "restore the file or delete the run's progress keys to start over"
    )
