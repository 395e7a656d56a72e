"""How batch size and learning rate follow the world size (pure).

- ``fixed-global-batch``: the global batch stays ``base_world * per_worker_batch``; fewer workers
  accumulate gradients over more micro-steps; the learning rate stays.
- ``linear``: every worker keeps its batch, the global batch scales with the world, and so does
  the learning rate (Goyal et al.).
- ``sqrt``: as ``linear`` but the learning rate scales with the square root.

``accumulation`` (the model definition's ``GRAD_ACCUMULATION``) is how many micro-batches of
``per_worker_batch`` one worker accumulates per optimizer step at the base world size; the
policies scale the resulting per-worker batch. It is the one accumulation count: the runner
only ever accumulates ``StepShape.accumulation`` micro-steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum


class BatchPolicy(str, Enum):
    FIXED_GLOBAL_BATCH = "fixed-global-batch"
    LINEAR = "linear"
    SQRT = "sqrt"

    @classmethod
    def parse(cls, text: str) -> BatchPolicy:
        try:
            return cls(text)
        except ValueError:
            names = ", ".join(p.value for p in cls)
            raise ValueError(f"unknown batch policy {text!r}; choose one of: {names}") from None


@dataclass(frozen=True)
class StepShape:
    """What one optimizer step looks like at a given world size."""

    world_size: int
    global_batch: int  # samples per optimizer step, all ranks together
    micro_batch: int  # samples per rank per forward/backward
    accumulation: int  # micro-steps per optimizer step
    lr_scale: float  # multiply each parameter group's base learning rate by this


def step_shape(
    policy: BatchPolicy,
    world_size: int,
    base_world_size: int,
    per_worker_batch: int,
    accumulation: int = 1,
) -> StepShape:
    if min(world_size, base_world_size, per_worker_batch, accumulation) < 1:
        raise ValueError("world sizes, batch size and accumulation must be >= 1")
    if policy is BatchPolicy.FIXED_GLOBAL_BATCH:
        global_batch = base_world_size * per_worker_batch * accumulation
        accumulation = max(1, math.ceil(global_batch / (world_size * per_worker_batch)))
        micro = math.ceil(global_batch / (world_size * accumulation))
        return StepShape(world_size, global_batch, micro, accumulation, 1.0)
    scale = world_size / base_world_size
    lr_scale = scale if policy is BatchPolicy.LINEAR else math.sqrt(scale)
    return StepShape(
        world_size,
        world_size * per_worker_batch * accumulation,
        per_worker_batch,
        accumulation,
        lr_scale,
    )
