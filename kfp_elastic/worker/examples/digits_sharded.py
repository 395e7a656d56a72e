"""The digits example (``digits.py``) sharded with FSDP2 and trained with AdamW:
``--model-def kfp_elastic.worker.examples.digits_sharded``.

``SHARDING = "per-module"`` is the whole difference to a DDP model definition: every rank holds
its shards of each layer's parameters and AdamW moments (``fully_shard`` on each layer, then on
the model), and every world change reshards them N → M from the ranks' host memory
(docs/runtime.md, "Sharded models").
"""

from __future__ import annotations

import torch

from kfp_elastic.worker.examples.digits import dataset, evaluate, loss, model

SHARDING = "per-module"


def optimizer(params) -> torch.optim.Optimizer:  # noqa: ANN001 - torch's own type is loose
    return torch.optim.AdamW(params, lr=0.003)


__all__ = ["SHARDING", "dataset", "evaluate", "loss", "model", "optimizer"]
