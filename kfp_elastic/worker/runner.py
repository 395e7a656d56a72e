"""The ``torchrun ... -m kfp_elastic.worker --model-def pkg.module`` runner: the model
definition's steps driven through the elastic loop the script API runs too (``loop.py``).

Every (re)start restores a whole state (model, optimizer, LR scheduler, AMP scaler, data
position, each rank's RNG; gathered and restored by ``train_step.TrainStep``): the newest
survivor's rescue (``rescue.py``) or else the committed snapshot, so a membership change moves
model and data together and every sample of every epoch reaches the final model exactly once.
Syncs, snapshots/commits, the stop on SIGTERM, the stall abort, rescues and the worker's end
are ``loop.ElasticLoop``'s. This module picks the steps: each takes the next global batch of
the epoch's fixed order, dealt to ranks round-robin; the loss is weighted so that the gradient
does not depend on how many samples each rank got or on the world size (``train_step.py``:
one optimizer step with accumulation, AMP, clipping and the scheduler).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset, default_collate

from kfp_elastic.contract.data_plan import epoch_order, step_batch
from kfp_elastic.worker.collective import EXIT_PREEMPTED, shared
from kfp_elastic.worker.device import Placement, init_process_group, place_this_process, to_device
from kfp_elastic.worker.loop import ElasticLoop
from kfp_elastic.worker.model_def import ModelDef, checked_scheduler, load_model_def
from kfp_elastic.worker.options import RuntimeOptions, parse_args
from kfp_elastic.worker.policy import BatchPolicy, lr_factor, step_shape
from kfp_elastic.worker.sharding import full_model_state, shard_model
from kfp_elastic.worker.train_step import TrainStep

log = logging.getLogger("kfp_elastic.worker")


class Trainer:
    def __init__(self, options: RuntimeOptions, model_def: ModelDef, placement: Placement) -> None:
        self.settings = settings = options.settings
        self.md = model_def
        self.device = placement.device
        self.policy = BatchPolicy.parse(settings.batch_policy)
        self.train_set = model_def.dataset("train")
        self.model = model_def.model().to(self.device)
        if model_def.sharded:  # FSDP2 instead of DDP; the optimizer steps the sharded parameters
            shard_model(self.model, model_def.sharding, model_def.shard, self.device)
        self.optimizer = (
            model_def.optimizer(self.model.parameters())
            if model_def.optimizer
            else torch.optim.SGD(self.model.parameters(), lr=settings.learning_rate)
        )
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
            settings.nan_policy,
        )
        self.loop = ElasticLoop.build(
            self.stepper,
            self.optimizer,
            settings,
            options.etcd,
            backend=placement.backend,
            device=self.device,
        )
        self.rank, self.world = self.loop.rank, self.loop.world
        try:
            self.manifest = self.loop.plan(
                len(self.train_set),
                settings.shard_size,
                settings.epochs,
                settings.seed,
                settings.shuffle,
            )
        except ValueError as error:
            raise ValueError(f"{error} (dataset('train') of {self.md.name})") from None
        progress = self.loop.progress
        base = settings.base_world_size or self.world
        self.base_world: int = shared(progress.base_world_size(base) if progress else None)
        self.loop.restore()
        # What the steps run: the sharded model itself, else the model inside DDP.
        self.ddp: nn.Module = (
            self.model
            if model_def.sharded
            else DistributedDataParallel(
                self.model, device_ids=[self.device.index] if placement.on_accelerator else None
            )
        )

    # -- training -----------------------------------------------------------------------------
    def run(self) -> int:
        try:
            stopped = self._train()
        except Exception:
            self.loop.write_rescue()  # after the stall abort that freed a blocked collective
            raise
        finally:
            self.loop.close_stall()  # what follows (saving, exit) may take longer than a step
        if stopped:
            self.loop.close()
            return EXIT_PREEMPTED
        weights = full_model_state(self.model) if self.md.sharded else self.model.state_dict()
        self.loop.finish(self.settings.output, weights)
        return 0

    def _train(self) -> bool:
        """Train to the end (False) or to an agreed stop on SIGTERM (True)."""
        loop = self.loop
        # The world is fixed for this process's life: the step shape and LR scale once.
        shape = step_shape(
            self.policy,
            self.world,
            self.base_world,
            self.settings.batch_size,
            self.md.grad_accumulation,
        )
        samples = self.manifest.num_samples
        self.stepper.lr_scale = lr_factor(
            shape, self.md.lr_decay, loop.epoch, loop.position, samples
        )
        loop.interval = (shape.global_batch, self.stepper.lr)
        step_time = self.settings.step_time
        while not loop.done:
            epoch = loop.epoch
            order = epoch_order(
                self.manifest.shards, epoch, self.manifest.seed, self.manifest.shuffle
            )
            while loop.epoch == epoch and not loop.done:
                began = time.monotonic()
                ids = step_batch(order, loop.position, shape.global_batch)
                self.stepper.lr_scale = lr_factor(
                    shape, self.md.lr_decay, epoch, loop.position, samples
                )
                lr = self.stepper.lr  # the scheduler moves it on within the step
                step = loop.step + 1  # the number of the step about to run
                if self.md.on_step is not None:
                    self.md.on_step(step)
                loss_sum = self._train_step(ids, shape.accumulation, step)
                if step_time > 0:
                    time.sleep(max(0.0, step_time - (time.monotonic() - began)))
                if loop.counted(shape.global_batch, lr, (loss_sum, len(ids))):
                    return True
        return False

    def _fetch(self, ids: list[int]) -> Any:
        """One batch: a dataset's own batched fetch when it has one, else item by item."""
        data = self.train_set
        if isinstance(data, TensorDataset) and self.md.collate is default_collate:
            index = torch.tensor(ids)
            return [tensor[index] for tensor in data.tensors]
        if hasattr(data, "__getitems__") and self.md.collate is default_collate:
            return default_collate(data.__getitems__(ids))
        return self.md.collate([data[i] for i in ids])

    def _train_step(self, ids: list[int], accumulation: int, step: int) -> float:
        """Optimizer step number ``step`` over the global batch ``ids``: this rank's loss sum."""
        summed = self.md.loss_reduction == "sum"
        return self.stepper.run(
            self.ddp,
            ids,
            self.rank,
            self.world,
            accumulation,
            lambda part: to_device(self._fetch(part), self.device),
            self.md.loss,
            summed,
            settle=self.loop.settle,
            step=step,
        )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=os.environ.get("KFP_ELASTIC_LOG_LEVEL", "INFO"),
        format="[%(asctime)s] worker %(levelname)s %(message)s",
    )
    options = parse_args(argv)
    model_def = load_model_def(options.model_def)
    placement = place_this_process(options.settings.device)
    init_process_group(placement, options.settings.collective_timeout)
    log.info(
        "placed rank=%s local_rank=%s device=%s backend=%s",
        os.environ.get("RANK"),
        os.environ.get("LOCAL_RANK"),
        placement.device,
        placement.backend,
    )
    try:
        return Trainer(options, model_def, placement).run()
    finally:
        if dist.is_initialized():  # an abort already tore the group down
            dist.destroy_process_group()
