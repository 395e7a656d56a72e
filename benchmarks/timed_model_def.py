"""Benchmark instrumentation: ``--model-def benchmarks.timed_model_def`` is another model-def
(``$TIMED_MODEL_DEF``, default ``kfp_elastic.worker.examples.digits``) plus one timestamp per
optimizer step.

Nothing of the runtime changes: model, loss, data, collate, optimizer, the training-state
hooks (scheduler, AMP, clipping, accumulation, LR decay) and the sharding (``SHARDING``,
``shard``) are the wrapped module's; the optimizer only gets a ``register_step_post_hook`` that
appends one line

    {"t": time.time(), "step": S, "rank": R, "world": W, "pid": P, "lr": LR}

to ``$TIMED_STEPS_FILE`` with a single ``os.write`` (O_APPEND: the processes of a job share the
file, and a SIGKILLed process has lost nothing it wrote) each time ``optimizer.step()`` returns
(on a GPU after ``torch.cuda.synchronize``: the time is when the step's work finished).
``S`` is the runtime's global step number, as the runner's step hook gives it (``on_step``, a
model definition's hook: ``worker/model_def.py``, called just before each optimizer step with its
number); ``TIMED_STEP_NUMBERS=0`` writes null instead. ``LR`` is the first parameter
group's learning rate the step used (batch-policy scale included). ``benchmarks/
static_ddp_baseline.py`` writes the same lines, so both sides pay the same few µs per step.

Without ``$TIMED_STEPS_FILE`` the lines go to ``timed_steps.jsonl`` in the run's snapshot
directory (``$KFP_ELASTIC_SNAPSHOT_DIR``, which every launcher sets): worker pods get no
environment of the benchmark's, only what the master gives them
(``python -m benchmarks cluster``). The runtime finds its own files there by name
(``snapshot-*.pt``, ``rescue-*.pt``), so the extra file disturbs nothing.

``TIMED_JOB_TYPE=T`` (one of ``benchmarks/scheduling/throughput.py``'s job types: bert,
cifar10, deepspeech2, imagenet, ncf, yolov3): every optimizer step takes as long as job type
``T`` takes for it on the current world's GPUs, ``step_seconds(T, world, global_batch)``: the
step hook sleeps whatever is left of that time since the step's first ``loss()`` call, before it
writes the step's line. The global batch is the samples this rank's ``loss()`` calls saw in the
step (micro-batches included) × the world size; ``TIMED_GLOBAL_BATCH=B`` fixes it instead. Over a
model definition that costs next to nothing (``TIMED_MODEL_DEF=kfp_elastic.testing.model_defs.
counted_blobs``: per-sample counts for the exactly-once check) a job then trains at a measured
GPU job's pace, world size included, without using the CPU for it; the master, etcd, the pods,
the snapshots and the data plan stay real. Data loading, snapshots and everything between steps
are not in the slept time: they cost what they really cost.

``TIMED_ETCD_REQUEST_TIMEOUT=S`` (benchmark only): the runtime's etcd client gets an S-second
request deadline instead of 5 s. The throughput benchmark stops workers with SIGSTOP for seconds
at a time; a commit in flight at that moment must not pass its (wall-clock) deadline meanwhile.
It changes nothing while etcd answers in milliseconds.
"""

from __future__ import annotations

import json
import os
import time

import torch

from kfp_elastic.job_env import SNAPSHOT_DIR_ENV
from kfp_elastic.worker.model_def import load_model_def

_inner = load_model_def(os.environ.get("TIMED_MODEL_DEF", "kfp_elastic.worker.examples.digits"))
STEPS_FILE_NAME = "timed_steps.jsonl"  # in the snapshot directory, without $TIMED_STEPS_FILE
_FILE = os.environ.get("TIMED_STEPS_FILE") or (
    os.path.join(os.environ[SNAPSHOT_DIR_ENV], STEPS_FILE_NAME)
    if os.environ.get(SNAPSHOT_DIR_ENV)
    else None
)
_NUMBERS = os.environ.get("TIMED_STEP_NUMBERS", "1") != "0"

if os.environ.get("TIMED_ETCD_REQUEST_TIMEOUT"):
    import dataclasses

    from kfp_elastic.etcd.client import connect as _connect
    from kfp_elastic.worker import loop as _loop

    def _patient_connect(settings):  # noqa: ANN001,ANN202
        timeout = float(os.environ["TIMED_ETCD_REQUEST_TIMEOUT"])
        return _connect(dataclasses.replace(settings, request_timeout=timeout))

    # Only the runtime's client: the agents' rendezvous keeps its own request timeout.
    _loop.connect = _patient_connect

