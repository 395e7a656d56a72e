"""The digits data with a wider MLP (64-1024-1024-10, 1.1 M parameters): a benchmark model whose
step does real work (≈ 20 ms for 2 gloo workers on 2 cores, vs ≈ 4 ms for the digits MLP), so
fixed per-step and per-snapshot costs weigh about as much as on a small real model.

    python -m benchmarks runtime --model wide
"""

from __future__ import annotations

import torch
from torch import nn

from kfp_elastic.worker.examples import digits

dataset = digits.dataset
loss = digits.loss
optimizer = digits.optimizer
evaluate = digits.evaluate

HIDDEN = 1024


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, 10),
    )
