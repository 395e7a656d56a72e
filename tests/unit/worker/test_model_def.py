"""The sharding hooks of a model definition (``worker/model_def.py``): ``SHARDING`` and
``shard(model, mesh)`` are checked when it is loaded, and a ``ModelDefError`` names the hook."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
import torch

from kfp_elastic.worker.model_def import SHARDING_POLICIES, ModelDefError, model_def_from


def _module(**hooks: Any) -> ModuleType:
    module = ModuleType("sharded_def")
    module.model = lambda: torch.nn.Linear(2, 1)
    module.loss = lambda model, batch: model(batch).sum()
    module.dataset = lambda split: [torch.zeros(2)]
    for name, value in hooks.items():
        setattr(module, name, value)
    return module


def test_a_model_definition_without_sharding_trains_ddp() -> None:
    loaded = model_def_from(_module(), "sharded_def")
    assert loaded.sharding is None and loaded.shard is None and not loaded.sharded


def test_sharding_per_module_is_accepted() -> None:
    assert "per-module" in SHARDING_POLICIES
    loaded = model_def_from(_module(SHARDING="per-module"), "sharded_def")
    assert loaded.sharding == "per-module" and loaded.sharded


def test_a_shard_hook_is_accepted() -> None:
    def shard(model: torch.nn.Module, mesh: Any) -> None:
        pass

    loaded = model_def_from(_module(shard=shard), "sharded_def")
    assert loaded.shard is shard and loaded.sharding is None and loaded.sharded


@pytest.mark.parametrize("value", ["bogus", "per_module", True, 1])
def test_an_unknown_sharding_policy_is_refused_by_name(value: Any) -> None:
    with pytest.raises(ModelDefError, match=r"sharded_def: SHARDING must be one of per-module"):
        model_def_from(_module(SHARDING=value), "sharded_def")


def test_a_shard_that_is_not_a_function_is_refused_by_name() -> None:
    with pytest.raises(ModelDefError, match=r"sharded_def: shard must be a function"):
        model_def_from(_module(shard="fully_shard"), "sharded_def")
