"""What a non-finite (NaN or inf) training loss does: the one check the built-in runtime
(``train_step.TrainStep``) and the script API (``elastic.State.commit(loss=...)``) share.

``--nan-policy fail`` (the default) stops the job: the worker raises ``NonFiniteLoss``, which
names the step and the rank; torchrun's error file carries it to the agent, which counts it in
the job's failure budget as a fatal failure (``contract/failure_budget.py``: its class name is
in ``FATAL_ERRORS``) and does not restart its workers; the master ends the job with it as its
error at its first occurrence, whatever the step, instead of reporting success for a model
that diverged.
``--nan-policy skip`` skips such a step (no optimizer step; see ``TrainStep``) and trains on.
"""

from __future__ import annotations

import logging
import math

from kfp_elastic.job_spec import DEFAULT_NAN_POLICY, NAN_POLICIES

__all__ = ["DEFAULT_NAN_POLICY", "NAN_POLICIES", "NonFiniteLoss", "skips_step"]


class NonFiniteLoss(RuntimeError):
    """The loss of a step was NaN or infinite and ``--nan-policy`` is ``fail``."""

    def __init__(self, loss: float, step: int, rank: int) -> None:
        self.loss, self.step, self.rank = loss, step, rank
        super().__init__(
            f"non-finite loss ({loss}) at step {step} on rank {rank}: training stopped "
            "(--nan-policy fail); lower the learning rate, clip gradients (CLIP_GRAD_NORM) or "
            "check the data, or pass --nan-policy skip to skip such steps"
        )


def skips_step(loss: float, step: int, rank: int, policy: str) -> bool:
    """Whether the step with this rank's ``loss`` is skipped: False for a finite loss, True for a
    non-finite one under ``skip``; under ``fail`` a non-finite loss raises ``NonFiniteLoss``."""
    if policy not in NAN_POLICIES:
        raise ValueError(f"nan policy must be one of {', '.join(NAN_POLICIES)}, not {policy!r}")
    if math.isfinite(loss):
        return False
    if policy == "skip":
        return True
    raise NonFiniteLoss(loss, step, rank)


log = logging.getLogger(__name__)


def skips_non_finite(loss: float, step: int, rank: int, policy: str) -> bool:
    """``skips_step``, with the warning a skipped step's loss gets in the worker's log: what
    both ways of training call with this rank's loss of step number ``step``."""
    if not skips_step(loss, step, rank, policy):
        return False
    log.warning("non-finite loss step=%d rank=%d loss=%s (--nan-policy skip)", step, rank, loss)
    return True
