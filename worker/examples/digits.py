"""Handwritten digits (scikit-learn's bundled 8x8 images).

``--model-def kfp_elastic.worker.examples.digits``.

1,797 images ship inside scikit-learn, so this trains offline; a small MLP reaches about 95 %
test accuracy on a CPU in well under a minute.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

TEST_FRACTION = 0.2
SPLIT_SEED = 0


def _split(split: str) -> TensorDataset:
    from sklearn.datasets import load_digits

    data = load_digits()
    features = torch.tensor(data.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
    cut = int(len(labels) * (1 - TEST_FRACTION))
    chosen = order[:cut] if split == "train" else order[cut:]
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}; digits has 'train' and 'test'")
    return TensorDataset(features[chosen], labels[chosen])


def dataset(split: str) -> TensorDataset:
    return _split(split)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def loss(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    features, labels = batch
    return nn.functional.cross_entropy(model(features), labels)


def optimizer(params) -> torch.optim.Optimizer:  # noqa: ANN001 - torch's own type is loose
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def evaluate(model: nn.Module, batch: list[torch.Tensor]) -> dict[str, float]:
    features, labels = batch
    logits = model(features)
    return {
        "loss": float(nn.functional.cross_entropy(logits, labels)),
        "correct": float((logits.argmax(dim=1) == labels).sum()),
        "count": len(labels),
    }
