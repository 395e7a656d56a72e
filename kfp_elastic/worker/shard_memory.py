"""A rank's shards of a training state in host memory, kept across its worker's restarts.

A sharded (FSDP2) state is snapshotted by every rank, each its own shards: torchrun restarts
every worker of a node on a world change, so what a worker keeps in its own memory dies with
it. A *slot* is one rank's shards of one step in a file of the node's host-memory directory
(``/dev/shm`` by default: tmpfs, memory the kernel charges to the pod, gone with the pod, never
on a disk), mapped into the worker's memory: the snapshot copies the shards into the mapping,
the next world's workers on that node map the same pages. A slot of another node's rank is its
*copy* (``sharded_snapshot.py``: every rank keeps its ring neighbour's).

A slot file is ``KFPSHRD1``, the header's length (8 bytes, little-endian), the header (JSON:
step, rank, world, the items and an opaque ``extra`` blob), zero padding to 64 bytes, then the
items' bytes, each 64-byte aligned. An item is one tensor chunk as DCP names it (``fqn`` and
the chunk's ``offsets``/``sizes`` in the global tensor, ``dtype``), or DCP's non-tensor value
(``bytes``). A file is written under a hidden name and renamed when complete, so a slot with its
final name is always whole. Two slots per (rank, world) are kept: the committed step's and the
one being written (``SLOTS_KEPT``); the older one's pages are reused for the next.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kfp_elastic.contract.sharded_memory import SLOTS_KEPT

MAGIC = b"KFPSHRD1"
ALIGN = 64
_NAME = re.compile(r"^step-(\d{9})-rank-(\d{5})-of-(\d{5})\.slot$")
_STORED_DTYPES = (
    *(torch.float32, torch.float64, torch.float16, torch.bfloat16),
    *(torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool),
)
_DTYPES = {str(t): t for t in _STORED_DTYPES}  # a slot names a dtype as str(dtype) does


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def slot_name(step: int, rank: int, world: int) -> str:
    return f"step-{step:09d}-rank-{rank:05d}-of-{world:05d}.slot"


def parse_slot_name(name: str) -> tuple[int, int, int] | None:
    """(step, rank, world) of a slot file's name; None for anything else."""
    found = _NAME.match(name)
    return (int(found[1]), int(found[2]), int(found[3])) if found else None


@dataclass(frozen=True)
class Item:
    """One entry of a slot: a tensor chunk (``dtype`` set) or a non-tensor value's bytes."""

    fqn: str
    offsets: tuple[int, ...]  # of the chunk in the global tensor (() for bytes)
    sizes: tuple[int, ...]
    dtype: str  # "" for bytes
    at: int = 0  # of its bytes in the payload
    nbytes: int = 0
    shape: tuple[int, ...] = ()  # of the global tensor

    @property
    def is_tensor(self) -> bool:
        return bool(self.dtype)

    def to_json(self) -> list[Any]:
        return [
            self.fqn,
            list(self.offsets),
            list(self.sizes),
            self.dtype,
            self.at,
            self.nbytes,
            list(self.shape),
        ]

    @classmethod
    def from_json(cls, data: list[Any]) -> Item:
        fqn, offsets, sizes, dtype, at, nbytes, shape = data
        return cls(fqn, tuple(offsets), tuple(sizes), dtype, int(at), int(nbytes), tuple(shape))


@dataclass
class SlotHeader:
    """What a slot holds: whose shards, of which step and world, and where each item is."""

    step: int
    rank: int
    world: int
    items: list[Item]
    extra: str = ""  # the rank's non-sharded state, opaque here (latin-1 text of bytes)
    payload: int = 0  # bytes after the header

    def encode(self) -> bytes:
        body = {
            "step": self.step,
            "rank": self.rank,
            "world": self.world,
            "items": [item.to_json() for item in self.items],
            "extra": self.extra,
            "payload": self.payload,
        }
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> SlotHeader:
        body = json.loads(raw)
        return cls(
            step=int(body["step"]),
            rank=int(body["rank"]),
            world=int(body["world"]),
            items=[Item.from_json(item) for item in body["items"]],
            extra=str(body.get("extra", "")),
            payload=int(body["payload"]),
        )

    @property
    def name(self) -> str:
        return slot_name(self.step, self.rank, self.world)


def laid_out(header: SlotHeader) -> tuple[SlotHeader, int]:
    """``header`` with every item's offset set and the payload's length; and where the payload
    starts in the file."""
    at = 0
    items = []
    for item in header.items:
        items.append(replace(item, at=at))
        at = _align(at + item.nbytes)
    placed = SlotHeader(header.step, header.rank, header.world, items, header.extra, at)
    return placed, _align(len(MAGIC) + 8 + len(placed.encode()))


class SlotError(RuntimeError):
    """A slot file is missing, incomplete or not a slot."""


@dataclass
class Slot:
    """A slot file mapped into this process: its header and views of its items' bytes."""

    path: Path
    header: SlotHeader
    start: int  # of the payload in the file
    _map: mmap.mmap = field(repr=False)

    def payload(self, at: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """A uint8 view of the payload's bytes ``[at, at + nbytes)`` (no copy)."""
        count = self.header.payload - at if nbytes is None else nbytes
        if count == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self._map, dtype=torch.uint8, count=count, offset=self.start + at)

    def raw(self, item: Item) -> torch.Tensor:
        return self.payload(item.at, item.nbytes)

    def tensor(self, item: Item) -> torch.Tensor:
        """The chunk ``item`` as a tensor viewing the slot's pages (no copy)."""
        raw = self.raw(item)
        dtype = _DTYPES[item.dtype]
        if not raw.numel():
            return torch.empty(item.sizes, dtype=dtype)
        return raw.view(dtype).view(item.sizes)

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # a view still alive keeps the mapping
            self._map.close()


