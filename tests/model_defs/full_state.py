"""A model definition that uses every training-state hook: an LR schedule (warm-up, then cosine)
and a step decay (``LR_DECAY``: × 0.5 half way through the third epoch), AMP
(``$FULL_STATE_AMP``, default fp16 with its GradScaler; "none" turns it off), gradient clipping,
gradient accumulation, SGD momentum and dropout (the RNG).

Everything is seeded, so two runs from the same state take the same steps bit for bit (on CPU,
equal batches per rank: 96 samples, ``--batch-size 4``, world 1 or 2).
"""

from __future__ import annotations

import os

import torch
from torch import nn

SAMPLES = 96
_AMP = os.environ.get("FULL_STATE_AMP", "fp16")
AMP = None if _AMP == "none" else _AMP
CLIP_GRAD_NORM = 1.0
GRAD_ACCUMULATION = 2
WARMUP_STEPS = 4
LR_DECAY = {"epochs": [2.5], "gamma": 0.5}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))


def dataset(split: str) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(1 if split == "train" else 2)
    features = torch.randn(SAMPLES, 8, generator=generator)
    targets = features.sum(dim=1, keepdim=True) + 0.1 * torch.randn(SAMPLES, 1, generator=generator)
    return torch.utils.data.TensorDataset(features, targets)


def loss(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    features, targets = batch
    return nn.functional.mse_loss(model(features).float(), targets)


def optimizer(params) -> torch.optim.Optimizer:  # noqa: ANN001 - torch's own type is loose
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    lr = torch.optim.lr_scheduler
    warmup = lr.LinearLR(optimizer, start_factor=0.1, total_iters=WARMUP_STEPS)
    cosine = lr.CosineAnnealingLR(optimizer, T_max=40)
    return lr.SequentialLR(optimizer, [warmup, cosine], milestones=[WARMUP_STEPS])
