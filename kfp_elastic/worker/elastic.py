"""Elastic training for your own DDP script: 0-step-loss preemption and exactly-once data.

Five added lines make a DDP script (e.g. pytorch/examples' DDP tutorial) elastic::

    from kfp_elastic.worker import elastic

    state = elastic.State(model=ddp_model, optimizer=optimizer, scheduler=scheduler)  # 1
    loader = elastic.DataLoader(dataset, state)                                       # 2
    for epoch in state.epochs():                                                      # 3
        for batch in loader:
            ...  # forward, backward, optimizer.step() as before
            state.commit()                                                            # 4
    state.finish()                                                                    # 5

* ``State`` registers what training needs to continue (model, optimizer, LR scheduler and any
  ``**extra`` object with ``state_dict``/``load_state_dict``, e.g. an AMP ``GradScaler``) and,
  on the first ``epochs()``, restores the newest state any rank has: a survivor's rescue
  (``worker/rescue.py``) or the committed snapshot (``worker/snapshot.py``), with the data
  position and the RNG. Like Elastic Horovod's ``hvd.elastic.State``, but the state lives in
  snapshot files and etcd, so it survives losing every node.
* ``ElasticSampler`` (what ``DataLoader`` uses as its batch sampler) deals the epoch's fixed
  order (``contract/data_plan.py``, the shard manifest in etcd) from the committed position: step
  after step the next ``batch_size x world`` sample ids, round-robin over the ranks. Like
  DLRover's ``ElasticDistributedSampler``, it resumes mid-epoch at the sample where the state
  was saved, whatever the new world size, so every sample is trained on once per epoch.
* ``commit(loss)`` after each optimizer step checks this rank's loss (a NaN/inf one raises
  ``NonFiniteLoss`` naming the step and rank under ``KFP_ELASTIC_NAN_POLICY=fail``, the
  default; ``skip`` only logs it, the script having stepped already), counts the step,
  snapshots when due (rank 0 writes, in the background; etcd records the step and data
  position) and, when any rank got SIGTERM, makes every rank stop at the same step after a
  committed snapshot: nothing trained is lost. An uncaught exception (a peer died) first
  writes the node's rescue (local rank 0's): the state after its last counted step, which the
  next world restores when it is the newest (none when it came between an
  ``optimizer.step()`` and its ``commit()``: the parameters are then ahead of the counted
  step). Under NCCL a rank blocked
  in a collective whose peer died is freed first: the same stall abort as the runtime's
  (``worker/device.py``, ``worker/peer_loss.py``), started by SIGTERM or the round breaking; each
  ``optimizer.step()`` then waits for the gradients' allreduce and raises
  ``CollectiveAborted`` instead of applying partial gradients.
* On a GPU a snapshot's copies of the parameters and optimizer state overlap the next forward
  and backward; ``optimizer.step()`` first waits for them (a step pre-hook,
  ``Snapshotter.guard``). Change parameters only in ``optimizer.step()`` (not between
  ``commit()`` and the next step), or a snapshot may hold the changed values.

The restore, syncs, snapshots, the stop, the abort, rescues and the worker's end are the
elastic loop the ``--model-def`` runner runs too (``worker/loop.py``).

Settings come from the environment the master sets (``kfp_elastic/job_env.py``); under a plain
``torchrun --rdzv-backend=elastic-etcd`` the rendezvous plugin gives the etcd connection and
``KFP_ELASTIC_SNAPSHOT_DIR`` (or ``State(snapshot_dir=...)``) says where snapshots go.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset, default_collate
from torch.utils.hooks import RemovableHandle

from kfp_elastic.contract.data_plan import epoch_order, step_ids, steps_left
from kfp_elastic.contract.nccl_env import nccl_error_handling_not_set
from kfp_elastic.etcd.settings import EtcdSettings
from kfp_elastic.job_env import SNAPSHOT_DIR_ENV, JobEnv
from kfp_elastic.worker.collective import EXIT_PREEMPTED, group_device
from kfp_elastic.worker.device import StallAbort
from kfp_elastic.worker.finite_loss import NonFiniteLoss, skips_non_finite
from kfp_elastic.worker.loop import ElasticLoop
from kfp_elastic.worker.progress import Manifest
from kfp_elastic.worker.sharding import (
    full_model_state,
    is_sharded,
    load_sharded_state,
    sharded_state,
)

__all__ = ["EXIT_PREEMPTED", "DataLoader", "ElasticSampler", "NonFiniteLoss", "State"]

log = logging.getLogger("kfp_elastic.worker.elastic")


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP (its state_dict keys have no ``module.`` prefix)."""
    return getattr(model, "module", model)


