"""The batch policies a job can name (``--batch-policy``): how the batch size and the learning rate
follow the world size. What each one does is ``worker/policy.py``'s (``step_shape``)."""

from __future__ import annotations

from enum import Enum


class BatchPolicy(str, Enum):
    FIXED_GLOBAL_BATCH = "fixed-global-batch"
    LINEAR = "linear"
    SQRT = "sqrt"

    @classmethod
    def parse(cls, text: str) -> BatchPolicy:
        try:
            return cls(text)
        except ValueError:
            names = ", ".join(p.value for p in cls)
            raise ValueError(f"unknown batch policy {text!r}; choose one of: {names}") from None
