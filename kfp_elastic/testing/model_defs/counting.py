"""A model whose weights count how often each sample reached them.

``counts[i]`` grows by exactly 1 each time sample ``i`` contributes a gradient to an optimizer
step that the final model descends from (SGD, lr 1, loss = -sum of the counts of the batch,
summed over the global batch). After E epochs every entry must be exactly E.
"""

from __future__ import annotations

import os

import torch
from torch import nn

SAMPLES = int(os.environ.get("COUNTING_SAMPLES", "240"))
LOSS_REDUCTION = "sum"


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.counts = nn.Parameter(torch.zeros(SAMPLES, dtype=torch.float64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.counts[ids]


class Ids(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)


def model() -> nn.Module:
    return Counter()


def dataset(split: str) -> Ids:
    return Ids()


def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return -model(batch).sum()


def optimizer(params) -> torch.optim.Optimizer:  # noqa: ANN001
    return torch.optim.SGD(params, lr=1.0)