class _ScriptState:
    """What a script registered (``loop.Trained``): model, optimizer, scheduler and extras.
    ``stepping`` from the start of an ``optimizer.step()`` to its ``commit()``: the parameters
    are then ahead of the counted step, and a rescue of them would count a step's samples
    twice."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        extra: dict[str, Any],
    ) -> None:
        self.model, self.optimizer, self.scheduler, self.extra = model, optimizer, scheduler, extra
        self.stepping = False
        self.sharded = is_sharded(model)  # FSDP2: every rank holds its own shards

    def state_dict(self) -> dict[str, Any]:
        if self.sharded:  # this rank's shards, keyed by name (``sharding.py``)
            state: dict[str, Any] = sharded_state(self.model, self.optimizer)
        else:
            state = {
                "model": _unwrapped(self.model).state_dict(),
                "optimizer": self.optimizer.state_dict(),
            }
        state["extra"] = {name: obj.state_dict() for name, obj in self.extra.items()}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.sharded:
            load_sharded_state(self.model, self.optimizer, state)
        else:
            _unwrapped(self.model).load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        for name, obj in self.extra.items():
            if name in state.get("extra", {}):
                obj.load_state_dict(state["extra"][name])


class State:
    """What a script trains, with its data position: restored, snapshotted and rescued by the
    elastic loop the ``--model-def`` runner runs too (``worker/loop.py``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        *,
        settings: JobEnv | None = None,
        snapshot_dir: str | os.PathLike[str] | None = None,
        **extra: Any,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("call dist.init_process_group() before elastic.State(...)")
        _show_logs()
        settings = settings or JobEnv.from_env()
        directory = str(snapshot_dir or settings.snapshot_dir)
        if not directory or directory == "None":
            raise ValueError(
                f"no snapshot directory: set {SNAPSHOT_DIR_ENV} (the master does) or pass "
                "State(snapshot_dir=...)"
            )
        self.settings = replace(settings, snapshot_dir=directory)
        if not self.settings.run_id:
            raise ValueError("no run id: run under torchrun (TORCHELASTIC_RUN_ID) or the master")
        self.model, self.optimizer, self.scheduler, self.extra = model, optimizer, scheduler, extra
        self._trained = _ScriptState(model, optimizer, scheduler, extra)
        nccl = _nccl()
        if nccl and (problem := nccl_error_handling_not_set(os.environ)) is not None:
            log.warning("%s", problem)
        self.loop = ElasticLoop.build(
            self._trained,
            optimizer,
            self.settings,
            EtcdSettings.from_env(),
            backend=dist.get_backend(),
            device=group_device(),
        )
        self.rank, self.world = self.loop.rank, self.loop.world
        self._dataset_length: int | None = None
        # NCCL: an optimizer step first waits for the gradients' allreduce and refuses partial
        # ones (an aborted collective's); the hook runs before the one that marks the step.
        self._hooks: list[RemovableHandle] = []
        if self.stall is not None:
            self._hooks.append(optimizer.register_step_pre_hook(lambda *_: self.loop.settle()))
        self._hooks.append(optimizer.register_step_pre_hook(self._stepping))
        previous_hook = sys.excepthook

        def rescue_then_report(kind: type, error: BaseException, trace: Any) -> None:
            self.loop.write_rescue()
            previous_hook(kind, error, trace)

        sys.excepthook = rescue_then_report

    def _stepping(self, *_: Any) -> None:
        self._trained.stepping = True

    # -- the loop's view ----------------------------------------------------------------------
    @property
    def stall(self) -> StallAbort | None:
        return self.loop.stall

    @property
    def manifest(self) -> Manifest | None:
        return self.loop.manifest

    @property
    def step(self) -> int:
        """Optimizer steps counted so far (over every world of the run)."""
        return self.loop.step

    @property
    def epoch(self) -> int:
        return self.loop.epoch

    @property
    def position(self) -> int:
        """Samples of the current epoch trained (by every rank together)."""
        return self.loop.position

    # -- what a script calls ------------------------------------------------------------------
    @property
    def global_batch_size(self) -> int:
        """Samples per step over all ranks: ``batch_size`` per rank of this world."""
        return self.settings.batch_size * self.world

    def epochs(self) -> Iterator[int]:
        """The epochs left to train (restores the state on first use)."""
        self._ensure_restored()
        while not self.loop.done:
            yield self.epoch

    def commit(self, loss: float | torch.Tensor | None = None) -> None:
        """Call once after each optimizer step: counts it (and its samples), snapshots when due,
        and exits the process (status 143) after a committed snapshot when a rank got SIGTERM.
        ``loss``, this rank's loss of the step, is checked first: a NaN/inf one raises
        ``NonFiniteLoss`` (naming the step and rank) unless the job's nan policy is ``skip``."""
        assert self.manifest is not None, "iterate state.epochs() first"
        if loss is not None:
            value = float(loss.item() if isinstance(loss, torch.Tensor) else loss)
            skips_non_finite(value, self.step + 1, self.rank, self.settings.nan_policy)
        lr = float(self.optimizer.param_groups[0]["lr"]) if self.optimizer.param_groups else 0.0
        self._trained.stepping = False  # counted now: the parameters are the step's
        if not self.loop.counted(self.global_batch_size, lr):
            return
        self.close()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        raise SystemExit(EXIT_PREEMPTED)

    def finish(self) -> None:
        """The end of training: rank 0 waits for the last snapshot and writes the final model
        to ``$KFP_ELASTIC_OUTPUT`` (``torch.save`` of the model's ``state_dict``)."""
        self._remove_hooks()
        if self._trained.sharded:  # the whole model, gathered from every rank's shards
            weights = full_model_state(self.model)
        else:
            weights = _unwrapped(self.model).state_dict()
        self.loop.finish(self.settings.output, weights)

    def close(self) -> None:
        """Release rank 0's etcd connection once no snapshot is in flight (``finish`` and the
        SIGTERM exit call it; safe to call again)."""
        self._remove_hooks()
        self.loop.close()

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # -- the data plan ------------------------------------------------------------------------
    def _attach_dataset(self, length: int) -> None:
        if self._dataset_length not in (None, length):
            raise ValueError("one State trains one dataset")
        self._dataset_length = length

    def batches(self) -> Iterator[list[int]]:
        """This rank's sample ids of each step left in the current epoch."""
        self._ensure_restored()
        assert self.manifest is not None
        m = self.manifest
        order = epoch_order(m.shards, self.epoch, m.seed, m.shuffle)
        batch = self.global_batch_size
        for start in range(self.position, m.num_samples, batch):
            yield step_ids(order, start, batch, self.world, self.rank)

    def steps_left_in_epoch(self) -> int:
        assert self.manifest is not None
        return steps_left(self.manifest.num_samples, self.position, self.global_batch_size)

    def _ensure_restored(self) -> None:
        if self.loop.restored:
            return
        if self._dataset_length is None:
            raise RuntimeError("make the loader (elastic.DataLoader / ElasticSampler) first")
        s = self.settings
        self.loop.plan(self._dataset_length, 0, s.epochs, s.seed, s.shuffle)
        self.loop.restore()


def _show_logs() -> None:
    """A script that configured no logging still shows what happened to its state (restored,
    committed, stopping, rescued): the lines the master's worker logs are read for. They come
    from the worker's loggers (``kfp_elastic.worker``: ``loop.py``'s, this module's and those of
    the modules the loop uses)."""
    worker = logging.getLogger("kfp_elastic.worker")
    if logging.getLogger().handlers or worker.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s] elastic %(levelname)s %(message)s"))
    worker.addHandler(handler)
    worker.setLevel(os.environ.get("KFP_ELASTIC_LOG_LEVEL", "INFO").upper())
    worker.propagate = False


