"""pytorch/examples' DDP tutorial (``multinode.py``) on CPU, nothing of kfp_elastic imported:
its own ``snapshot.pt`` every epoch, resumed from at every (re)start. Run by the master it
restarts when a node is lost and goes on from its last snapshot; the snapshot lives in
``$KFP_ELASTIC_SNAPSHOT_DIR``, the job's shared directory (``kfp_elastic/job_env.py``).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.data = [
            (torch.rand(20, generator=generator), torch.rand(1, generator=generator))
            for _ in range(size)
        ]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index]


def ddp_setup() -> None:
    init_process_group(backend="gloo")


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, step_time):  # noqa: ANN001
        self.global_rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        self.step_time = step_time
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, snapshot_path: str) -> None:
        snapshot = torch.load(snapshot_path, map_location="cpu")
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}", flush=True)

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        time.sleep(self.step_time)

    def _run_epoch(self, epoch: int) -> None:
        print(f"[RANK{self.global_rank}] Epoch {epoch} | Steps: {len(self.train_data)}", flush=True)
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        os.makedirs(os.path.dirname(self.snapshot_path) or ".", exist_ok=True)
        temporary = self.snapshot_path + ".tmp"
        torch.save(snapshot, temporary)
        os.replace(temporary, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}", flush=True)

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.global_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch + 1)


def main(save_every: int, total_epochs: int, batch_size: int, step_time: float) -> None:
    ddp_setup()
    dataset = MyTrainDataset(256)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(
        dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset)
    )
    snapshot_path = os.path.join(os.environ.get("KFP_ELASTIC_SNAPSHOT_DIR", "."), "snapshot.pt")
    # As the tutorial has it: the trainer (and its DDP model) outlives destroy_process_group()
    # and is freed as main() returns, which is where a job's end can deadlock in torch.
    trainer = Trainer(model, loader, optimizer, save_every, snapshot_path, step_time)
    trainer.train(total_epochs)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int)
    parser.add_argument("save_every", type=int)
    parser.add_argument("--batch_size", default=32, type=int)
    parser.add_argument("--step_time", default=0.0, type=float)
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.step_time)
