"""Loading a user's model definition: a module with ``model()``, ``loss()`` and ``dataset()``,
named as a module (``pkg.module``, importable in the worker) or as a file (``my_model.py``, a
path ending in ``.py``; the master hands workers an absolute path). A file is loaded like
``python my_model.py`` would run it: its directory comes first on ``sys.path``, so it can import
its neighbours.

def model() -> torch.nn.Module
def loss(model, batch) -> torch.Tensor          # mean over the batch (see LOSS_REDUCTION)
def dataset(split: str) -> Sequence             # "train", "test"; len() and [i]
def optimizer(params) -> torch.optim.Optimizer  # optional, default SGD(lr=--lr)
def scheduler(optimizer) -> LRScheduler         # optional, stepped once per optimizer step
def collate(items: list) -> batch               # optional, default torch's default_collate
def evaluate(model, batch) -> dict[str, float]  # optional, metrics of one test batch
LOSS_REDUCTION = "mean"                         # optional: "sum" if loss() sums the batch
AMP = None                                      # optional: "bf16" | "fp16" autocast
CLIP_GRAD_NORM = None                           # optional: max global gradient L2 norm
GRAD_ACCUMULATION = 1                           # optional: micro-batches per optimizer step
LR_DECAY = None                                 # optional: {"epochs": [6, 9], "gamma": 0.1}
def on_step(step: int) -> None                  # optional: the step hook (below)
SHARDING = None                                 # optional: "per-module" shards with FSDP2
def shard(model, mesh) -> None                  # optional: your own fully_shard calls

``scheduler`` owns the learning rate's *schedule*; the batch policy's LR scaling (``linear``,
``sqrt``: ``worker/policy.py``) multiplies whatever LR the scheduler set, for the duration of
``optimizer.step()`` only, so the scheduler and the snapshots always hold the unscaled LR and a
restore at another world size continues the same schedule. ``LR_DECAY`` multiplies it too: by
``gamma`` at each milestone epoch, counted in samples seen, so a run whose world changes decays at
the same data as one that never changed (``worker/policy.py`` ``LrDecay``).
``on_step(step)`` is the runner's step hook, for instrumentation (``benchmarks/
timed_model_def.py`` numbers its per-step time stamps with it): called once per optimizer
step, just before it runs, with its number: the steps counted before it + 1, over every world
of the run (a restored run goes on from the restored step).
``SHARDING = "per-module"`` or ``shard(model, mesh)`` trains the model sharded (FSDP2) instead
of DDP: ``worker/sharding.py`` (per-module: ``fully_shard`` on each direct child with parameters,
then on the model; ``shard``: your own ``fully_shard`` calls on the 1-D ``mesh`` of all ranks).
``ReduceLROnPlateau`` needs a metric per step and is refused. ``AMP="fp16"`` adds a
``GradScaler``; ``"bf16"`` needs none.
``GRAD_ACCUMULATION = k`` makes ``--batch-size`` the micro-batch of one forward/backward and
an optimizer step ``k`` of them per worker at the base world size: it is the batch policy's one
accumulation count at that size (``fixed-global-batch`` raises it when workers are missing).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.utils.data import default_collate

from kfp_elastic.job_spec import is_file_reference
from kfp_elastic.worker.policy import LrDecay

REQUIRED = ("model", "loss", "dataset")
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


#: ``SHARDING`` values a model definition may set (None: DDP, every rank the whole model).
SHARDING_POLICIES = ("per-module",)


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
    scheduler: Callable[[Any], Any] | None = None
    amp: str | None = None  # a key of AMP_DTYPES
    clip_grad_norm: float | None = None
    grad_accumulation: int = 1
    lr_decay: LrDecay | None = None
    on_step: Callable[[int], Any] | None = None
    sharding: str | None = None  # a ``sharding.SHARDING_POLICIES`` value
    shard: Callable[[Any, Any], Any] | None = None

    @property
    def sharded(self) -> bool:
        return self.sharding is not None or self.shard is not None


def load_model_def(name: str) -> ModelDef:
    """The checked hooks of model definition ``name`` (a module or a ``.py`` file); a
    ``ModelDefError`` names it and says what is wrong. Any error its code raises while it is
    imported (a ``SyntaxError``, a failed import of its own) propagates as it is."""
    if is_file_reference(name):
        return model_def_from(_import_file(Path(name)), name)
    if not name or not all(part.isidentifier() for part in name.split(".")):
        raise ModelDefError(
            f"--model-def {name!r} is neither a module path like pkg.module nor a file like "
            "my_model.py"
        )
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if not (name == missing or name.startswith(missing + ".")):
            raise  # the model definition itself imports something missing: its own error
        raise ModelDefError(
            f"--model-def {name}: module not found ({error}); is its package installed or on "
            "PYTHONPATH? (a file is given as a path: --model-def my_model.py)"
        ) from error
    return model_def_from(module, name)


def _import_file(path: Path) -> ModuleType:
    if path.suffix != ".py":
        raise ModelDefError(f"--model-def {path}: a model definition file must end in .py")
    if not path.is_file():
        raise ModelDefError(f"--model-def {path}: no such file (from {Path.cwd()})")
    path = path.resolve()
    # Under its own name (like a script's neighbours import it) unless that name is taken.
    name = path.stem if path.stem.isidentifier() and path.stem not in sys.modules else None
    name = name or f"kfp_elastic_model_def_{abs(hash(str(path))):x}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelDefError(f"--model-def {path}: cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def model_def_from(module: ModuleType, name: str) -> ModelDef:
    """The checked hooks of an imported model-definition module."""
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
    scheduler = getattr(module, "scheduler", None)
    if scheduler is not None and not callable(scheduler):
        raise ModelDefError(f"--model-def {name}: scheduler must be a function of the optimizer")
    amp = getattr(module, "AMP", None)
    if amp is not None and amp not in AMP_DTYPES:
        raise ModelDefError(f"--model-def {name}: AMP must be 'bf16', 'fp16' or None, got {amp!r}")
    clip = getattr(module, "CLIP_GRAD_NORM", None)
    if clip is not None and (
        isinstance(clip, bool)
        or not isinstance(clip, int | float)
        or not math.isfinite(clip)
        or clip <= 0
    ):
        raise ModelDefError(
            f"--model-def {name}: CLIP_GRAD_NORM must be a positive number or None, got {clip!r}"
        )
    accumulation = getattr(module, "GRAD_ACCUMULATION", 1)
    if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
        raise ModelDefError(
            f"--model-def {name}: GRAD_ACCUMULATION must be an integer >= 1, got {accumulation!r}"
        )
    on_step = getattr(module, "on_step", None)
    if on_step is not None and not callable(on_step):
        raise ModelDefError(f"--model-def {name}: on_step must be a function of the step number")
    sharding = getattr(module, "SHARDING", None)
    if sharding is not None and sharding not in SHARDING_POLICIES:
        raise ModelDefError(
            f"--model-def {name}: SHARDING must be one of {', '.join(SHARDING_POLICIES)} or "
            f"None, got {sharding!r}"
        )
    shard = getattr(module, "shard", None)
    if shard is not None and not callable(shard):
        raise ModelDefError(f"--model-def {name}: shard must be a function of (model, mesh)")
    try:
        lr_decay = LrDecay.parse(getattr(module, "LR_DECAY", None))
    except ValueError as error:
        raise ModelDefError(f"--model-def {name}: {error}") from None
    return ModelDef(
        name=name,
        model=module.model,
        loss=module.loss,
        dataset=module.dataset,
        optimizer=getattr(module, "optimizer", None),
        collate=getattr(module, "collate", default_collate),
        evaluate=getattr(module, "evaluate", None),
        loss_reduction=reduction,
        scheduler=scheduler,
        amp=amp,
        clip_grad_norm=None if clip is None else float(clip),
        grad_accumulation=accumulation,
        lr_decay=lr_decay,
        on_step=on_step,
        sharding=sharding,
        shard=shard,
    )


def checked_scheduler(name: str, scheduler: Any, optimizer: torch.optim.Optimizer) -> Any:
    """``scheduler(optimizer)``'s result, refused unless the runtime can step it per step."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) or not isinstance(
        scheduler, torch.optim.lr_scheduler.LRScheduler
    ):
        raise ModelDefError(
            f"--model-def {name}: scheduler(optimizer) must return an LRScheduler that steps "
            f"without a metric (not ReduceLROnPlateau), got {type(scheduler).__qualname__}"
        )
    if scheduler.optimizer is not optimizer:
        raise ModelDefError(
            f"--model-def {name}: scheduler(optimizer) must schedule the optimizer it is given"
        )
    return scheduler
