"""Snapshots of a sharded (FSDP2) training state: every rank its own shards, in host memory,
with a copy on another node; restored N → M from memory, else from the last on-disk snapshot.

**Snapshot** (``ShardedSnapshots.save``, collective, between optimizer steps): every rank copies
its shards (the DTensors' local chunks of the model and optimizer state, with DCP's chunk
metadata) and its small rest (LR scheduler, scaler, data position, its generators) into a slot
of its node's host-memory directory (``shard_memory.py``). That copy is the only part the
training thread waits for. A background thread then sends the slot to the rank's *ring
neighbour* (:func:`ring_neighbours`: a rank on another node where there is one), receives the
slots of the ranks it is neighbour to, and all ranks agree (an allreduce on a group of their
own, once before any payload moves, that every copy has its place, and once after) that every
rank has its slot and every copy arrived; only then does rank 0 commit the step
in etcd (``memory-{step:09d}``, with the data position as for DDP). A snapshot counts only when
every rank has it; until the next one commits, the previous one stays (two slots per rank).

**Every ``disk_every``-th snapshot** is also saved to the persisted directory with
``torch.distributed.checkpoint.save`` (``dcp-{step:09d}/``, each rank's rest beside it and a
``.complete`` marker written after all ranks finished), synchronously: the fallback for a loss
no copy covers.

**Restore** (:func:`restore_sharded`, collective, in any new world): the committed step's slots
are looked up on every rank's node (``memory_reshard.holdings``); when every old rank's slot is
somewhere, ``torch.distributed.checkpoint.load`` reshards them into this world's shards through
``memory_reshard.PeerMemoryReader`` (no file, only the boxes each rank needs, over the process
group). When a slot is nowhere (two neighbours lost at once), the newest complete on-disk
snapshot at or before the committed step is loaded with DCP's own reader and resharding, the
commit is rolled back to its step and data position, and the log says so.

**Memory** per rank: two slots of its own shards and two of each shard it keeps a copy of (with
a ring neighbour on another node: one), i.e. about ``4 × state / world`` of host memory (tmpfs:
``/dev/shm``, charged to the pod), plus the state itself. A restore adds no buffer of a shard's
size: received boxes land in the new shards' own memory.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import queue
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from kfp_elastic.worker.memory_reshard import Moved, PeerMemoryReader, ShardsLost, holdings
from kfp_elastic.worker.shard_memory import Item, NodeSlots, Slot, SlotHeader
from kfp_elastic.worker.sharding import SHARDED_KEYS
from kfp_elastic.worker.train_step import RNG_BY_RANK

log = logging.getLogger(__name__)

MEMORY_PREFIX, DISK_PREFIX = "memory-", "dcp-"
DISK_KEPT = 2  # on-disk snapshots kept: the newest and one to fall back to
COMPLETE_MARKER = ".complete"


def memory_snapshot_name(step: int) -> str:
    return f"{MEMORY_PREFIX}{step:09d}"


def disk_snapshot_name(step: int) -> str:
    return f"{DISK_PREFIX}{step:09d}"


def is_sharded_snapshot(name: str) -> bool:
    return name.startswith((MEMORY_PREFIX, DISK_PREFIX))


def ring_neighbours(nodes: Sequence[str]) -> list[int | None]:
    """For each rank (its node's name by rank), the rank that keeps a copy of its shards: the
    rank ``k`` places on, where ``k`` is how many ranks its node has (the same local rank on the
    next node, as torchrun numbers ranks node by node), else the first rank after it on another
    node. A rank whose node is the only one gets none (the copy would share its memory)."""
    world = len(nodes)
    neighbours: list[int | None] = []
    for rank, node in enumerate(nodes):
        candidates = [(rank + nodes.count(node) + i) % world for i in range(world)]
        neighbours.append(next((c for c in candidates if nodes[c] != node), None))
    return neighbours


# -- a state as slot items ------------------------------------------------------------------------
def _encode(value: Any) -> str:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def _decode(text: str) -> Any:
    return torch.load(io.BytesIO(base64.b64decode(text)), map_location="cpu", weights_only=True)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype)


def state_items(state: dict[str, Any]) -> list[tuple[Item, torch.Tensor | bytes]]:
    """This rank's items of a sharded state, named as DCP names them (its flattened keys and
    each DTensor's local chunk: offsets and sizes in the global tensor); a plain tensor is one
    whole chunk (every rank has it), anything else its ``torch.save`` bytes."""
    flat, _ = flatten_state_dict(state)
    items: list[tuple[Item, torch.Tensor | bytes]] = []
    for fqn, value in flat.items():
        if isinstance(value, DTensor):
            sizes, offsets = compute_local_shape_and_global_offset(
                value.shape, value.device_mesh, value.placements
            )
            local = value.to_local()
            nbytes = local.numel() * local.element_size()
            item = Item(
                fqn,
                tuple(offsets),
                tuple(sizes),
                _dtype_name(local.dtype),
                nbytes=nbytes,
                shape=tuple(value.shape),
            )
            items.append((item, local))
        elif isinstance(value, torch.Tensor):
            nbytes = value.numel() * value.element_size()
            zeros = (0,) * value.dim()
            shape = tuple(value.shape)
            dtype = _dtype_name(value.dtype)
            items.append((Item(fqn, zeros, shape, dtype, nbytes=nbytes, shape=shape), value))
        else:
            buffer = io.BytesIO()
            torch.save(value, buffer)
            raw = buffer.getvalue()
            items.append((Item(fqn, (), (), "", nbytes=len(raw)), raw))
    return items


def _fill(slot: Slot, values: Sequence[torch.Tensor | bytes]) -> None:
    for item, value in zip(slot.header.items, values, strict=True):
        if isinstance(value, bytes):
            slot.raw(item).copy_(torch.frombuffer(bytearray(value), dtype=torch.uint8))
        elif value.numel():
            slot.tensor(item).copy_(value.detach())


@dataclass
class SnapshotCost:
    """What the last snapshot cost this rank."""

    blocking_s: float = 0.0  # the training thread's copy into the slot (and a disk save)
    exchange_s: float = 0.0  # the background copy to the neighbour and the agreement
    slot_bytes: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0


class ShardedSnapshots:
    """One rank's sharded snapshots (module doc). Collective to make: every rank of the world
    makes one, with its node's host-memory directory."""

    def __init__(
        self,
        memory_dir: str | Path,
        persist_dir: str | Path,
        node: str,
        disk_every: int = 0,
        mode: str = "memory",
    ) -> None:
        self.mode = mode  # "disk": every snapshot is DCP's save only (no slots, no copies)
        self.slots = NodeSlots(memory_dir)
        self.persist_dir = Path(persist_dir)
        self.persist_dir.mkdir(parents=True, exist_ok=True)
        self.disk_every = disk_every
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        nodes: list[Any] = [None] * self.world
        dist.all_gather_object(nodes, node)
        self.nodes: list[str] = nodes
        self.neighbours = ring_neighbours(nodes)
        self.sources = [r for r, n in enumerate(self.neighbours) if n == self.rank]
        # The copies and the agreement run beside training, on a group of their own.
        self.group = dist.new_group(backend="gloo")
        self._queue: queue.Queue = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._saved = 0
        self.cost = SnapshotCost()
        self.last_cost_s: float | None = None  # for the snapshot policy (``_exchanger``)

    # -- snapshot -----------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: dict[str, Any],
        on_committed: Callable[[str], None],
        wait: bool = False,
    ) -> None:
        """Snapshot ``state`` (the trained state with DTensors under ``SHARDED_KEYS``, the rest
        small) as step ``step``; ``on_committed(name)`` runs on rank 0 once every rank has its
        slot and every copy arrived. Collective."""
        self.wait()
        began = time.perf_counter()
        sharded = {key: state[key] for key in SHARDED_KEYS}
        rest = {key: value for key, value in state.items() if key not in SHARDED_KEYS}
        if self.mode == "disk":
            self.save_to_disk(step, sharded, rest)
            self._cost(step, SnapshotCost(blocking_s=time.perf_counter() - began), True)
            if self.rank == 0:
                on_committed(disk_snapshot_name(step))
            return
        items = state_items(sharded)
        header = SlotHeader(step, self.rank, self.world, [i for i, _ in items], _encode(rest))
        slot = self.slots.create(header)
        try:
            _fill(slot, [value for _, value in items])
            self.slots.publish(slot)
        except BaseException:
            slot.close()
            raise
        self._saved += 1
        to_disk = bool(self.disk_every) and self._saved % self.disk_every == 1 % self.disk_every
        if to_disk:
            self.save_to_disk(step, sharded, rest)
        cost = SnapshotCost(blocking_s=time.perf_counter() - began, slot_bytes=slot.header.payload)
        self._cost(step, cost, to_disk)
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._exchanger, daemon=True, name="shard-exchange"
            )
            self._thread.start()
        self._idle.clear()
        self._queue.put((step, slot, on_committed))
        if wait:
            self.wait()

    def _cost(self, step: int, cost: SnapshotCost, to_disk: bool) -> None:
        """Record what the snapshot of ``step`` blocked training for: the snapshot policy's
        cost, and one INFO line per rank and snapshot (``disk=1``: a DCP save was part of it)."""
        self.cost = cost
        self.last_cost_s = cost.blocking_s
        log.info(
            "sharded snapshot step=%d rank=%d mode=%s blocking_s=%.4f slot_bytes=%d disk=%d",
            step,
            self.rank,
            self.mode,
            cost.blocking_s,
            cost.slot_bytes,
            int(to_disk),
        )

    def wait(self) -> None:
        """Until the snapshot in flight is committed (or failed: its error is raised)."""
        self._idle.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _exchanger(self) -> None:
        while True:
            step, slot, on_committed = self._queue.get()
            began, cpu = time.perf_counter(), time.thread_time()
            try:
                sent, received = self._exchange(slot)
                self.cost.sent_bytes, self.cost.received_bytes = sent, received
                if self.rank == 0:
                    on_committed(memory_snapshot_name(step))
            except BaseException as error:  # noqa: BLE001 - surfaced by wait()
                log.exception("sharded snapshot failed step=%d rank=%d", step, self.rank)
                self._error = error
                # Not committed: its slots go, so that the next snapshot reuses their pages
                # and never the committed snapshot's.
                self.slots.drop(step, self.world)
            finally:
                slot.close()
                self.cost.exchange_s = time.perf_counter() - began
                # What the snapshot policy weighs: the training thread's copy and the
                # exchange's CPU (on a busy node it comes out of training as well).
                self.last_cost_s = self.cost.blocking_s + time.thread_time() - cpu
                self._idle.set()

    def _exchange(self, slot: Slot) -> tuple[int, int]:
        """Send ``slot`` to this rank's neighbour, receive the slots this rank keeps copies
        of, and agree with every rank that all are in place (raises when any rank failed).
        The ranks first agree that every copy has its place: a payload sent to a rank that
        has none would never be received, and its sender would wait for ever."""
        to = self.neighbours[self.rank]
        copies: dict[int, Slot] = {}
        sent = received = 0
        try:
            try:
                raw = slot.header.encode() if to is not None else b""
                lengths = {s: torch.zeros(1, dtype=torch.int64) for s in self.sources}
                self._p2p(
                    [(torch.tensor([len(raw)], dtype=torch.int64), to)] if to is not None else [],
                    [(lengths[s], s) for s in self.sources],
                )
                heads = {s: torch.empty(int(lengths[s]), dtype=torch.uint8) for s in self.sources}
                self._p2p(
                    [(torch.frombuffer(bytearray(raw), dtype=torch.uint8), to)] if raw else [],
                    [(heads[s], s) for s in self.sources],
                )
                for source in self.sources:
                    copies[source] = self.slots.receive(heads[source].numpy().tobytes())
            except Exception:
                self._agree(False)
                raise
            if not self._agree(True):
                raise RuntimeError("a rank cannot place a copy: the snapshot is not committed")
            try:
                payload = slot.payload()
                self._p2p(
                    [(payload, to)] if to is not None and payload.numel() else [],
                    [(c.payload(), s) for s, c in copies.items() if c.header.payload],
                )
                sent = payload.numel() if to is not None else 0
                for copy in copies.values():
                    self.slots.publish(copy)
                    received += copy.header.payload
            except Exception:
                self._agree(False)
                raise
            if not self._agree(True):
                raise RuntimeError(
                    "a rank's slot or copy is missing: the snapshot is not committed"
                )
        finally:
            for copy in copies.values():
                copy.close()
                if copy.path.name.startswith("."):  # never published: of no use to anyone
                    copy.path.unlink(missing_ok=True)
        return sent, received

    def _agree(self, ok: bool) -> bool:
        """Whether every rank is ``ok`` (collective on the exchange's group)."""
        agreed = torch.tensor([int(ok)], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group)
        return bool(agreed.item())

    def _p2p(
        self,
        sends: list[tuple[torch.Tensor, int | None]],
        receives: list[tuple[torch.Tensor, int]],
    ) -> None:
        ops = [dist.P2POp(dist.isend, t, peer, self.group) for t, peer in sends if peer is not None]
        ops += [dist.P2POp(dist.irecv, t, peer, self.group) for t, peer in receives]
        for work in dist.batch_isend_irecv(ops) if ops else ():
            work.wait()

    # -- on disk --------------------------------------------------------------------------------
    def save_to_disk(self, step: int, sharded: dict[str, Any], rest: dict[str, Any]) -> Path:
        """DCP's save of the shards into ``dcp-{step}/``, each rank's rest beside them, then the
        ``.complete`` marker (rank 0, after every rank finished). Collective."""
        directory = self.persist_dir / disk_snapshot_name(step)
        dcp.save(sharded, checkpoint_id=directory)
        torch.save(rest, directory / f"rest-{self.rank:05d}.pt")
        dist.barrier()
        if self.rank == 0:
            marker = {"step": step, "world": self.world}
            (directory / COMPLETE_MARKER).write_text(json.dumps(marker))
            for old in disk_snapshots(self.persist_dir)[DISK_KEPT:]:
                shutil.rmtree(old, ignore_errors=True)
        return directory

    def close(self, remove: bool = False) -> None:
        """Wait for the snapshot in flight; ``remove``: drop this node's slots (the job is
        complete; local rank 0 of each node)."""
        self.wait()
        if remove:
            self.slots.remove()


