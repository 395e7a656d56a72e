"""The training-state hooks (scheduler, AMP, clipping, accumulation) and their state: one
process, no process group; a snapshot's save → load restores a state equal to the one saved
and the next steps continue identically."""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from kfp_elastic.worker.finite_loss import NonFiniteLoss, skips_step
from kfp_elastic.worker.model_def import (
    ModelDef,
    ModelDefError,
    checked_scheduler,
    load_model_def,
    model_def_from,
)
from kfp_elastic.worker.policy import BatchPolicy, step_shape
from kfp_elastic.worker.snapshot import Snapshotter
from kfp_elastic.worker.train_step import TrainStep, micro_batches, rng_state, set_rng_state
from tests.helpers import assert_same_state

FULL = "tests.model_defs.full_state"


class Replica(nn.Module):
    """What ``run`` needs of DDP in one process: forward and ``no_sync``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any) -> Any:
        return self.module(*args)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield


def _module(**attributes: Any) -> types.ModuleType:
    module = types.ModuleType("user_def")
    module.model = lambda: nn.Linear(1, 1)
    module.loss = lambda model, batch: model(batch).sum()
    module.dataset = lambda split: [torch.zeros(1)]
    for name, value in attributes.items():
        setattr(module, name, value)
    return module


@pytest.mark.parametrize(
    ("attributes", "message"),
    [
        ({"AMP": "fp8"}, "AMP must be 'bf16', 'fp16' or None, got 'fp8'"),
        ({"AMP": True}, "AMP must be"),
        ({"CLIP_GRAD_NORM": 0}, "CLIP_GRAD_NORM must be a positive number or None, got 0"),
        ({"CLIP_GRAD_NORM": float("inf")}, "CLIP_GRAD_NORM must be a positive number"),
        ({"CLIP_GRAD_NORM": "1.0"}, "CLIP_GRAD_NORM must be a positive number"),
        ({"GRAD_ACCUMULATION": 0}, "GRAD_ACCUMULATION must be an integer >= 1, got 0"),
        ({"GRAD_ACCUMULATION": 2.0}, "GRAD_ACCUMULATION must be an integer >= 1, got 2.0"),
        ({"scheduler": "cosine"}, "scheduler must be a function of the optimizer"),
        ({"LR_DECAY": 0.1}, "LR_DECAY must be None or"),
        ({"LR_DECAY": {"epochs": [9, 6], "gamma": 0.1}}, "LR_DECAY epochs must be a non-empty"),
        ({"LR_DECAY": {"epochs": [2], "gamma": 0}}, "LR_DECAY gamma must be a number in"),
    ],
)
def test_bad_hook_values_are_named(attributes: dict, message: str) -> None:
    with pytest.raises(ModelDefError, match=message.replace("(", r"\(").replace(")", r"\)")):
        model_def_from(_module(**attributes), "user_def")


def test_hooks_default_to_plain_training_and_are_read_when_set() -> None:
    plain = model_def_from(_module(), "user_def")
    assert (plain.scheduler, plain.amp, plain.clip_grad_norm, plain.grad_accumulation) == (
        None,
        None,
        None,
        1,
    )
    full = load_model_def(FULL)
    assert full.scheduler is not None
    assert (full.amp, full.clip_grad_norm, full.grad_accumulation) == ("fp16", 1.0, 2)


def test_scheduler_that_cannot_step_per_step_is_refused() -> None:
    model = nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ModelDefError, match="not ReduceLROnPlateau"):
        checked_scheduler("m", torch.optim.lr_scheduler.ReduceLROnPlateau(opt), opt)
    with pytest.raises(ModelDefError, match="got function"):
        checked_scheduler("m", lambda: None, opt)
    with pytest.raises(ModelDefError, match="the optimizer it is given"):
        checked_scheduler("m", torch.optim.lr_scheduler.StepLR(other, 1), opt)


def test_micro_batches_split_front_loaded() -> None:
    assert micro_batches([1, 2, 3, 4, 5], 2) == [[1, 2, 3], [4, 5]]
    assert micro_batches([1], 3) == [[1], [], []]
    assert micro_batches([], 2) == [[], []]


@pytest.mark.parametrize("policy", list(BatchPolicy))
def test_grad_accumulation_is_the_policys_accumulation_at_the_base_world(policy) -> None:
    base = step_shape(policy, 4, 4, per_worker_batch=8, accumulation=3)
    assert (base.global_batch, base.micro_batch, base.accumulation) == (96, 8, 3)
    half = step_shape(policy, 2, 4, per_worker_batch=8, accumulation=3)
    if policy is BatchPolicy.FIXED_GLOBAL_BATCH:  # fewer workers accumulate more
        assert (half.global_batch, half.micro_batch, half.accumulation) == (96, 8, 6)
    else:
        assert (half.global_batch, half.micro_batch, half.accumulation) == (48, 8, 3)


def _stepper(md: ModelDef) -> TrainStep:
    model = md.model()
    opt = md.optimizer(model.parameters())
    scheduler = checked_scheduler(md.name, md.scheduler(opt), opt) if md.scheduler else None
    return TrainStep(model, opt, scheduler, md.amp, md.clip_grad_norm)


def _train(stepper: TrainStep, md: ModelDef, steps: int, start: int = 0) -> list[float]:
    """``steps`` steps over the training set's consecutive global batches of 8; the LR each
    step used."""
    data = md.dataset("train")

    def fetch(ids: list[int]) -> list[torch.Tensor]:
        return [tensor[torch.tensor(ids)] for tensor in data.tensors]

    lrs = []
    for step in range(start, start + steps):
        ids = [(8 * step + i) % len(data) for i in range(8)]
        lrs.append(stepper.lr)
        stepper.run(Replica(stepper.model), ids, 0, 1, md.grad_accumulation, fetch, md.loss, False)
    return lrs


@pytest.mark.parametrize("amp", ["fp16", "bf16", "none"])
def test_state_after_snapshot_and_restore_equals_the_state_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, amp: str
) -> None:
    md = load_model_def(FULL)
    md = ModelDef(**{**md.__dict__, "amp": None if amp == "none" else amp})
    before = _stepper(md)
    _train(before, md, 6)  # past the warm-up: both schedulers of the sequence have state
    saved = before.state_dict() | {"step": 6} | rng_state()
    if amp == "fp16":  # the first steps overflow fp16 at the initial scale: it backed off
        assert saved["scaler"]["scale"] < 65536.0
    snapshots = Snapshotter(tmp_path)
    snapshots.save(6, saved, lambda name: None, wait=True)
    loaded = snapshots.load(snapshots.available()[0])

    torch.manual_seed(1234)  # the restore must set the RNG, not inherit it
    after = _stepper(md)
    after.load_state_dict(loaded)
    set_rng_state(loaded)
    assert_same_state(before.state_dict(), after.state_dict())
    assert after.lr == before.lr

    set_rng_state(saved)
    expected = _train(before, md, 5, start=6)
    set_rng_state(loaded)
    assert _train(after, md, 5, start=6) == expected  # the same LR sequence
    assert_same_state(before.state_dict(), after.state_dict())  # and the same training


def test_policy_lr_scale_multiplies_the_scheduled_lr_only_inside_the_step() -> None:
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepper = TrainStep(model, opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    stepper.lr_scale = 2.0
    assert stepper.lr == pytest.approx(0.2)

    def loss(ddp: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return ddp(batch).sum()

    stepper.run(Replica(model), [0], 0, 1, 1, lambda ids: torch.ones(1, 1), loss, True)
    assert model.weight.item() == pytest.approx(-0.2)  # the gradient 1 at LR 0.1 x 2
    # The scheduler (and the state a snapshot holds) saw the unscaled LR: 0.1 -> 0.05.
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert stepper.state_dict()["scheduler"]["_last_lr"] == pytest.approx([0.05])
    assert stepper.lr == pytest.approx(0.1)


def test_clipping_bounds_the_gradient_norm() -> None:
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    stepper = TrainStep(model, opt, clip_grad_norm=0.5)

    def loss(ddp: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return ddp(batch).sum()

    stepper.run(Replica(model), [0], 0, 1, 1, lambda ids: torch.full((1, 1), 10.0), loss, True)
    assert model.weight.item() == pytest.approx(-0.5)  # gradient 10 clipped to norm 0.5


def test_older_snapshot_without_scheduler_state_restores_the_model_defs_lr(
    caplog: pytest.LogCaptureFixture,
) -> None:
    md = load_model_def(FULL)
    old = _stepper(ModelDef(**{**md.__dict__, "scheduler": None, "amp": None}))
    for group in old.optimizer.param_groups:
        group["lr"] *= 3  # older runtimes saved the policy-scaled LR in the optimizer
    state = {"model": old.model.state_dict(), "optimizer": old.optimizer.state_dict(), "step": 9}
    for amp in (None, "fp16"):
        plain = _stepper(ModelDef(**{**md.__dict__, "scheduler": None, "amp": amp}))
        plain.load_state_dict(state)
        assert plain.lr == pytest.approx(0.05)
    scheduled = _stepper(md)
    with caplog.at_level(logging.WARNING):
        scheduled.load_state_dict(state)
    assert scheduled.lr == pytest.approx(0.005)  # the warm-up's first LR: the schedule restarts
    assert "no scheduler state step=9" in caplog.text
    assert "no GradScaler state step=9" in caplog.text


def test_a_failure_inside_the_optimizer_step_marks_the_state_unsafe() -> None:
    model = nn.Linear(1, 1)

    class Failing(torch.optim.SGD):
        def step(self, closure=None):  # noqa: ANN001, ANN202
            raise RuntimeError("peer lost")

    stepper = TrainStep(model, Failing(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="peer lost"):
        stepper.run(
            Replica(model),
            [0],
            0,
            1,
            1,
            lambda ids: torch.ones(1, 1),
            lambda ddp, b: ddp(b).sum(),
            True,
        )
    assert stepper.stepping  # the runner writes no rescue from here
    assert stepper.optimizer.param_groups[0]["lr"] == 0.1  # the scale was taken back


# -- non-finite losses (worker/finite_loss.py) -------------------------------------------------


def test_the_nan_policy_decides_per_loss() -> None:
    assert not skips_step(0.5, 7, 1, "fail") and not skips_step(0.5, 7, 1, "skip")
    assert skips_step(float("nan"), 7, 1, "skip") and skips_step(float("-inf"), 7, 1, "skip")
    with pytest.raises(NonFiniteLoss, match=r"non-finite loss \(inf\) at step 7 on rank 1"):
        skips_step(float("inf"), 7, 1, "fail")
    with pytest.raises(ValueError, match="nan policy must be one of fail, skip"):
        skips_step(0.5, 7, 1, "ignore")


def _nan_stepper(policy: str) -> tuple[TrainStep, Replica, Any]:
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    stepper = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), nan_policy=policy)
    replica = Replica(model)

    def run(loss: Any) -> float:
        return stepper.run(
            replica, [0, 1], 0, 1, 1, lambda part: torch.ones(len(part), 2), loss, False, step=4
        )

    return stepper, replica, run


def test_a_nan_loss_fails_before_the_parameters_change() -> None:
    stepper, replica, run = _nan_stepper("fail")
    before = {k: v.clone() for k, v in replica.module.state_dict().items()}
    with pytest.raises(NonFiniteLoss, match="at step 4 on rank 0"):
        run(lambda model, batch: model(batch).mean() * float("nan"))
    assert_same_state(replica.module.state_dict(), before)


def test_a_nan_loss_skips_the_step_under_skip_and_training_goes_on() -> None:
    stepper, replica, run = _nan_stepper("skip")
    before = {k: v.clone() for k, v in replica.module.state_dict().items()}
    assert run(lambda model, batch: model(batch).mean() * float("nan")) == 0.0
    assert_same_state(replica.module.state_dict(), before)
    assert all(p.grad is None for p in replica.module.parameters())
    assert run(lambda model, batch: model(batch).mean()) != 0.0
    assert not torch.equal(replica.module.weight, before["weight"])
