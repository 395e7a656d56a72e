"""Device → host copies of a snapshot that overlap training, and the one host buffer they use.

A snapshot of a state on a GPU copies its tensors into pinned host memory. Blocking the step
for the whole copy costs ~0.2 s per 4 GB (PCIe/NVLink-C2C); most of it need not block at all:

* **What may still be in flight when ``pack`` returns** (``deferred``): tensors on an
  accelerator that nothing but ``optimizer.step()`` changes, i.e. the optimizer's parameters
  and its state (momentum, Adam moments). The next forward and backward only read them.
* **What is copied before ``pack`` returns**: everything else: buffers (BatchNorm statistics
  change in every forward; DDP broadcasts buffers in place), RNG states, CPU tensors.

The deferred copies run on a side CUDA stream that first waits for the work queued on the
training stream (the finished step), and end with an event. Before the next
``optimizer.step()`` the training stream waits for that event (a GPU-side wait: the host does
not block, ``Snapshotter.guard`` registers it as the optimizer's step pre-hook); the snapshot
writer thread waits for it on the host before it reads the buffer. On CPU (and any
accelerator but CUDA) copies are synchronous, as before: ``SyncCopier``'s waits are no-ops.

``HostBuffer`` is the one pinned buffer of a process, allocated once and reused by snapshots and
by the rescue written after a failure (which never pins memory of its own: pinning gigabytes
takes seconds of torchrun's 30 s between SIGTERM and SIGKILL). Its size counts against the
pod's memory limit: ``memory_problem`` says when it would not fit (``cgroup_memory``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

log = logging.getLogger(__name__)


def deferred(asynchronous: Sequence[bool], stepped: Sequence[bool]) -> list[bool]:
    """Per tensor: whether its copy may still be in flight once ``pack`` returns: copied
    asynchronously (from a GPU, ``Copier.asynchronous``) and changed only by
    ``optimizer.step()``, which waits for it."""
    return [copy and only_step for copy, only_step in zip(asynchronous, stepped, strict=True)]


def overlaps(device_types: set[str]) -> bool:
    """Whether a state on these (non-CPU) device types is copied on a side stream: exactly one
    CUDA device; anything else (several devices, MPS, XPU) copies synchronously."""
    return device_types == {"cuda"}


class Copied(Protocol):
    """Copies queued so far."""

    def wait_host(self) -> None:
        """Block this thread until they are in host memory."""

    def wait_device(self) -> None:
        """Make work queued on the current stream from now on wait for them (no host wait)."""


class Copier(Protocol):
    def start(self) -> None:
        """Copies queued from now on see the results of all work queued so far."""

    def asynchronous(self, source: torch.Tensor) -> bool:
        """Whether copies of ``source`` may still be in flight after ``mark``."""

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None: ...

    def mark(self) -> Copied:
        """The copies queued so far."""


class _Done:
    def wait_host(self) -> None:
        pass

    def wait_device(self) -> None:
        pass


DONE: Copied = _Done()


class SyncCopier:
    """Copies that are done when ``mark`` returns (CPU: plain copies, nothing to wait for)."""

    def __init__(self, devices: Sequence[torch.device] = ()) -> None:
        self.devices = list(devices)

    def start(self) -> None:
        pass

    def asynchronous(self, source: torch.Tensor) -> bool:
        return False

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        # Asynchronous only into pinned memory; a pageable target makes the copy synchronous.
        target.copy_(source, non_blocking=source.device.type != "cpu" and target.is_pinned())

    def mark(self) -> Copied:
        for device in self.devices:  # the copies were queued on each device's current stream
            torch.accelerator.current_stream(device).synchronize()
        return DONE


class _CudaCopied:
    def __init__(self, event: torch.cuda.Event, device: torch.device) -> None:
        self.event, self.device = event, device

    def wait_host(self) -> None:
        self.event.synchronize()

    def wait_device(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)


class CudaCopier:
    """Copies on a side stream of ``device`` (one per process, reused)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def start(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def asynchronous(self, source: torch.Tensor) -> bool:
        return source.device == self.device

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        if source.device != self.device:
            target.copy_(source)
            return
        with torch.cuda.stream(self.stream):
            target.copy_(source, non_blocking=target.is_pinned())
        # The allocator must not hand the source's memory out again (a temporary made
        # contiguous, a tensor freed meanwhile) before the side stream has read it.
        source.record_stream(self.stream)

    def mark(self) -> Copied:
        event = torch.cuda.Event()
        event.record(self.stream)
        return _CudaCopied(event, self.device)


# -- the host buffer --------------------------------------------------------------------------
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_memory(root: Path = CGROUP_ROOT) -> tuple[int | None, int | None]:
    """(limit, usage) in bytes of this container's memory cgroup (v2, else v1); None where
    unknown or unlimited. Usage is anonymous memory where ``memory.stat`` says (page cache is
    reclaimed before an OOM kill), else the whole charge."""

    def anonymous(name: str, key: str) -> int | None:
        try:
            lines = (root / name).read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            field, _, value = line.partition(" ")
            if field == key and value.strip().isdigit():
                return int(value)
        return None

    def read(*names: str) -> int | None:
        for name in names:
            try:
                text = (root / name).read_text().strip()
            except OSError:
                continue
            if text.isdigit():
                value = int(text)
                return value if value < 1 << 60 else None  # v1 "unlimited" is ~2**63
            return None  # "max": unlimited
        return None

    used = anonymous("memory.stat", "anon")
    if used is None:
        used = anonymous("memory/memory.stat", "total_rss")
    if used is None:
        used = read("memory.current", "memory/memory.usage_in_bytes")
    return read("memory.max", "memory/memory.limit_in_bytes"), used


def memory_problem(nbytes: int, limit: int | None, used: int | None) -> str | None:
    """Why pinning ``nbytes`` would overrun the memory limit (an OOM kill of the pod), or None."""
    if limit is None:
        return None
    if (used or 0) + nbytes <= limit:
        return None
    return (
        f"the snapshot buffer ({nbytes / 2**30:.2f} GiB, the training state's size) does not "
        f"fit the container's memory limit ({limit / 2**30:.2f} GiB, {(used or 0) / 2**30:.2f} "
        "GiB in use): raise the worker pod's memory (worker_memory) or give the state's size "
        "as snapshot_buffer, which the master adds to the pod's memory request and limit"
    )


class HostBuffer:
    """The process's one reusable snapshot buffer: pinned (a uint8 tensor) for device states,
    a bytearray otherwise. One user at a time (``take``/``release``): the snapshot in flight
    (until its writer is done with it) or a rescue."""

    def __init__(self) -> None:
        self.data: bytearray | torch.Tensor | None = None
        self._free = threading.Lock()

    @property
    def nbytes(self) -> int:
        if self.data is None:
            return 0
        return len(self.data) if isinstance(self.data, bytearray) else self.data.numel()

    def take(self, timeout: float = -1) -> bool:
        return self._free.acquire(timeout=timeout)

    def release(self) -> None:
        self._free.release()

    def fit(self, nbytes: int, pinned: bool) -> bytearray | torch.Tensor:
        """The buffer, grown to ``nbytes`` when smaller (held by the caller)."""
        if self.data is not None and self.nbytes >= nbytes:
            if pinned == isinstance(self.data, torch.Tensor):
                return self.data
        self.data = None  # free the old one before the new one is allocated
        if pinned:
            problem = memory_problem(nbytes, *cgroup_memory())
            if problem:
                log.error("%s", problem)
            self.data = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            log.info("pinned snapshot buffer bytes=%d", nbytes)
        else:
            self.data = bytearray(nbytes)
        return self.data


_STREAMS: dict[torch.device, CudaCopier] = {}


def copier_for(devices: set[torch.device], overlap: bool) -> Copier:
    """How a state on ``devices`` (its non-CPU ones) is copied: on the device's side stream
    (one per process) when ``overlap`` is wanted and possible, else synchronously."""
    if overlap and overlaps({d.type for d in devices}) and len(devices) == 1:
        (device,) = devices
        if device not in _STREAMS:
            _STREAMS[device] = CudaCopier(device)
        return _STREAMS[device]
    return SyncCopier(sorted(devices, key=str))
