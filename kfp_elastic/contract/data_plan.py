"""The shard manifest and which samples each rank takes at each step: pure functions of the
committed position. The job contract checks a manifest here before any worker starts
(``JobSpec.manifest``); the master publishes it and the workers follow it (``worker/progress.py``).

An epoch is a permutation of the dataset's sample ids, fixed by (seed, epoch) and the shard
manifest: shards are shuffled, then samples inside each shard. Training consumes that order
front to back; the *position* (samples consumed this epoch) is saved in every snapshot, so
rolling the model back to a snapshot rolls the data back with it. A step takes the next
``global_batch`` ids and deals them to ranks round-robin; every rank therefore takes the same
number of steps per epoch whatever the world size (the last step may be short or even empty on
some ranks, which the loss weighting accounts for).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    shard_id: int
    start: int  # first sample id
    end: int  # one past the last sample id

    @property
    def size(self) -> int:
        return self.end - self.start


def shards_for_length(length: int, shard_size: int) -> list[Shard]:
    if length < 1:
        raise ValueError("the dataset is empty: nothing to train on")
    if shard_size < 1:
        raise ValueError(f"shard size must be >= 1, got {shard_size}")
    return [
        Shard(i, start, min(start + shard_size, length))
        for i, start in enumerate(range(0, length, shard_size))
    ]


def epoch_order(shards: Sequence[Shard], epoch: int, seed: int, shuffle: bool = True) -> list[int]:
    """All sample ids of one epoch in training order."""
    rng = random.Random(seed * 1_000_003 + epoch)
    ordered = list(shards)
    if shuffle:
        rng.shuffle(ordered)
    ids: list[int] = []
    for shard in ordered:
        block = list(range(shard.start, shard.end))
        if shuffle:
            rng.shuffle(block)
        ids.extend(block)
    return ids


def shard_order(shards: Sequence[Shard], epoch: int, seed: int, shuffle: bool = True) -> list[int]:
    """Shard ids in the order ``epoch_order`` visits them (same RNG stream)."""
    rng = random.Random(seed * 1_000_003 + epoch)
    ordered = list(shards)
    if shuffle:
        rng.shuffle(ordered)
    return [s.shard_id for s in ordered]


def step_batch(order: Sequence[int], position: int, global_batch: int) -> list[int]:
    """The ids of the step that starts at ``position``: the next ``global_batch`` of the epoch
    (fewer at its end)."""
    return list(order[position : position + global_batch])


def rank_share(batch: Sequence[int], rank: int, world_size: int) -> list[int]:
    """The ids of a step's ``batch`` that rank ``rank`` trains on: dealt round-robin."""
    return list(batch[rank::world_size])


def step_ids(
    order: Sequence[int], position: int, global_batch: int, world_size: int, rank: int
) -> list[int]:
    """The ids rank ``rank`` trains on in the step that starts at ``position``."""
    return rank_share(step_batch(order, position, global_batch), rank, world_size)


def steps_left(total: int, position: int, global_batch: int) -> int:
    return max(0, -(-(total - position) // global_batch))


@dataclass(frozen=True)
class QueueState:
    todo: tuple[int, ...]
    doing: tuple[int, ...]
    done: tuple[int, ...]


def queue_state(shards: Sequence[Shard], visit_order: Sequence[int], position: int) -> QueueState:
    """TODO / DOING / DONE shards of an epoch once ``position`` samples are consumed."""
    sizes = {s.shard_id: s.size for s in shards}
    todo, doing, done = [], [], []
    consumed = 0
    for shard_id in visit_order:
        begins, consumed = consumed, consumed + sizes[shard_id]
        if consumed <= position:
            done.append(shard_id)
        elif begins < position:
            doing.append(shard_id)
        else:
            todo.append(shard_id)
    return QueueState(tuple(todo), tuple(doing), tuple(done))


@dataclass(frozen=True)
class Manifest:
    shards: tuple[Shard, ...]
    epochs: int
    seed: int = 0
    shuffle: bool = True

    @property
    def num_samples(self) -> int:
        return sum(s.size for s in self.shards)

    def to_json(self) -> str:
        return json.dumps(
            {
                "shards": [[s.shard_id, s.start, s.end] for s in self.shards],
                "epochs": self.epochs,
                "seed": self.seed,
                "shuffle": self.shuffle,
            }
        )

    @classmethod
    def from_json(cls, text: bytes | str) -> Manifest:
        data = json.loads(text)
        return cls(
            tuple(Shard(*row) for row in data["shards"]),
            int(data["epochs"]),
            int(data.get("seed", 0)),
            bool(data.get("shuffle", True)),
        )

    def visit_order(self, epoch: int) -> list[int]:
        return shard_order(self.shards, epoch, self.seed, self.shuffle)

    def queues(self, epoch: int, position: int) -> QueueState:
        return queue_state(self.shards, self.visit_order(epoch), position)


def manifest_from_shards(
    shards: Sequence[Shard], epochs: int, seed: int = 0, shuffle: bool = True
) -> Manifest:
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    if not shards or sum(s.size for s in shards) == 0:
        raise ValueError("the shard manifest is empty: nothing to train on")
    return Manifest(tuple(shards), epochs, seed, shuffle)