_JOB_TYPE = os.environ.get("TIMED_JOB_TYPE") or None
_GLOBAL_BATCH = float(os.environ.get("TIMED_GLOBAL_BATCH") or 0) or None
if _JOB_TYPE is not None:
    from benchmarks.scheduling.throughput import curve as _curve

    _curve(_JOB_TYPE)  # an unknown type fails at import, naming the known ones

LOSS_REDUCTION = _inner.loss_reduction
model = _inner.model
dataset = _inner.dataset
collate = _inner.collate
if _inner.evaluate is not None:
    evaluate = _inner.evaluate
if _inner.scheduler is not None:
    scheduler = _inner.scheduler
AMP = _inner.amp
CLIP_GRAD_NORM = _inner.clip_grad_norm
GRAD_ACCUMULATION = _inner.grad_accumulation
if _inner.lr_decay is not None:
    LR_DECAY = {"epochs": list(_inner.lr_decay.epochs), "gamma": _inner.lr_decay.gamma}
SHARDING = _inner.sharding
if _inner.shard is not None:
    shard = _inner.shard


class StepClock:
    """When the step in progress began and how many samples it has seen on this rank."""

    def __init__(self) -> None:
        self.began: float | None = None
        self.samples = 0

    def saw(self, batch: object) -> None:
        if self.began is None:
            self.began = time.monotonic()
        self.samples += batch_size(batch)

    def finish(self) -> tuple[float | None, int]:
        """(monotonic start of the step, its samples on this rank); resets for the next."""
        began, samples = self.began, self.samples
        self.began, self.samples = None, 0
        return began, samples


def batch_size(batch: object) -> int:
    """Samples in a collated batch: the first dimension of its first tensor (0: none found)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    items = batch.values() if isinstance(batch, dict) else batch
    if isinstance(items, list | tuple) or isinstance(batch, dict):
        for item in items:
            size = batch_size(item)
            if size:
                return size
    return 0


def paced_sleep_s(
    job_type: str, world: int, global_batch: float, began: float | None, now: float
) -> float:
    """Seconds left to sleep so that the step begun at ``began`` lasts what ``job_type`` takes
    for ``global_batch`` samples on ``world`` GPUs (0 when it already took longer)."""
    from benchmarks.scheduling.throughput import step_seconds

    if global_batch <= 0:
        return 0.0
    target = step_seconds(job_type, max(1, world), global_batch)
    return max(0.0, target - (now - began)) if began is not None else target


def _world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


_clock = StepClock()


def loss(model, batch):  # noqa: ANN001,ANN201 - the wrapped model-def's own types
    if _JOB_TYPE is not None:
        _clock.saw(batch)
    return _inner.loss(model, batch)


_step: int | None = None  # the number of the optimizer step in progress (the runner's hook)


def on_step(step: int) -> None:
    """The runner's step hook: the step about to run is number ``step`` (the wrapped model
    definition's own hook, if any, is called too)."""
    global _step
    _step = step
    if _inner.on_step is not None:
        _inner.on_step(step)


class StepLog:
    """One JSON line per step, appended with one write() (shared by the processes of a job)."""

    def __init__(self, path: str | None) -> None:
        if path:  # the snapshot directory may not exist yet when the optimizer is made
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.pid = os.getpid()

    def emit(
        self, step: int | None, lr: float | None = None, device: torch.device | None = None
    ) -> None:
        """``device``: where the step computed; a GPU's queued work is waited for first, so
        that the time stamp is when the step finished, not when its kernels were queued."""
        if self.fd is not None:
            if device is not None and device.type == "cuda":
                torch.cuda.synchronize(device)
            record = {
                "t": time.time(),
                "step": step,
                "rank": self.rank,
                "world": self.world,
                "pid": self.pid,
                "lr": lr,
            }
            os.write(self.fd, (json.dumps(record) + "\n").encode())


_log: StepLog | None = None


def _after_step(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    assert _log is not None
    if _JOB_TYPE is not None:
        began, samples = _clock.finish()
        world = _world_size()
        batch = _GLOBAL_BATCH or samples * world
        time.sleep(paced_sleep_s(_JOB_TYPE, world, batch, began, time.monotonic()))
    group = optimizer.param_groups[0]
    device = group["params"][0].device if group["params"] else None
    _log.emit(_step if _NUMBERS else None, group["lr"], device)


def optimizer(params) -> torch.optim.Optimizer:  # noqa: ANN001 - torch's own type is loose
    global _log
    if _inner.optimizer is None:
        raise ValueError(f"{_inner.name} defines no optimizer(); the timed wrapper needs one")
    opt = _inner.optimizer(params)
    if _log is None:
        _log = StepLog(_FILE)
    opt.register_step_post_hook(_after_step)
    return opt
