"""Seconds per training step of a job type on ``n`` GPUs at a global batch: the curve that both the
sleeping model definition (``benchmarks/timed_model_def.py``, ``TIMED_JOB_TYPE``) and the
cluster simulator (``--scaling pollux``) use.

The curves come from measured multi-GPU step times of six training jobs on Pollux's testbed
(16 nodes × 4 NVIDIA T4): ``benchmarks/scheduling/data/<type>.csv``, copied from the artifact of
the Pollux paper (see ``data/README.md``; Apache-2.0). Each row is one placement: ``num_nodes``,
``num_replicas`` (GPUs), ``local_bsz`` (per-GPU batch), ``step_time`` and ``sync_time`` (the
part of the step spent in the gradient all-reduce), seconds.

The rule (:func:`step_seconds`), a step = local compute + all-reduce:

- **compute(b)**, seconds of one GPU's forward/backward at per-GPU batch ``b``: for each measured
  ``local_bsz``, the smallest ``step_time - sync_time`` over all placements (compute does not
  depend on where the other replicas are; the smallest is the least disturbed measurement);
  linear between measured batches, proportional to ``b`` above the largest (a GPU's work grows
  with its batch) and the smallest batch's time below the smallest (fixed costs dominate).
- **sync(n)**, seconds of the all-reduce among ``n`` replicas: for each measured replica count
  (6..64), the median ``sync_time`` of its best placement (the fewest nodes: packed, as a
  scheduler places a job when it can); linear in ``n`` between measured counts; ``0`` at one
  GPU (nothing to reduce); linear from 0 at 1 GPU to the 6-GPU value for 2..5 GPUs, which the
  data does not measure (an assumption); the 64-GPU value above 64 (a ring all-reduce's time
  hardly grows with ``n``).
- ``step_seconds(type, n, B) = compute(B / n) + sync(n)``.

:func:`speedup` is the ratio a simulator needs: how much faster a job trains on ``n`` GPUs
than on ``base`` GPUs at the same global batch (the ``fixed-global-batch`` policy).
"""

from __future__ import annotations

import bisect
import csv
import functools
import statistics
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
JOB_TYPES = ("bert", "cifar10", "deepspeech2", "imagenet", "ncf", "yolov3")


@dataclass(frozen=True)
class Curve:
    """One job type's measured compute and all-reduce times (see the module's rule)."""

    job_type: str
    batches: tuple[float, ...]  # measured per-GPU batches, ascending
    compute_s: tuple[float, ...]  # compute seconds at each
    replicas: tuple[int, ...]  # 1, then the measured replica counts, ascending
    sync_s: tuple[float, ...]  # all-reduce seconds at each (0 at 1 replica)

    @property
    def reference_batch(self) -> float:
        """A typical per-GPU batch of this job type: the median measured one."""
        return statistics.median(self.batches)

    def compute(self, local_batch: float) -> float:
        if local_batch <= self.batches[0]:
            return self.compute_s[0]
        if local_batch >= self.batches[-1]:
            return self.compute_s[-1] * local_batch / self.batches[-1]
        return _interpolate(self.batches, self.compute_s, local_batch)

    def sync(self, gpus: int) -> float:
        if gpus >= self.replicas[-1]:
            return self.sync_s[-1]
        return _interpolate(self.replicas, self.sync_s, gpus)


def _interpolate(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    i = bisect.bisect_right(xs, x)
    if i == 0:
        return ys[0]
    if i == len(xs):
        return ys[-1]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def curve_from_rows(job_type: str, rows: list[dict[str, str]]) -> Curve:
    """The curve of measured rows (``num_nodes``, ``num_replicas``, ``local_bsz``,
    ``step_time``, ``sync_time``), by the module's rule."""
    if not rows:
        raise ValueError(f"job type {job_type!r}: no measurements")
    compute: dict[float, float] = {}
    by_replicas: dict[int, list[tuple[int, float]]] = {}
    for row in rows:
        batch, step = float(row["local_bsz"]), float(row["step_time"])
        sync = float(row["sync_time"])
        compute[batch] = min(compute.get(batch, step), max(0.0, step - sync))
        by_replicas.setdefault(int(row["num_replicas"]), []).append((int(row["num_nodes"]), sync))
    replicas, syncs = [1], [0.0]
    for count in sorted(r for r in by_replicas if r > 1):
        fewest = min(nodes for nodes, _ in by_replicas[count])
        replicas.append(count)
        syncs.append(statistics.median(s for nodes, s in by_replicas[count] if nodes == fewest))
    batches = sorted(compute)
    return Curve(
        job_type,
        tuple(batches),
        tuple(compute[b] for b in batches),
        tuple(replicas),
        tuple(syncs),
    )


@functools.cache
def curve(job_type: str) -> Curve:
    """The curve of ``job_type`` (one of :data:`JOB_TYPES`), read once from ``data/``."""
    if job_type not in JOB_TYPES:
        raise ValueError(f"unknown job type {job_type!r}; known: {', '.join(JOB_TYPES)}")
    with open(DATA / f"{job_type}.csv", newline="") as f:
        return curve_from_rows(job_type, list(csv.DictReader(f)))


def step_seconds(job_type: str, gpus: int, global_batch: float) -> float:
    """Seconds per optimizer step of ``job_type`` on ``gpus`` GPUs (the world size) at
    ``global_batch`` samples per step, by the module's rule:
    ``compute(global_batch / gpus) + sync(gpus)``."""
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    if global_batch <= 0:
        raise ValueError(f"global batch must be > 0, got {global_batch}")
    c = curve(job_type)
    return c.compute(global_batch / gpus) + c.sync(gpus)


def speedup(job_type: str, gpus: int, base: int, global_batch: float) -> float:
    """How many times faster ``job_type`` steps on ``gpus`` GPUs than on ``base`` GPUs at the
    same global batch."""
    return step_seconds(job_type, base, global_batch) / step_seconds(job_type, gpus, global_batch)
