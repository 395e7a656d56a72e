"""The elastic loop both ways of training run: the ``--model-def`` runner (``worker/runner.py``)
and the script API (``worker/elastic.py``) drive one ``ElasticLoop`` each.

What a worker process does around its optimizer steps lives here, once:

* **restore** the newest state any rank has (``restore.py``: a survivor's rescue, else the
  committed snapshot), with the data position and each rank's own random generators
  (``train_step.restore_rng_state``), and commit a restored rescue like any snapshot;
* **count** each finished step (data position, generators, the stall abort's progress) and, at
  a **sync** (``schedule.py``: one small allreduce), agree on "stop" and learn rank 0's
  decisions; **snapshot/commit** when rank 0 says so (``snapshot.py``, ``progress.py``: every
  rank's generators in rank 0's snapshot, the commit stamped with its time and round);
* **SIGTERM**: the handler's flag is the sync's "stop"; the ranks stop at the same step after a
  committed snapshot, and the node records its end (``contract/worker_end.py``);
* **abort**: under NCCL the stall abort (``device.py``) frees a rank blocked in a collective
  once SIGTERM or the round breaking (``peer_loss.py``) told it to stop, so that the failure
  reaches the training thread, which then writes its **rescue** (``rescue.py``): the state
  after the last counted step, unless the parameters are ahead of it (inside, or after, an
  optimizer step not yet counted);
* **finish**: the final model, the rescues discarded, the node's end recorded.

Both make their loop one way, ``ElasticLoop.build``: its parts (snapshotter and the optimizer's
guard, rescues, snapshot policy, stall abort) from the worker's settings (``job_env.JobEnv``).
What differs between the two ways stays with them: which steps run and how (the runner's
``TrainStep`` over its data plan; the script's own loop over ``ElasticSampler``), and what
their state is (``Trained``).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from kfp_elastic import slow_stop
from kfp_elastic.contract.worker_end import (
    END_COMPLETED,
    END_SIGTERM,
    now_end,
    record_end,
)
from kfp_elastic.etcd.client import connect
from kfp_elastic.etcd.settings import EtcdSettings
from kfp_elastic.job_env import JobEnv, rendezvous_round, worker_name
from kfp_elastic.worker.collective import gathered, shared
from kfp_elastic.worker.device import settle
from kfp_elastic.worker.memory_reshard import Moved
from kfp_elastic.worker.peer_loss import watch_stalls
from kfp_elastic.worker.progress import (
    INITIAL,
    Committed,
    Manifest,
    Progress,
    commit_with_retry,
    ensure_manifest,
)
from kfp_elastic.worker.progress import recorded as stamped
from kfp_elastic.worker.rescue import Rescues
from kfp_elastic.worker.restore import committed_head, newest_state
from kfp_elastic.worker.schedule import SnapshotPolicy, next_sync_step
from kfp_elastic.worker.sharded_snapshot import (
    MEMORY_PREFIX,
    ShardedRestore,
    ShardedSnapshots,
    ShardsLost,
    disk_snapshot_name,
    is_sharded_snapshot,
    newest_disk_snapshot,
    restore_from_disk,
    restore_from_memory,
)
from kfp_elastic.worker.snapshot import SnapshotError, Snapshotter
from kfp_elastic.worker.train_step import RNG_BY_RANK, restore_rng_state, rng_state

log = logging.getLogger("kfp_elastic.worker")


class Trained(Protocol):
    """What a loop snapshots, rescues and restores besides the position and the generators."""

    @property
    def sharded(self) -> bool:
        """The model is sharded (FSDP2): its state is every rank's own shards
        (``sharding.py``), snapshotted by every rank (``sharded_snapshot.py``)."""
        ...

    @property
    def stepping(self) -> bool:
        """The parameters are ahead of the last counted step (or half updated): no rescue."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ElasticLoop:
    """One worker process's elastic training loop around its optimizer steps (module doc).

    Collective: every rank makes one, calls ``plan`` and ``restore`` once, ``counted`` after
    each step, and ``finish`` at the end; ``write_rescue`` when training broke."""

    def __init__(
        self,
        trained: Trained,
        *,
        run_id: str,
        etcd: EtcdSettings,
        snapshots: Snapshotter,
        rescues: Rescues,
        snapshot_policy: SnapshotPolicy,
        backend: str,
        collective_abort: float,
        device: torch.device,
        seed: int,
        sharded: ShardedSnapshots | None = None,
    ) -> None:
        self.trained = trained
        self.sharded = sharded  # a sharded model's snapshots (every rank's shards)
        self.run_id, self.etcd, self.seed = run_id, etcd, seed
        self.snapshots, self.rescues, self.snapshot_policy = snapshots, rescues, snapshot_policy
        self.device = device  # where the sync's tensor lives: NCCL reduces device tensors only
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # One rescue writer per node: the node's ranks hold the same state after a step.
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.round = rendezvous_round() or 0  # the round this world was formed in (0: unknown)
        self.progress: Progress | None = None
        if self.rank == 0:
            self.progress = Progress(connect(etcd), etcd.run_prefix(run_id))
        self.manifest: Manifest | None = None
        self.committed, self.revision = INITIAL, 0
        self.restored = False
        self.step = self.epoch = self.position = 0
        self.rng = rng_state()  # this rank's generators after its last counted step
        self.losses: list[float] = []  # agreed mean loss of each step since the last commit
        self._pending_losses: list[tuple[float, int]] = []  # (this rank's loss sum, divisor)
        self.interval: tuple[int, float] = (0, 0.0)  # (global batch, lr) since the commit
        self._sync_at = 0
        self._synced = (time.monotonic(), 0)  # (when, step) of the last sync
        self._snapshot_step = 0
        # Seconds per step of the last few sync intervals; the fastest is the estimate, as a
        # stalled node (or a benchmark's SIGSTOP) must not make the loop look slower.
        self._step_times: collections.deque[float] = collections.deque(maxlen=8)
        self.stop_requested = False
        signal.signal(signal.SIGTERM, self._on_sigterm)
        # NCCL: a collective whose peer died is aborted after SIGTERM or when the round breaks
        # (``peer_loss.py``), so that the failure reaches the training thread and its rescue.
        self.stall = watch_stalls(backend, collective_abort, etcd, run_id)

    @classmethod
    def build(
        cls,
        trained: Trained,
        optimizer: torch.optim.Optimizer,
        settings: JobEnv,
        etcd: EtcdSettings,
        *,
        backend: str,
        device: torch.device,
    ) -> ElasticLoop:
        """The loop of a worker process and its parts, made one way for the runner and the
        script API: the snapshotter (``settings.snapshot_dir``, with its node-local copy in
        ``settings.local_snapshot_dir``) and its guard on ``optimizer``'s steps, the rescues (in
        the node-local directory when there is one), the snapshot policy, the stall abort."""
        local_dir = settings.local_snapshot_dir or None
        snapshots = Snapshotter(settings.snapshot_dir, local_dir)
        # Each optimizer step first waits for the last snapshot's copies of what it changes.
        snapshots.guard(optimizer)
        run_id = settings.run_id or "local"  # "local": a runtime started without torchrun
        sharded = None
        if trained.sharded:
            node = worker_name() or socket.gethostname()
            sharded = ShardedSnapshots(
                Path(settings.memory_snapshot_dir) / run_id / node,
                settings.snapshot_dir,
                node,
                disk_every=settings.disk_snapshot_every,
                mode=settings.sharded_snapshots,
            )
        return cls(
            trained,
            run_id=run_id,
            etcd=etcd,
            snapshots=snapshots,
            rescues=Rescues(local_dir or settings.snapshot_dir, run_id, snapshots.buffer),
            snapshot_policy=SnapshotPolicy(
                settings.snapshot_every or None,  # the contract's 0: auto
                settings.snapshot_overhead,
                settings.snapshot_max_interval,
            ),
            backend=backend,
            collective_abort=settings.collective_abort,
            device=device,
            seed=settings.seed,
            sharded=sharded,
        )

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self.stop_requested = True
        slow_stop.arm(f"worker rank={self.rank}")

    # -- the data plan and the restore ----------------------------------------------------------
    def plan(
        self, dataset_length: int, shard_size: int, epochs: int, seed: int, shuffle: bool
    ) -> Manifest:
        """The run's shard manifest (rank 0 publishes it once; every rank gets it)."""
        self.manifest = shared(
            ensure_manifest(self.progress, dataset_length, shard_size, epochs, seed, shuffle)
            if self.progress
            else None
        )
        return self.manifest

    @property
    def done(self) -> bool:
        assert self.manifest is not None
        return self.epoch >= self.manifest.epochs or self.committed.complete

    def restore(self) -> None:
        """Restore the newest state any rank has: a survivor's rescue, else the committed one."""
        assert self.manifest is not None, "plan() first"
        if self.sharded is not None:
            self._restore_sharded(self.sharded)
            return
        restored = newest_state(
            self.rank,
            self.world,
            self.progress,
            self.manifest,
            self.snapshots,
            self.rescues,
            reads_rescues=self.local_rank == 0,
        )
        state = restored.state
        self._take(restored.committed, restored.revision, state, restored.source)
        if restored.holder is not None:
            assert state is not None
            # Persist + commit it like any snapshot (in the background): until that lands the
            # rescue files stay, so another failure meanwhile finds them again.
            self.losses = list(state.get("losses", ()))
            self.commit(
                complete=self.epoch >= self.manifest.epochs,
                rescued=True,
                shape=(state.get("global_batch", 0), state.get("lr", 0.0)),
                world=state.get("world_size", self.world),
            )

    def _restore_sharded(self, sharded: ShardedSnapshots) -> None:
        """A sharded state: the committed step resharded from the nodes' memory, else the
        newest on-disk snapshot at or before it (the commit rolled back to its position)."""
        assert self.manifest is not None
        committed, revision = shared(
            committed_head(self.progress, self.manifest) if self.rank == 0 else None
        )
        restored = None
        if committed.snapshot:
            if not is_sharded_snapshot(committed.snapshot):
                raise SnapshotError(
                    f"committed snapshot {committed.snapshot} is not a sharded model's: this run "
                    "trained without sharding; use a new run id for a sharded model"
                )
            template = self.trained.state_dict()
            if committed.snapshot.startswith(MEMORY_PREFIX):
                try:
                    restored = restore_from_memory(
                        sharded, template, committed.step, committed.world_size
                    )
                except ShardsLost as lost:
                    log.warning("%s: falling back to the last on-disk snapshot", lost)
            if restored is None:  # a disk snapshot committed, or the memory's shards lost
                restored = self._restore_from_disk(sharded, template, committed)
                committed, revision = shared(
                    self._rolled_back(committed, revision, restored) if self.rank == 0 else None
                )
        # A sharded restore always says what it moved (0 from disk or for a new run).
        if restored is None:
            self._take(committed, revision, None, "nothing (a new run)", Moved())
        else:
            moved = restored.moved or Moved()
            self._take(committed, revision, restored.state, restored.source, moved)

    def _take(
        self,
        committed: Committed,
        revision: int,
        state: dict[str, Any] | None,
        source: str,
        moved: Moved | None = None,
    ) -> None:
        """Go on from ``state`` (None: the initial state) at ``committed``: the position, the
        generators, the sync schedule; say where it came from (and, for a reshard, the bytes
        it moved)."""
        self.committed, self.revision = committed, revision
        self.step, self.epoch, self.position = committed.step, committed.epoch, committed.position
        rng = "fresh"
        if state is not None:
            self.trained.load_state_dict(state)
            rng = restore_rng_state(state, self.rank, self.world, self.seed)
            self.step, self.epoch, self.position = state["step"], state["epoch"], state["position"]
        self.rng = rng_state()
        self.restored = True
        self._snapshot_step = self.step
        self._synced = (time.monotonic(), self.step)
        self._sync_at = next_sync_step(self.step, None, self.snapshot_policy.every)
        bytes_moved = (
            f" received_bytes={moved.received} sent_bytes={moved.sent} copied_bytes={moved.copied}"
            if moved is not None
            else ""
        )
        log.info(
            "restored rank=%d world=%d step=%d epoch=%d position=%d from=%s rng=%s%s",
            self.rank,
            self.world,
            self.step,
            self.epoch,
            self.position,
            source,
            rng,
            bytes_moved,
        )
        if self.committed.complete and self.rank == 0:
            log.warning(
                "run %s is complete already (committed step %d): nothing to train. If this is a "
                "new job, its run id was used by a finished run: choose another --rdzv-id, or "
                "delete that run's keys first: kfp-elastic forget %s --etcd ENDPOINT",
                self.run_id,
                self.committed.step,
                self.run_id,
            )

    def _restore_from_disk(
        self, sharded: ShardedSnapshots, template: dict[str, Any], committed: Committed
    ) -> ShardedRestore:
        directory = shared(
            newest_disk_snapshot(sharded.persist_dir, committed.step) if self.rank == 0 else None
        )
        if directory is None:
            raise SnapshotError(
                f"the shards of committed step {committed.step} are lost (a rank and the "
                f"neighbour holding its copy are both gone) and {sharded.persist_dir} holds no "
                "complete on-disk snapshot at or before it: raise --disk-snapshot-every's "
                f"frequency, or start the run over: kfp-elastic forget {self.run_id}"
            )
        restored = restore_from_disk(template, directory)
        if committed.snapshot == directory.name:
            return restored  # the committed snapshot is on disk (--sharded-snapshots disk)
        log.warning(
            "restored from the on-disk snapshot %s (step %d): the in-memory shards of step %d "
            "are lost; %d steps are trained again",
            directory.name,
            restored.step,
            committed.step,
            committed.step - restored.step,
        )
        return restored

    def _rolled_back(
        self, committed: Committed, revision: int, restored: ShardedRestore
    ) -> tuple[Committed, int]:
        """Rank 0: the commit moved back to an on-disk snapshot's step and data position."""
        assert self.progress is not None and self.manifest is not None
        state = restored.state
        if state["step"] == committed.step:
            return committed, revision
        older = Committed(
            step=state["step"],
            epoch=state["epoch"],
            position=state["position"],
            snapshot=disk_snapshot_name(state["step"]),
            world_size=int(state.get("world_size", self.world)),
        )
        if not self.progress.commit(self.manifest, committed, revision, older):
            raise SnapshotError("another process committed while rolling back; restart")
        return older, self.progress.committed_record()[1]

    # -- around each step -----------------------------------------------------------------------
    def settle(self) -> None:
        """Before an ``optimizer.step()``: wait for the step's device work (the gradient
        allreduce) and raise ``CollectiveAborted`` if the stall abort aborted it meanwhile: its
        partial gradients must never reach the parameters (``device.settle``)."""
        settle(self.device, self.stall)

    def counted(self, global_batch: int, lr: float, loss: tuple[float, int] | None = None) -> bool:
        """Count the optimizer step just finished (``global_batch`` samples at ``lr``; ``loss``:
        this rank's loss sum and what divides the sum over ranks into the step's mean). Syncs
        when due; True when the ranks agreed to stop: the snapshot is committed, the end
        recorded, and the caller ends its process with ``EXIT_PREEMPTED``."""
        assert self.manifest is not None, "restore() first"
        total = self.manifest.num_samples
        self.step += 1
        self.position += min(global_batch, total - self.position)
        epoch_end = self.position >= total
        if epoch_end:
            self.epoch, self.position = self.epoch + 1, 0
            log.info("epoch end rank=%d epoch=%d step=%d", self.rank, self.epoch - 1, self.step)
        self.rng = rng_state()
        self.interval = (global_batch, lr)
        if loss is not None:
            self._pending_losses.append(loss)
        if self.stall is not None:
            self.stall.progress()
        done = self.epoch >= self.manifest.epochs
        if not (done or epoch_end or self.step >= self._sync_at):
            return False
        stop, snapshot = self._sync(epoch_end)
        if stop:
            self.close_stall()  # the stop is agreed: no collective can hang now
        if snapshot or stop or done:
            self.commit(complete=done, wait=stop or done, stopping=stop)
        if not stop:
            return False
        log.warning(
            "stopping on SIGTERM rank=%d step=%d (snapshot committed)", self.rank, self.step
        )
        if self.stop_requested:  # this node got the SIGTERM (not only agreed to stop)
            self.record_end(END_SIGTERM)
        return True

    def _sync(self, epoch_end: bool) -> tuple[bool, bool]:
        """Agree on "stop" (SIGTERM on any rank), learn rank 0's decisions (snapshot now, the
        next sync step) and gather the mean loss of each step since the last sync: one small
        allreduce instead of one per step. Only rank 0 passes non-zero decisions."""
        decisions = (0, 0)
        if self.rank == 0:  # only rank 0 snapshots: its clock decides
            when, step = self._synced
            if self.step > step:
                self._step_times.append((time.monotonic() - when) / (self.step - step))
            step_time = min(self._step_times, default=None)
            trained_s = (self.step - self._snapshot_step) * (step_time or 0.0)
            cost = (self.sharded or self.snapshots).last_cost_s
            due = self.snapshot_policy.due(self.step, epoch_end, trained_s, cost)
            decisions = (int(due), next_sync_step(self.step, step_time, self.snapshot_policy.every))
        local = torch.tensor(
            [float(self.stop_requested), *map(float, decisions)]
            + [total for total, _ in self._pending_losses],
            dtype=torch.float64,
        ).to(self.device)
        dist.all_reduce(local)
        stop, snapshot, sync_at, *totals = local.cpu().tolist()
        if self.stall is not None:
            self.stall.check()  # an aborted allreduce returns whatever was there
        divisors = [n for _, n in self._pending_losses]
        self.losses.extend(
            round(float(t) / max(1, n), 6) for t, n in zip(totals, divisors, strict=True)
        )
        self._pending_losses = []
        self._sync_at = int(sync_at)
        self._synced = (time.monotonic(), self.step)
        return stop > 0, snapshot > 0

    # -- snapshot, commit, rescue ---------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        """The whole training state after the last counted step: what snapshots and rescues
        hold (the generators added by the caller)."""
        position = {"step": self.step, "epoch": self.epoch, "position": self.position}
        return self.trained.state_dict() | position | self.rng

    def commit(
        self,
        *,
        complete: bool,
        wait: bool = False,
        stopping: bool = False,
        rescued: bool = False,
        shape: tuple[int, float] | None = None,
        world: int = 0,
    ) -> None:
        """Snapshot the state (rank 0, in the background unless ``wait``) and commit it when
        persisted. Collective: every rank's generators go into rank 0's snapshot."""
        self._snapshot_step = self.step
        losses, self.losses = tuple(self.losses), []
        rng_by_rank = gathered(self.rng) if self.sharded is None else None
        if self.rank != 0 and self.sharded is None:
            return
        step, epoch, position = self.step, self.epoch, self.position
        batch, lr = shape or self.interval
        world = world or self.world
        if self.sharded is None:
            state = self._state() | {RNG_BY_RANK: rng_by_rank, "world_size": world}
        else:  # every rank its own shards and generators (its slot's rest)
            state = self._state() | {"world_size": world, "global_batch": batch, "lr": lr}

        def on_persisted(name: str) -> None:
            new = Committed(
                step,
                epoch,
                position,
                name,
                world,
                batch,
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

        if self.sharded is not None:
            self.sharded.save(step, state, on_persisted, wait=wait)
        else:
            self.snapshots.save(step, state, on_persisted, wait=wait)

    def _commit_with_retry(self, new: Committed) -> None:
        assert self.progress is not None and self.manifest is not None
        # Stamped with rank 0's time and the world's round, appended to the recent commits:
        # the timeline's numbers come from these, not from when a master saw the commit.
        new = stamped(self.committed, new, self.round, time.time())
        revision = commit_with_retry(
            self.progress,
            self.manifest,
            self.committed,
            self.revision,
            new,
            retry_s=self.etcd.outage_wait,
        )
        self.committed, self.revision = new, revision

    def write_rescue(self) -> None:
        """Training broke (a peer died, mostly; under NCCL after the stall abort freed this
        rank): keep the last counted step for the next world (``rescue.py``), unless the
        parameters are ahead of it."""
        if not self.restored or self.local_rank != 0:
            return  # nothing trained yet, or local rank 0 of this node writes the node's rescue
        if self.sharded is not None:
            # A rank holds its own shards only: the lost ranks' shards of this step are gone,
            # so the next world restores the committed step (every rank's, from memory).
            log.warning(
                "training broke rank=%d step=%d: a sharded state is restored from the last "
                "committed snapshot",
                self.rank,
                self.step,
            )
            return
        if self.trained.stepping:
            log.error(
                "training failed inside optimizer.step() rank=%d step=%d: no rescue, "
                "the next world restores the committed snapshot",
                self.rank,
                self.step + 1,
            )
            return
        batch, lr = self.interval
        # Losses of steps not yet agreed are this rank's estimate of the global-batch mean.
        pending = [round(total * self.world / max(1, n), 6) for total, n in self._pending_losses]
        state = self._state() | {
            RNG_BY_RANK: [self.rng if r == self.rank else None for r in range(self.world)],
            "world_size": self.world,
            "global_batch": batch,
            "lr": lr,
            "losses": [*self.losses, *pending],
        }
        try:
            path = self.rescues.write(self.step, self.rank, state)
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

    # -- the end ----------------------------------------------------------------------------------
    def finish(self, output: str, weights: dict[str, torch.Tensor]) -> None:
        """The end of training: rank 0 waits for the last snapshot and saves ``weights`` (the
        final model's ``state_dict``) to ``output`` (if set); the rescues go, the end is
        recorded."""
        self.close_stall()  # saving and the final barrier may take longer than a step
        if self.sharded is not None:
            self.sharded.wait()
        if self.rank == 0:
            self.snapshots.wait()
            if output:
                Path(output).parent.mkdir(parents=True, exist_ok=True)
                torch.save({k: v.cpu() for k, v in weights.items()}, output)
        dist.barrier()
        self.rescues.discard_up_to(self.step)  # the job is complete: none can win
        if self.sharded is not None and self.local_rank == 0:
            self.sharded.slots.remove()  # the node's shards and copies: the job is complete
        self.record_end(END_COMPLETED)
        self.close()

    def record_end(self, end: str) -> None:
        """How this node's worker ended, for a master that did not watch
        (``contract/worker_end.py``)."""
        worker = worker_name()
        if self.local_rank != 0 or worker is None:
            return
        try:
            client = connect(self.etcd)
        except Exception as error:  # noqa: BLE001 - the pod status may still tell
            log.warning("end not recorded worker=%s error=%r", worker, error)
            return
        try:
            record = now_end(end, self.step, self.round)
            record_end(client, self.etcd.run_prefix(self.run_id), worker, record)
        finally:
            client.close()

    def close_stall(self) -> None:
        if self.stall is not None:
            self.stall.close()

    def close(self) -> None:
        """Release rank 0's etcd connection once no snapshot is in flight (safe to repeat)."""
        self.close_stall()
        if self.sharded is not None:
            self.sharded.wait()
        if self.progress is not None:
            self.snapshots.wait()
            with contextlib.suppress(Exception):
                self.progress.close()
            self.progress = None
