"""A DDP training script in the style of pytorch/examples' DDP tutorial (``multinode.py``), made
elastic with ``kfp_elastic.worker.elastic``: the five added lines are marked ``# elastic``.

Its model counts how often each sample reached it (SGD, lr 1, loss = -sum of the counts of
the batch, scaled by the world size because DDP averages gradients over ranks): after E epochs
every count must be exactly E, whatever preemptions and world size changes happened.

    torchrun --rdzv-backend=elastic-etcd ... tests/scripts/ddp_counting.py --samples 240

``--fsdp``: the model is sharded with FSDP2 (``fully_shard``) instead of wrapped in DDP; the
script API takes it as it is (its state: every rank's shards).
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

from kfp_elastic.worker import elastic


class Ids(Dataset):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)


class Counter(torch.nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.counts = torch.nn.Parameter(torch.zeros(size, dtype=torch.float64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.counts[ids]


def ddp_setup() -> None:
    dist.init_process_group(backend="gloo")


class Trainer:
    def __init__(
        self, model: torch.nn.Module, dataset: Dataset, step_time: float, fsdp: bool = False
    ) -> None:
        self.global_rank = dist.get_rank()
        self.model = fully_shard(model) if fsdp else DDP(model)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1.0)
        self.state = elastic.State(model=self.model, optimizer=self.optimizer)  # elastic
        self.train_data = elastic.DataLoader(dataset, self.state)  # elastic
        self.step_time = step_time

    def _run_batch(self, ids: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        loss = -self.model(ids).sum() * dist.get_world_size()
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch: int) -> None:
        print(f"[rank {self.global_rank}] Epoch {epoch} | Steps left: {len(self.train_data)}")
        for ids in self.train_data:
            self._run_batch(ids)
            self.state.commit()  # elastic
            time.sleep(self.step_time)

    def train(self) -> None:
        for epoch in self.state.epochs():  # elastic
            self._run_epoch(epoch)
        self.state.finish()  # elastic


def main(samples: int, step_time: float, hang_at_end: bool = False, fsdp: bool = False) -> None:
    ddp_setup()
    Trainer(Counter(samples), Ids(samples), step_time, fsdp).train()
    dist.destroy_process_group()
    if hang_at_end:  # a script that never returns after its last step (tests the master)
        threading.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="elastic DDP counting job")
    parser.add_argument("--samples", type=int, default=240)
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds to sleep per step")
    parser.add_argument("--hang-at-end", action="store_true", help="never exit after training")
    parser.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2")
    args = parser.parse_args()
    main(args.samples, args.step_time, args.hang_at_end, args.fsdp)
