"""N → M resharding of a sharded training state from the ranks' host memory, through DCP.

The old world's state is in slots (``shard_memory.py``): each old rank's shards, and a copy of
each on its ring neighbour's node. A new world (any size) loads it with
``torch.distributed.checkpoint.load`` and its ``DefaultLoadPlanner``, reading from
:class:`PeerMemoryReader` instead of storage: DCP's metadata says which chunks the old world
had (offsets and sizes in each global tensor), its planner computes which byte boxes of which
chunks each new rank's shards need, and the reader moves exactly those boxes from the ranks
whose node holds them, over the new world's process group (point-to-point sends straight from
the holder's slot pages into the receiver's own shard tensors), or copies them locally when
this rank's node holds them. No file is written or read; no buffer of the state's size exists.

The metadata is the union of the slot headers every new rank finds on its node for the
committed step (one ``all_gather_object`` of headers, no payload). A chunk that no rank holds
(two neighbours lost at once) makes :func:`holdings` raise :class:`ShardsLost` before anything
is moved: the caller falls back to the last on-disk snapshot.
"""

from __future__ import annotations

import io
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from kfp_elastic.worker.shard_memory import _DTYPES, Item, NodeSlots, Slot, SlotHeader

log = logging.getLogger(__name__)


class ShardsLost(RuntimeError):
    """Some old rank's shards are on no node of the new world (it and its copy's holder are
    both gone): the in-memory state is incomplete."""


ChunkKey = tuple[str, tuple[int, ...]]  # (fqn, chunk offsets); offsets () for bytes


@dataclass
class Holdings:
    """What the new world holds of one old world's step: every old rank's slot header, and
    which new ranks can read which old rank's slot on their node."""

    step: int
    old_world: int
    headers: dict[int, SlotHeader]  # old rank -> its slot's header
    holders: dict[int, list[int]]  # old rank -> new ranks whose node has its slot
    local: dict[int, Path] = field(default_factory=dict)  # old rank -> this rank's slot path

    def chunk_homes(self) -> dict[ChunkKey, list[tuple[int, int]]]:
        """Where each chunk's bytes are: every (old rank, item index) that has it, lowest old
        rank first (a replicated tensor, which every rank has whole, has one per old rank)."""
        homes: dict[ChunkKey, list[tuple[int, int]]] = defaultdict(list)
        for old_rank in sorted(self.headers):
            for index, item in enumerate(self.headers[old_rank].items):
                homes[(item.fqn, item.offsets)].append((old_rank, index))
        return dict(homes)

    def metadata(self) -> Metadata:
        """DCP's metadata of the old world's state: every tensor's global size and chunks."""
        entries: dict[str, Any] = {}
        seen: set[ChunkKey] = set()
        for old_rank in sorted(self.headers):
            for item in self.headers[old_rank].items:
                key = (item.fqn, item.offsets)
                if key in seen:
                    continue
                seen.add(key)
                if not item.is_tensor:
                    entries[item.fqn] = BytesStorageMetadata()
                    continue
                entry = entries.get(item.fqn)
                if entry is None:
                    entry = entries[item.fqn] = TensorStorageMetadata(
                        properties=TensorProperties(dtype=_DTYPES[item.dtype]),
                        size=torch.Size(item.shape),
                        chunks=[],
                    )
                entry.chunks.append(
                    ChunkStorageMetadata(torch.Size(item.offsets), torch.Size(item.sizes))
                )
        return Metadata(state_dict_metadata=entries)


def holdings(slots: NodeSlots, step: int, old_world: int, group: Any = None) -> Holdings:
    """Collective over the new world (``group``: a CPU one, gloo; default: the default group):
    which slots of ``step`` (a world of ``old_world`` ranks) each rank's node holds. Raises
    :class:`ShardsLost` (on every rank alike) when an old rank's slot is on no node."""
    local = slots.of_step(step, old_world)
    mine = {old_rank: slots.header_bytes(path) for old_rank, path in local.items()}
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    headers: dict[int, SlotHeader] = {}
    holders: dict[int, list[int]] = defaultdict(list)
    for new_rank, held in enumerate(everyone):
        for old_rank, raw in held.items():
            headers.setdefault(old_rank, SlotHeader.decode(raw))
            holders[old_rank].append(new_rank)
    missing = sorted(set(range(old_world)) - set(headers))
    if missing:
        raise ShardsLost(
            f"the shards of rank(s) {missing} of the {old_world}-rank world at step {step} are "
            "on no node of this world (each rank and the neighbour that held its copy are gone)"
        )
    return Holdings(step, old_world, headers, dict(holders), local)


@dataclass(frozen=True)
class _Request:
    holder: int  # the new rank that sends it
    old_rank: int
    index: int  # of the item in the old rank's slot
    offsets: tuple[int, ...] | None  # the box in the chunk (None: the whole item)
    lengths: tuple[int, ...] | None


@dataclass
class Moved:
    """What one load moved: bytes received from other ranks, bytes copied on this node."""

    received: int = 0
    sent: int = 0
    copied: int = 0


