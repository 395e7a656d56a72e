"""The counting model (``counting.py``) sharded with FSDP2 (``SHARDING = "per-module"``): its
counts are split over the ranks, so every resize moves shards between them, and the final
model still proves that every sample reached it exactly once per epoch."""

from __future__ import annotations

from kfp_elastic.testing.model_defs.counting import (
    LOSS_REDUCTION,
    SAMPLES,
    Counter,
    Ids,
    dataset,
    loss,
    model,
    optimizer,
)

SHARDING = "per-module"

__all__ = [
    "LOSS_REDUCTION",
    "SAMPLES",
    "SHARDING",
    "Counter",
    "Ids",
    "dataset",
    "loss",
    "model",
    "optimizer",
]
