"""A tiny DDP job for torchrun (gloo, CPU) that logs JSON events, for tests and benchmarks.

    torchrun --nnodes=2:3 --rdzv-backend=c10d ... examples/tiny_ddp.py --steps 50 --events ev.jsonl

Every process appends one JSON line per event (start, step, done) to ``--events``. Rank 0 writes
the number of finished steps to ``<state-dir>/<run id>.step`` after each step; after a restart
(membership change or failure) training continues from there and exits 0 after ``--steps``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="total steps of the job")
    parser.add_argument("--step-time", type=float, default=0.05, help="min seconds per step")
    parser.add_argument("--events", help="append JSON-line events to this file")
    parser.add_argument("--state-dir", help="progress files (default: beside --events, or tmp)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pg-timeout", type=float, default=120.0, help="gloo timeout, seconds")
    return parser.parse_args(argv)


class EventLog:
    """Appends JSON lines with O_APPEND; each line is one write(), so processes can share a file."""

    def __init__(self, path: str | None, **common: Any) -> None:
        self.common = common
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None

    def emit(self, event: str, **fields: Any) -> None:
        if self.fd is not None:
            record = {"event": event, "t": time.time(), **self.common, **fields}
            os.write(self.fd, (json.dumps(record) + "\n").encode())


def read_step(path: Path) -> int:
    try:
        return int(path.read_text().strip() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def write_step(path: Path, step: int) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(str(step))
    os.replace(tmp, path)  # atomic: readers never see a half-written file


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = os.environ
    rank, world_size = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    run_id = env.get("TORCHELASTIC_RUN_ID", "local")
    log = EventLog(
        args.events,
        rank=rank,
        world_size=world_size,
        group_rank=int(env.get("GROUP_RANK", 0)),
        restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
        pid=os.getpid(),
        run_id=run_id,
        warm=env.get("KFP_ELASTIC_WARM_STARTED") == "1",  # forked by elastic-etcd's zygote
    )
    default_dir = Path(args.events).parent if args.events else Path(tempfile.gettempdir())
    state_dir = Path(args.state_dir) if args.state_dir else default_dir
    state_dir.mkdir(parents=True, exist_ok=True)
    state_file = state_dir / f"{run_id}.step"

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    # Rank 0's view of the progress file is authoritative: broadcast it so all ranks agree.
    start = torch.tensor([read_step(state_file)], dtype=torch.int64)
    dist.broadcast(start, src=0)
    step = int(start.item())
    log.emit("start", step=step)

    torch.manual_seed(args.seed)  # same initial weights everywhere (DDP broadcasts rank 0's too)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    # Plain SGD by hand: constructing torch.optim.SGD imports torch._dynamo (1.3-2.7 s here),
    # which would dominate every restart this script exists to time.
    params = list(model.parameters())
    while step < args.steps:
        began = time.monotonic()
        data = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
        inputs = torch.randn(16, 32, generator=data)
        targets = inputs.sum(dim=1, keepdim=True)
        loss = nn.functional.mse_loss(model(inputs), targets)
        for p in params:
            p.grad = None
        loss.backward()  # the allreduce: fails here when a peer dies
        with torch.no_grad():
            for p in params:
                p -= 0.01 * p.grad
        step += 1
        if rank == 0:
            write_step(state_file, step)
        log.emit("step", step=step, loss=round(loss.item(), 6))
        time.sleep(max(0.0, args.step_time - (time.monotonic() - began)))

    log.emit("done", step=step)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