def disk_snapshots(persist_dir: Path) -> list[Path]:
    """Complete on-disk snapshots, newest first."""
    found = [
        p
        for p in persist_dir.glob(f"{DISK_PREFIX}*")
        if p.is_dir() and (p / COMPLETE_MARKER).exists()
    ]
    return sorted(found, key=lambda p: p.name, reverse=True)


# -- restore --------------------------------------------------------------------------------------
@dataclass
class ShardedRestore:
    state: dict[str, Any]  # the trained state with this rank's new shards, and the rest
    step: int
    source: str  # what it came from, for the log
    moved: Moved | None = None  # bytes moved by an in-memory reshard


def _rest_with_generators(rests: dict[int, dict[str, Any]], old_world: int) -> dict[str, Any]:
    """Old rank 0's rest with every old rank's generators (``RNG_BY_RANK``): a world of the
    same size goes on with its own; another size derives new ones (``restore_rng_state``)."""
    rest = dict(rests[min(rests)])
    rest[RNG_BY_RANK] = [
        {k: v for k, v in rests[r].items() if k in ("rng", "cuda_rng")} if r in rests else None
        for r in range(old_world)
    ]
    return rest


def restore_from_memory(
    snapshots: ShardedSnapshots, template: dict[str, Any], step: int, old_world: int
) -> ShardedRestore:
    """The committed step's state, resharded from the slots the ranks' nodes hold into
    ``template`` (this world's state: its DTensors are loaded in place). Collective; raises
    ``ShardsLost`` on every rank when a slot is nowhere."""
    # The slots are host memory: they move over the CPU group (gloo), under NCCL too.
    held = holdings(snapshots.slots, step, old_world, snapshots.group)
    reader = PeerMemoryReader(snapshots.slots, held, snapshots.group)
    sharded = {key: template[key] for key in SHARDED_KEYS}
    dcp.load(sharded, storage_reader=reader)
    rests = {r: _decode(h.extra) for r, h in held.headers.items()}
    state = dict(template) | sharded | _rest_with_generators(rests, old_world)
    # Slots of older worlds or steps are of no use once this world has its state.
    snapshots.slots.keep_only(step, old_world)
    return ShardedRestore(state, step, f"memory ({len(held.headers)} slots)", reader.moved)


def restore_from_disk(template: dict[str, Any], directory: Path) -> ShardedRestore:
    """An on-disk snapshot (DCP's reader reshards it into ``template``). Collective."""
    marker = json.loads((directory / COMPLETE_MARKER).read_text())
    sharded = {key: template[key] for key in SHARDED_KEYS}
    dcp.load(sharded, checkpoint_id=directory)
    rests = {
        int(p.stem.split("-")[1]): torch.load(p, map_location="cpu", weights_only=True)
        for p in directory.glob("rest-*.pt")
    }
    state = dict(template) | sharded | _rest_with_generators(rests, int(marker["world"]))
    return ShardedRestore(state, int(marker["step"]), f"disk {directory.name}")


def newest_disk_snapshot(persist_dir: Path, at_most: int) -> Path | None:
    return next(
        (p for p in disk_snapshots(persist_dir) if int(p.name[len(DISK_PREFIX) :]) <= at_most),
        None,
    )


__all__ = [
    "ShardedRestore",
    "ShardedSnapshots",
    "ShardsLost",
    "disk_snapshots",
    "is_sharded_snapshot",
    "memory_snapshot_name",
    "newest_disk_snapshot",
    "restore_from_disk",
    "restore_from_memory",
    "ring_neighbours",
]
