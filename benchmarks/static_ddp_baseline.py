"""A plain, static torchrun DDP job: the baseline of ``python -m benchmarks runtime``.

    PYTHONPATH=. torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:PORT -m benchmarks.static_ddp_baseline \\
        --epochs 20 --batch-size 32 --steps-file steps.jsonl

The same model, data, optimizer and global batch as ``python -m kfp_elastic.worker --model-def
kfp_elastic.worker.examples.digits --batch-size 32`` at the same world size
(``$TIMED_MODEL_DEF`` picks
another model-def), written the way a plain DDP script is: a ``DataLoader`` with a
``DistributedSampler`` (``set_epoch`` per epoch), DDP, one optimizer step per batch, no
snapshots, no etcd, no per-step loss read-back. With 1,437 training images and 32 per rank, a
2-rank world takes 23 steps per epoch, as the runtime does with a global batch of 64.

With ``--steps-file`` each rank appends one JSON line ``{"t", "step", "rank", "world", "pid"}``
after every ``optimizer.step()``, exactly as ``benchmarks/timed_model_def.py`` does for the
runtime (same code, same cost).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.timed_model_def import StepLog
from kfp_elastic.job_spec import DEVICES
from kfp_elastic.worker.device import place_this_process, to_device
from kfp_elastic.worker.model_def import load_model_def


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-def",
        default=os.environ.get("TIMED_MODEL_DEF", "kfp_elastic.worker.examples.digits"),
    )
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps-file", help="append a JSON line per step to this file")
    parser.add_argument("--output", type=Path, help="write the final state_dict here")
    parser.add_argument("--device", choices=DEVICES, default="cpu", help="as the runtime's")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    md = load_model_def(args.model_def)
    placement = place_this_process(args.device)  # the runtime's device and backend
    dist.init_process_group(
        placement.backend, device_id=placement.device if placement.on_accelerator else None
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    train = md.dataset("train")
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, collate_fn=md.collate)
    model = DistributedDataParallel(
        md.model().to(placement.device),
        device_ids=[placement.device.index] if placement.on_accelerator else None,
    )
    optimizer = md.optimizer(model.parameters())
    steps = StepLog(args.steps_file)
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            loss = md.loss(model, to_device(batch, placement.device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            steps.emit(step, device=placement.device)
    if rank == 0 and args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.module.state_dict(), args.output)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
