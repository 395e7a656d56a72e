"""Rescue snapshots: what a surviving worker had trained when its world broke.

When a peer dies, every survivor's next collective fails (or its agent stops it to re-form),
and torchrun restarts the survivors' workers too. Their memory still holds the model and
optimizer after the last *finished* optimizer step, which is newer than the committed snapshot
by up to ``--snapshot-every`` steps. Each survivor writes that state, with its data position
and RNG, as ``rescue-{step:09d}-r{rank}.pt`` (snapshot format, write-to-temp + rename) into its
node-local snapshot directory, or the persisted one when it has none, before it exits.

The agent only joins the next round after its worker has exited, so every rescue a survivor
wrote is on disk before the new world starts. There every rank reports the newest readable
rescue newer than the committed step; the newest wins, its holder broadcasts it, and rank 0
commits it like any snapshot. A SIGKILLed node then costs at most the step in flight instead
of a snapshot interval; only losing every node falls back to the committed snapshot.

Any finished step is a state every sample before its position reached exactly once (the
survivors ran the same synchronous steps), so a rescue is as good as a commit. A state caught
*inside* ``optimizer.step()`` is not (some parameters updated, others not): none is written.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kfp_elastic.worker import snapshot_format
from kfp_elastic.worker.host_copy import HostBuffer
from kfp_elastic.worker.snapshot import read_state
from kfp_elastic.worker.snapshot_format import CorruptSnapshot, NotPackable

log = logging.getLogger(__name__)

# Seconds a rescue waits for the snapshot in flight to give the process's host buffer back
# before it copies into fresh pageable memory instead (torchrun SIGKILLs 30 s after SIGTERM).
BUFFER_WAIT_S = 5.0

_NAME = re.compile(r"^rescue-(\d{9})-r(\d+)\.pt$")


def rescue_name(step: int, rank: int) -> str:
    return f"rescue-{step:09d}-r{rank}.pt"


@dataclass(frozen=True)
class Found:
    step: int
    path: Path


def _rescues(directory: Path) -> list[Found]:
    found = []
    with contextlib.suppress(OSError):
        for path in directory.iterdir():
            match = _NAME.match(path.name)
            if match:
                found.append(Found(int(match.group(1)), path))
    return found


class Rescues:
    """Rescue files of one run in ``directory`` (node-local if the node has a local one).

    ``buffer``: the process's snapshot buffer (``Snapshotter.buffer``), which a rescue reuses
    when it is free within ``buffer_wait_s`` and big enough; a rescue never pins memory of its
    own (pinning gigabytes after SIGTERM takes seconds): otherwise it copies into pageable
    memory."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        run_id: str,
        buffer: HostBuffer | None = None,
        buffer_wait_s: float = BUFFER_WAIT_S,
    ) -> None:
        self.directory = Path(directory)
        self.run_id = run_id
        self.buffer = buffer
        self.buffer_wait_s = buffer_wait_s

    def write(self, step: int, rank: int, state: dict[str, Any]) -> Path:
        """Write ``state`` (its ``step`` is ``step``) and drop this rank's older rescues."""
        self.directory.mkdir(parents=True, exist_ok=True)
        name = rescue_name(step, rank)
        temporary = self.directory / f".{name}.tmp{os.getpid()}"
        state = {**state, "run_id": self.run_id}
        buffer = self.buffer
        if buffer is not None and not buffer.take(timeout=self.buffer_wait_s):
            log.warning("snapshot buffer busy: rescue copies into pageable memory")
            buffer = None
        try:
            snapshot_format.pack(state, buffer, pin=False).write_to(temporary)
        except NotPackable:
            torch.save(state, temporary)
        finally:
            if buffer is not None:
                buffer.release()
        os.replace(temporary, self.directory / name)
        for old in _rescues(self.directory):
            if old.step < step and old.path.name.endswith(f"-r{rank}.pt"):
                old.path.unlink(missing_ok=True)
        return self.directory / name

    def newest_after(self, committed_step: int) -> tuple[int, dict[str, Any]] | None:
        """The newest readable rescue of this run past ``committed_step``, loaded."""
        for found in sorted(_rescues(self.directory), key=lambda f: f.step, reverse=True):
            if found.step <= committed_step:
                break
            try:
                state = read_state(found.path)
            except (CorruptSnapshot, OSError, RuntimeError, ValueError) as error:
                log.warning("unreadable rescue path=%s error=%s", found.path, error)
                continue
            if state.get("run_id") != self.run_id or state.get("step") != found.step:
                continue  # another run's file in a shared directory, or a renamed one
            return found.step, state
        return None

    def discard_up_to(self, step: int) -> None:
        """Delete rescues at or before ``step`` (committed: they can no longer win)."""
        for found in _rescues(self.directory):
            if found.step <= step:
                found.path.unlink(missing_ok=True)


def best_holder(steps: list[int], committed_step: int) -> int | None:
    """The rank whose rescue to restore: the newest step, the lowest rank among equals; None
    when no rank has one newer than the committed step (``-1`` = none on that rank)."""
    best = max(steps, default=-1)
    if best <= committed_step:
        return None
    return steps.index(best)
