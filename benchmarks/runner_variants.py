"""Ablations for ``benchmarks/elastic_runtime.py --ablate``: ``worker.runner`` with candidate fixes
patched in at run time. NOT the runtime, and not all of them keep its guarantees (see ``noreduce``):
they only show how much each cost is worth.

    torchrun ... benchmarks/runner_variants.py --model-def ... (the runner's own arguments)

``$RUNNER_FIXES`` is a comma-separated subset of:

``nosleep``    skip ``time.sleep()`` when there is nothing to wait (``--step-time 0``); today the
               loop calls ``time.sleep(0.0)`` every step, which gives the CPU away.
``noreduce``   no per-step ``all_reduce`` of (loss, stop flag): the loss stays local and SIGTERM is
               not agreed on. Upper bound of a fix that agrees on "stop" and reduces the losses
               only at commit steps (one small all_reduce per snapshot instead of per step).
``writer``     one long-lived snapshot writer thread fed by a queue instead of a new
               ``threading.Thread`` per snapshot (``Thread.start()`` waits until the new thread
               has run, i.e. has taken the GIL, which on a busy CPU is a scheduling round).
``placement``  ``Progress.commit`` computes shard-queue moves only for the epochs between the old
               and the new committed position instead of for every epoch of the job (today's cost
               grows with ``--epochs``).
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script by torchrun

import torch  # noqa: E402

from worker import progress as progress_module  # noqa: E402
from worker import runner  # noqa: E402
from worker.snapshot import Snapshotter, _to_cpu  # noqa: E402

FIXES = {f.strip() for f in os.environ.get("RUNNER_FIXES", "").split(",") if f.strip()}
KNOWN = {"nosleep", "noreduce", "writer", "placement"}
if FIXES - KNOWN:
    raise SystemExit(f"unknown RUNNER_FIXES {sorted(FIXES - KNOWN)}; known: {sorted(KNOWN)}")


class _Time:
    monotonic = staticmethod(time.monotonic)

    @staticmethod
    def sleep(seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


def _train_step_noreduce(self: runner.Trainer, ids: list[int], accumulation: int) -> bool:
    """``Trainer._train_step`` without the final all_reduce (everything else unchanged)."""
    mine = ids[self.rank::self.world]
    chunk = -(-len(mine) // accumulation) if mine else 0
    loss_sum = torch.zeros(())
    for micro in range(accumulation):
        part = mine[micro * chunk:(micro + 1) * chunk] if chunk else []
        last = micro == accumulation - 1
        if not part and not last:
            continue
        with (self.ddp.no_sync() if not last else contextlib.nullcontext()):
            if part:
                batch = self.md.collate([self.train_set[i] for i in part])
                loss = self.md.loss(self.ddp, batch)
                weight = (self.world if self.md.loss_reduction == "sum"
                          else self.world * len(part) / len(ids))
                (loss * weight).backward()
                per_sample = loss.detach() * (1 if self.md.loss_reduction == "sum"
                                              else len(part))
                loss_sum += per_sample
            else:
                sum(p.sum() * 0 for p in self.ddp.parameters()).backward()
    self.optimizer.step()
    self.optimizer.zero_grad(set_to_none=True)
    self.losses.append(round(float(loss_sum) * self.world / max(1, len(ids)), 6))
    return bool(self.stop_requested)


class QueuedSnapshotter(Snapshotter):
    """Same contract as Snapshotter (one snapshot in flight), one long-lived writer thread."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        threading.Thread(target=self._loop, daemon=True, name="snapshot-writer").start()

    def save(self, step: int, state: dict[str, Any], on_persisted: Any,
             wait: bool = False) -> None:
        self.wait()
        cpu_state = _to_cpu(state)
        self._idle.clear()
        self._queue.put((step, cpu_state, on_persisted))
        if wait:
            self.wait()

    def wait(self) -> None:
        self._idle.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _loop(self) -> None:
        while True:
            step, state, on_persisted = self._queue.get()
            self._write(step, state, on_persisted)
            self._idle.set()


def _queue_moves_changed_epochs(self: progress_module.Progress, manifest: Any, old: Any,
                                new: Any) -> list:
    """``Progress._queue_moves`` over the epochs whose queues can differ between old and new."""
    if old.complete or new.complete:
        epochs = range(manifest.epochs)
    else:
        epochs = range(min(old.epoch, new.epoch), min(max(old.epoch, new.epoch) + 1,
                                                      manifest.epochs))
    tx = self._client.transactions
    sizes = {s.shard_id: s.size for s in manifest.shards}

    def placement(at: Any) -> dict:
        out = {}
        for epoch in epochs:
            position = (manifest.num_samples if epoch < at.epoch or at.complete
                        else at.position if epoch == at.epoch else 0)
            queues = manifest.queues(epoch, position)
            consumed = 0
            for shard_id in manifest.visit_order(epoch):
                begins, consumed = consumed, consumed + sizes[shard_id]
                state = ("done" if shard_id in queues.done else
                         "doing" if shard_id in queues.doing else "todo")
                out[(epoch, shard_id)] = (state, max(0, min(position, consumed) - begins)
                                          if state == "doing" else 0)
        return out

    before, after = placement(old), placement(new)
    ops: list = []
    for (epoch, shard_id), (state, consumed) in after.items():
        old_state = before.get((epoch, shard_id), ("todo", 0))
        if old_state == (state, consumed):
            continue
        if old_state[0] != state:
            ops.append(tx.delete(self.keys.queue(epoch, old_state[0], shard_id)))
        value = (progress_module.json.dumps({"consumed": consumed}) if state == "doing"
                 else "{}")
        ops.append(tx.put(self.keys.queue(epoch, state, shard_id), value))
    return ops


if "nosleep" in FIXES:
    runner.time = _Time  # type: ignore[assignment]
if "noreduce" in FIXES:
    runner.Trainer._train_step = _train_step_noreduce  # type: ignore[method-assign]
if "writer" in FIXES:
    runner.Snapshotter = QueuedSnapshotter  # type: ignore[misc]
if "placement" in FIXES:
    progress_module.Progress._queue_moves = _queue_moves_changed_epochs  # type: ignore[method-assign]

if __name__ == "__main__":
    from worker.model_def import ModelDefError

    try:
        sys.exit(runner.main(sys.argv[1:]))
    except ModelDefError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
