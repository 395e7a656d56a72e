"""Training-state snapshots: a fast node-local copy, a persisted copy, then a commit in etcd.

Only rank 0 writes (DDP replicas are identical). ``save`` copies the state's tensor bytes into
a reused buffer (``snapshot_format.pack``; on a GPU the copies of parameters and optimizer
state overlap the next forward and backward: ``guard``, ``worker/host_copy.py``), so training
goes on while a background thread writes ``snapshot-{step:09d}.pt`` first into the node-local
directory, then into the persisted one (a PVC in a cluster), each by write-to-temp and
rename, and only then calls ``on_persisted`` (the etcd commit). A snapshot that is committed
therefore always exists in the persisted directory; a node that survives restores from its
local copy, anyone else from the persisted one, and newcomers get it by broadcast (as tensors,
``collective.shared_state``). Files are in ``snapshot_format`` (checksummed
raw tensors) unless the state holds something that format cannot store; then ``torch.save``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from kfp_elastic.worker import snapshot_format
from kfp_elastic.worker.host_copy import DONE, Copied, Copier, HostBuffer
from kfp_elastic.worker.snapshot_format import CorruptSnapshot, NotPackable, Packed

log = logging.getLogger(__name__)

KEEP = 3  # snapshots kept per directory: the committed one and a couple to fall back to
WRITER_NICE = 10  # niceness of the snapshot writer thread (the training thread keeps its own)


class SnapshotError(RuntimeError):
    """A snapshot is missing or unreadable; the message names the file and what to do."""


def snapshot_name(step: int) -> str:
    return f"snapshot-{step:09d}.pt"


def read_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A snapshot file's state: our format, or (older files, fallbacks) ``torch.save``."""
    if snapshot_format.is_packed_file(path):
        return snapshot_format.load(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


class Snapshotter:
    def __init__(
        self,
        persist_dir: str | os.PathLike[str],
        local_dir: str | os.PathLike[str] | None = None,
        copier: Copier | None = None,  # how tensors reach the buffer (default: by device)
    ) -> None:
        self.persist_dir = Path(persist_dir)
        self.local_dir = Path(local_dir) if local_dir else None
        for directory in self._dirs():
            directory.mkdir(parents=True, exist_ok=True)
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None
        # Reused (pinned host memory when the state is on a device): one snapshot is in flight;
        # the rescue borrows it (``Rescues``).
        self.buffer = HostBuffer()
        self._copier = copier
        self._optimizer: torch.optim.Optimizer | None = None
        self._copied: Copied = DONE  # the last snapshot's copies the next step must wait for
        self._packable = True
        self._sync_part_s = 0.0
        # What the last snapshot cost: the training thread's copy (wall) + the writer's CPU.
        # On a busy node the writer's CPU comes out of training as well.
        self.last_cost_s: float | None = None

    def _dirs(self) -> list[Path]:
        return [d for d in (self.local_dir, self.persist_dir) if d is not None]

    def save(
        self,
        step: int,
        state: dict[str, Any],
        on_persisted: Callable[[str], None],
        wait: bool = False,
    ) -> None:
        """Write ``state`` as the snapshot of ``step``; ``on_persisted(name)`` after it is safe.

        At most one snapshot is in flight: this first waits for the previous one."""
        self.wait()
        began = time.perf_counter()
        packed: Packed | dict[str, Any] | None = None
        if self._packable:
            self.buffer.take()
            try:
                packed = snapshot_format.pack(
                    state, self.buffer, stepped=self._stepped(), copier=self._copier
                )
                self._copied = packed.copied
            except NotPackable as why:
                log.warning("snapshot state not packable (%s); using torch.save", why)
                self._packable = False
            finally:
                if packed is None:
                    self.buffer.release()
        if packed is None:
            packed = _to_cpu(state)
        self._sync_part_s = time.perf_counter() - began
        if self._thread is None:  # one long-lived writer: starting threads costs the loop
            self._thread = threading.Thread(
                target=self._writer, daemon=True, name="snapshot-writer"
            )
            self._thread.start()
        self._idle.clear()
        self._queue.put((step, packed, on_persisted))
        if wait:
            self.wait()

    def guard(self, optimizer: torch.optim.Optimizer) -> RemovableHandle:
        """Let a snapshot's copies of what only ``optimizer.step()`` changes (parameters,
        optimizer state) overlap the next forward and backward: each ``optimizer.step()``
        first waits for them (``wait_copied``; a GPU-side wait, see ``host_copy``). Call once,
        with the optimizer that steps the snapshotted state; without it every copy blocks
        ``save``. The state must then not change those tensors outside ``optimizer.step()``."""
        self._optimizer = optimizer
        return optimizer.register_step_pre_hook(lambda *_: self.wait_copied())

    def wait_copied(self) -> None:
        """Before changing the state's parameters or optimizer state: wait for the last
        snapshot's copies of them (no-op on CPU, where ``save`` copies everything at once)."""
        copied, self._copied = self._copied, DONE
        copied.wait_device()

    def _stepped(self) -> Callable[[torch.Tensor], bool] | None:
        """Whether only the guarded optimizer's step changes a tensor (None: not guarded)."""
        if self._optimizer is None:
            return None
        optimizer = self._optimizer
        owned = {p.data_ptr() for g in optimizer.param_groups for p in g["params"]}
        owned |= {
            value.data_ptr()
            for per_param in optimizer.state.values()
            for value in per_param.values()
            if isinstance(value, torch.Tensor)
        }
        return lambda tensor: tensor.data_ptr() in owned

    def wait(self) -> None:
        """Block until the snapshot in flight is persisted and committed (re-raise its error)."""
        self._idle.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _writer(self) -> None:
        # Linux: a thread has its own nice value. The writer then takes the CPU that training
        # leaves idle (allreduce waits) instead of competing with it on a busy node.
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        while True:
            step, state, on_persisted = self._queue.get()
            began = time.thread_time()
            try:
                self._write(step, state, on_persisted)
            finally:
                if isinstance(state, Packed):
                    self.buffer.release()
                self.last_cost_s = self._sync_part_s + time.thread_time() - began
                self._idle.set()

    def _write(
        self, step: int, state: Packed | dict[str, Any], on_persisted: Callable[[str], None]
    ) -> None:
        name = snapshot_name(step)
        try:
            first, *others = self._dirs()
            temporary = first / f".{name}.tmp{os.getpid()}"
            if isinstance(state, Packed):
                self._write_packed(first, temporary, state)
            else:
                torch.save(state, temporary)  # serialise once (holds the GIL), copy bytes
            os.replace(temporary, first / name)
            for directory in others:
                temporary = directory / f".{name}.tmp{os.getpid()}"
                if isinstance(state, Packed):
                    self._write_packed(directory, temporary, state)
                else:
                    shutil.copyfile(first / name, temporary)
                os.replace(temporary, directory / name)
            for directory in (first, *others):
                self._prune(directory)
            on_persisted(name)
        except BaseException as error:  # noqa: BLE001 - surfaced by wait()
            log.exception("snapshot failed step=%d", step)
            self._error = error

    @staticmethod
    def _write_packed(directory: Path, temporary: Path, state: Packed) -> None:
        """Write into the oldest snapshot's file when KEEP exist (renamed out of sight first).

        Overwriting pages the file already has costs a copy; a new file costs allocating and
        zeroing them, then freeing the pruned one's: 9 MB took 8 ms fresh, 1 ms recycled here.
        The oldest is never the committed snapshot (that is the newest persisted one)."""
        existing = sorted(directory.glob("snapshot-*.pt"))
        if len(existing) >= KEEP:
            with contextlib.suppress(OSError):  # gone meanwhile: write a fresh file
                os.replace(existing[0], temporary)
        state.write_to(temporary)

    @staticmethod
    def _prune(directory: Path) -> None:
        for old in sorted(directory.glob("snapshot-*.pt"))[:-KEEP]:
            old.unlink(missing_ok=True)

    def load(self, name: str) -> dict[str, Any]:
        """The named snapshot, from the local copy if this node has a good one."""
        errors = []
        for directory in self._dirs():
            path = directory / name
            if not path.exists():
                errors.append(f"{path}: missing")
                continue
            try:
                return read_state(path)
            except CorruptSnapshot as error:
                errors.append(f"{path}: unreadable ({error})")
            except Exception as error:  # noqa: BLE001 - try the next copy, then explain
                errors.append(f"{path}: unreadable ({type(error).__name__}: {error})")
        raise SnapshotError(f"snapshot {name} cannot be restored: " + "; ".join(errors))

    def available(self) -> list[str]:
        """Snapshot names in the persisted directory, newest first."""
        return sorted((p.name for p in self.persist_dir.glob("snapshot-*.pt")), reverse=True)

    def copy_persisted_to_local(self, name: str) -> None:
        if self.local_dir is not None and not (self.local_dir / name).exists():
            shutil.copyfile(self.persist_dir / name, self.local_dir / name)
