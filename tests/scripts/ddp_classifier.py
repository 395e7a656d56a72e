"""docs/runtime.md's "Bring your own script" example, runnable: a classifier with an LR scheduler
and an extra state object, its five added lines marked ``# 1`` .. ``# 5``. 49 samples: with 2
ranks and batch 4 an epoch's last step leaves rank 1 an empty batch."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

from kfp_elastic.worker import elastic


class MyModel(torch.nn.Sequential):
    def __init__(self) -> None:
        super().__init__(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def MyDataset() -> TensorDataset:  # noqa: N802 - the doc's name
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(49, 4, generator=generator), torch.arange(49) % 3)


class StepCounter:
    """An extra state object (like an AMP GradScaler): anything with state_dict/load_state_dict."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]


def main() -> None:
    dist.init_process_group("gloo")  # "nccl" on GPUs
    torch.manual_seed(0)
    model = DDP(MyModel())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)
    counter = StepCounter()
    extras = {"counter": counter}
    state = elastic.State(model=model, optimizer=optimizer, scheduler=scheduler, **extras)  # 1
    loader = elastic.DataLoader(MyDataset(), state)  # 2
    batch_size = state.settings.batch_size  # per rank ($KFP_ELASTIC_BATCH_SIZE)
    for _epoch in state.epochs():  # 3
        for inputs, targets in loader:
            optimizer.zero_grad()
            # summed, not averaged: an empty batch then adds nothing
            loss = F.cross_entropy(model(inputs), targets, reduction="sum") / batch_size
            loss.backward()
            optimizer.step()
            scheduler.step()
            counter.steps += 1
            state.commit()  # 4
    state.finish()  # 5
    print(f"rank {dist.get_rank()} trained steps={counter.steps} lr_steps={scheduler.last_epoch}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
