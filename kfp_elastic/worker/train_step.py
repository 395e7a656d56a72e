"""One optimizer step of the built-in runtime, and the training state it changes.

A step over a global batch (``TrainStep.run``), in torch's AMP recipe order:

1. this rank's share of the batch in ``accumulation`` micro-batches (``micro_batches``); each
   runs the loss under ``torch.autocast`` (``AMP``) and backward (scaled by the ``GradScaler``
   with fp16); DDP allreduces gradients only at the last one (``no_sync`` before);
2. ``scaler.unscale_`` → ``clip_grad_norm_`` (``CLIP_GRAD_NORM``) → the batch policy's LR scale
   applied for ``optimizer.step()`` only (``scaler.step`` skips a step with inf/NaN gradients)
   → ``scaler.update`` → ``scheduler.step()`` (once per optimizer step, skipped or not).

A non-finite loss is ``finite_loss.skips_step``'s decision: under ``--nan-policy fail`` the rank
raises before its backward; under ``skip`` it backpropagates NaN into every gradient instead, so
DDP's allreduce carries the decision to every rank and all skip the same optimizer step without
a collective of their own (with fp16 the GradScaler skips it and lowers its scale).

``state_dict`` / ``load_state_dict`` are the one place that gathers and restores this state
(model, optimizer, LR scheduler, GradScaler): snapshots, rescues and restores all use them.

A snapshot never falls mid-accumulation: the runner takes them only between steps, and a
rescue written after a failure inside a step holds the state of the last finished one, because
nothing in it changes before the optimizer step (gradients are not state); a failure from there
to the end of the step (``stepping``) writes no rescue at all.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from kfp_elastic.contract.data_plan import rank_share
from kfp_elastic.worker.finite_loss import DEFAULT_NAN_POLICY, skips_non_finite
from kfp_elastic.worker.model_def import AMP_DTYPES
from kfp_elastic.worker.sharding import is_sharded, load_sharded_state, sharded_state

log = logging.getLogger(__name__)


def micro_batches(mine: Sequence[int], accumulation: int) -> list[list[int]]:
    """This rank's samples of a step in ``accumulation`` micro-batches (front-loaded; trailing
    ones are empty when there are fewer samples than micro-batches)."""
    chunk = -(-len(mine) // accumulation) if mine else 0
    return [list(mine[i * chunk : (i + 1) * chunk]) for i in range(accumulation)]


def rng_state() -> dict[str, torch.Tensor]:
    """The random generators a model may draw from (dropout, augmentation) as snapshot keys."""
    state = {"rng": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_rng"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["rng"])
    if "cuda_rng" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng"])


# A snapshot's generators of every rank (index: rank; None where a rank's is not known, as in
# a rescue, which holds its writer's): ranks draw different dropout masks and augmentations,
# and each must go on with its own, not rank 0's.
RNG_BY_RANK = "rng_by_rank"


def derived_seed(seed: int, rank: int, step: int) -> int:
    """A seed for ``rank`` at ``step`` of a run seeded ``seed``: different for every rank and
    every restart step, the same for the same three (a rank with no generators to restore)."""
    digest = hashlib.sha256(f"{seed}:{rank}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def restore_rng_state(state: dict[str, Any], rank: int, world: int, seed: int) -> str:
    """Put back this rank's generators from a restored ``state``; returns which, for the log.

    * ``own``: the state holds this rank's (``RNG_BY_RANK``) for a world of this size;
    * ``writer's``: same world size, but only the writer's are known (a rescue: the ranks of a
      lost node left none) -- what ranks seeded alike (torch's default) had anyway;
    * ``derived seed N``: another world size (rank r of the new world is not rank r of the old
      one, and a new rank has none) or a state without per-rank generators: seeded with
      ``derived_seed(seed, rank, step)``, different for every rank.
    """
    per_rank = state.get(RNG_BY_RANK)
    if isinstance(per_rank, list) and len(per_rank) == world:
        own = per_rank[rank]
        set_rng_state(own if own is not None else state)
        return "own" if own is not None else "writer's"
    chosen = derived_seed(seed, rank, int(state.get("step", 0)))
    torch.manual_seed(chosen)  # the CPU generator and every CUDA device's
    return f"derived seed {chosen}"


@contextlib.contextmanager
def _no_sync(module: nn.Module) -> Any:
    """Gradients accumulate without a reduction: DDP's ``no_sync``; an FSDP2 module's
    ``set_requires_gradient_sync(False)`` (its reduce-scatter then waits for the last one)."""
    if hasattr(module, "no_sync"):
        with module.no_sync():
            yield
        return
    module.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)  # type: ignore[operator]


def _device_type(model: nn.Module) -> str:
    parameter = next(model.parameters(), None)
    return parameter.device.type if parameter is not None else "cpu"


class TrainStep:
    """Steps ``optimizer`` (and ``scheduler``) for ``model`` with the model definition's AMP,
    clipping and accumulation; owns the GradScaler."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        amp: str | None = None,
        clip_grad_norm: float | None = None,
        nan_policy: str = DEFAULT_NAN_POLICY,
    ) -> None:
        self.model = model
        self.nan_policy = nan_policy
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.device_type = _device_type(model)
        self.amp_dtype = AMP_DTYPES[amp] if amp else None
        self.scaler = torch.amp.GradScaler(self.device_type) if amp == "fp16" else None
        self.clip_grad_norm = clip_grad_norm
        self.lr_scale = 1.0  # the batch policy's, for this world size
        # The model definition's LRs (after the scheduler's initial step): what a state without
        # a schedule of its own restores to.
        self.initial_lrs = [group["lr"] for group in optimizer.param_groups]
        self.stepping = False  # inside the optimizer step: parameters possibly half updated
        self.sharded = is_sharded(model)  # FSDP2: every rank holds its own shards

    @property
    def lr(self) -> float:
        """The learning rate of the next step (first parameter group), policy scale included."""
        return self.optimizer.param_groups[0]["lr"] * self.lr_scale

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.amp_dtype)

    def run(
        self,
        ddp: nn.Module,
        ids: Sequence[int],
        rank: int,
        world: int,
        accumulation: int,
        fetch: Callable[[list[int]], Any],
        loss: Callable[[Any, Any], torch.Tensor],
        summed: bool,
        settle: Callable[[], None] = lambda: None,
        step: int = 0,
    ) -> float:
        """Optimizer step number ``step`` over the global batch ``ids`` (dealt round-robin to
        ranks); returns this rank's loss summed over its samples (a skipped non-finite
        micro-batch adds nothing). ``settle`` runs once the gradients are reduced, before
        anything reads them (``worker/device.py``: an aborted collective leaves partial
        gradients that must not reach the parameters)."""
        parts = micro_batches(rank_share(ids, rank, world), accumulation)
        loss_sum = 0.0
        for index, part in enumerate(parts):
            last = index == len(parts) - 1
            if not part and not last:
                continue
            with _no_sync(ddp) if not last else contextlib.nullcontext():
                if part:
                    with self.autocast():
                        value = loss(ddp, fetch(part))
                    item = value.item()
                    if skips_non_finite(item, step, rank, self.nan_policy):
                        self._backward(sum(p.sum() for p in ddp.parameters()) * math.nan)
                        continue
                    # DDP averages gradients over ranks; weight so the step's gradient is that
                    # of the mean over the whole global batch, however it was split.
                    weight = world if summed else world * len(part) / len(ids)
                    self._backward(value if weight == 1 else value * weight)
                    loss_sum += item * (1 if summed else len(part))
                else:  # no samples left for this rank: still join the gradient allreduce
                    self._backward(sum(p.sum() * 0 for p in ddp.parameters()))
        settle()
        if self.scaler is None and self.nan_policy == "skip" and not self._gradients_finite():
            self._skip_optimizer_step(step, rank)
        else:
            self._optimizer_step()
        return loss_sum

    def _gradients_finite(self) -> bool:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return not grads or bool(torch.stack([g.isfinite().all() for g in grads]).all())

    def _skip_optimizer_step(self, step: int, rank: int) -> None:
        """A step some rank's non-finite loss (or gradient) skips: parameters and optimizer
        stay; the schedule moves on, as after a step the GradScaler skips."""
        log.warning("skipped step=%d rank=%d: non-finite gradients", step, rank)
        self._step_scheduler()
        self.optimizer.zero_grad(set_to_none=True)

    def _backward(self, value: torch.Tensor) -> None:
        (self.scaler.scale(value) if self.scaler is not None else value).backward()

    def _optimizer_step(self) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clipping needs the true gradients
        if self.clip_grad_norm is not None:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm)
        groups = self.optimizer.param_groups
        scheduled = [group["lr"] for group in groups]
        self.stepping = True
        for group, lr in zip(groups, scheduled, strict=True):
            group["lr"] = lr * self.lr_scale
        try:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        finally:
            # The scheduler and every saved state see the unscaled LR.
            for group, lr in zip(groups, scheduled, strict=True):
                group["lr"] = lr
        self._step_scheduler()
        self.stepping = False
        self.optimizer.zero_grad(set_to_none=True)

    def _step_scheduler(self) -> None:
        if self.scheduler is not None:
            with warnings.catch_warnings():
                # A step the GradScaler skipped (inf/NaN) still advances the schedule: the
                # schedule counts the runtime's steps. torch warns about that; it is intended.
                warnings.filterwarnings(
                    "ignore", re.escape("Detected call of `lr_scheduler.step()`")
                )
                self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and, when used, scheduler and GradScaler state (CPU or device
        tensors, JSON-able values: ``snapshot_format`` stores them without pickle)."""
        if self.sharded:  # this rank's shards, keyed by name (``sharding.py``)
            state = sharded_state(self.model, self.optimizer)
        else:
            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` gathered; older snapshots (no scheduler/scaler keys, a
        policy-scaled LR in the optimizer) restore the model definition's LRs."""
        if self.sharded:
            load_sharded_state(self.model, self.optimizer, state)
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        else:
            if self.scheduler is not None:
                log.warning(
                    "snapshot holds no scheduler state step=%s: the schedule starts over",
                    state.get("step"),
                )
            for group, lr in zip(self.optimizer.param_groups, self.initial_lrs, strict=True):
                group["lr"] = lr
        if self.scaler is not None:
            if "scaler" in state:
                self.scaler.load_state_dict(state["scaler"])
            else:
                log.warning(
                    "snapshot holds no GradScaler state step=%s: the loss scale starts over",
                    state.get("step"),
                )
