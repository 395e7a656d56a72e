"""Where a worker process computes: its device, the collective backend, batches on the device,
and the abort that frees a rank stuck in a NCCL collective whose peer is gone.

* **Device**: ``--device auto`` takes the accelerator ``torch.accelerator`` reports (CUDA on a
  GPU node), ``LOCAL_RANK``'s device on it, else the CPU; ``cuda`` insists on one, ``cpu`` never
  uses one. ``choose_device`` decides from plain values (tested without a GPU); the choice and
  its reason are logged (``explain_device``), as a warning when ``auto`` takes the CPU on a
  machine whose NVIDIA driver lists GPUs.
* **Backend**: the one torch registers for the device type (``nccl`` for cuda, ``gloo`` for the
  CPU): NCCL only takes device tensors, so every collective's tensor is made on
  ``Placement.device``.
* **Batches** reach an accelerator from pinned host memory with ``non_blocking`` copies.
* **Abort**: a rank blocked in a NCCL collective (a peer died) runs no Python, so its SIGTERM
  handler never does; torchrun SIGKILLs it 30 s later and the rescue is lost, and without a
  SIGTERM it waits for the collective timeout (10 min by default). ``StallAbort`` is told to stop
  by either of two signals: SIGTERM, through ``signal.set_wakeup_fd`` (written by CPython's
  C-level handler, whatever the main thread is doing; the agent sends it when the rendezvous
  sees a peer gone), or its round breaking (``worker/peer_loss.py``: this process's own etcd
  watch of the round's participants, which needs no agent). When no step finished for
  ``grace_s`` after either, it aborts the process group from its own thread. The blocked call
  then raises and the training thread writes its rescue from device memory. Gloo needs none of
  this: its collectives fail at once when a peer's connection drops (and its abort does not
  unblock).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kfp_elastic.contract.nccl_env import set_nccl_error_handling
from kfp_elastic.gpus import visible_gpus
from kfp_elastic.job_spec import DEVICES  # --device: the job contract's choices

log = logging.getLogger(__name__)


class CollectiveAborted(RuntimeError):
    """The process group was aborted (a peer is gone): what the last collective returned is
    not to be used."""


class DeviceError(RuntimeError):
    """The requested device cannot be used here; the message says why and what to set."""


@dataclass(frozen=True)
class Placement:
    """One process's device and the collective backend that goes with it."""

    device: torch.device
    backend: str

    @property
    def on_accelerator(self) -> bool:
        return self.device.type != "cpu"


def choose_device(
    requested: str, local_rank: int, accelerator: str | None, count: int
) -> torch.device:
    """The device of the process with ``local_rank`` given the node's ``accelerator`` type
    (``torch.accelerator.current_accelerator()``, None: none) and how many it has."""
    if requested not in DEVICES:
        raise DeviceError(f"--device must be one of {', '.join(DEVICES)}, got {requested!r}")
    if requested == "cpu" or (requested == "auto" and (accelerator is None or count == 0)):
        return torch.device("cpu")
    wanted = accelerator if requested == "auto" else requested
    if accelerator != wanted or count == 0:
        raise DeviceError(
            f"--device {requested}: no {wanted} device visible to this process "
            f"(accelerator: {accelerator or 'none'}); use --device auto or cpu"
        )
    if not 0 <= local_rank < count:
        raise DeviceError(
            f"LOCAL_RANK={local_rank} but only {count} {wanted} device(s) are visible: "
            "--nproc-per-node (nproc_per_worker) must not exceed the GPUs per node"
        )
    return torch.device(wanted, local_rank)


def explain_device(
    requested: str, device: torch.device, accelerator: str | None, count: int, driver_gpus: int
) -> tuple[int, str]:
    """The log level and line that say which device this process computes on and why.
    ``driver_gpus``: GPUs the NVIDIA driver lists for this process (``kfp_elastic.gpus``). A
    process that takes the CPU under ``--device auto`` although the driver lists GPUs is a
    warning: torch cannot use them (a CPU-only torch build, or a driver too old for its CUDA)."""
    seen = f"torch sees {count} {accelerator} device(s)" if accelerator else "torch sees no GPU"
    if device.type != "cpu":
        return logging.INFO, f"device={device} (--device {requested}: {seen})"
    if requested == "cpu":
        return logging.INFO, "device=cpu (--device cpu)"
    if driver_gpus:
        return logging.WARNING, (
            f"device=cpu although the NVIDIA driver lists {driver_gpus} GPU(s): --device auto, "
            f"but {seen} (torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
            "install a CUDA build of torch that this driver supports, or give --device cuda "
            "to fail instead"
        )
    return logging.INFO, f"device=cpu (--device auto: {seen} and the driver lists no GPU)"


def backend_for(device: torch.device) -> str:
    """The collective backend for tensors on ``device`` (torch's registered default)."""
    try:
        return dist.get_default_backend_for_device(device)
    except ValueError:
        raise DeviceError(f"no collective backend for device type {device.type!r}") from None


def device_of_this_process(requested: str) -> torch.device:
    """``LOCAL_RANK``'s device here (``choose_device``), logged with the reason."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    count = torch.accelerator.device_count() if accelerator is not None else 0
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    kind = accelerator.type if accelerator else None
    device = choose_device(requested, local_rank, kind, count)
    level, line = explain_device(requested, device, kind, count, len(visible_gpus()))
    log.log(level, "rank local=%d %s", local_rank, line)
    return device


def place_this_process(requested: str) -> Placement:
    """Choose this process's device (from ``LOCAL_RANK``) and make it the current one."""
    device = device_of_this_process(requested)
    if device.type != "cpu":
        # Before init_process_group: NCCL and the object collectives use the current device.
        torch.accelerator.set_device_index(device.index)
    return Placement(device, backend_for(device))


