"""Handwritten digits (scikit-learn's bundled 8x8 images).

``--model-def kfp_elastic.worker.examples.digits``.

1,797 images ship inside scikit-learn, so this trains offline; a small MLP reaches about 95 %
test accuracy on a CPU in well under a minute.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

TEST_FRACTION = 0.2
SPLIT_SEED = 0
PIXELS = 64


@functools.cache
def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    """What ``sklearn.datasets.load_digits()`` returns (pixels 0..16, labels), read from the CSV
    file scikit-learn ships, without importing scikit-learn: that import took ≈ 1.5 s of every
    worker start here, i.e. of every restart after a membership change."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the digits example reads scikit-learn's data: pip install scikit-learn"
        )
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as handle:
        values = [float(x) for x in handle.read().replace("\n", ",").split(",") if x.strip()]
    table = torch.tensor(values).reshape(-1, PIXELS + 1)
    return table[:, :PIXELS], table[:, PIXELS].to(torch.int64)


def _split(split: str) -> TensorDataset:
    pixels, labels = _digits()
    features = pixels / 16.0
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
