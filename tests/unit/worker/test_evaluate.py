"""``evaluate`` runs on the job's device: the CPU here, a GPU where asked (tests/gpu/)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kfp_elastic.worker.device import DeviceError
from kfp_elastic.worker.evaluate import evaluate, main
from kfp_elastic.worker.model_def import load_model_def

DIGITS = "kfp_elastic.worker.examples.digits"


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.pt"
    torch.manual_seed(0)
    torch.save(load_model_def(DIGITS).model().state_dict(), path)
    return path


def test_auto_and_cpu_give_the_same_scores_without_a_gpu(model_file: Path) -> None:
    if torch.accelerator.is_available():
        pytest.skip("this machine has an accelerator: auto would take it")
    assert evaluate(DIGITS, model_file, device="auto") == evaluate(DIGITS, model_file, device="cpu")


def test_an_unusable_device_is_a_clear_error(model_file: Path, capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(DeviceError, match="no cuda device visible"):
        evaluate(DIGITS, model_file, device="cuda")
    assert main(["--model-def", DIGITS, "--model", str(model_file), "--device", "cuda"]) == 2
    assert "no cuda device visible" in capsys.readouterr().err
