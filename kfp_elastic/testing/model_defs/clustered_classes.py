"""Ten overlapping classes in 30 dimensions: a task a small MLP learns over several epochs and
does not solve (held-out accuracy ≈ 88 %), for comparing how runs converge.

``--model-def kfp_elastic.testing.model_defs.clustered_classes``.

Generated like scikit-learn's ``make_classification`` (without importing it: that import costs
every worker start about 1.5 s): each class is two Gaussian clusters around random centres in 10
informative dimensions, mixed by a random linear map, plus 20 dimensions of pure noise; 5 % of the
labels are replaced by random ones. 16,000 training and 4,000 held-out samples, seeded, the same
in every process. The MLP (30-128-128-10) with SGD + momentum and the decay ``LR_DECAY`` below
reaches about 88 % after 12 epochs at worlds of 1, 2 and 4 (``linear`` policy, 32 samples per
worker) on a CPU; the digits example is at 95 % after one or two epochs, too easy to tell runs
apart.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.data import TensorDataset

# A classifier's loss and held-out metrics, as the digits example has them
from kfp_elastic.worker.examples.digits import evaluate, loss  # noqa: F401 - hooks

CLASSES = 10
CLUSTERS_PER_CLASS = 2
INFORMATIVE = 10
NOISE = 20
FEATURES = INFORMATIVE + NOISE
TRAIN_SAMPLES = 16_000
TEST_SAMPLES = 4_000
SEPARATION = 1.5  # cluster centres' spread in units of the clusters' own standard deviation
FLIP = 0.05  # share of labels replaced by random ones
SEED = 1
LR = 0.05  # at the base world size; the batch policy scales it (linear: x world / base world)
MOMENTUM = 0.9
# Step-wise decay at 60 % and 85 % of a 12-epoch run, by data seen (worker/policy.py LrDecay).
LR_DECAY = {"epochs": [7, 10], "gamma": 0.1}


@functools.cache
def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED)
    count = TRAIN_SAMPLES + TEST_SAMPLES
    centres = torch.randn(CLASSES * CLUSTERS_PER_CLASS, INFORMATIVE, generator=generator)
    cluster = torch.randint(len(centres), (count,), generator=generator)
    informative = centres[cluster] * SEPARATION + torch.randn(
        count, INFORMATIVE, generator=generator
    )
    mixing = torch.randn(INFORMATIVE, INFORMATIVE, generator=generator) / INFORMATIVE**0.5
    noise = torch.randn(count, NOISE, generator=generator)
    features = torch.cat([informative @ mixing, noise], dim=1)
    features = (features - features.mean(dim=0)) / features.std(dim=0)
    labels = cluster % CLASSES
    flipped = torch.rand(count, generator=generator) < FLIP
    labels = torch.where(flipped, torch.randint(CLASSES, (count,), generator=generator), labels)
    return features, labels


def dataset(split: str) -> TensorDataset:
    features, labels = _data()
    if split == "train":
        return TensorDataset(features[:TRAIN_SAMPLES], labels[:TRAIN_SAMPLES])
    if split == "test":
        return TensorDataset(features[TRAIN_SAMPLES:], labels[TRAIN_SAMPLES:])
    raise ValueError(f"unknown split {split!r}; clustered_classes has 'train' and 'test'")


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, CLASSES)
    )


def optimizer(params) -> torch.optim.Optimizer:  # noqa: ANN001 - torch's own type is loose
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
