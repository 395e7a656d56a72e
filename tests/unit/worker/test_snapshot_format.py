"""The snapshot file format: exact round trips, copy-at-pack, corruption detected, fallbacks."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest
import torch

from kfp_elastic.worker import snapshot_format
from kfp_elastic.worker.snapshot import SnapshotError, Snapshotter
from kfp_elastic.worker.snapshot_format import CorruptSnapshot, NotPackable


def _trained_state(optimizer_type: type[torch.optim.Optimizer], **options: object) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2))
    optimizer = optimizer_type(model.parameters(), **options)
    for _ in range(2):
        model(torch.randn(4, 5)).square().sum().backward()
        optimizer.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": 2,
        "epoch": 0,
        "position": 8,
        "rng": torch.get_rng_state(),
    }


def _assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b and type(a) is type(b)


@pytest.mark.parametrize(
    ("optimizer_type", "options"),
    [
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
        (torch.optim.Adam, {"lr": 1e-3, "betas": (0.9, 0.99)}),
    ],
)
def test_model_and_optimizer_state_round_trip_exactly(tmp_path: Path, optimizer_type, options):
    state = _trained_state(optimizer_type, **options)
    snapshot_format.pack(state).write_to(tmp_path / "s.pt")
    loaded = snapshot_format.load(tmp_path / "s.pt")
    _assert_same(state, loaded)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2))
    model.load_state_dict(loaded["model"])
    optimizer_type(model.parameters(), **options).load_state_dict(loaded["optimizer"])


def test_dtypes_shapes_and_containers_round_trip(tmp_path: Path) -> None:
    state = {
        "f64": torch.arange(6, dtype=torch.float64).reshape(2, 3),
        "bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "i64": torch.tensor(7),
        "flags": torch.tensor([True, False]),
        "empty": torch.empty(0, 4),
        "strided": torch.arange(12.0).reshape(3, 4).t(),
        "by_int": {0: "a", 3: [1, 2.5, None]},
        "pair": (1, "x"),
        "nan": float("inf"),
        "$odd": "keys starting with $ survive",
    }
    snapshot_format.pack(state).write_to(tmp_path / "s.pt")
    _assert_same(state, snapshot_format.load(tmp_path / "s.pt"))


def test_pack_copies_so_later_training_does_not_change_the_snapshot(tmp_path: Path) -> None:
    weights = torch.zeros(1000)
    packed = snapshot_format.pack({"w": weights})
    weights.add_(1.0)  # the next optimizer step, while the writer thread works
    packed.write_to(tmp_path / "s.pt")
    assert torch.equal(snapshot_format.load(tmp_path / "s.pt")["w"], torch.zeros(1000))


def test_the_buffer_is_reused_between_snapshots() -> None:
    first = snapshot_format.pack({"w": torch.ones(100)})
    second = snapshot_format.pack({"w": torch.ones(50)}, reuse=first.buffer)
    assert second.buffer is first.buffer


def test_a_state_packed_into_a_tensor_buffer_reads_back(tmp_path: Path) -> None:
    # On a GPU the buffer is a pinned uint8 tensor (device -> host DMA lands in it directly).
    state = {"w": torch.arange(10.0), "step": 3, "rng": torch.get_rng_state()}
    buffer = torch.full((1 << 16,), 0xAB, dtype=torch.uint8)  # old bytes in the alignment gaps
    packed = snapshot_format.pack(state, reuse=buffer)
    assert packed.buffer is buffer
    packed.write_to(tmp_path / "tensor.pt")
    loaded = snapshot_format.load(tmp_path / "tensor.pt")
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["rng"], state["rng"])
    assert loaded["step"] == 3


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda data: data[:-10], "truncated"),
        (lambda data: data[:-1] + bytes([data[-1] ^ 0x01]), "mismatch"),
        (lambda data: data[:20], "header"),
        (lambda data: b"PK\x03\x04" + data[4:], "bad magic"),
    ],
)
def test_damaged_files_are_refused_with_the_reason(tmp_path: Path, damage, message) -> None:
    path = tmp_path / "s.pt"
    snapshot_format.pack({"w": torch.randn(256)}).write_to(path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CorruptSnapshot, match=message):
        snapshot_format.load(path)


def test_snapshotter_writes_the_packed_format_and_explains_a_damaged_copy(tmp_path: Path):
    snapshots = Snapshotter(tmp_path / "persist", tmp_path / "local")
    names: list[str] = []
    snapshots.save(4, {"model": {"w": torch.ones(8)}, "step": 4}, names.append, wait=True)
    for directory in ("persist", "local"):
        assert snapshot_format.is_packed_file(tmp_path / directory / names[0])
    local = tmp_path / "local" / names[0]
    local.write_bytes(local.read_bytes()[:-3])
    assert snapshots.load(names[0])["step"] == 4  # the damaged local copy falls to the PVC's
    persisted = tmp_path / "persist" / names[0]
    persisted.write_bytes(persisted.read_bytes()[:-3])
    with pytest.raises(SnapshotError, match="unreadable.*truncated"):
        snapshots.load(names[0])


def test_state_the_format_cannot_hold_falls_back_to_torch_save(tmp_path: Path) -> None:
    with pytest.raises(NotPackable, match="Fraction"):
        snapshot_format.pack({"odd": Fraction(1, 3)})
    state = {"model": {"w": torch.ones(2)}, "sparse": torch.eye(3).to_sparse(), "step": 1}
    with pytest.raises(NotPackable, match="layout"):
        snapshot_format.pack(state)
    snapshots = Snapshotter(tmp_path)
    names: list[str] = []
    snapshots.save(1, state, names.append, wait=True)
    assert not snapshot_format.is_packed_file(tmp_path / names[0])
    loaded = snapshots.load(names[0])
    assert torch.equal(loaded["sparse"].to_dense(), torch.eye(3)) and loaded["step"] == 1


def test_state_dict_metadata_is_kept(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    state = model.state_dict()
    snapshot_format.pack({"model": state}).write_to(tmp_path / "s.pt")
    loaded = snapshot_format.load(tmp_path / "s.pt")["model"]
    assert loaded._metadata == state._metadata and list(loaded) == list(state)


def test_snapshots_written_by_torch_save_still_load(tmp_path: Path) -> None:
    torch.save({"model": {"w": torch.ones(3)}, "step": 9}, tmp_path / "snapshot-000000009.pt")
    assert Snapshotter(tmp_path).load("snapshot-000000009.pt")["step"] == 9


def test_old_snapshot_files_are_recycled_and_every_kept_one_reads_back(tmp_path: Path) -> None:
    from kfp_elastic.worker.snapshot import KEEP

    snapshots = Snapshotter(tmp_path)
    names: list[str] = []
    sizes = [4000, 4000, 4000, 10, 3000, 50]  # a smaller state lands in a larger old file
    for step, size in enumerate(sizes):
        if step == KEEP:
            oldest_inode = (tmp_path / names[0]).stat().st_ino
        snapshots.save(
            step, {"w": torch.full((size,), float(step)), "step": step}, names.append, wait=True
        )
        if step == KEEP:
            assert (tmp_path / names[-1]).stat().st_ino == oldest_inode  # pages reused
    kept = sorted(p.name for p in tmp_path.glob("snapshot-*.pt"))
    assert kept == names[-KEEP:]
    for step, name in enumerate(names[-KEEP:], start=len(sizes) - KEEP):
        loaded = snapshots.load(name)
        assert loaded["step"] == step
        assert torch.equal(loaded["w"], torch.full((sizes[step],), float(step)))
    assert not list(tmp_path.glob(".*"))  # no temporary left behind
