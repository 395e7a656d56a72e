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

``LrDecay`` (the model definition's ``LR_DECAY``) is the step-wise decay rule: the LR times
``gamma`` at each milestone, counted in epochs of data (samples seen), not optimizer steps. Under
``linear``/``sqrt`` a smaller world takes more, smaller steps per epoch, so a milestone in steps
would come at other data for every world history; in epochs it comes at the same sample whatever
the world did. It multiplies the policy's LR scale (``lr_factor``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from kfp_elastic.contract.batch_policy import BatchPolicy


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


@dataclass(frozen=True)
class LrDecay:
    """The LR times ``gamma`` at each of ``epochs`` (ascending, fractions allowed: 2.5 is half
    way through the third epoch)."""

    epochs: tuple[float, ...]
    gamma: float

    @classmethod
    def parse(cls, value: object) -> LrDecay | None:
        """``LR_DECAY``: None, or ``{"epochs": [6, 9], "gamma": 0.1}``; ValueError naming what
        is wrong otherwise."""
        if value is None:
            return None
        if not isinstance(value, Mapping) or set(value) != {"epochs", "gamma"}:
            raise ValueError(
                f'LR_DECAY must be None or {{"epochs": [6, 9], "gamma": 0.1}}, got {value!r}'
            )
        epochs, gamma = value["epochs"], value["gamma"]
        if (
            not isinstance(epochs, list | tuple)
            or not epochs
            or not all(_is_number(e) and e > 0 for e in epochs)
            or list(epochs) != sorted(epochs)
        ):
            raise ValueError(
                f"LR_DECAY epochs must be a non-empty ascending list of epochs > 0, got {epochs!r}"
            )
        if not _is_number(gamma) or not 0 < gamma <= 1:
            raise ValueError(f"LR_DECAY gamma must be a number in (0, 1], got {gamma!r}")
        return cls(tuple(float(e) for e in epochs), float(gamma))

    def factor(self, progress: float) -> float:
        """The decay after ``progress`` epochs of data."""
        return self.gamma ** sum(1 for milestone in self.epochs if progress >= milestone)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def lr_factor(
    shape: StepShape, decay: LrDecay | None, epoch: int, position: int, samples: int
) -> float:
    """What the scheduler's LR is multiplied by for the step that starts at sample ``position``
    of ``epoch`` (of ``samples`` per epoch): the policy's scale times the decay so far."""
    if decay is None:
        return shape.lr_scale
    return shape.lr_scale * decay.factor(epoch + position / max(1, samples))
