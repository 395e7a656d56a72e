"""Sharded (FSDP2) training: how a model is sharded, and its state as torch's distributed
state-dict API sees it.

A model is *sharded* when its parameters are DTensors (``torch.distributed.fsdp.fully_shard``
made them so). Both ways in train one:

* a model definition asks for it with ``SHARDING = "per-module"`` (``fully_shard`` on every
  direct child module that has parameters, then on the model: torch's recipe for a stack of
  blocks) or with its own hook ``def shard(model, mesh) -> None`` that calls ``fully_shard`` on
  the units it chooses; the runner builds the optimizer after sharding (its parameters must be
  the DTensors) and trains the sharded model where it trains DDP otherwise;
* a script passes its FSDP2 model and optimizer to ``elastic.State`` as it would a DDP one.

The state of a sharded model and its optimizer is
``torch.distributed.checkpoint.state_dict.get_state_dict`` (DTensors: each rank its own shards,
keyed by parameter name) and goes back through ``set_state_dict``; snapshots, the neighbour
copies and the N → M reshard work on that (``sharded_snapshot.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from kfp_elastic.worker.model_def import SHARDING_POLICIES

#: The keys of a trained state that hold the sharded model and optimizer (the rest of the
#: state, such as the LR scheduler, is the same on every rank and small).
SHARDED_KEYS = ("model", "optimizer")


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are sharded (DTensors)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def shard_model(
    model: nn.Module,
    policy: str | None,
    hook: Callable[[nn.Module, Any], None] | None,
    device: torch.device,
) -> nn.Module:
    """``model`` sharded over every rank of the default group (a 1-D mesh): by the model
    definition's ``shard(model, mesh)`` hook, else by ``policy``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    if hook is not None:
        hook(model, mesh)
        if not is_sharded(model):
            raise ValueError("shard(model, mesh) left the model unsharded: call fully_shard")
        return model
    if policy != "per-module":
        raise ValueError(f"SHARDING must be one of {SHARDING_POLICIES} or None, got {policy!r}")
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's and optimizer's state as this rank's shards (DTensors), keyed by name;
    the optimizer's state is initialised when it has none yet, so that a fresh model gives
    the tensors a restore loads into."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def load_sharded_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
    )


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state on CPU (collective: every rank calls it; rank 0 gets it)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)
