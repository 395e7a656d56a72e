"""Batch/LR policy, data plan and model-def loading: pure, no processes."""

from __future__ import annotations

import pytest

from kfp_elastic.contract.data_plan import (
    QueueState,
    epoch_order,
    queue_state,
    shard_order,
    shards_for_length,
    step_ids,
    steps_left,
)
from kfp_elastic.worker.model_def import ModelDefError, load_model_def
from kfp_elastic.worker.policy import BatchPolicy, LrDecay, lr_factor, step_shape
from kfp_elastic.worker.progress import Committed, Manifest, manifest_from_shards


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_fixed_global_batch_keeps_the_global_batch(world: int) -> None:
    shape = step_shape(BatchPolicy.FIXED_GLOBAL_BATCH, world, base_world_size=4, per_worker_batch=8)
    assert shape.global_batch == 32 and shape.lr_scale == 1.0
    assert shape.micro_batch * shape.accumulation * world >= 32


def test_linear_and_sqrt_scale_the_learning_rate() -> None:
    linear = step_shape(BatchPolicy.LINEAR, 2, 4, 8)
    assert (linear.global_batch, linear.lr_scale) == (16, 0.5)
    sqrt = step_shape(BatchPolicy.SQRT, 16, 4, 8)
    assert (sqrt.global_batch, sqrt.lr_scale) == (128, 2.0)


def test_lr_decay_steps_down_at_each_milestone_epoch() -> None:
    decay = LrDecay.parse({"epochs": [2, 3.5], "gamma": 0.1})
    assert decay == LrDecay((2.0, 3.5), 0.1)
    factors = [decay.factor(p) for p in (0.0, 1.99, 2.0, 3.49, 3.5, 10.0)]
    assert factors == pytest.approx([1.0, 1.0, 0.1, 0.1, 0.01, 0.01])
    assert LrDecay.parse(None) is None


def test_lr_factor_decays_at_the_same_sample_whatever_the_world() -> None:
    """lr x world size times the decay: a world of 1 and a world of 4 (the same data, 4 times
    the steps) decay at the same position of the same epoch."""
    decay = LrDecay((1.5,), 0.5)
    small = step_shape(BatchPolicy.LINEAR, 1, 4, 8)
    big = step_shape(BatchPolicy.LINEAR, 4, 4, 8)
    assert lr_factor(small, decay, 1, 499, 1000) == 0.25
    assert lr_factor(small, decay, 1, 500, 1000) == 0.125
    assert lr_factor(big, decay, 1, 500, 1000) == 0.5
    assert lr_factor(big, None, 7, 0, 1000) == 1.0


def test_unknown_policy_names_the_choices() -> None:
    with pytest.raises(ValueError, match="fixed-global-batch, linear, sqrt"):
        BatchPolicy.parse("cubic")


def test_epoch_order_is_a_permutation_fixed_by_seed_and_epoch() -> None:
    shards = shards_for_length(103, 10)
    first = epoch_order(shards, 0, seed=1)
    assert sorted(first) == list(range(103))
    assert first == epoch_order(shards, 0, seed=1)
    assert first != epoch_order(shards, 1, seed=1)


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_every_sample_once_per_epoch_for_any_world_size(world: int) -> None:
    order = epoch_order(shards_for_length(50, 7), 0, seed=0)
    seen: list[int] = []
    position = 0
    steps = steps_left(len(order), 0, 12)
    for _ in range(steps):
        for rank in range(world):
            seen += step_ids(order, position, 12, world, rank)
        position += len(order[position : position + 12])
    assert sorted(seen) == list(range(50))


def test_world_change_mid_epoch_still_covers_each_sample_once() -> None:
    order = epoch_order(shards_for_length(60, 8), 2, seed=3)
    seen, position = [], 0
    for world in (3, 3, 2, 2, 4, 1, 1):
        for rank in range(world):
            seen += step_ids(order, position, 10, world, rank)
        position += 10
    assert sorted(seen) == list(range(60)) and position == 70


def test_queue_state_follows_the_position() -> None:
    shards = shards_for_length(30, 10)
    visit = shard_order(shards, 0, seed=0, shuffle=False)
    assert queue_state(shards, visit, 0) == QueueState((0, 1, 2), (), ())
    assert queue_state(shards, visit, 15) == QueueState((2,), (1,), (0,))
    assert queue_state(shards, visit, 30) == QueueState((), (), (0, 1, 2))


def test_manifest_and_committed_round_trip_as_json() -> None:
    manifest = manifest_from_shards(shards_for_length(10, 3), epochs=2, seed=5)
    assert Manifest.from_json(manifest.to_json()) == manifest
    record = Committed(4, 1, 6, "snapshot-000000004.pt", 2, 32, 0.1, False, (0.5,))
    assert Committed.from_json(record.to_json()) == record


def test_empty_dataset_is_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        shards_for_length(0, 10)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no.such.module", "module not found"),
        ("not a module", "is neither a module path like pkg.module nor a file"),
        ("json", "lacks model(), loss(), dataset()"),
    ],
)
def test_bad_model_def_says_what_is_wrong(name: str, message: str) -> None:
    with pytest.raises(ModelDefError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model_def(name)


def test_example_model_defs_load() -> None:
    assert load_model_def("kfp_elastic.worker.examples.digits").evaluate is not None
    assert load_model_def("kfp_elastic.testing.model_defs.counting").loss_reduction == "sum"


def test_the_digits_example_holds_exactly_scikit_learns_digits() -> None:
    """It reads scikit-learn's CSV itself (no ``import sklearn`` at each worker start)."""
    import torch
    from sklearn.datasets import load_digits

    from kfp_elastic.worker.examples import digits

    reference = load_digits()
    pixels, labels = digits._digits()
    assert torch.equal(pixels, torch.tensor(reference.data, dtype=torch.float32))
    assert torch.equal(labels, torch.tensor(reference.target, dtype=torch.int64))
    train, test = digits.dataset("train"), digits.dataset("test")
    assert len(train) + len(test) == len(reference.target) and len(test) == 360
    assert float(train.tensors[0].max()) == 1.0