def _map_file(path: Path, size: int, writable: bool) -> mmap.mmap:
    """``path`` mapped: writable with its ``size`` bytes reserved first (a full tmpfs then
    fails here with a message, instead of a SIGBUS at the first write to a page it cannot
    back); read-only ones copy-on-write (no write ever reaches the file)."""
    flags = os.O_RDWR if writable else os.O_RDONLY
    fd = os.open(path, flags)
    try:
        if writable:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as error:
                raise SlotError(
                    f"{path.parent}: no room for a {size / 2**20:.1f} MiB slot ({error.strerror}): "
                    "a sharded job keeps each rank's shards and a neighbour's copy in host "
                    "memory (4 x state / ranks per process); give the worker pods that much more "
                    "/dev/shm (--sharded-state, worker_sharded_state), or point "
                    "--memory-snapshot-dir at a larger tmpfs"
                ) from error
            return mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
        return mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)


class NodeSlots:
    """The slots in one node's host-memory directory: this node's ranks' and the copies it
    keeps of other nodes' ranks."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def names(self) -> Iterator[tuple[int, int, int, Path]]:
        """(step, rank, world, path) of every complete slot."""
        for path in self.directory.iterdir():
            parsed = parse_slot_name(path.name)
            if parsed:
                yield (*parsed, path)

    def of_step(self, step: int, world: int) -> dict[int, Path]:
        """The complete slots of ``step`` in a world of ``world`` ranks, by rank."""
        return {r: p for s, r, w, p in self.names() if s == step and w == world}

    def create(self, header: SlotHeader) -> Slot:
        """A writable slot for ``header`` (its items' offsets set here) under a hidden name;
        ``publish`` gives it its final name."""
        placed, _ = laid_out(header)
        return self._writable(placed, placed.encode())

    def receive(self, raw_header: bytes) -> Slot:
        """A writable slot for a header another rank sent (its items' offsets set)."""
        return self._writable(SlotHeader.decode(raw_header), raw_header)

    def _writable(self, header: SlotHeader, encoded: bytes) -> Slot:
        """The pages of an older slot of the same (rank, world) are reused when ``SLOTS_KEPT``
        exist: overwriting pages costs a copy, a new file also allocating and zeroing them."""
        start = _align(len(MAGIC) + 8 + len(encoded))
        hidden = self.directory / f".{header.name}.tmp{os.getpid()}"
        older = sorted(p for s, r, w, p in self.names() if r == header.rank and w == header.world)
        if len(older) >= SLOTS_KEPT:
            with contextlib.suppress(OSError):  # gone meanwhile: a fresh file
                os.replace(older[0], hidden)
        if not hidden.exists():
            hidden.touch()
        try:
            mapping = _map_file(hidden, start + header.payload, writable=True)
        except BaseException:
            hidden.unlink(missing_ok=True)  # no slot: its pages (maybe an older slot's) freed
            raise
        mapping[: len(MAGIC) + 8 + len(encoded)] = MAGIC + struct.pack("<Q", len(encoded)) + encoded
        return Slot(hidden, header, start, mapping)

    def publish(self, slot: Slot) -> Path:
        """Give a slot written through ``create`` or ``receive`` its final name."""
        final = self.directory / slot.header.name
        os.replace(slot.path, final)
        slot.path = final
        return final

    def open(self, path: Path) -> Slot:
        """A complete slot, mapped read-only."""
        try:
            with path.open("rb") as file:
                head = file.read(len(MAGIC) + 8)
                if len(head) < len(MAGIC) + 8 or head[: len(MAGIC)] != MAGIC:
                    raise SlotError(f"{path}: not a slot file")
                (length,) = struct.unpack("<Q", head[len(MAGIC) :])
                raw = file.read(length)
            header = SlotHeader.decode(raw)
            start = _align(len(MAGIC) + 8 + length)
            size = path.stat().st_size
        except (OSError, ValueError, KeyError) as error:
            raise SlotError(f"{path}: unreadable ({error})") from error
        if size < start + header.payload:
            raise SlotError(f"{path}: truncated ({size} < {start + header.payload} bytes)")
        return Slot(path, header, start, _map_file(path, start + header.payload, False))

    def header_bytes(self, path: Path) -> bytes:
        with path.open("rb") as file:
            head = file.read(len(MAGIC) + 8)
            (length,) = struct.unpack("<Q", head[len(MAGIC) :])
            return file.read(length)

    def keep_only(self, step: int, world: int, ranks: set[int] | None = None) -> None:
        """Drop every slot but those of ``step`` in a world of ``world`` (of ``ranks``, when
        given) and the hidden ones of live writers: after a restore, the older worlds' slots
        are of no use."""
        for s, r, w, path in list(self.names()):
            if (s, w) != (step, world) or (ranks is not None and r not in ranks):
                path.unlink(missing_ok=True)

    def drop(self, step: int, world: int) -> None:
        """Drop the slots of ``step`` in a world of ``world`` (a snapshot that failed)."""
        for s, _, w, path in list(self.names()):
            if (s, w) == (step, world):
                path.unlink(missing_ok=True)

    def nbytes(self) -> int:
        """Bytes the complete slots of this directory hold."""
        return sum(path.stat().st_size for *_, path in self.names())

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
