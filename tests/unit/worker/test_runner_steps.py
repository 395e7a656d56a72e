"""The runner's step hook (a model definition's ``on_step``): called once per optimizer step, with
its number, and ``benchmarks/timed_model_def.py`` numbering its step lines 1, 2, 3, ... with it
(a world of one on Gloo)."""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path

import pytest
import torch

from kfp_elastic.etcd.embedded import EmbeddedEtcd
from kfp_elastic.testing.model_defs import counting
from kfp_elastic.worker import runner
from kfp_elastic.worker.device import Placement
from kfp_elastic.worker.model_def import load_model_def
from kfp_elastic.worker.options import parse_args


def test_the_step_hook_is_called_once_per_step_with_its_number(
    world_of_one: None, etcd_env: None, etcd: EmbeddedEtcd, run_id: str, tmp_path: Path
) -> None:
    called: list[int] = []
    model_def = dataclasses.replace(
        load_model_def("kfp_elastic.testing.model_defs.counting"), on_step=called.append
    )
    options = parse_args(
        ["--model-def", model_def.name, "--snapshot-dir", str(tmp_path)]
        + ["--batch-size", "16", "--epochs", "2", "--snapshot-every", "5"]
    )
    trainer = runner.Trainer(options, model_def, Placement(torch.device("cpu"), "gloo"))
    assert trainer.run() == 0
    steps = trainer.loop.step
    assert steps == 2 * -(-counting.SAMPLES // 16)  # two epochs
    assert called == list(range(1, steps + 1))


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
        options = parse_args(
            ["--model-def", "benchmarks.timed_model_def", "--snapshot-dir", str(tmp_path / "s")]
            + ["--batch-size", "16", "--epochs", "1", "--snapshot-every", "5"]
        )
        trainer = runner.Trainer(
            options, load_model_def(options.model_def), Placement(torch.device("cpu"), "gloo")
        )
        assert trainer.run() == 0
        lines = (tmp_path / "steps.jsonl").read_text().splitlines()
        steps = [json.loads(line)["step"] for line in lines]
        assert steps and steps == list(range(1, len(steps) + 1))
        assert trainer.loop.step == len(steps)
    finally:
        monkeypatch.undo()
        importlib.reload(timed)  # as the environment of other tests has it
