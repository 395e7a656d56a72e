"""The digits example, except that rank ``NAN_RANK``'s loss is NaN at step ``NAN_STEP``.

The step is the LR scheduler's count (a constant schedule): it is part of every snapshot and
rescue and moves on for a skipped step too, so a restored worker reaches the same step again
(a deterministic divergence) and ``--nan-policy skip`` gets past it.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from kfp_elastic.worker.examples.digits import dataset, model, optimizer
from kfp_elastic.worker.examples.digits import loss as digits_loss

__all__ = ["dataset", "loss", "model", "optimizer", "scheduler"]

NAN_STEP = 3
NAN_RANK = 1
_schedules: list[torch.optim.lr_scheduler.LRScheduler] = []


def scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    _schedules.append(schedule)
    return schedule


def loss(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    value = digits_loss(model, batch)
    step = _schedules[-1].last_epoch + 1  # the step being trained, 1-based
    if step == NAN_STEP and int(os.environ.get("RANK", "0")) == NAN_RANK:
        return value * float("nan")
    return value
