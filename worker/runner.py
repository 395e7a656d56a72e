"""The elastic training loop behind ``torchrun ... -m kfp_elastic.worker --model-def pkg.module``.

Every (re)start restores a whole state (model, optimizer, LR scheduler, AMP scaler, data
position, RNG; gathered and restored by ``train_step.TrainStep``): the newest
survivor's rescue (``rescue.py``) or else the committed snapshot, so a membership change moves
model and data together and every sample of every epoch reaches the final model exactly once.
When ranks sync and rank 0 snapshots is ``schedule.py``'s decision. Steps take the next global
batch of the epoch's fixed order, dealt to ranks round-robin; the loss is weighted so that the
gradient does not depend on how many samples each rank got or on the world size
(``train_step.py``: one optimizer step with accumulation, AMP, clipping and the scheduler).
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset, default_collate

from kfp_elastic.etcd.client import connect
from kfp_elastic.job_env import rendezvous_round

from .collective import EXIT_PREEMPTED, gathered, shared
from .data_plan import epoch_order
from .device import (
    Placement,
    init_process_group,
    place_this_process,
    settle,
    to_device,
)
from .ending import END_COMPLETED, END_SIGTERM, now_end, record_end, worker_name
from .model_def import ModelDef, checked_scheduler, load_model_def
from .options import parse_args
from .peer_loss import watch_stalls
from .policy import BatchPolicy, lr_factor, step_shape
from .progress import (
    Committed,
    Manifest,
    Progress,
    commit_with_retry,
    ensure_manifest,
    recorded,
)
from .rescue import Rescues
from .restore import newest_state
from .schedule import SnapshotPolicy, next_sync_step
from .snapshot import Snapshotter
from .train_step import RNG_BY_RANK, TrainStep, restore_rng_state, rng_state

log = logging.getLogger("kfp_elastic.worker")


class Trainer:
    def __init__(self, args: argparse.Namespace, model_def: ModelDef, placement: Placement) -> None:
        self.args = args
        self.md = model_def
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = placement.device
        # One rescue writer per node: the node's ranks hold the same state after a step.
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.policy = BatchPolicy.parse(args.policy)
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
        self.round = rendezvous_round() or 0  # the round this world was formed in (0: unknown)
        self.run_id = run_id
        self.progress: Progress | None = None
        if self.rank == 0:
            client = connect(args.etcd_settings)
            self.progress = Progress(client, args.etcd_settings.run_prefix(run_id))
        self.snapshots = Snapshotter(args.snapshot_dir, args.local_snapshot_dir)
        self.rescues = Rescues(
            args.local_snapshot_dir or args.snapshot_dir, run_id, self.snapshots.buffer
        )
        self.snapshot_policy = SnapshotPolicy(
            args.snapshot_every, args.snapshot_overhead, args.snapshot_max_interval
        )
        self.train_set = model_def.dataset("train")
        self.stop_requested = False
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self.stall = watch_stalls(
            placement.backend, args.collective_abort, args.etcd_settings, run_id
        )
        self.manifest: Manifest = shared(self._manifest() if self.rank == 0 else None)
        base = args.base_world_size or self.world
        self.base_world: int = shared(
            self.progress.base_world_size(base) if self.progress else None
        )
        self.committed: Committed
        self.committed_revision = 0
        self.start: tuple[int, int, int] = (0, 0, 0)  # (step, epoch, position) restored
        self.losses: list[float] = []
        self.model = model_def.model().to(self.device)
        self.optimizer = (
            model_def.optimizer(self.model.parameters())
            if model_def.optimizer
            else torch.optim.SGD(self.model.parameters(), lr=args.lr)
        )
        # Each optimizer step first waits for the last snapshot's copies of what it changes.
        self.snapshots.guard(self.optimizer)
        scheduler = (
            checked_scheduler(model_def.name, model_def.scheduler(self.optimizer), self.optimizer)
            if model_def.scheduler
            else None
        )
        self.stepper = TrainStep(
            self.model,
            self.optimizer,
            scheduler,
            model_def.amp,
            model_def.clip_grad_norm,
            args.nan_policy,
        )
        self._restore()
        self.ddp = DistributedDataParallel(
            self.model, device_ids=[self.device.index] if placement.on_accelerator else None
        )
        self._pending_losses: list[tuple[float, int]] = []  # (this rank's loss sum, batch)
        # What a rescue would hold: the last finished step's position, RNG and batch shape.
        self._finished = self.start
        self._rng_after_step = rng_state()
        self._interval_shape = (0, 0.0)  # (global batch, lr) of the steps since the commit

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self.stop_requested = True

    # -- state --------------------------------------------------------------------------------
    def _manifest(self) -> Manifest:
        assert self.progress is not None
        try:
            return ensure_manifest(
                self.progress,
                len(self.train_set),
                self.args.shard_size,
                self.args.epochs,
                self.args.seed,
                self.args.shuffle,
            )
        except ValueError as error:
            raise ValueError(f"{error} (dataset('train') of {self.md.name})") from None

    def _restore(self) -> None:
        """Restore the newest state any rank has: a survivor's rescue, else the committed one."""
        restored = newest_state(
            self.rank,
            self.world,
            self.progress,
            self.manifest,
            self.snapshots,
            self.rescues,
            reads_rescues=self.local_rank == 0,
        )
        committed, state = restored.committed, restored.state
        self.committed, self.committed_revision = committed, restored.revision
        self.start = (committed.step, committed.epoch, committed.position)
        rng = "fresh"
        if state is not None:
            self.stepper.load_state_dict(state)
            rng = restore_rng_state(state, self.rank, self.world, self.args.seed)
            self.start = (state["step"], state["epoch"], state["position"])
        log.info(
            "restored rank=%d world=%d step=%d epoch=%d position=%d from=%s rng=%s",
            self.rank,
            self.world,
            *self.start,
            restored.source,
            rng,
        )
        if restored.holder is not None:
            assert state is not None
            # Persist + commit it like any snapshot (in the background): until that lands the
            # rescue files stay, so another failure meanwhile finds them again.
            self.losses = list(state.get("losses", ()))
            self._commit(
                *self.start,
                state.get("global_batch", 0),
                state.get("lr", 0.0),
                complete=self.start[1] >= self.manifest.epochs,
                world=state.get("world_size", self.world),
                rescued=True,
            )

    def _state(
        self, step: int, epoch: int, position: int, rng: dict[str, torch.Tensor]
    ) -> dict[str, Any]:
        """The whole training state after ``step``: what snapshots and rescues hold."""
        position_state = {"step": step, "epoch": epoch, "position": position}
        return self.stepper.state_dict() | position_state | rng

    def _commit(
        self,
        step: int,
        epoch: int,
        position: int,
        shape_batch: int,
        lr: float,
        complete: bool = False,
        wait: bool = False,
        world: int = 0,
        rescued: bool = False,
        stopping: bool = False,
    ) -> None:
        losses, self.losses = tuple(self.losses), []
        rng_by_rank = gathered(rng_state())  # every rank's generators, into rank 0's snapshot
        if self.rank != 0:
            return
        state = self._state(step, epoch, position, rng_state()) | {RNG_BY_RANK: rng_by_rank}
        world = world or self.world

        def commit(name: str) -> None:
            new = Committed(
                step,
                epoch,
                position,
                name,
                world,
                shape_batch,
                lr,
                complete,
                losses,
                rescued,
                stopping,
            )
            self._commit_with_retry(new)
            self.rescues.discard_up_to(step)
            log.info(
                "committed step=%d epoch=%d position=%d snapshot=%s world=%d",
                step,
                epoch,
                position,
                name,
                world,
            )

        self.snapshots.save(step, state, commit, wait=wait)

    def _commit_with_retry(self, new: Committed) -> None:
        assert self.progress is not None
        # Stamped with rank 0's time and the world's round, appended to the recent commits:
        # the timeline's numbers come from these, not from when a master saw the commit.
        new = recorded(self.committed, new, self.round, time.time())
        revision = commit_with_retry(
            self.progress, self.manifest, self.committed, self.committed_revision, new
        )
        self.committed, self.committed_revision = new, revision

    # -- training -----------------------------------------------------------------------------
    def run(self) -> int:
        try:
            stopped = self._train()
        except Exception:
            self._write_rescue()
            raise
        finally:
            if self.stall is not None:  # what follows (saving, exit) may take longer than a step
                self.stall.close()
        if stopped:
            if self.stop_requested:  # this node got the SIGTERM (not only agreed to stop)
                self._record_end(END_SIGTERM)
            return EXIT_PREEMPTED
        if self.rank == 0:
            self.snapshots.wait()
            if self.args.output:
                Path(self.args.output).parent.mkdir(parents=True, exist_ok=True)
                weights = {k: v.cpu() for k, v in self.model.state_dict().items()}
                torch.save(weights, self.args.output)
        dist.barrier()
        self.rescues.discard_up_to(self._finished[0])  # the job is complete: none can win
        self._record_end(END_COMPLETED)
        return 0

    def _record_end(self, end: str) -> None:
        """How this node's worker ended, for a master that did not watch (``ending.py``)."""
        worker = worker_name()
        if self.local_rank != 0 or worker is None:
            return
        settings = self.args.etcd_settings
        try:
            client = connect(settings)
        except Exception as error:  # noqa: BLE001 - the pod status may still tell
            log.warning("end not recorded worker=%s error=%r", worker, error)
            return
        try:
            record = now_end(end, self._finished[0], self.round)
            record_end(client, settings.run_prefix(self.run_id), worker, record)
        finally:
            client.close()

    def _train(self) -> bool:
        """Train to the end (False) or to an agreed stop on SIGTERM (True)."""
        step, epoch, position = self.start
        total = self.manifest.num_samples
        if self.committed.complete and self.rank == 0:
            run_id = os.environ.get("TORCHELASTIC_RUN_ID", "?")
            log.warning(
                "run %s is complete already (committed step %d): nothing to train. If this is a "
                "new job, its run id was used by a finished run: choose another --rdzv-id, or "
                "delete that run's keys first: kfp-elastic forget %s --etcd ENDPOINT",
                run_id,
                self.committed.step,
                run_id,
            )
        # The world is fixed for this process's life: the step shape and LR scale once.
        shape = step_shape(
            self.policy,
            self.world,
            self.base_world,
            self.args.batch_size,
            self.md.grad_accumulation,
        )
        self.stepper.lr_scale = lr_factor(shape, self.md.lr_decay, epoch, position, total)
        self._interval_shape = (shape.global_batch, self.stepper.lr)
        every = self.snapshot_policy.every
        sync_at = next_sync_step(step, None, every)
        synced_at, synced_step, snapshot_step = time.monotonic(), step, step
        # Seconds per step of the last few sync intervals; the fastest is the estimate, as a
        # stalled node (or a benchmark's SIGSTOP) must not make the loop look slower.
        recent: collections.deque[float] = collections.deque(maxlen=8)
        while epoch < self.manifest.epochs and not self.committed.complete:
            order = epoch_order(
                self.manifest.shards, epoch, self.manifest.seed, self.manifest.shuffle
            )
            while position < total:
                began = time.monotonic()
                ids = order[position : position + shape.global_batch]
                self.stepper.lr_scale = lr_factor(shape, self.md.lr_decay, epoch, position, total)
                lr = self.stepper.lr  # the scheduler moves it on within the step
                self._train_step(ids, shape.accumulation, step + 1)
                step, position = step + 1, position + len(ids)
                if position >= total:
                    epoch, position = epoch + 1, 0
                    log.info("epoch end rank=%d epoch=%d step=%d", self.rank, epoch - 1, step)
                self._finished = (step, epoch, position)
                self._rng_after_step = rng_state()
                self._interval_shape = (shape.global_batch, lr)
                if self.stall is not None:
                    self.stall.progress()
                done = epoch >= self.manifest.epochs
                stop = False
                if self.args.step_time > 0:
                    time.sleep(max(0.0, self.args.step_time - (time.monotonic() - began)))
                if done or position == 0 or step >= sync_at:
                    proposal = (0, 0)
                    if self.rank == 0:  # only rank 0 snapshots: its clock decides
                        if step > synced_step:
                            recent.append((time.monotonic() - synced_at) / (step - synced_step))
                        step_time = min(recent, default=None)
                        trained_s = (step - snapshot_step) * (step_time or 0.0)
                        due = self.snapshot_policy.due(
                            step, position == 0, trained_s, self.snapshots.last_cost_s
                        )
                        proposal = (int(due), next_sync_step(step, step_time, every))
                    stop, snapshot, sync_at = self._sync(*proposal)
                    if stop and self.stall is not None:
                        self.stall.close()  # the stop is agreed: no collective can hang now
                    if snapshot or stop or done:
                        self._commit(
                            step,
                            epoch,
                            position,
                            *self._interval_shape,
                            complete=done,
                            wait=stop or done,
                            stopping=stop,
                        )
                        snapshot_step = step
                    synced_at, synced_step = time.monotonic(), step
                if stop:
                    log.warning(
                        "stopping on SIGTERM rank=%d step=%d (snapshot committed)", self.rank, step
                    )
                    return True
                if position == 0:
                    break  # a new epoch: its own order
        return False

    def _write_rescue(self) -> None:
        """Training broke (a peer died, mostly): keep the last finished step for the next
        world (``worker/rescue.py``), unless it broke halfway through an optimizer step."""
        step, epoch, position = self._finished
        if self.local_rank != 0:
            return  # local rank 0 of this node writes the node's rescue
        if self.stepper.stepping:
            log.error(
                "training failed inside optimizer.step() rank=%d step=%d: no rescue, "
                "the next world restores the committed snapshot",
                self.rank,
                step + 1,
            )
            return
        batch, lr = self._interval_shape
        # Losses of steps not yet agreed are this rank's estimate of the global-batch mean.
        pending = [round(total * self.world / max(1, n), 6) for total, n in self._pending_losses]
        state = self._state(step, epoch, position, self._rng_after_step) | {
            RNG_BY_RANK: [
                self._rng_after_step if r == self.rank else None for r in range(self.world)
            ],
            "world_size": self.world,
            "global_batch": batch,
            "lr": lr,
            "losses": [*self.losses, *pending],
        }
        try:
            path = self.rescues.write(step, self.rank, state)
        except Exception as error:  # noqa: BLE001 - the original failure is what matters
            log.error("rescue not written rank=%d step=%d error=%r", self.rank, step, error)
            return
        log.warning(
            "training broke; rescued rank=%d step=%d epoch=%d position=%d path=%s",
            self.rank,
            step,
            epoch,
            position,
            path,
        )

    def _fetch(self, ids: list[int]) -> Any:
        """One batch: a dataset's own batched fetch when it has one, else item by item."""
        data = self.train_set
        if isinstance(data, TensorDataset) and self.md.collate is default_collate:
            index = torch.tensor(ids)
            return [tensor[index] for tensor in data.tensors]
        if hasattr(data, "__getitems__") and self.md.collate is default_collate:
            return default_collate(data.__getitems__(ids))
        return self.md.collate([data[i] for i in ids])

    def _sync(self, snapshot: int, next_sync: int) -> tuple[bool, bool, int]:
        """Agree on "stop" (SIGTERM on any rank), learn rank 0's decisions (snapshot now, the
        next sync step) and gather the mean loss of each step since the last sync: one small
        allreduce instead of one per step. Only rank 0 passes non-zero decisions."""
        local = torch.tensor(
            [float(self.stop_requested), float(snapshot), float(next_sync)]
            + [loss for loss, _ in self._pending_losses],
            dtype=torch.float64,
            device=self.device,  # NCCL reduces device tensors only
        )
        dist.all_reduce(local)
        stop, snapshot, next_step, *totals = local.tolist()
        if self.stall is not None:
            self.stall.check()  # an aborted allreduce returns whatever was there
        counts = [count for _, count in self._pending_losses]
        self.losses.extend(
            round(float(total) / max(1, n), 6) for total, n in zip(totals, counts, strict=True)
        )
        self._pending_losses = []
        return stop > 0, snapshot > 0, int(next_step)

    def _train_step(self, ids: list[int], accumulation: int, step: int) -> None:
        """Optimizer step number ``step`` over the global batch ``ids``."""
        summed = self.md.loss_reduction == "sum"
        loss_sum = self.stepper.run(
            self.ddp,
            ids,
            self.rank,
            self.world,
            accumulation,
            lambda part: to_device(self._fetch(part), self.device),
            self.md.loss,
            summed,
            settle=lambda: settle(self.device, self.stall),
            step=step,
        )
        self._pending_losses.append((loss_sum, len(ids)))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=os.environ.get("KFP_ELASTIC_LOG_LEVEL", "INFO"),
        format="[%(asctime)s] worker %(levelname)s %(message)s",
    )
    args = parse_args(argv)
    model_def = load_model_def(args.model_def)
    placement = place_this_process(args.device)
    init_process_group(placement, args.collective_timeout)
    log.info(
        "placed rank=%s local_rank=%s device=%s backend=%s",
        os.environ.get("RANK"),
        os.environ.get("LOCAL_RANK"),
        placement.device,
        placement.backend,
    )
    try:
        return Trainer(args, model_def, placement).run()
    finally:
        if dist.is_initialized():  # an abort already tore the group down
            dist.destroy_process_group()
