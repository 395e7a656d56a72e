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
  order (``worker/data_plan.py``, the shard manifest in etcd) from the committed position: step
  after step the next ``batch_size x world`` sample ids, round-robin over the ranks. Like
  DLRover's ``ElasticDistributedSampler``, it resumes mid-epoch at the sample where the state
  was saved, whatever the new world size, so every sample is trained on once per epoch.
* ``commit(loss)`` after each optimizer step checks this rank's loss (a NaN/inf one raises
  ``NonFiniteLoss`` naming the step and rank under ``KFP_ELASTIC_NAN_POLICY=fail``, the
  default; ``skip`` only logs it, the script having stepped already), counts the step,
  snapshots when due (rank 0 writes, in the background; etcd records the step and data
  position) and, when any rank got SIGTERM, makes every rank stop at the same step after a
  committed snapshot: nothing trained is lost. An uncaught exception (a peer died) first
  writes this rank's rescue: the state after its last counted step, which the next world
  restores when it is the newest. Under NCCL a rank blocked in a collective whose peer died is
  freed first: the same stall abort as the runtime's (``worker/device.py``,
  ``worker/peer_loss.py``), started by SIGTERM or the round breaking; each
  ``optimizer.step()`` then waits for the gradients' allreduce and raises
  ``CollectiveAborted`` instead of applying partial gradients.
* On a GPU a snapshot's copies of the parameters and optimizer state overlap the next forward
  and backward; ``optimizer.step()`` first waits for them (a step pre-hook,
  ``Snapshotter.guard``). Change parameters only in ``optimizer.step()`` (not between
  ``commit()`` and the next step), or a snapshot may hold the changed values.

Settings come from the environment the master sets (``kfp_elastic/job_env.py``); under a plain
``torchrun --rdzv-backend=elastic-etcd`` the rendezvous plugin gives the etcd connection and
``KFP_ELASTIC_SNAPSHOT_DIR`` (or ``State(snapshot_dir=...)``) says where snapshots go.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset, default_collate
from torch.utils.hooks import RemovableHandle

from kfp_elastic.etcd.client import connect
from kfp_elastic.etcd.settings import EtcdSettings
from kfp_elastic.job_env import SNAPSHOT_DIR_ENV, JobEnv

from .collective import EXIT_PREEMPTED, gathered, group_device, shared
from .data_plan import epoch_order, step_ids, steps_left
from .device import nccl_error_handling_not_set, settle
from .finite_loss import NonFiniteLoss, skips_step
from .peer_loss import watch_stalls
from .progress import INITIAL, Committed, Manifest, Progress, commit_with_retry, ensure_manifest
from .rescue import Rescues
from .restore import newest_state
from .schedule import SnapshotPolicy, next_sync_step
from .snapshot import Snapshotter
from .train_step import RNG_BY_RANK, restore_rng_state, rng_state

__all__ = ["EXIT_PREEMPTED", "DataLoader", "ElasticSampler", "NonFiniteLoss", "State"]

