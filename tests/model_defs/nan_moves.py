"""The digits example, except that rank ``NAN_RANK``'s loss turns NaN at a step that moves on at
every restart: step ``FIRST_NAN_STEP`` in the first rendezvous round, one step later per round
after it (``KFP_ELASTIC_RDZV_ROUND``, set by the agent for the workers it starts).

A divergence that no two starts share, so no agent sees "the same failure again": under
``--nan-policy fail`` only the job's failure budget (``kfp_elastic/contract/failure_budget.py``: a
``NonFiniteLoss`` is fatal) keeps torchrun from restarting it in place until the NaN has moved
past the last step and the job "succeeds".
"""

from __future__ import annotations

import os

import torch
from torch import nn

from kfp_elastic.job_env import ROUND_ENV
from kfp_elastic.worker.examples.digits import dataset, model, optimizer
from kfp_elastic.worker.examples.digits import loss as digits_loss

__all__ = ["dataset", "loss", "model", "optimizer", "scheduler"]

FIRST_NAN_STEP = 2
NAN_RANK = 1
_schedules: list[torch.optim.lr_scheduler.LRScheduler] = []


def nan_step(round_number: int) -> int:
    """The step whose loss is NaN in rendezvous round ``round_number`` (rounds count from 1)."""
    return FIRST_NAN_STEP + max(0, round_number - 1)


def scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    _schedules.append(schedule)
    return schedule


def loss(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    value = digits_loss(model, batch)
    step = _schedules[-1].last_epoch + 1  # the step being trained, 1-based, restored on restart
    round_number = int(os.environ.get(ROUND_ENV, "1") or 1)
    if int(os.environ.get("RANK", "0")) == NAN_RANK and step == nan_step(round_number):
        return value * float("nan")
    return value
