"""A small classifier whose weights also count how often each sample reached them.

Two parts in one model, trained by one loss:

- ``counts``, as in ``counting.py``: ``counts[i]`` grows by exactly 1 each time sample ``i``
  contributes to an optimizer step the final model descends from (SGD with lr 1, summed loss),
  so after E epochs every entry is E: the exactly-once check;
- a linear classifier of four overlapping Gaussian blobs in 2-D, whose test accuracy (``kfp-elastic
  evaluate``: the test split yields ``(features, label)``) plateaus below 100 %, so a model that
  lost or repeated training shows in it.

Everything is float64 and seeded; with ``fixed-global-batch`` every step takes the same samples
at any world size (``contract/data_plan.py``), so a disturbed run ends within rounding of an
undisturbed one.
"""

from __future__ import annotations

import torch
from torch import nn

SAMPLES = 240
TEST_SAMPLES = 400
LOSS_REDUCTION = "sum"
# The classifier's learning rate, carried by the loss: one SGD with lr 1 keeps ``counts`` exact.
CLASSIFIER_LR = 0.01
_CENTERS = torch.tensor([[1.0, 1.0], [-1.0, 1.0], [-1.0, -1.0], [1.0, -1.0]], dtype=torch.float64)


class CountedClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.counts = nn.Parameter(torch.zeros(SAMPLES, dtype=torch.float64))
        self.linear = nn.Linear(2, len(_CENTERS), dtype=torch.float64)

    def forward(
        self, features: torch.Tensor, ids: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        logits = self.linear(features)
        # Training passes the ids: both parameters take part in every step (DDP requires it).
        return logits if ids is None else (logits, self.counts[ids])


def _blobs(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(len(_CENTERS), (count,), generator=generator)
    noise = torch.randn(count, 2, generator=generator, dtype=torch.float64)
    return _CENTERS[labels] + 0.9 * noise, labels


class Blobs(torch.utils.data.Dataset):
    def __init__(self, split: str) -> None:
        self.train = split == "train"
        self.features, self.labels = _blobs(
            SAMPLES if self.train else TEST_SAMPLES, 1 + (split != "train")
        )

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        item = (self.features[index], self.labels[index])
        return (*item, torch.tensor(index)) if self.train else item


def model() -> nn.Module:
    return CountedClassifier()


def dataset(split: str) -> Blobs:
    return Blobs(split)


def loss(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    if len(batch) == 2:  # the test split (evaluation)
        features, labels = batch
        return CLASSIFIER_LR * nn.functional.cross_entropy(model(features), labels, reduction="sum")
    features, labels, ids = batch
    logits, counts = model(features, ids)
    classify = nn.functional.cross_entropy(logits, labels, reduction="sum")
    return CLASSIFIER_LR * classify - counts.sum()


def optimizer(params) -> torch.optim.Optimizer:  # noqa: ANN001 - torch's own type is loose
    return torch.optim.SGD(params, lr=1.0)
