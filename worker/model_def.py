"""Loading a user's model definition: a module with ``model()``, ``loss()`` and ``dataset()``.

def model() -> torch.nn.Module
def loss(model, batch) -> torch.Tensor          # mean over the batch (see LOSS_REDUCTION)
def dataset(split: str) -> Sequence             # "train", "test"; len() and [i]
def optimizer(params) -> torch.optim.Optimizer  # optional, default SGD(lr=--lr)
def collate(items: list) -> batch               # optional, default torch's default_collate
def evaluate(model, batch) -> dict[str, float]  # optional, metrics of one test batch
LOSS_REDUCTION = "mean"                         # optional: "sum" if loss() sums the batch
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.utils.data import default_collate

REQUIRED = ("model", "loss", "dataset")


class ModelDefError(ValueError):
    """The --model-def module cannot be used; the message says what is missing."""


@dataclass(frozen=True)
class ModelDef:
    name: str
    model: Callable[[], Any]
    loss: Callable[[Any, Any], Any]
    dataset: Callable[[str], Any]
    optimizer: Callable[[Any], Any] | None
    collate: Callable[[list], Any]
    evaluate: Callable[[Any, Any], dict] | None
    loss_reduction: str


def load_model_def(name: str) -> ModelDef:
    if not name or not all(part.isidentifier() for part in name.split(".")):
        raise ModelDefError(f"--model-def {name!r} is not a module path like pkg.module")
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as error:
        raise ModelDefError(
            f"--model-def {name}: module not found ({error}); is its package installed or on "
            "PYTHONPATH?"
        ) from error
    missing = [f for f in REQUIRED if not callable(getattr(module, f, None))]
    if missing:
        raise ModelDefError(
            f"--model-def {name} lacks {', '.join(f + '()' for f in missing)}; a model "
            "definition needs model(), loss(model, batch) and dataset(split)"
        )
    if len(inspect.signature(module.loss).parameters) != 2:
        raise ModelDefError(f"--model-def {name}: loss must take (model, batch)")
    reduction = getattr(module, "LOSS_REDUCTION", "mean")
    if reduction not in ("mean", "sum"):
        raise ModelDefError(f"--model-def {name}: LOSS_REDUCTION must be 'mean' or 'sum'")
    return ModelDef(
        name=name,
        model=module.model,
        loss=module.loss,
        dataset=module.dataset,
        optimizer=getattr(module, "optimizer", None),
        collate=getattr(module, "collate", default_collate),
        evaluate=getattr(module, "evaluate", None),
        loss_reduction=reduction,
    )
