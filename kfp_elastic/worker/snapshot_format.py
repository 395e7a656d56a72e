"""The snapshot file format: a JSON tree, raw tensor bytes, a CRC32C; no pickle, no zip.

``torch.save`` pickles, zips and CRC32s with miniz: ~18 ms for a 1.1 M-parameter model and
its optimizer, CPU that a saturated node takes out of training at every snapshot. This format
costs one copy of the tensor bytes into a reused buffer (on the training thread: the state must
not change while it is read), a hardware CRC32C and one ``write`` (on the writer thread).

Layout (little-endian)::

    b"KFPSNAP1" | u64 header length | header (JSON) | payload (tensor bytes, 64-byte aligned)

The header holds the state tree with every tensor replaced by ``{"$t": i}``, the tensor table
(dtype, shape, offset, bytes), the payload length and its CRC32C. Tree values may be dicts (any
JSON-able or int keys), lists, tuples, str, int, float, bool, None and dense tensors; anything
else raises :class:`NotPackable` and the caller falls back to ``torch.save``. A truncated or
altered file fails to load with :class:`CorruptSnapshot`, never with wrong numbers.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kfp_elastic.worker.host_copy import DONE, Copied, Copier, HostBuffer, copier_for, deferred

try:  # hardware CRC32C (SSE4.2/ARMv8): ~12 GB/s against zlib's ~1.5 GB/s
    from google_crc32c import extend as _crc32c_extend
    from google_crc32c import value as _crc32c

    CHECKSUM = "crc32c"
except ImportError:  # pragma: no cover - the package is a dependency; zlib keeps it working
    _crc32c = _crc32c_extend = None
    CHECKSUM = "crc32"

MAGIC = b"KFPSNAP1"
ALIGN = 64
CRC_PIECE = 1 << 20
_LENGTH = struct.Struct("<Q")


class NotPackable(TypeError):
    """The state holds a value this format does not store (use torch.save for it)."""


class CorruptSnapshot(ValueError):
    """The file is truncated, altered or not a snapshot; the message says which check failed."""


def checksum(data: memoryview | bytes | bytearray, kind: str = CHECKSUM) -> int:
    if kind == "crc32c" and _crc32c is not None:
        # Its C function takes only bytes: copies of 1 MiB pieces (cache-sized, ~0.1 ms/MB)
        # still beat zlib's CRC32 on the whole buffer.
        view, crc = memoryview(data), 0
        for start in range(0, len(view), CRC_PIECE):
            crc = _crc32c_extend(crc, bytes(view[start : start + CRC_PIECE]))
        return crc
    if kind == "crc32":
        return zlib.crc32(data)
    raise CorruptSnapshot(f"checksum {kind!r} is not available here (pip install google-crc32c)")


@dataclass
class Packed:
    """A state copied out: its tree, tensor table and the first ``size`` bytes of ``buffer``.

    The checksum and header are made on first write (the writer thread, not the trainer's)."""

    tree: Any
    table: list[dict[str, Any]]
    buffer: bytearray | torch.Tensor  # a pinned uint8 tensor when the state was on a device
    size: int
    # Device → host copies that may still be in flight (``pack``'s ``stepped``): every read
    # of the buffer waits for them first.
    copied: Copied = DONE
    _header: bytes | None = None

    @property
    def payload(self) -> memoryview:
        self.copied.wait_host()
        raw = self.buffer if isinstance(self.buffer, bytearray) else self.buffer.numpy()
        return memoryview(raw).cast("B")[: self.size]

    @property
    def header(self) -> bytes:
        if self._header is None:
            payload = self.payload
            header = json.dumps(
                {
                    "format": 1,
                    "state": self.tree,
                    "tensors": self.table,
                    "payload": self.size,
                    "checksum": CHECKSUM,
                    "sum": checksum(payload),
                },
                separators=(",", ":"),
            ).encode()
            # Pad so that the payload starts ALIGN-aligned in the file (and in the buffer it
            # is read into): tensors are then viewed in place.
            header += b" " * (-(len(MAGIC) + _LENGTH.size + len(header)) % ALIGN)
            self._header = header
        return self._header

    def write_to(self, path: str | os.PathLike[str]) -> None:
        """Write the file; an existing file at ``path`` is overwritten in place (its pages are
        reused, which is much cheaper than allocating new ones) and cut to size."""
        header = MAGIC + _LENGTH.pack(len(self.header)) + self.header
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            _write_all(descriptor, header, 0)
            _write_all(descriptor, self.payload, len(header))
            os.ftruncate(descriptor, len(header) + self.size)
        finally:
            os.close(descriptor)


def _write_all(descriptor: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(descriptor, view, offset)
        view, offset = view[written:], offset + written


def _dense(value: torch.Tensor) -> torch.Tensor:
    if value.layout != torch.strided or value.is_quantized or value.is_nested:
        raise NotPackable(f"tensor with layout {value.layout} / quantized / nested")
    return value.detach()


def _tree(value: Any, tensors: list[torch.Tensor]) -> Any:
    """The JSON tree of ``value``; tensors are appended to ``tensors``."""
    if isinstance(value, torch.Tensor):
        tensors.append(_dense(value))
        return {"$t": len(tensors) - 1}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        metadata = getattr(value, "_metadata", None)  # a state_dict's module versions
        if (
            metadata is None
            and all(isinstance(k, str) for k in value)
            and not any(k.startswith("$") for k in value)
        ):
            return {k: _tree(v, tensors) for k, v in value.items()}
        if all(isinstance(k, str | int) and not isinstance(k, bool) for k in value):
            tree = {"$d": [[k, _tree(v, tensors)] for k, v in value.items()]}
            if isinstance(metadata, dict):
                tree["$m"] = _tree(metadata, tensors)
            return tree
    elif isinstance(value, list):
        return [_tree(v, tensors) for v in value]
    elif isinstance(value, tuple) and type(value) is tuple:
        return {"$u": [_tree(v, tensors) for v in value]}
    raise NotPackable(f"cannot store a {type(value).__qualname__} in a snapshot")


@dataclass(frozen=True)
class Layout:
    """Where a state's tensors go in the payload: the tree, the tensors, their table (dtype,
    shape, offset, bytes) and the payload's size."""

    tree: Any
    tensors: list[torch.Tensor]
    table: list[dict[str, Any]]
    size: int


def layout(state: dict[str, Any]) -> Layout:
    """``state``'s payload layout (``NotPackable`` when the format cannot store it)."""
    tensors: list[torch.Tensor] = []
    tree = _tree(state, tensors)
    table, offset = [], 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        table.append(
            {
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "shape": list(tensor.shape),
                "offset": offset,
                "nbytes": nbytes,
            }
        )
        offset += -(-nbytes // ALIGN) * ALIGN
    return Layout(tree, tensors, table, offset)


def pieces(table: list[dict[str, Any]], start: int, length: int) -> list[tuple[int, int, int, int]]:
    """The tensors' bytes in payload bytes ``[start, start + length)``: (tensor index, offset
    in the tensor, offset in that range, bytes) each; alignment padding is in none."""
    out, end = [], start + length
    for index, entry in enumerate(table):
        low, high = max(start, entry["offset"]), min(end, entry["offset"] + entry["nbytes"])
        if low < high:
            out.append((index, low - entry["offset"], low - start, high - low))
    return out


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A dense tensor's bytes as a flat uint8 tensor (a copy only when not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def from_bytes(raw: torch.Tensor, entry: dict[str, Any]) -> torch.Tensor:
    """The tensor a table entry describes, on ``raw``'s storage (``nbytes`` uint8)."""
    dtype = getattr(torch, entry["dtype"])
    if not entry["nbytes"]:
        return torch.empty(entry["shape"], dtype=dtype, device=raw.device)
    return raw.view(dtype).reshape(entry["shape"])


def _buffer_for(
    size: int,
    pinned: bool,
    reuse: HostBuffer | bytearray | torch.Tensor | None,
    may_pin: bool,
) -> bytearray | torch.Tensor:
    """``reuse`` when it fits, else a new buffer (a grown ``HostBuffer``): pinned host memory (a
    uint8 tensor) when ``pinned``, so that copies to and from a device are asynchronous DMA; a
    bytearray otherwise, and whenever pinning is not allowed (it takes seconds per GB)."""
    raw = reuse.data if isinstance(reuse, HostBuffer) else reuse
    if raw is not None and (len(raw) if isinstance(raw, bytearray) else raw.numel()) >= size:
        if not pinned or not may_pin or buffer_pinned(raw):
            return raw
    if not may_pin:
        return bytearray(size)
    if isinstance(reuse, HostBuffer):
        return reuse.fit(size, pinned)
    if pinned:
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)
    return bytearray(size)


def pack(
    state: dict[str, Any],
    reuse: HostBuffer | bytearray | torch.Tensor | None = None,
    *,
    stepped: Callable[[torch.Tensor], bool] | None = None,
    pin: bool | None = None,
    copier: Copier | None = None,
) -> Packed:
    """Copy ``state`` into ``reuse`` (grown if needed) and describe it; call on the thread that
    owns the state, before it changes again. Tensors on an accelerator are copied into pinned
    host memory with asynchronous copies. ``pin``: None pins a new buffer for a state on an
    accelerator, True always, False never (a buffer that fits is reused, else a bytearray).

    ``stepped(tensor)``: whether only ``optimizer.step()`` changes ``tensor``. Without it this
    returns once every copy is done, so the caller blocks for the copy only (checksum and write
    happen later, on the writer). With it, on one CUDA device, those tensors' copies may still
    be in flight (``host_copy``): ``Packed.copied`` says when they are done; the caller must
    make the next ``optimizer.step()`` wait for it (``Snapshotter.guard``)."""
    laid = layout(state)
    devices = {t.device for t in laid.tensors if t.device.type != "cpu"}
    pinned = bool(devices) if pin is None else pin
    buffer = _buffer_for(laid.size, pinned, reuse, may_pin=pin is not False)
    if copier is None:
        copier = copier_for(devices, overlap=stepped is not None and buffer_pinned(buffer))
    later = deferred(
        [copier.asynchronous(t) for t in laid.tensors],
        [stepped(t) for t in laid.tensors] if stepped is not None else [False] * len(laid.tensors),
    )
    # Sources first (a non-contiguous tensor's temporary is queued work), then the copies.
    sources = [as_bytes(t) if t.numel() else t for t in laid.tensors]
    if isinstance(buffer, torch.Tensor):
        flat = buffer
    elif laid.size:
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=laid.size)
    else:
        flat = torch.empty(0, dtype=torch.uint8)
    copier.start()
    copied = DONE
    for pending in (False, True):  # what must be copied now, then what may follow
        queued = False
        for source, entry, late in zip(sources, laid.table, later, strict=True):
            if late == pending and entry["nbytes"]:
                copier.copy(flat[entry["offset"] : entry["offset"] + entry["nbytes"]], source)
                queued = queued or copier.asynchronous(source)
        if pending:
            copied = copier.mark() if queued else DONE
        elif queued or not any(later):
            # Waiting would also wait for the step still queued on the device: only when a
            # copy that must be done now is asynchronous (SyncCopier: its devices' streams).
            copier.mark().wait_host()
    return Packed(laid.tree, laid.table, buffer, laid.size, copied=copied)


def buffer_pinned(buffer: bytearray | torch.Tensor | None) -> bool:
    return isinstance(buffer, torch.Tensor) and buffer.is_pinned()


def is_packed_file(path: str | os.PathLike[str]) -> bool:
    with open(path, "rb") as handle:
        return handle.read(len(MAGIC)) == MAGIC


def _untree(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_untree(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "$t" in value:
        return tensors[value["$t"]]
    if "$d" in value:
        items = {k: _untree(v, tensors) for k, v in value["$d"]}
        if "$m" not in value:
            return items
        with_metadata = OrderedDict(items)
        with_metadata._metadata = _untree(value["$m"], tensors)  # type: ignore[attr-defined]
        return with_metadata
    if "$u" in value:
        return tuple(_untree(v, tensors) for v in value["$u"])
    return {k: _untree(v, tensors) for k, v in value.items()}


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    data = bytearray(open(path, "rb").read())  # noqa: SIM115 - read whole, closed at once
    if data[: len(MAGIC)] != MAGIC:
        raise CorruptSnapshot("not a kfp-elastic snapshot (bad magic)")
    start = len(MAGIC) + _LENGTH.size
    if len(data) < start:
        raise CorruptSnapshot("truncated header")
    (header_length,) = _LENGTH.unpack_from(data, len(MAGIC))
    try:
        header = json.loads(bytes(data[start : start + header_length]))
    except ValueError as error:
        raise CorruptSnapshot(f"unreadable header ({error})") from None
    payload = memoryview(data)[start + header_length :]
    if len(payload) != header["payload"]:
        raise CorruptSnapshot(
            f"payload has {len(payload)} bytes, header says {header['payload']}"
            " (truncated or appended to)"
        )
    if checksum(payload, header["checksum"]) != header["sum"]:
        raise CorruptSnapshot(f"{header['checksum']} mismatch: the tensor bytes were altered")
    flat = (
        torch.frombuffer(data, dtype=torch.uint8, offset=start + header_length, count=len(payload))
        if len(payload)
        else torch.empty(0, dtype=torch.uint8)
    )
    # Own storage per tensor (a copy): a view would keep, and torch.save would write, the
    # whole payload for any one tensor of it.
    tensors = [
        from_bytes(flat[e["offset"] : e["offset"] + e["nbytes"]], e).clone()
        for e in header["tensors"]
    ]
    return build(header["state"], tensors)


def build(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """The state a layout's tree describes, with ``tensors`` in place of its ``{"$t": i}``."""
    return _untree(tree, tensors)
