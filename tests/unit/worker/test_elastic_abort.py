"""The script API's stall abort (worker/elastic.py): a world of one on Gloo, whose State is
given the NCCL stall abort with a stand-in for the communicator abort. After the round breaks,
the next ``optimizer.step()`` refuses the (partial) gradients and the uncaught error writes the
rescue of the last counted step."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

from kfp_elastic.etcd.embedded import EmbeddedEtcd
from kfp_elastic.job_env import JobEnv
from kfp_elastic.worker import elastic, loop, peer_loss
from kfp_elastic.worker.device import CollectiveAborted, StallAbort
from kfp_elastic.worker.rescue import Rescues


def test_a_script_stalled_after_its_round_broke_is_aborted_and_rescued(
    world_of_one: None,
    etcd_env: None,
    etcd: EmbeddedEtcd,
    run_id: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "excepthook", lambda *_: None)  # State chains to it; restored
    aborted = threading.Event()
    made: list[StallAbort | None] = []

    def nccl_stall(backend: str, grace_s: float, etcd: object, run: str) -> StallAbort | None:
        assert backend == "gloo" and grace_s == 7.0 and run == run_id
        stall = peer_loss.watch_stalls("nccl", 0.0, None, run, {}, abort=aborted.set)
        made.append(stall)
        return stall

    monkeypatch.setattr(loop, "watch_stalls", nccl_stall)
    model = torch.nn.Linear(1, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    settings = JobEnv(
        run_id=run_id, snapshot_dir=str(tmp_path), epochs=1, batch_size=1, collective_abort=7.0
    )
    state = elastic.State(model, optimizer, settings=settings)
    loader = elastic.DataLoader(torch.utils.data.TensorDataset(torch.ones(8, 1)), state)
    stall = made[0]
    assert stall is not None and state.stall is stall
    batches = iter(loader)
    for _ in range(2):
        (inputs,) = next(batches)
        model(inputs).sum().backward()
        optimizer.step()
        state.commit()
    trained = model.weight.detach().clone()
    stall.round_broken("participant(s) lost: node-b")
    assert aborted.wait(30)
    (inputs,) = next(batches)
    model(inputs).sum().backward()
    with pytest.raises(CollectiveAborted) as raised:
        optimizer.step()  # the aborted allreduce's gradients never reach the parameters
    assert torch.equal(model.weight, trained)
    sys.excepthook(CollectiveAborted, raised.value, raised.value.__traceback__)
    found = Rescues(tmp_path, run_id).newest_after(0)
    assert found is not None and found[0] == 2
    assert torch.equal(found[1]["model"]["weight"], trained)
    state.close()
