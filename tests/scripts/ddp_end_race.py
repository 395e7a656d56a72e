"""The end of a DDP script where torch's Gloo process group can deadlock (world of one).

The last collective is asynchronous and its Python tensor is dropped at once, so the Gloo
thread may hold the last reference to the finished work while ``main()`` returns and frees the
DDP model, whose Reducer holds the last reference to the process group: the group's destructor
then joins the Gloo threads with the GIL held, and the Gloo thread waits for the GIL to free the
tensor. In a cold process this hangs now and then; a worker forked by the zygote must never.

    MASTER_PORT=... python tests/scripts/ddp_end_race.py
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = DDP(torch.nn.Linear(20, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 20)).sum().backward()
        optimizer.step()
    dist.all_reduce(torch.ones(100_000), async_op=True)  # its Work and tensor dropped at once
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    print("ended", flush=True)
