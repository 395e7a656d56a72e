"""Which GPUs a local process gets: one rule for the master's local launcher, the local test
harness (``testing/nodes.py``) and the benchmarks.

Local node ``i`` with ``nproc`` processes gets GPUs ``i*nproc .. i*nproc+nproc-1`` of the
machine's visible ones as its ``CUDA_VISIBLE_DEVICES``, as a pod gets GPUs of its own from the
device plugin; its process of ``LOCAL_RANK`` k then uses the k-th (``worker/device.py``). Without
this every node's ``LOCAL_RANK`` 0 took GPU 0, which NCCL refuses ("Duplicate GPU detected").

A job whose processes compute on GPUs (``--device cuda``, or ``auto`` on a machine that has
GPUs) and asks for more processes than there are GPUs is refused before anything starts
(``require_gpus``). Read from the NVIDIA driver, not torch: the master does not import torch,
which would cost it seconds at every start.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

NVIDIA_GPUS_DIR = Path("/proc/driver/nvidia/gpus")  # one entry per GPU the driver sees
DEV_DIR = Path("/dev")
_DEVICE_NODE = re.compile(r"nvidia[0-9]+")  # one per GPU; nvidiactl, nvidia-uvm are not GPUs


class GpuShortage(ValueError):
    """More processes would compute on GPUs than there are GPUs."""


def visible_gpus(
    env: Mapping[str, str] | None = None,
    driver_dir: Path = NVIDIA_GPUS_DIR,
    dev_dir: Path = DEV_DIR,
) -> tuple[str, ...]:
    """The GPUs this machine gives its processes: ``CUDA_VISIBLE_DEVICES``'s entries when it is
    set, else every GPU the NVIDIA driver lists, else (a sandbox without the driver's /proc
    entries) one per ``/dev/nvidiaN`` device node; none without any."""
    listed = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return tuple(part.strip() for part in listed.split(",") if part.strip())
    try:
        count = sum(1 for _ in driver_dir.iterdir())
    except OSError:
        try:
            count = sum(1 for entry in dev_dir.iterdir() if _DEVICE_NODE.fullmatch(entry.name))
        except OSError:
            return ()
    return tuple(str(i) for i in range(count))


def uses_gpus(device: str | None, gpus: Sequence[str]) -> bool:
    """Whether processes with ``--device device`` compute on GPUs here: ``cuda`` always, ``auto``
    when there are GPUs, ``cpu`` never; ``None`` (a command of the user's: its device is its own
    business) when there are GPUs."""
    return device == "cuda" or (device != "cpu" and bool(gpus))


def require_gpus(device: str | None, processes: int, gpus: Sequence[str]) -> None:
    """Raise ``GpuShortage`` when ``processes`` processes of ``--device device`` would share
    ``gpus`` (NCCL refuses two ranks on one GPU). ``None`` (the device is unknown) passes."""
    if device is None or not uses_gpus(device, gpus) or processes <= len(gpus):
        return
    raise GpuShortage(
        f"--device {device}: {processes} processes need a GPU each but this machine has "
        f"{len(gpus)} ({', '.join(gpus) or 'none'} visible): use fewer workers or processes "
        "per worker, or --device cpu"
    )


def gpus_for_worker(index: int, nproc: int, gpus: Sequence[str]) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` of local node ``index`` with ``nproc`` processes: GPUs of its
    own, its process of ``LOCAL_RANK`` k using the k-th. None without GPUs. Past the last GPU
    they wrap around: only for processes that do not compute on GPUs (``require_gpus`` refused
    the others before they started)."""
    if not gpus:
        return None
    return ",".join(gpus[(index * nproc + k) % len(gpus)] for k in range(nproc))