def _nccl() -> bool:
    return dist.get_backend() == "nccl"


class ElasticSampler:
    """A batch sampler: this rank's sample ids of each remaining step of the current epoch,
    from the state's data position (``State.batches``). A rank whose share of an epoch's last,
    short step is empty gets an empty batch: it must still run its step (DDP's allreduce)."""

    def __init__(self, dataset_length: int, state: State) -> None:
        self.state = state
        state._attach_dataset(dataset_length)

    def __iter__(self) -> Iterator[list[int]]:
        return self.state.batches()

    def __len__(self) -> int:
        self.state._ensure_restored()
        return self.state.steps_left_in_epoch()


def DataLoader(  # noqa: N802 - a drop-in for torch's class
    dataset: Dataset, state: State, collate_fn: Callable[[list], Any] | None = None, **kwargs: Any
) -> TorchDataLoader:
    """``torch.utils.data.DataLoader`` over ``ElasticSampler`` (batches of the job's
    ``batch_size`` per rank); ``kwargs`` as torch's (``num_workers``, ``pin_memory``, ...)."""
    collate = collate_fn or default_collate

    def collate_or_empty(samples: list) -> Any:
        if samples:
            return collate(samples)
        return _emptied(collate([dataset[0]]))  # same structure, no samples

    return TorchDataLoader(
        dataset,
        batch_sampler=ElasticSampler(len(dataset), state),  # type: ignore[arg-type]
        collate_fn=collate_or_empty,
        **kwargs,
    )


def _emptied(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, dict):
        return {k: _emptied(v) for k, v in batch.items()}
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        return type(batch)(_emptied(v) for v in batch)  # type: ignore[call-arg]
    return batch
