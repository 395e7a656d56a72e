"""Sync and snapshot scheduling decisions (pure)."""

from __future__ import annotations

import pytest

from kfp_elastic.job_env import parse_snapshot_every
from kfp_elastic.worker.schedule import (
    FIRST_SNAPSHOT_AFTER_S,
    FIRST_SYNC_GAP,
    MAX_SYNC_GAP,
    SYNC_TARGET_S,
    SnapshotPolicy,
    next_sync_step,
)


@pytest.mark.parametrize(("text", "steps"), [("auto", 0), (" AUTO ", 0), ("0", 0), ("7", 7)])
def test_parse_snapshot_every(text: str, steps: int) -> None:
    assert parse_snapshot_every(text) == steps


@pytest.mark.parametrize("text", ["-3", "often", "1.5"])
def test_parse_snapshot_every_refuses_with_the_reason(text: str) -> None:
    with pytest.raises(ValueError, match="--snapshot-every"):
        parse_snapshot_every(text)


def test_syncs_about_every_target_seconds_of_training() -> None:
    assert next_sync_step(100, None, None) == 100 + FIRST_SYNC_GAP
    assert next_sync_step(100, SYNC_TARGET_S / 50, None) == 150
    assert next_sync_step(100, 10.0, None) == 101  # slow steps: every step
    assert next_sync_step(100, 1e-6, None) == 100 + MAX_SYNC_GAP


def test_explicit_interval_is_always_a_sync() -> None:
    assert next_sync_step(100, SYNC_TARGET_S / 50, 30) == 120  # next multiple of 30
    assert next_sync_step(120, SYNC_TARGET_S / 5, 30) == 125  # a sync before it
    assert next_sync_step(0, None, 3) == 3


def test_explicit_policy_snapshots_every_n_steps_and_at_epoch_ends() -> None:
    policy = SnapshotPolicy(every=10)
    assert policy.due(20, False, 0.0, None)
    assert not policy.due(25, False, 1e9, 0.001)
    assert policy.due(25, True, 0.0, None)


def test_auto_policy_keeps_snapshots_to_the_overhead_share() -> None:
    policy = SnapshotPolicy(every=None, overhead=0.01, max_interval_s=300)
    assert not policy.due(5, False, FIRST_SNAPSHOT_AFTER_S - 0.1, None)
    assert policy.due(5, False, FIRST_SNAPSHOT_AFTER_S, None)  # measure one early
    assert not policy.due(5, False, 0.9, 0.01)  # 10 ms snapshots: one per second of training
    assert policy.due(5, False, 1.0, 0.01)
    assert not policy.due(5, True, 0.5, 0.01)  # epoch ends do not force one
    assert policy.due(5, False, 300.0, 100.0)  # the cap wins over a very costly snapshot
    assert "1.0%" in policy.describe() and "10 steps" in SnapshotPolicy(10).describe()
