"""CUDA state through the runtime's snapshot and back, byte for byte, onto the right device."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from tests.gpu.support import GPU_COUNT, requires_cuda
from tests.ranks import run_ranks

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
    assert isinstance(snapshotter.buffer.data, torch.Tensor) and snapshotter.buffer.data.is_pinned()
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


def test_training_goes_on_while_the_copies_run_and_the_snapshot_holds_the_step_before(
    tmp_path: Path,
) -> None:
    """The copies of parameters and optimizer state run on a side stream behind ``save``;
    the next ``optimizer.step()`` waits for them on the GPU: the file holds the state of the
    snapshot's step, byte for byte, although training went on at once."""
    from kfp_elastic.worker.host_copy import DONE
    from kfp_elastic.worker.snapshot import Snapshotter, read_state

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(2048, 2048), torch.nn.BatchNorm1d(2048), torch.nn.Linear(2048, 2048)
    ).cuda()  # ~64 MB of state with momentum: copies that take a while
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batch = torch.randn(64, 2048, device="cuda")

    def step() -> None:
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    snapshotter = Snapshotter(tmp_path)
    snapshotter.guard(optimizer)
    persisted: list[str] = []
    for snapshot in range(3):
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 1}
        expected = {k: _bytes(v) for k, v in model.state_dict().items()}
        momentum = _bytes(optimizer.state_dict()["state"][0]["momentum_buffer"])
        snapshotter.save(snapshot, state, persisted.append)
        assert snapshotter._copied is not DONE, "the parameters' copies did not overlap"
        for _ in range(3):
            step()  # the first one waits (on the GPU) for the copies it would overwrite
        snapshotter.wait()
        saved = read_state(tmp_path / persisted[-1])
        assert {k: _bytes(v) for k, v in saved["model"].items()} == expected
        assert _bytes(saved["optimizer"]["state"][0]["momentum_buffer"]) == momentum
    assert snapshotter.buffer.data is not None and snapshotter.buffer.data.is_pinned()


def test_a_rescue_of_a_cuda_state_reuses_the_pinned_buffer(tmp_path: Path) -> None:
    from kfp_elastic.worker.rescue import Rescues
    from kfp_elastic.worker.snapshot import Snapshotter

    state = {"w": torch.randn(1024, 1024, device="cuda"), "step": 2}
    snapshotter = Snapshotter(tmp_path / "snapshots")
    snapshotter.save(1, state, lambda name: None, wait=True)
    pinned = snapshotter.buffer.data
    rescues = Rescues(tmp_path / "rescues", "run", snapshotter.buffer)
    rescues.write(2, 0, state)
    assert snapshotter.buffer.data is pinned
    found = rescues.newest_after(1)
    assert found is not None and _bytes(found[1]["w"]) == _bytes(state["w"])


RANK = textwrap.dedent("""
    import hashlib, json, pickle, sys
    import torch, torch.distributed as dist
    from kfp_elastic.worker.collective import shared_state

    original = dist.broadcast_object_list
    def small_objects_only(objects, src=0, group=None, device=None, **kwargs):
        if dist.get_rank() == src:
            assert len(pickle.dumps(objects)) < 64 * 1024, "the state went through pickle"
        return original(objects, src=src, group=group, device=device, **kwargs)
    dist.broadcast_object_list = small_objects_only
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(5)
    state = {"w": torch.randn(1000, 1001, generator=g), "h": torch.randn(77, generator=g).half(),
             "rng": torch.get_rng_state(), "step": 4}
    got = shared_state(state if rank == 0 else None, chunk_bytes=1 << 20)
    def digest(t):
        raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        return [str(t.dtype), str(t.device), hashlib.sha256(raw).hexdigest()]
    print(json.dumps({"rank": rank, "got": {k: digest(got[k]) for k in ("w", "h", "rng")},
                      "expected": {k: digest(state[k]) for k in ("w", "h", "rng")},
                      "step": got["step"]}))
    dist.destroy_process_group()
""")


def test_two_nccl_ranks_restore_a_state_as_tensors_byte_for_byte() -> None:
    """Ranks share the GPU when there is one (each its own NCCL_HOSTID, sockets on lo)."""
    reports = run_ranks(
        RANK,
        timeout=180,
        env_of=lambda rank: {
            "CUDA_VISIBLE_DEVICES": str(rank if GPU_COUNT > 1 else 0),
            "NCCL_HOSTID": f"shared-state-{rank}",
            "NCCL_SOCKET_IFNAME": "lo",
        },
    )
    for report in reports:
        assert report["got"] == report["expected"] and report["step"] == 4
