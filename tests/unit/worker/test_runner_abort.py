"""The runtime's stall abort (worker/runner.py): a world of one on Gloo whose Trainer is given
the NCCL stall abort with a stand-in for the communicator abort. When its round breaks after a
step, the next step refuses its (partial) gradients and the rescue of the finished step is
written before the error leaves ``run()``."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from kfp_elastic.etcd.embedded import EmbeddedEtcd
from kfp_elastic.worker import loop, runner
from kfp_elastic.worker.device import CollectiveAborted, Placement, StallAbort
from kfp_elastic.worker.model_def import load_model_def
from kfp_elastic.worker.options import parse_args
from kfp_elastic.worker.rescue import Rescues


class BreaksAfterFirstStep(StallAbort):
    """The round breaks right after the first finished step, and the abort is done before the
    training thread goes on (a real one comes from the watch thread, ``grace_s`` later)."""

    def __init__(self, aborted: threading.Event) -> None:
        super().__init__(0.0, aborted.set)
        self._aborted_event = aborted
        self._steps = 0

    def progress(self) -> None:
        super().progress()
        self._steps += 1
        if self._steps == 1:
            self.round_broken("participant(s) lost: node-b")
            assert self._aborted_event.wait(30)


def test_the_runtime_stalled_after_its_round_broke_is_aborted_and_rescued(
    world_of_one: None,
    etcd_env: None,
    etcd: EmbeddedEtcd,
    run_id: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    aborted = threading.Event()
    made: list[StallAbort] = []

    def nccl_stall(backend: str, grace_s: float, etcd: object, run: str) -> StallAbort:
        assert backend == "gloo" and grace_s == 7.0 and run == run_id
        made.append(BreaksAfterFirstStep(aborted))
        return made[0]

    monkeypatch.setattr(loop, "watch_stalls", nccl_stall)
    options = parse_args(
        ["--model-def", "kfp_elastic.testing.model_defs.counting", "--snapshot-dir", str(tmp_path)]
        + ["--collective-abort", "7", "--batch-size", "4", "--snapshot-every", "100"]
    )
    trainer = runner.Trainer(
        options, load_model_def(options.model_def), Placement(torch.device("cpu"), "gloo")
    )
    with pytest.raises(CollectiveAborted, match="round broken"):
        trainer.run()
    found = Rescues(tmp_path, run_id).newest_after(0)
    assert found is not None and found[0] == 1  # the finished step, not the refused one
    counts = found[1]["model"]["counts"]
    assert counts.sum() == 4  # one step of a global batch of 4: each sample counted once