class PeerMemoryReader(StorageReader):
    """A DCP storage reader over the new world's slots (module doc). Every rank of the new
    world reads at once (``dcp.load`` is collective); ``read_data`` is where they exchange."""

    def __init__(self, slots: NodeSlots, held: Holdings, group: Any = None) -> None:
        super().__init__()
        self.slots, self.held, self.group = slots, held, group
        self.homes = held.chunk_homes()
        self.moved = Moved()
        self._open: dict[int, Slot] = {}

    # -- the storage reader's protocol ---------------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.held.metadata()

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            self._exchange(plan, planner)
        finally:
            for slot in self._open.values():
                slot.close()
            self._open.clear()
        done: Future[None] = Future()
        done.set_result(None)
        return done

    # -- the exchange ----------------------------------------------------------------------------
    def _slot(self, old_rank: int) -> Slot:
        if old_rank not in self._open:
            self._open[old_rank] = self.slots.open(self.held.local[old_rank])
        return self._open[old_rank]

    def _request(self, item: ReadItem, me: int) -> _Request:
        index = item.storage_index
        key = (index.fqn, tuple(index.offset) if index.offset is not None else ())
        homes = self.homes[key]
        # This node's copy when it has one (a replicated tensor mostly), else the first home.
        old_rank, position = next(
            (home for home in homes if me in self.held.holders[home[0]]), homes[0]
        )
        holders = self.held.holders[old_rank]
        holder = me if me in holders else holders[(me + old_rank) % len(holders)]
        if item.type == LoadItemType.BYTE_IO:
            return _Request(holder, old_rank, position, None, None)
        return _Request(
            holder, old_rank, position, tuple(item.storage_offsets), tuple(item.lengths)
        )

    def _source(self, request: _Request) -> torch.Tensor:
        """The requested bytes as a flat uint8 tensor (a view of the slot when contiguous)."""
        slot = self._slot(request.old_rank)
        item = slot.header.items[request.index]
        if request.offsets is None:
            return slot.raw(item)
        box = slot.tensor(item)
        for dim, (start, length) in enumerate(
            zip(request.offsets, request.lengths or (), strict=True)
        ):
            box = box.narrow(dim, start, length)
        return box.contiguous().reshape(-1).view(torch.uint8)

    def _exchange(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        me, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        requests = [self._request(item, me) for item in plan.items]
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, requests, group=self.group)
        # This rank's own reads: from its node's slots.
        for item, request in zip(plan.items, requests, strict=True):
            if request.holder == me:
                self.moved.copied += self._deliver(item, planner, self._source(request))
        # The others, one ring shift at a time: send to me + k what it asked of me, receive
        # from me - k what I asked of it; both sides know the order (the requests' order).
        for shift in range(1, world):
            to, source = (me + shift) % world, (me - shift) % world
            ops = []
            sends = [r for r in everyone[to] if r.holder == me]
            for tag, request in enumerate(sends):
                data = self._source(request)
                if data.numel():
                    ops.append(dist.P2POp(dist.isend, data, to, self.group, tag))
                    self.moved.sent += data.numel()
            arrivals: list[tuple[ReadItem, torch.Tensor, bool]] = []
            asked = [
                (item, request)
                for item, request in zip(plan.items, requests, strict=True)
                if request.holder == source
            ]
            for tag, (item, request) in enumerate(asked):
                buffer, direct = self._landing(item, request, planner)
                if buffer.numel():
                    ops.append(dist.P2POp(dist.irecv, buffer, source, self.group, tag))
                arrivals.append((item, buffer, direct))
            for work in dist.batch_isend_irecv(ops) if ops else ():
                work.wait()
            for item, buffer, direct in arrivals:
                self.moved.received += buffer.numel()
                if direct:
                    planner.commit_tensor(item, planner.resolve_tensor(item))
                else:
                    self._deliver(item, planner, buffer)

    def _landing(
        self, item: ReadItem, request: _Request, planner: LoadPlanner
    ) -> tuple[torch.Tensor, bool]:
        """Where the bytes of ``request`` are received: straight into this rank's shard when
        its box is contiguous CPU memory (True), else a buffer of the box's size."""
        nbytes = self._nbytes(request)
        if item.type == LoadItemType.TENSOR:
            target = planner.resolve_tensor(item).detach()
            if target.device.type == "cpu" and target.is_contiguous():
                flat = target.reshape(-1).view(torch.uint8)
                if flat.numel() == nbytes:
                    return flat, True
        return torch.empty(nbytes, dtype=torch.uint8), False

    def _nbytes(self, request: _Request) -> int:
        item: Item = self.held.headers[request.old_rank].items[request.index]
        if request.lengths is None:
            return item.nbytes
        count = 1
        for length in request.lengths:
            count *= length
        return count * torch.empty((), dtype=_DTYPES[item.dtype]).element_size()

    @staticmethod
    def _deliver(item: ReadItem, planner: LoadPlanner, data: torch.Tensor) -> int:
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(data.numpy().tobytes()))
            return data.numel()
        target = planner.resolve_tensor(item).detach()
        if target.numel():
            source = data.view(target.dtype).view(target.shape)
            target.copy_(source)
        planner.commit_tensor(item, target)
        return data.numel()
