"""A sharded (FSDP2) MLP on the digits data trained with AdamW, wide enough that its state is
what sharded training is for: 64 → H → H → H → H → 10 (``DEPTH`` hidden-to-hidden layers),
50.6 M parameters at the default H = 4096, ~600 MB of model and AdamW state (fp32).

    --model-def benchmarks.sharded_model_def        # python -m benchmarks sharded

``$SHARDED_MODEL_HIDDEN`` sets H (``--quick``: 1280, 5.0 M parameters). ``SHARDING =
"per-module"``: every layer is its own FSDP unit, so each rank holds about a third of every
layer's parameters and AdamW moments in a world of 3. The benchmark trains it through
``benchmarks.timed_model_def`` (``$TIMED_MODEL_DEF``), which adds a time stamp per optimizer
step, numbered by the ``on_step`` hook.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from kfp_elastic.worker.examples import digits

HIDDEN_ENV = "SHARDED_MODEL_HIDDEN"
DEFAULT_HIDDEN = 4096
DEPTH = 3  # hidden-to-hidden layers
SHARDING = "per-module"

dataset = digits.dataset
loss = digits.loss
evaluate = digits.evaluate


def hidden() -> int:
    """The width H (``$SHARDED_MODEL_HIDDEN``, else 4096)."""
    return int(os.environ.get(HIDDEN_ENV) or DEFAULT_HIDDEN)


def parameter_count(width: int, depth: int = DEPTH) -> int:
    """Parameters of the MLP of width ``width`` (weights and biases)."""
    return (digits.PIXELS + 1) * width + depth * (width + 1) * width + (width + 1) * 10


def model() -> nn.Module:
    torch.manual_seed(0)
    width = hidden()
    layers: list[nn.Module] = [nn.Linear(digits.PIXELS, width), nn.ReLU()]
    for _ in range(DEPTH):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def optimizer(params) -> torch.optim.Optimizer:  # noqa: ANN001 - torch's own type is loose
    return torch.optim.AdamW(params, lr=1e-4)
