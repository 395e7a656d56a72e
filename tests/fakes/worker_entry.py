"""A trivial worker entry for master tests: no torch, no collectives, starts in milliseconds.

Run by torchrun (one process per rank). Rank 0 counts steps in ``<state-dir>/<run id>.step``;
every rank sleeps ``--step-time`` per step and exits 0 once the file says ``--steps``. With
``KFP_ELASTIC_ETCD_ENDPOINTS`` set and ``--commit-every K``, rank 0 also commits its progress to
etcd like the worker runtime does (``worker.progress``), ``complete`` at the last step, and
on SIGTERM commits its step as ``stopping`` and exits 143.
``--exit-code C`` exits at once with C (a crashing worker). Events go to ``--events`` as JSON
lines: start, step, done.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path


def emit(path: str | None, event: str, **fields: object) -> None:
    if not path:
        return
    record = {
        "event": event,
        "t": time.time(),
        "rank": int(os.environ.get("RANK", 0)),
        "world_size": int(os.environ.get("WORLD_SIZE", 1)),
        "pid": os.getpid(),
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        **fields,
    }
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def read_step(path: Path) -> int:
    try:
        return int(path.read_text().strip() or 0)
    except (FileNotFoundError, ValueError):
        return 0


class Committer:
    """Rank 0's commits to etcd, through worker.progress like the real runtime."""

    BATCH = 8

    def __init__(self, every: int, total: int) -> None:
        from kfp_elastic.etcd.client import connect
        from kfp_elastic.etcd.settings import EtcdSettings
        from kfp_elastic.worker.progress import Progress

        settings = EtcdSettings.from_env()
        run = settings.run_prefix(os.environ["TORCHELASTIC_RUN_ID"])
        self.client = connect(settings)
        self.progress = Progress(self.client, run)
        self.manifest = self.progress.manifest()
        self.every, self.total = every, total

    def maybe_commit(self, step: int, losses: list[float]) -> None:
        if step % self.every and step < self.total:
            return
        self.commit(step, losses)

    def commit(self, step: int, losses: list[float], stopping: bool = False) -> None:
        from kfp_elastic.job_env import ROUND_ENV
        from kfp_elastic.worker.progress import Committed, recorded

        previous, revision = self.progress.committed_record()
        samples = self.manifest.num_samples if self.manifest else 10**9
        epochs = self.manifest.epochs if self.manifest else 1
        per_epoch = max(1, -(-samples // self.BATCH))
        done = step >= self.total
        epoch = min(step // per_epoch, epochs - 1) if not done else epochs - 1
        position = samples if done else min(samples, (step - epoch * per_epoch) * self.BATCH)
        new = Committed(
            step=step,
            epoch=epoch,
            position=position,
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
            complete=done,
            losses=tuple(losses),
            stopping=stopping,
        )
        new = recorded(previous, new, int(os.environ.get(ROUND_ENV, 0) or 0), time.time())
        if self.manifest is not None:
            self.progress.commit(self.manifest, previous, revision, new)
        else:
            self.client.put(self.progress.keys.committed, new.to_json())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-time", type=float, default=0.1)
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--events")
    parser.add_argument("--exit-code", type=int)
    parser.add_argument("--commit-every", type=int, default=0)
    args = parser.parse_args(argv)
    if args.exit_code is not None:
        print(f"worker exits with {args.exit_code} as asked", file=sys.stderr, flush=True)
        return args.exit_code
    rank = int(os.environ.get("RANK", 0))
    state = Path(args.state_dir) / f"{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}.step"
    committer = (
        Committer(args.commit_every, args.steps)
        if rank == 0 and args.commit_every and "KFP_ELASTIC_ETCD_ENDPOINTS" in os.environ
        else None
    )
    stop: list[int] = []
    if committer is not None:  # like the runtime: SIGTERM stops at a (stopping) commit
        signal.signal(signal.SIGTERM, lambda signum, _frame: stop.append(signum))
    step = read_step(state)
    emit(args.events, "start", step=step)
    losses: list[float] = []
    while step < args.steps:
        time.sleep(args.step_time)
        if stop and committer is not None:
            committer.commit(step, losses, stopping=True)
            emit(args.events, "stopped", step=step)
            return 128 + signal.SIGTERM
        if rank == 0:
            step += 1
            tmp = state.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(str(step))
            os.replace(tmp, state)
            losses.append(round(1.0 / step, 4))
            emit(args.events, "step", step=step)
            if committer is not None:
                committer.maybe_commit(step, losses)
                if step % committer.every == 0:
                    losses = []
        else:
            step = read_step(state)
    emit(args.events, "done", step=step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