log = logging.getLogger("kfp_elastic.worker.elastic")


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP (its state_dict keys have no ``module.`` prefix)."""
    return getattr(model, "module", model)


class State:
    """What a script trains, with its data position: restored, snapshotted and rescued."""

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
        self.settings = settings or JobEnv.from_env()
        directory = str(snapshot_dir or self.settings.snapshot_dir)
        if not directory or directory == "None":
            raise ValueError(
                f"no snapshot directory: set {SNAPSHOT_DIR_ENV} (the master does) or pass "
                "State(snapshot_dir=...)"
            )
        if not self.settings.run_id:
            raise ValueError("no run id: run under torchrun (TORCHELASTIC_RUN_ID) or the master")
        self.model, self.optimizer, self.scheduler, self.extra = model, optimizer, scheduler, extra
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.step = self.epoch = self.position = 0
        self.snapshots = Snapshotter(directory)
        # Each optimizer step first waits for the last snapshot's copies of what it changes.
        self.snapshots.guard(optimizer)
        self.rescues = Rescues(directory, self.settings.run_id, self.snapshots.buffer)
        every = self.settings.snapshot_every or None  # 0: auto
        self.snapshot_policy = SnapshotPolicy(every)
        self.progress: Progress | None = None
        if self.rank == 0:
            etcd = EtcdSettings.from_env()
            self.progress = Progress(connect(etcd), etcd.run_prefix(self.settings.run_id))
        self.manifest: Manifest | None = None
        self._dataset_length: int | None = None
        self._committed, self._revision = INITIAL, 0
        self._restored = False
        self._rng_restored = "fresh"  # how this rank's generators were restored (for the log)
        self._stop_requested = False
        self._in_commit = False
        self._rng = rng_state()  # this rank's generators after its last counted step
        self._sync_at = 0
        self._synced = (time.monotonic(), 0)  # (when, step) of the last sync
        self._snapshot_step = 0
        self._step_times: collections.deque[float] = collections.deque(maxlen=8)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        # NCCL: a collective whose peer died is aborted (after SIGTERM or when the round breaks,
        # ``worker/peer_loss.py``) so that the rescue below gets written; an optimizer step
        # first waits for the gradients' allreduce and refuses partial ones.
        nccl = _nccl()
        if nccl and (problem := nccl_error_handling_not_set(os.environ)) is not None:
            log.warning("%s", problem)
        self.stall = watch_stalls(
            dist.get_backend(),
            self.settings.collective_abort,
            EtcdSettings.from_env() if nccl else None,
            self.settings.run_id,
        )
        self._settle_hook: RemovableHandle | None = None
        if self.stall is not None:
            stall = self.stall
            self._settle_hook = optimizer.register_step_pre_hook(
                lambda *_: settle(_collective_device(), stall)
            )
        previous_hook = sys.excepthook

        def rescue_then_report(kind: type, error: BaseException, trace: Any) -> None:
            self._write_rescue()
            previous_hook(kind, error, trace)

        sys.excepthook = rescue_then_report

    # -- what a script calls ------------------------------------------------------------------
    @property
    def global_batch_size(self) -> int:
        """Samples per step over all ranks: ``batch_size`` per rank of this world."""
        return self.settings.batch_size * self.world

    def epochs(self) -> Iterator[int]:
        """The epochs left to train (restores the state on first use)."""
        self._ensure_restored()
        assert self.manifest is not None
        while self.epoch < self.manifest.epochs:
            yield self.epoch

    def commit(self, loss: float | torch.Tensor | None = None) -> None:
        """Call once after each optimizer step: counts it (and its samples), snapshots when due,
        and exits the process (status 143) after a committed snapshot when a rank got SIGTERM.
        ``loss``, this rank's loss of the step, is checked first: a NaN/inf one raises
        ``NonFiniteLoss`` (naming the step and rank) unless the job's nan policy is ``skip``."""
        assert self.manifest is not None, "iterate state.epochs() first"
        if loss is not None:
            value = float(loss.item() if isinstance(loss, torch.Tensor) else loss)
            if skips_step(value, self.step + 1, self.rank, self.settings.nan_policy):
                log.warning(
                    "non-finite loss step=%d rank=%d loss=%s", self.step + 1, self.rank, value
                )
        total = self.manifest.num_samples
        self.step += 1
        self.position += min(self.global_batch_size, total - self.position)
        epoch_end = self.position >= total
        if epoch_end:
            self.epoch, self.position = self.epoch + 1, 0
        self._rng = rng_state()
        if self.stall is not None:
            self.stall.progress()
        done = self.epoch >= self.manifest.epochs
        if not (done or epoch_end or self.step >= self._sync_at):
            return
        stop, snapshot = self._sync(epoch_end)
        if stop:
            self._close_stall()  # the stop is agreed: no collective can hang now
        if snapshot or stop or done:
            self._snapshot(complete=done, wait=stop or done, stopping=stop)
        if stop:
            log.warning(
                "stopping on SIGTERM rank=%d step=%d (snapshot committed)", self.rank, self.step
            )
            self.close()
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            raise SystemExit(EXIT_PREEMPTED)

    def finish(self) -> None:
        """The end of training: rank 0 waits for the last snapshot and writes the final model
        to ``$KFP_ELASTIC_OUTPUT`` (``torch.save`` of the model's ``state_dict``)."""
        self._close_stall()  # saving and the final barrier may take longer than a step
        if self.rank == 0:
            self.snapshots.wait()
            if self.settings.output:
                Path(self.settings.output).parent.mkdir(parents=True, exist_ok=True)
                torch.save(_unwrapped(self.model).state_dict(), self.settings.output)
        dist.barrier()
        self.rescues.discard_up_to(self.step)  # the job is complete: none can win
        self.close()

    def close(self) -> None:
        """Release rank 0's etcd connection once no snapshot is in flight (``finish`` and the
        SIGTERM exit call it; safe to call again)."""
        self._close_stall()
        if self.progress is not None:
            self.snapshots.wait()
            with contextlib.suppress(Exception):
                self.progress.close()
            self.progress = None

    def _close_stall(self) -> None:
        if self.stall is not None:
            self.stall.close()
        if self._settle_hook is not None:
            self._settle_hook.remove()
            self._settle_hook = None

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

    # -- restore ------------------------------------------------------------------------------
    def _ensure_restored(self) -> None:
        if self._restored:
            return
        if self._dataset_length is None:
            raise RuntimeError("make the loader (elastic.DataLoader / ElasticSampler) first")
        s = self.settings
        self.manifest = shared(
            ensure_manifest(self.progress, self._dataset_length, 0, s.epochs, s.seed, s.shuffle)
            if self.progress
            else None
        )
        self._restore()
        self._restored = True

    def _restore(self) -> None:
        """The newest state any rank has: a survivor's rescue, else the committed snapshot."""
        assert self.manifest is not None
        restored = newest_state(
            self.rank, self.world, self.progress, self.manifest, self.snapshots, self.rescues
        )
        committed = restored.committed
        self._committed, self._revision = committed, restored.revision
        self.step, self.epoch, self.position = committed.step, committed.epoch, committed.position
        if restored.state is not None:
            self._load(restored.state)
        self._snapshot_step = self.step
        self._sync_at = next_sync_step(self.step, None, self.snapshot_policy.every)
        log.info(
            "restored rank=%d world=%d step=%d epoch=%d position=%d from=%s rng=%s",
            self.rank,
            self.world,
            self.step,
            self.epoch,
            self.position,
            restored.source,
            self._rng_restored,
        )
        if restored.holder is not None:  # persist + commit it like any snapshot, in background
            self._snapshot(complete=False, wait=False, rescued=True)

    def _state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "model": _unwrapped(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "extra": {name: obj.state_dict() for name, obj in self.extra.items()},
            "step": self.step,
            "epoch": self.epoch,
            "position": self.position,
            **self._rng,
            "world_size": self.world,
            "global_batch": self.global_batch_size,
        }
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def _load(self, state: dict[str, Any]) -> None:
        _unwrapped(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        for name, obj in self.extra.items():
            if name in state.get("extra", {}):
                obj.load_state_dict(state["extra"][name])
        self._rng_restored = restore_rng_state(state, self.rank, self.world, self.settings.seed)
        self._rng = rng_state()
        self.step, self.epoch, self.position = state["step"], state["epoch"], state["position"]

    # -- sync, snapshot, rescue -----------------------------------------------------------------
    def _on_sigterm(self, signum: int, frame: object) -> None:
        self._stop_requested = True

    def _sync(self, epoch_end: bool) -> tuple[bool, bool]:
        """Agree on "stop" (SIGTERM on any rank) and learn rank 0's decisions (snapshot now, the
        next sync step): one small allreduce every ~0.5 s of training."""
        decisions = (0, 0)
        if self.rank == 0:  # only rank 0 snapshots: its clock decides
            when, step = self._synced
            if self.step > step:
                self._step_times.append((time.monotonic() - when) / (self.step - step))
            step_time = min(self._step_times, default=None)
            trained_s = (self.step - self._snapshot_step) * (step_time or 0.0)
            due = self.snapshot_policy.due(
                self.step, epoch_end, trained_s, self.snapshots.last_cost_s
            )
            decisions = (int(due), next_sync_step(self.step, step_time, self.snapshot_policy.every))
        flags = torch.tensor(
            [float(self._stop_requested), *map(float, decisions)], dtype=torch.float64
        ).to(_collective_device())
        dist.all_reduce(flags)
        stop, snapshot, sync_at = (float(x) for x in flags.cpu().tolist())
        if self.stall is not None:
            self.stall.check()  # an aborted allreduce returns whatever was there
        self._sync_at = int(sync_at)
        self._synced = (time.monotonic(), self.step)
        return stop > 0, snapshot > 0

    def _snapshot(
        self, *, complete: bool, wait: bool, rescued: bool = False, stopping: bool = False
    ) -> None:
        self._snapshot_step = self.step
        rng_by_rank = gathered(self._rng)  # every rank's generators, into rank 0's snapshot
        if self.rank != 0:
            return
        assert self.manifest is not None
        new = Committed(
            self.step,
            self.epoch,
            self.position,
            world_size=self.world,
            global_batch=self.global_batch_size,
            complete=complete,
            rescued=rescued,
            stopping=stopping,
        )

        def commit(name: str) -> None:
            assert self.progress is not None and self.manifest is not None
            named = replace(new, snapshot=name)
            revision = commit_with_retry(
                self.progress, self.manifest, self._committed, self._revision, named
            )
            self._committed, self._revision = named, revision
            self.rescues.discard_up_to(named.step)
            log.info(
                "committed step=%d epoch=%d position=%d snapshot=%s world=%d",
                named.step,
                named.epoch,
                named.position,
                name,
                named.world_size,
            )

        state = self._state() | {RNG_BY_RANK: rng_by_rank}
        self.snapshots.save(self.step, state, commit, wait=wait)

    def _write_rescue(self) -> None:
        """Training broke (a peer died, mostly): keep this rank's last counted step for the
        next world (``worker/rescue.py``). ``commit()`` follows ``optimizer.step()``, and peers'
        failures surface in collectives (forward, backward, sync), never between the two."""
        if not self._restored or self.manifest is None:
            return
        try:
            own = [self._rng if r == self.rank else None for r in range(self.world)]
            path = self.rescues.write(self.step, self.rank, self._state() | {RNG_BY_RANK: own})
        except Exception as error:  # noqa: BLE001 - the original failure is what matters
            log.error("rescue not written rank=%d step=%d error=%r", self.rank, self.step, error)
            return
        log.warning(
            "training broke; rescued rank=%d step=%d epoch=%d position=%d path=%s",
            self.rank,
            self.step,
            self.epoch,
            self.position,
            path,
        )


def _show_logs() -> None:
    """A script that configured no logging still shows what happened to its state (restored,
    committed, stopping, rescued): the lines the master's worker logs are read for."""
    if logging.getLogger().handlers or log.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s] elastic %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(os.environ.get("KFP_ELASTIC_LOG_LEVEL", "INFO").upper())
    log.propagate = False


def _nccl() -> bool:
    return dist.get_backend() == "nccl"


def _collective_device() -> torch.device:
    """Where this process's collective tensors live: NCCL reduces device tensors only."""
    return group_device()


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