def init_process_group(placement: Placement, timeout_s: float) -> None:
    """The default process group for ``placement``, bound to its device, with ``timeout_s``
    for every collective (torch's defaults: 10 min NCCL, 30 min Gloo)."""
    if placement.backend == "nccl":
        set_nccl_error_handling()
    dist.init_process_group(
        placement.backend,
        timeout=timedelta(seconds=timeout_s),
        device_id=placement.device if placement.on_accelerator else None,
    )


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` (tensors in dicts, lists, tuples) on ``device``; pinned + non-blocking copies
    on an accelerator (the loss that reads them waits on the same stream)."""
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        if batch.device == device:
            return batch
        if batch.device.type == "cpu" and not batch.is_pinned():
            batch = batch.pin_memory()
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, list):
        return [to_device(value, device) for value in batch]
    if isinstance(batch, tuple):
        moved = [to_device(value, device) for value in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else tuple(moved)
    return batch


def stall_is_abortable(
    now: float, stop_at: float | None, progress_at: float, grace_s: float
) -> bool:
    """Abort when this process was told to stop (SIGTERM, or its round broke: ``stop_at``, the
    first of them) and no step finished for ``grace_s`` since then (or since the last one after
    it): a healthy world reaches its agreed stop within a sync interval."""
    if stop_at is None:
        return False
    return now - max(stop_at, progress_at) >= grace_s


class StallAbort:
    """Aborts ``abort()`` (the process group) when this process was told to stop (SIGTERM, or
    ``round_broken()``) and its training thread then makes no progress for ``grace_s``.
    ``progress()`` after each finished step; ``close()`` at the end. One per process (it owns
    the signal wakeup fd). ``clock``: seconds, monotonic (tests pass their own)."""

    def __init__(
        self,
        grace_s: float,
        abort: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = 0.05,
    ) -> None:
        self.grace_s = grace_s
        self._abort = abort
        self._clock = clock
        self._poll_s = poll_s
        self._progress_at = clock()
        self._stop_at: float | None = None
        self._stop_reason = ""
        self._stop_lock = threading.Lock()
        self._on_close: list[Callable[[], None]] = []
        self.aborted = False  # set before the abort: whoever sees False saw a whole collective
        self._closed = threading.Event()
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, daemon=True, name="stall-abort")
        self._thread.start()

    def progress(self) -> None:
        self._progress_at = self._clock()

    @property
    def stop_reason(self) -> str | None:
        """What told this process to stop (None: nothing yet)."""
        return self._stop_reason if self._stop_at is not None else None

    def round_broken(self, reason: str) -> None:
        """This process's round lost a participant (any thread may call it)."""
        self._stopped(f"round broken ({reason})")

    def check(self) -> None:
        """Raise ``CollectiveAborted`` when the group was aborted: a collective cut short
        returns (partial data) instead of raising."""
        if self.aborted:
            raise CollectiveAborted(
                f"process group aborted after {self._stop_reason}; a peer is gone"
            )

    def on_close(self, release: Callable[[], None]) -> None:
        """Run ``release`` (what feeds ``round_broken``) when this closes."""
        self._on_close.append(release)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        for release in reversed(self._on_close):
            try:
                release()
            except Exception as error:  # noqa: BLE001 - closing must not fail training's end
                log.warning("stall abort clean-up failed error=%r", error)
        with contextlib.suppress(ValueError):  # not the main thread: nothing to restore
            signal.set_wakeup_fd(self._previous_fd)
        self._thread.join(timeout=1)
        self._reader.close()
        self._writer.close()

    def _stopped(self, reason: str) -> None:
        with self._stop_lock:
            if self._stop_at is None:
                self._stop_at, self._stop_reason = self._clock(), reason

    def _watch(self) -> None:
        while not self._closed.wait(self._poll_s):
            with contextlib.suppress(BlockingIOError, OSError):
                if signal.SIGTERM in self._reader.recv(64):
                    self._stopped("SIGTERM")
            if stall_is_abortable(self._clock(), self._stop_at, self._progress_at, self.grace_s):
                log.warning(
                    "aborting process group pid=%d reason=no step finished %.1fs after %s",
                    os.getpid(),
                    self.grace_s,
                    self._stop_reason,
                )
                self.aborted = True
                try:
                    self._abort()
                except Exception as error:  # noqa: BLE001 - nothing else can unblock it
                    log.error("process group abort failed error=%r", error)
                return


def settle(device: torch.device, stall: StallAbort | None) -> None:
    """Before ``optimizer.step()``: wait for the step's device work (the gradient allreduce
    included) and raise if the group was aborted meanwhile. An aborted allreduce completes with
    partial gradients, which must never reach the parameters (nor a rescue)."""
    if device.type != "cpu":
        torch.accelerator.current_stream(device).synchronize()
    if stall is not None:
        stall.check()


def abort_process_group() -> None:
    """Abort every NCCL communicator of this process (torch 2.13:
    ``distributed_c10d._abort_process_group``, which calls ``ProcessGroupNCCL.abort()`` inside
    one NCCL group so that communicators cannot deadlock each other, pytorch#119797)."""
    dist.distributed_c10d._abort_process_group()
