"""CUDA state through the runtime's snapshot and back, byte for byte, onto the right device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu.support import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def test_a_cuda_state_round_trips_byte_for_byte_through_pinned_memory(tmp_path: Path) -> None:
    from kfp_elastic.worker.snapshot import Snapshotter, read_state

    generator = torch.Generator(device="cuda").manual_seed(1)
    state = {
        "weight": torch.randn(257, 129, device="cuda", generator=generator),
        "half": torch.randn(1000, device="cuda", generator=generator).to(torch.bfloat16),
        "steps": torch.arange(7, device="cuda"),
        "strided": torch.randn(64, 64, device="cuda", generator=generator).t(),
        "step": 3,
    }
    persisted: list[str] = []
    snapshotter = Snapshotter(tmp_path)
    snapshotter.save(3, state, persisted.append, wait=True)
    assert isinstance(snapshotter._buffer, torch.Tensor) and snapshotter._buffer.is_pinned()
    restored = read_state(tmp_path / persisted[0])
    assert restored["step"] == 3
    for key in ("weight", "half", "steps", "strided"):
        assert restored[key].dtype == state[key].dtype and restored[key].shape == state[key].shape
        assert _bytes(restored[key]) == _bytes(state[key]), key
    # The pinned buffer is reused: a second save of changed values is as exact.
    state["weight"].mul_(2)
    snapshotter.save(4, state, persisted.append, wait=True)
    assert _bytes(read_state(tmp_path / persisted[1])["weight"]) == _bytes(state["weight"])


def test_a_restored_training_state_lands_on_this_process_device(tmp_path: Path) -> None:
    from kfp_elastic.worker.snapshot import Snapshotter, read_state
    from kfp_elastic.worker.train_step import TrainStep, rng_state, set_rng_state

    def stepper() -> TrainStep:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4).cuda()
        return TrainStep(model, torch.optim.AdamW(model.parameters(), lr=0.1), None, None, None)

    trained = stepper()
    loss = trained.model(torch.randn(16, 8, device="cuda")).square().mean()
    loss.backward()
    trained.optimizer.step()
    persisted: list[str] = []
    state = trained.state_dict() | {"step": 1, "epoch": 0, "position": 16} | rng_state()
    assert "cuda_rng" in state, "the CUDA generator is part of the state"
    Snapshotter(tmp_path).save(1, state, persisted.append, wait=True)

    fresh = stepper()
    loaded = read_state(tmp_path / persisted[0])
    fresh.load_state_dict(loaded)
    set_rng_state(loaded)
    for before, after in zip(trained.model.parameters(), fresh.model.parameters(), strict=True):
        assert after.device == torch.device("cuda", 0) and torch.equal(before, after)
    moments = [s["exp_avg"] for s in fresh.optimizer.state.values()]
    assert moments and all(m.device.type == "cuda" for m in moments)
    assert torch.equal(torch.cuda.get_rng_state(), loaded["cuda_rng"])
