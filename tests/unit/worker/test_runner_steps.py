"""The runner's step numbers as ``benchmarks/timed_model_def.py`` reads them: the ``step`` local
of ``Trainer._train`` (the steps finished before the one now finishing), so that a job's step
lines number its optimizer steps 1, 2, 3, ... (a world of one on Gloo)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

from kfp_elastic.etcd.embedded import EmbeddedEtcd
from kfp_elastic.worker import runner
from kfp_elastic.worker.device import Placement
from kfp_elastic.worker.model_def import load_model_def
from kfp_elastic.worker.options import parse_args


def test_the_timed_wrapper_numbers_the_runners_steps(
    world_of_one: None,
    etcd_env: None,
    etcd: EmbeddedEtcd,
    run_id: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TIMED_MODEL_DEF", "kfp_elastic.testing.model_defs.counting")
    monkeypatch.setenv("TIMED_STEPS_FILE", str(tmp_path / "steps.jsonl"))
    import benchmarks.timed_model_def as timed

    importlib.reload(timed)  # it reads its environment on import
    try:
        args = parse_args(
            ["--model-def", "benchmarks.timed_model_def", "--snapshot-dir", str(tmp_path / "s")]
            + ["--batch-size", "16", "--epochs", "1", "--snapshot-every", "5"]
        )
        trainer = runner.Trainer(
            args, load_model_def(args.model_def), Placement(torch.device("cpu"), "gloo")
        )
        assert trainer.run() == 0
        lines = (tmp_path / "steps.jsonl").read_text().splitlines()
        steps = [json.loads(line)["step"] for line in lines]
        assert steps and steps == list(range(1, len(steps) + 1))
        assert trainer.loop.step == len(steps)
    finally:
        monkeypatch.undo()
        importlib.reload(timed)  # as the environment of other tests has it
