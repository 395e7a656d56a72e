"""A model of >= 1 B parameters for the snapshot benchmark on a GPU (the blocking time per
snapshot next to ``torch.save`` of the same state; DLRover's Flash Checkpoint, the field's
anchor, blocks ≈ 0.2 s per checkpoint: docs/benchmarks.md):

    python -m benchmarks runtime --parts micro --model 1b --device cuda --micro-n 10

The digits data through a deep MLP (64 → 8192, 16 × 8192², 8192 → 10: 1.07 B parameters,
4.3 GB in fp32, 8.6 GB with SGD momentum). Far too big for the CI machines (it is never
imported by a test); an H100 holds it with room to spare.
"""

from __future__ import annotations

import torch
from torch import nn

from kfp_elastic.worker.examples import digits

dataset = digits.dataset
loss = digits.loss
optimizer = digits.optimizer
evaluate = digits.evaluate

HIDDEN = 8192
LAYERS = 16


def model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, HIDDEN), nn.ReLU()]
    for _ in range(LAYERS):
        layers += [nn.Linear(HIDDEN, HIDDEN), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(HIDDEN, 10))
