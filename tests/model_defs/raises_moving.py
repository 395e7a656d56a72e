"""The digits example, except that rank ``FAILING_RANK`` raises at a step that moves on at every
start, like a data-dependent error: step ``FIRST_FAILING_STEP`` in the first rendezvous round,
one step later per round after it (``KFP_ELASTIC_RDZV_ROUND``).

No two starts fail the same way, so no agent gives up on a repeated failure: only the job's
failure budget (``--max-failures``, counted once per round in etcd) ends it; without one,
torchrun restarts it in place until the error has moved past the last step.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from kfp_elastic.job_env import ROUND_ENV
from kfp_elastic.worker.examples.digits import dataset, model, optimizer
from kfp_elastic.worker.examples.digits import loss as digits_loss

__all__ = ["dataset", "loss", "model", "optimizer", "scheduler"]

FIRST_FAILING_STEP = 2
FAILING_RANK = 1
ERROR = "raises_moving: a data-dependent error at step"
_schedules: list[torch.optim.lr_scheduler.LRScheduler] = []


def scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    _schedules.append(schedule)
    return schedule


def loss(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    step = _schedules[-1].last_epoch + 1  # the step being trained, 1-based, restored on restart
    round_number = int(os.environ.get(ROUND_ENV, "1") or 1)
    failing_step = FIRST_FAILING_STEP + max(0, round_number - 1)
    if int(os.environ.get("RANK", "0")) == FAILING_RANK and step == failing_step:
        raise RuntimeError(f"{ERROR} {step}")
    return digits_loss(model, batch)
