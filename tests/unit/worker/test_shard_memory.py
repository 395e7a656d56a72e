"""Slot files of a node's host-memory directory (``worker/shard_memory.py``): written, published,
mapped back byte for byte; refused when incomplete; recycled per (rank, world)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from kfp_elastic.contract.sharded_memory import SLOTS_KEPT
from kfp_elastic.worker.shard_memory import (
    ALIGN,
    MAGIC,
    Item,
    NodeSlots,
    SlotError,
    SlotHeader,
    parse_slot_name,
    slot_name,
)


def _values(seed: int = 0) -> dict[str, torch.Tensor | bytes]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "w32": torch.randn(5, 3, generator=generator),
        "w64": torch.randn(7, generator=generator, dtype=torch.float64),
        "half": torch.randn(3, 3, generator=generator).to(torch.float16),
        "brain": torch.randn(11, generator=generator).to(torch.bfloat16),
        "ids": torch.arange(9, dtype=torch.int64) * (seed + 1),
        "small": torch.tensor([1, -2, 3], dtype=torch.int8),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5),
        "blob": b"non-tensor \x00\x01 bytes",
        "nothing": b"",
    }


def _items(values: dict[str, torch.Tensor | bytes]) -> list[Item]:
    items = []
    for fqn, value in values.items():
        if isinstance(value, bytes):
            items.append(Item(fqn, (), (), "", nbytes=len(value)))
        else:
            sizes = tuple(value.shape)
            nbytes = value.numel() * value.element_size()
            # A chunk at an offset of a larger global tensor, as a DTensor's shard would be.
            offsets = (1,) + (0,) * (value.dim() - 1) if value.dim() else ()
            shape = (sizes[0] + 1, *sizes[1:]) if value.dim() else ()
            items.append(Item(fqn, offsets, sizes, str(value.dtype), nbytes=nbytes, shape=shape))
    return items


def _write(
    slots: NodeSlots,
    step: int,
    rank: int,
    world: int,
    values: dict[str, torch.Tensor | bytes],
    publish: bool = True,
) -> Path:
    slot = slots.create(SlotHeader(step, rank, world, _items(values), extra="rest"))
    try:
        for item, value in zip(slot.header.items, values.values(), strict=True):
            if isinstance(value, bytes):
                if value:
                    slot.raw(item).copy_(torch.frombuffer(bytearray(value), dtype=torch.uint8))
            elif value.numel():
                slot.tensor(item).copy_(value)
        return slots.publish(slot) if publish else slot.path
    finally:
        slot.close()


def _read(slots: NodeSlots, path: Path) -> tuple[SlotHeader, dict[str, torch.Tensor | bytes]]:
    slot = slots.open(path)
    try:
        got: dict[str, torch.Tensor | bytes] = {}
        for item in slot.header.items:
            if item.is_tensor:
                got[item.fqn] = slot.tensor(item).clone()
            else:
                got[item.fqn] = slot.raw(item).numpy().tobytes()
        return slot.header, got
    finally:
        slot.close()


def _assert_same(got: dict[str, torch.Tensor | bytes], values: dict[str, torch.Tensor | bytes]):
    assert list(got) == list(values)
    for key, value in values.items():
        if isinstance(value, bytes):
            assert got[key] == value, key
        else:
            tensor = got[key]
            assert isinstance(tensor, torch.Tensor)
            assert tensor.dtype == value.dtype and tensor.shape == value.shape, key
            assert torch.equal(tensor, value), key


def test_a_published_slot_maps_back_byte_for_byte(tmp_path: Path) -> None:
    slots = NodeSlots(tmp_path / "node")
    values = _values()
    path = _write(slots, 7, 1, 3, values)
    assert path.name == slot_name(7, 1, 3) and path.parent == slots.directory
    header, got = _read(slots, path)
    assert (header.step, header.rank, header.world, header.extra) == (7, 1, 3, "rest")
    _assert_same(got, values)
    # The items keep DCP's chunk naming, and every item's bytes are 64-byte aligned.
    by_name = {item.fqn: item for item in header.items}
    assert by_name["w32"].offsets == (1, 0) and by_name["w32"].shape == (6, 3)
    assert by_name["scalar"].offsets == () and by_name["blob"].dtype == ""
    assert all(item.at % ALIGN == 0 for item in header.items)
    assert path.read_bytes().startswith(MAGIC)
    assert slots.of_step(7, 3) == {1: path} and slots.nbytes() == path.stat().st_size


def test_a_copy_received_from_its_header_maps_back_like_the_original(tmp_path: Path) -> None:
    """A rank's neighbour makes the copy from the header it is sent and the payload's bytes."""
    mine, theirs = NodeSlots(tmp_path / "a"), NodeSlots(tmp_path / "b")
    values = _values(3)
    original = mine.open(_write(mine, 4, 0, 2, values))
    copy = theirs.receive(mine.header_bytes(original.path))
    copy.payload().copy_(original.payload())
    original.close()
    copy.close()
    path = theirs.publish(copy)
    assert path == theirs.directory / slot_name(4, 0, 2)
    _, got = _read(theirs, path)
    _assert_same(got, values)


def test_a_slot_of_only_empty_items_round_trips(tmp_path: Path) -> None:
    slots = NodeSlots(tmp_path)
    values: dict[str, torch.Tensor | bytes] = {"none": torch.empty(0, dtype=torch.bfloat16)}
    header, got = _read(slots, _write(slots, 1, 0, 1, values))
    assert header.payload == 0
    _assert_same(got, values)


def test_a_truncated_or_foreign_file_is_refused(tmp_path: Path) -> None:
    slots = NodeSlots(tmp_path)
    path = _write(slots, 2, 0, 2, _values())
    size = path.stat().st_size
    with path.open("r+b") as file:
        file.truncate(size - 1)
    with pytest.raises(SlotError, match="truncated"):
        slots.open(path)

    foreign = tmp_path / slot_name(2, 1, 2)
    foreign.write_bytes(b"not a slot at all, only text")
    with pytest.raises(SlotError, match="not a slot"):
        slots.open(foreign)
    foreign.write_bytes(b"KFP")
    with pytest.raises(SlotError, match="not a slot"):
        slots.open(foreign)
    # The magic, then a header that is not the JSON of one.
    foreign.write_bytes(MAGIC + (5).to_bytes(8, "little") + b"{oops")
    with pytest.raises(SlotError, match="unreadable"):
        slots.open(foreign)
    with pytest.raises(SlotError):
        slots.open(tmp_path / slot_name(9, 0, 2))  # no such file


def test_a_slot_that_does_not_fit_is_refused_before_any_page_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slots = NodeSlots(tmp_path)
    older = [_write(slots, step, 0, 2, _values()) for step in (1, 2)]

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(SlotError, match="no room for a .* MiB slot"):
        _write(slots, 3, 0, 2, _values())
    with pytest.raises(SlotError, match="no room"):
        _write(slots, 1, 1, 2, _values())
    # The newest slot stays; the oldest one's file, taken for the new slot, is not left
    # behind under a hidden name (its pages would be lost to the node until the pod ends).
    assert [path for *_, path in slots.names()] == [older[1]]
    assert sorted(p.name for p in tmp_path.iterdir()) == [older[1].name]


def test_a_mapped_slot_is_never_written_through(tmp_path: Path) -> None:
    slots = NodeSlots(tmp_path)
    values = _values()
    path = _write(slots, 1, 0, 1, values)
    slot = slots.open(path)
    try:
        slot.tensor(slot.header.items[0]).add_(1)  # a reader's mistake stays its own
    finally:
        slot.close()
    _, got = _read(slots, path)
    _assert_same(got, values)


def test_an_unpublished_slot_is_not_listed(tmp_path: Path) -> None:
    slots = NodeSlots(tmp_path)
    hidden = _write(slots, 5, 0, 2, _values(), publish=False)
    assert hidden.exists() and hidden.name.startswith(".")
    assert list(slots.names()) == [] and slots.of_step(5, 2) == {} and slots.nbytes() == 0
    done = _write(slots, 5, 1, 2, _values())
    assert slots.of_step(5, 2) == {1: done}


def test_the_newest_slots_per_rank_and_world_are_kept_and_the_oldest_pages_reused(
    tmp_path: Path,
) -> None:
    assert SLOTS_KEPT == 2
    slots = NodeSlots(tmp_path)
    others = [_write(slots, 1, 1, 2, _values()), _write(slots, 1, 0, 3, _values())]
    inodes = {}
    for step in (1, 2, 3, 4):
        # Steps of different sizes: a reused file is resized to the new slot.
        values = _values(step) | {"grows": torch.ones(step * 100)}
        path = _write(slots, step, 0, 2, values)
        inodes[step] = path.stat().st_ino
        _, got = _read(slots, path)
        _assert_same(got, values)
    kept = sorted((s, r, w) for s, r, w, _ in slots.names())
    assert kept == [(1, 0, 3), (1, 1, 2), (3, 0, 2), (4, 0, 2)]
    # Step 3 was written into step 1's file, step 4 into step 2's.
    assert inodes[3] == inodes[1] and inodes[4] == inodes[2]
    assert all(path.exists() for path in others)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_keep_only_drops_every_other_step_world_and_rank_but_not_a_writer(
    tmp_path: Path,
) -> None:
    slots = NodeSlots(tmp_path)
    for step, rank, world in [(3, 0, 2), (3, 1, 2), (3, 0, 3), (2, 0, 2), (4, 2, 3)]:
        _write(slots, step, rank, world, {"x": torch.ones(3)})
    writing = _write(slots, 5, 0, 2, {"x": torch.ones(3)}, publish=False)
    slots.keep_only(3, 2, ranks={1})
    assert sorted((s, r, w) for s, r, w, _ in slots.names()) == [(3, 1, 2)]
    assert writing.exists()
    slots.keep_only(3, 2)
    assert [(s, r, w) for s, r, w, _ in slots.names()] == [(3, 1, 2)]
    slots.remove()
    assert not tmp_path.exists()


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        (slot_name(12, 3, 4), (12, 3, 4)),
        ("step-000000000-rank-00000-of-00001.slot", (0, 0, 1)),
        (f".{slot_name(12, 3, 4)}.tmp123", None),
        ("step-12-rank-3-of-4.slot", None),
        ("step-000000012-rank-00003-of-00004.slot.bak", None),
        ("step-000000012-rank-00003-of-00004", None),
        ("memory-000000012", None),
    ],
)
def test_parse_slot_name(name: str, parsed: tuple[int, int, int] | None) -> None:
    assert parse_slot_name(name) == parsed
