"""Shard queues and committed progress in a real etcd; snapshots on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kfp_elastic.contract.data_plan import shards_for_length
from kfp_elastic.etcd.client import connect
from kfp_elastic.worker.options import parse_args
from kfp_elastic.worker.progress import Committed, Progress, ensure_manifest, manifest_from_shards
from kfp_elastic.worker.snapshot import SnapshotError, Snapshotter


@pytest.fixture
def progress(etcd, run_id: str):
    client = connect(etcd.client_settings())
    yield Progress(client, f"/kfp-elastic/{run_id}")
    client.close()


def queue_keys(progress: Progress, epoch: int) -> dict[str, set[int]]:
    client = progress._client
    result = {}
    for state in ("todo", "doing", "done"):
        prefix = progress.keys.queue(epoch, state)
        result[state] = {int(m.key.decode()[len(prefix) :]) for _, m in client.get_prefix(prefix)}
    return result


def test_manifest_is_published_once_with_every_epochs_todo_queue(progress: Progress) -> None:
    manifest = manifest_from_shards(shards_for_length(100, 10), epochs=2, seed=1)
    assert progress.publish_manifest(manifest) == manifest
    other = manifest_from_shards(shards_for_length(50, 10), epochs=1)
    assert progress.publish_manifest(other) == manifest  # the first one wins
    for epoch in (0, 1):
        assert queue_keys(progress, epoch) == {
            "todo": set(range(10)),
            "doing": set(),
            "done": set(),
        }


def test_a_worker_published_manifest_keeps_the_jobs_shuffle_setting(
    progress: Progress, etcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KFP_ELASTIC_ETCD_ENDPOINTS", etcd.endpoint)
    monkeypatch.setenv("KFP_ELASTIC_SNAPSHOT_DIR", "/tmp/unused")
    settings = parse_args(["--model-def", "m", "--no-shuffle", "--seed", "3"]).settings
    made = ensure_manifest(progress, 100, 10, 1, settings.seed, settings.shuffle)
    assert not made.shuffle and made.visit_order(0) == list(range(10))
    assert progress.manifest() == made  # what every later rank and restart reads
    assert parse_args(["--model-def", "m"]).settings.shuffle


def test_commits_move_shards_and_reject_a_stale_writer(progress: Progress) -> None:
    manifest = progress.publish_manifest(
        manifest_from_shards(shards_for_length(30, 10), epochs=2, seed=0)
    )
    first = Committed(step=1, epoch=0, position=15, snapshot="s1")
    assert progress.commit(manifest, None, 0, first)
    committed, revision = progress.committed_record()
    assert committed == first
    visit = manifest.visit_order(0)
    queues = queue_keys(progress, 0)
    assert queues == {"done": {visit[0]}, "doing": {visit[1]}, "todo": {visit[2]}}
    value, _ = progress._client.get(progress.keys.queue(0, "doing", visit[1]))
    assert json.loads(value) == {"consumed": 5}
    assert not progress.commit(manifest, None, 0, Committed(step=9, epoch=0, position=30))
    end = Committed(step=2, epoch=1, position=0, snapshot="s2")
    assert progress.commit(manifest, committed, revision, end)
    assert queue_keys(progress, 0) == {"done": {0, 1, 2}, "doing": set(), "todo": set()}
    assert progress.queue_counts(1) == {"todo": 3, "doing": 0, "done": 0}
    complete = Committed(step=3, epoch=2, position=0, complete=True)
    assert progress.commit(manifest, end, progress.committed_record()[1], complete)
    assert progress.queue_counts(1) == {"todo": 0, "doing": 0, "done": 3}


def test_queues_left_behind_by_an_interrupted_commit_are_repaired(
    progress: Progress, monkeypatch
) -> None:
    manifest = progress.publish_manifest(
        manifest_from_shards(shards_for_length(400, 5), epochs=2, seed=0)
    )  # 80 shards
    # A commit over 80 shards needs more than one transaction: kill it after the first.
    real = progress._client.transaction
    calls = []

    def first_only(**kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise ConnectionError("rank 0 killed mid-commit")
        return real(**kwargs)

    monkeypatch.setattr(progress._client, "transaction", first_only)
    end_of_epoch = Committed(step=5, epoch=1, position=0)
    with pytest.raises(ConnectionError):
        progress.commit(manifest, None, 0, end_of_epoch)
    monkeypatch.setattr(progress._client, "transaction", real)
    assert progress.committed_record()[0] == end_of_epoch  # the record moved ...
    assert progress.queue_counts(0)["done"] < 80  # ... the queues did not all follow
    assert progress.reconcile_queues(manifest, end_of_epoch) > 0
    assert progress.queue_counts(0) == {"todo": 0, "doing": 0, "done": 80}
    assert progress.queue_counts(1) == {"todo": 80, "doing": 0, "done": 0}
    assert progress.reconcile_queues(manifest, end_of_epoch) == 0  # idempotent


def test_base_world_size_is_fixed_by_the_first_proposal(progress: Progress) -> None:
    assert progress.base_world_size(3) == 3
    assert progress.base_world_size(2) == 3


def test_snapshot_saved_then_committed_then_loaded(tmp_path: Path) -> None:
    snapshots = Snapshotter(tmp_path / "persist", tmp_path / "local")
    committed: list[str] = []
    state = {"model": {"w": torch.ones(3)}, "step": 7}
    snapshots.save(7, state, committed.append, wait=True)
    assert committed == ["snapshot-000000007.pt"]
    assert (tmp_path / "persist" / committed[0]).exists()
    loaded = snapshots.load(committed[0])
    assert torch.equal(loaded["model"]["w"], torch.ones(3)) and loaded["step"] == 7


def test_corrupt_snapshot_gives_a_clear_error(tmp_path: Path) -> None:
    snapshots = Snapshotter(tmp_path / "persist")
    (tmp_path / "persist" / "snapshot-000000003.pt").write_bytes(b"not a torch file")
    with pytest.raises(SnapshotError, match="snapshot-000000003.pt.*unreadable"):
        snapshots.load("snapshot-000000003.pt")
    with pytest.raises(SnapshotError, match="missing"):
        snapshots.load("snapshot-000000009.pt")


def test_failed_commit_surfaces_on_wait(tmp_path: Path) -> None:
    snapshots = Snapshotter(tmp_path)

    def refuse(name: str) -> None:
        raise RuntimeError("etcd said no")

    snapshots.save(1, {"step": 1}, refuse)
    with pytest.raises(RuntimeError, match="etcd said no"):
        snapshots.wait()
