"""What every rank of a worker group agrees on: a value rank ``src`` decides, and how a worker
stopped by a preemption ends."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

EXIT_PREEMPTED = 143  # what a process killed by SIGTERM reports; never "success" mid-job


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
