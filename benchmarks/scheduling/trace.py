"""Reading a cluster trace and sampling a workload from it.

The trace is Pollux's ``philly.csv`` (``timestamp``, ``duration``, ``num_gpus``, ``gpu_time``,
``cluster``), shipped gzipped as :data:`DEFAULT_TRACE` (``benchmarks/scheduling/data/README.md``:
its source, licence and columns); :func:`read_trace` reads a ``.gz`` path or a plain CSV.
:func:`sample` draws a workload the way the Pollux authors did:

- **eligible**: ``duration >= 60`` s and ``gpu_time < 1000`` GPU-hours;
- **window**: submitted at a time of day in ``[start_hour, start_hour + window_hours)`` (wrapping
  past midnight), on *any* day of the trace;
- **sample**: ``jobs`` of them drawn uniformly without replacement among every eligible job in
  that window across all days (``random.Random(seed)``), so the heavy tail of job lengths is
  sampled as often as it occurs in the trace; each keeps its time of day, so the workload arrives
  over one window: its submit time is the seconds since ``start_hour`` on its own day;
- each job gets a job type (a throughput curve, ``--scaling pollux``) drawn uniformly from
  ``job_types`` by the same seeded generator, after the sample.
- A job asking more GPUs than the cluster has is cut to the cluster's size with its GPU time
  kept (it runs longer), so that every job can run.
"""

from __future__ import annotations

import csv
import gzip
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.scheduling.throughput import JOB_TYPES

MIN_DURATION_S = 60.0
MAX_GPU_TIME_S = 1000 * 3600.0
DAY_S = 24 * 3600
DEFAULT_TRACE = Path(__file__).resolve().parent / "data" / "philly.csv.gz"


@dataclass(frozen=True)
class TraceJob:
    """One job of the trace: submitted at ``submit_s`` seconds of its day, ran ``duration_s`` on
    ``gpus`` GPUs."""

    name: str
    submit_s: float  # seconds since midnight of its day
    duration_s: float
    gpus: int

    @property
    def gpu_time_s(self) -> float:
        return self.duration_s * self.gpus


@dataclass(frozen=True)
class Job:
    """One job of a sampled workload."""

    name: str
    submit_s: float  # seconds since the window's start
    gpus: int  # GPUs it asks for (cut to the cluster's size)
    work: float  # GPU-seconds at its size: the trace's duration × num_gpus
    job_type: str | None = None  # a throughput curve (benchmarks/scheduling/throughput.py)
    global_batch: float | None = None  # samples per step (None: gpus × the type's median)


def read_trace(path: Path) -> list[TraceJob]:
    """Every row of a ``philly.csv``-style trace, gzipped (a name ending in ``.gz``) or plain; a
    clear error for a missing file or column."""
    if not path.is_file():
        raise FileNotFoundError(
            f"trace {path} not found; pass --trace with the path of a philly.csv(.gz) "
            f"(the default: {DEFAULT_TRACE})"
        )
    jobs = []
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        reader = csv.DictReader(f)
        missing = {"timestamp", "duration", "num_gpus"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"trace {path}: missing column(s) {', '.join(sorted(missing))}")
        for i, row in enumerate(reader):
            jobs.append(
                TraceJob(
                    f"job-{i}",
                    seconds_of_day(row["timestamp"]),
                    float(row["duration"]),
                    int(row["num_gpus"]),
                )
            )
    return jobs


def seconds_of_day(timestamp: str) -> int:
    """``"YYYY-MM-DD HH:MM:SS"`` -> seconds since its midnight (a clear error otherwise)."""
    try:
        hours, minutes, seconds = (int(v) for v in timestamp[11:].split(":"))
        ok = len(timestamp) == 19 and timestamp[10] == " "
    except ValueError:
        ok = False
    if not ok or not (0 <= hours < 24 and 0 <= minutes < 60 and 0 <= seconds < 61):
        raise ValueError(f"timestamp {timestamp!r} is not 'YYYY-MM-DD HH:MM:SS'")
    return hours * 3600 + minutes * 60 + seconds


def eligible(job: TraceJob) -> bool:
    """The Pollux authors' filter: at least a minute long, under 1000 GPU-hours."""
    return job.duration_s >= MIN_DURATION_S and job.gpu_time_s < MAX_GPU_TIME_S and job.gpus >= 1


def offset_in_window(submit_s: float, start_hour: float, window_hours: float) -> float | None:
    """Seconds from the window's start to ``submit_s`` (a time of day), or None outside it."""
    offset = (submit_s - start_hour * 3600) % DAY_S
    return offset if offset < window_hours * 3600 else None


def sample(
    trace: list[TraceJob],
    jobs: int,
    start_hour: float,
    window_hours: float,
    seed: int,
    cluster_gpus: int,
    job_types: Sequence[str] = JOB_TYPES,
) -> list[Job]:
    """``jobs`` jobs of the window, by the module's rule, ordered by submit time."""
    if not 0 <= start_hour < 24:
        raise ValueError(f"--start-hour must be in [0, 24), got {start_hour}")
    if not 0 < window_hours <= 24:
        raise ValueError(f"--window-hours must be in (0, 24], got {window_hours}")
    pool = [
        (offset, job)
        for job in trace
        if eligible(job)
        and (offset := offset_in_window(job.submit_s, start_hour, window_hours)) is not None
    ]
    if jobs > len(pool):
        raise ValueError(
            f"--jobs {jobs}: only {len(pool)} eligible jobs in the {window_hours:g}-hour window "
            f"from hour {start_hour:g}"
        )
    rng = random.Random(seed)
    chosen = rng.sample(pool, jobs)
    chosen.sort(key=lambda item: (item[0], item[1].name))
    return [
        Job(job.name, offset, min(job.gpus, cluster_gpus), job.gpu_time_s, rng.choice(job_types))
        for offset, job in chosen
    ]
