"""What every rank of a worker group agrees on: a value rank ``src`` decides (a training state
among them, moved as tensors), and how a worker stopped by a preemption ends."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from kfp_elastic.worker import snapshot_format
from kfp_elastic.worker.snapshot_format import NotPackable

EXIT_PREEMPTED = 143  # what a process killed by SIGTERM reports; never "success" mid-job
# Bytes of a state's payload per broadcast: each rank holds one staging buffer of this size on
# the group's device, never one of the whole state.
STATE_CHUNK_BYTES = 64 << 20


def shared(value: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``value`` on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gathered(value: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's ``value``, by rank, on rank ``dst`` (None on the others); collective."""
    box: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(value, box, dst=dst)
    return box


def group_device() -> torch.device:
    """Where the default group's collectives run: the current CUDA device under NCCL, else
    the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shared_state(
    state: dict[str, Any] | None, src: int = 0, chunk_bytes: int = STATE_CHUNK_BYTES
) -> dict[str, Any] | None:
    """Rank ``src``'s training state on every rank (collective), moved as tensors: a small
    header (the ``snapshot_format`` tree and tensor table) as an object, then the tensors'
    bytes in ``chunk_bytes`` broadcasts on the group's device, from ``src``'s tensors straight
    into each other rank's own (CPU) tensors: no pickling of the state, no device buffer of
    its size. ``src`` gets its ``state`` back as it is. A state the format cannot store goes
    as one object (pickled), as ``shared`` sends anything."""
    rank = dist.get_rank()
    laid = None
    if rank == src and state is not None:
        try:
            laid = snapshot_format.layout(state)
        except NotPackable:
            laid = None
    head = shared(("tensors", laid.tree, laid.table, laid.size) if laid else ("object",), src)
    if head[0] == "object":
        return shared(state if rank == src else None, src)
    _, tree, table, size = head
    if rank == src:
        assert laid is not None
        mine = [snapshot_format.as_bytes(t) if t.numel() else t for t in laid.tensors]
    else:
        mine = [torch.empty(e["nbytes"], dtype=torch.uint8) for e in table]
    staging = torch.empty(min(chunk_bytes, size), dtype=torch.uint8, device=group_device())
    for start in range(0, size, chunk_bytes):
        piece = staging[: min(chunk_bytes, size - start)]
        spans = snapshot_format.pieces(table, start, len(piece))
        if rank == src:
            for index, at, into, length in spans:
                piece[into : into + length].copy_(mine[index][at : at + length])
        dist.broadcast(piece, src)
        if rank != src:
            for index, at, into, length in spans:
                mine[index][at : at + length].copy_(piece[into : into + length])
    if rank == src:
        return state
    tensors = [
        snapshot_format.from_bytes(raw, entry) for raw, entry in zip(mine, table, strict=True)
    ]
    return snapshot_format.build(tree, tensors)
