"""A script-API training loop whose rank 1 loss is NaN at step 3; it hands every loss to
``state.commit(loss)``, which applies the job's nan policy (``KFP_ELASTIC_NAN_POLICY``)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

from kfp_elastic.worker import elastic

NAN_STEP, NAN_RANK = 3, 1


@record
def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    state = elastic.State(model=model, optimizer=optimizer)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 4, generator=generator), torch.arange(48) % 3)
    loader = elastic.DataLoader(data, state)
    for _epoch in state.epochs():
        for inputs, targets in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs), targets)
            if state.step + 1 == NAN_STEP and dist.get_rank() == NAN_RANK:
                loss = loss * float("nan")
            loss.backward()
            optimizer.step()
            state.commit(loss)
    state.finish()
    print(f"rank {dist.get_rank()} finished steps={state.step}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
