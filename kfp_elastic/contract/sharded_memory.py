"""What a sharded (FSDP2) job keeps in its nodes' host memory, shared by the worker runtime
(``worker/shard_memory.py`` keeps the slots) and the pod spec (``job_spec.py`` sizes each worker
pod's memory-backed ``/dev/shm`` and memory by it).

Every rank keeps its own shards and a copy of its ring neighbour's, each in ``SLOTS_KEPT`` slots
(the committed snapshot's and the one being written): ``SLOTS_KEPT × (1 + COPIES)`` shards of
``state / ranks`` bytes each. The smallest world (``min_workers × nproc_per_worker`` ranks) has
the largest shards.
"""

from __future__ import annotations

SLOTS_KEPT = 2  # per (rank, world): the committed step's and the one being written
COPIES = 1  # of each rank's shards, on its ring neighbour's node


def host_memory_per_process(state_bytes: int, ranks: int) -> int:
    """Bytes of host memory one rank keeps for a sharded state of ``state_bytes`` (parameters
    and optimizer state) in a world of ``ranks``."""
    shard = -(-state_bytes // max(1, ranks))
    return SLOTS_KEPT * (1 + COPIES) * shard
