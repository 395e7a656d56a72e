"""What the script API (worker/elastic.py) gets from the elastic loop it shares with the
``--model-def`` runner (worker/loop.py), in a world of one on Gloo: the worker's end recorded
(on the SIGTERM stop and at the finish), commits stamped with their time and round for the
timeline, and no rescue of parameters that are ahead of the counted step."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from kfp_elastic.contract.worker_end import END_COMPLETED, END_SIGTERM, read_end
from kfp_elastic.etcd.client import connect
from kfp_elastic.etcd.embedded import EmbeddedEtcd
from kfp_elastic.job_env import ROUND_ENV, JobEnv
from kfp_elastic.worker import elastic
from kfp_elastic.worker.collective import EXIT_PREEMPTED
from kfp_elastic.worker.progress import Progress
from kfp_elastic.worker.rescue import Rescues

SAMPLES = 8  # batch 1 in a world of one: 8 steps an epoch


@pytest.fixture
def job_env(etcd: EmbeddedEtcd, monkeypatch: pytest.MonkeyPatch) -> None:
    """The etcd connection, the worker's name and its round, as the master's workers have."""
    for name, value in etcd.client_settings().to_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("KFP_ELASTIC_WORKER_NAME", "worker-a")
    monkeypatch.setenv(ROUND_ENV, "3")
    monkeypatch.setattr(sys, "excepthook", lambda *_: None)  # State chains to it; restored


def _state(run_id: str, tmp_path: Path, optimizer_class: type = torch.optim.SGD) -> elastic.State:
    model = torch.nn.Linear(1, 1, bias=False)
    optimizer = optimizer_class(model.parameters(), lr=0.1)
    settings = JobEnv(
        run_id=run_id,
        snapshot_dir=str(tmp_path / "snap"),
        output=str(tmp_path / "model.pt"),
        epochs=1,
        batch_size=1,
        snapshot_every=2,
    )
    return elastic.State(model, optimizer, settings=settings)


def _train(state: elastic.State, steps: int) -> None:
    loader = elastic.DataLoader(torch.utils.data.TensorDataset(torch.ones(SAMPLES, 1)), state)
    for _ in state.epochs():
        for done, (inputs,) in enumerate(loader):
            if done == steps:
                return
            state.model(inputs).sum().backward()
            state.optimizer.step()
            state.optimizer.zero_grad()
            state.commit()


def _end_and_committed(etcd: EmbeddedEtcd, run_id: str):  # noqa: ANN202 - test helper
    settings = etcd.client_settings()
    client = connect(settings)
    try:
        end = read_end(client, settings.run_prefix(run_id), "worker-a")
        committed, _ = Progress(client, settings.run_prefix(run_id)).committed_record()
    finally:
        client.close()
    return end, committed


def test_a_finished_script_records_its_end_and_stamped_commits(
    world_of_one: None, job_env: None, etcd: EmbeddedEtcd, run_id: str, tmp_path: Path
) -> None:
    state = _state(run_id, tmp_path)
    _train(state, SAMPLES)
    state.finish()
    end, committed = _end_and_committed(etcd, run_id)
    assert end is not None and (end.end, end.step, end.round) == (END_COMPLETED, SAMPLES, 3)
    assert committed is not None and committed.complete and committed.step == SAMPLES
    assert committed.round == 3 and committed.at > 0  # the timeline's time and round
    assert [entry.step for entry in committed.recent] == [2, 4, 6, 8]
    assert (tmp_path / "model.pt").exists()


def test_a_script_stopped_by_sigterm_records_its_end(
    world_of_one: None, job_env: None, etcd: EmbeddedEtcd, run_id: str, tmp_path: Path
) -> None:
    state = _state(run_id, tmp_path)
    os.kill(os.getpid(), signal.SIGTERM)  # State's handler: stop at the next sync
    with pytest.raises(SystemExit) as stopped:
        _train(state, SAMPLES)
    assert stopped.value.code == EXIT_PREEMPTED
    end, committed = _end_and_committed(etcd, run_id)
    assert committed is not None and committed.stopping and not committed.complete
    assert end is not None and (end.end, end.step) == (END_SIGTERM, committed.step)


class HalfStep(torch.optim.SGD):
    """Fails inside its third ``step()`` after updating the parameters, as a peer lost in the
    middle of a sharded optimizer's step leaves them."""

    steps = 0

    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch's signature
        super().step(closure)
        self.steps += 1
        if self.steps == 3:
            raise RuntimeError("peer lost inside optimizer.step()")


def test_no_rescue_of_a_script_that_failed_inside_an_optimizer_step(
    world_of_one: None, job_env: None, run_id: str, tmp_path: Path
) -> None:
    state = _state(run_id, tmp_path, HalfStep)
    with pytest.raises(RuntimeError, match="inside optimizer.step") as raised:
        _train(state, SAMPLES)
    sys.excepthook(RuntimeError, raised.value, raised.value.__traceback__)
    assert Rescues(tmp_path / "snap", run_id).newest_after(-1) is None
    state.close()


def test_a_script_that_failed_between_steps_is_rescued(
    world_of_one: None, job_env: None, run_id: str, tmp_path: Path
) -> None:
    state = _state(run_id, tmp_path)
    _train(state, 3)
    error = RuntimeError("peer lost in the next forward")
    sys.excepthook(RuntimeError, error, None)
    found = Rescues(tmp_path / "snap", run_id).newest_after(-1)
    assert found is not None and found[0] == 3
    assert torch.equal(found[1]["model"]["weight"], state.model.weight.detach())
    state.close()
