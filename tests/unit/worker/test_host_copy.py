"""Snapshot copies that overlap training: what may stay in flight, what waits for it, the one
host buffer (shared with the rescue) and its fit in the container's memory.

The CUDA copier itself needs a GPU (tests/gpu/test_gpu_snapshot.py); here a copier that runs
its copies as late as it may stands in for the side stream, so that a missing wait shows up as
wrong bytes in the snapshot."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from kfp_elastic.worker import snapshot_format
from kfp_elastic.worker.host_copy import (
    DONE,
    HostBuffer,
    SyncCopier,
    cgroup_memory,
    copier_for,
    deferred,
    memory_problem,
    overlaps,
)
from kfp_elastic.worker.rescue import Rescues
from kfp_elastic.worker.snapshot import Snapshotter, read_state


class _Late:
    def __init__(self, copies: list, gate: threading.Event | None) -> None:
        self.copies, self.gate = copies, gate

    def run(self) -> None:
        while self.copies:
            target, source = self.copies.pop(0)
            target.copy_(source)

    def wait_host(self) -> None:
        if self.gate is not None:
            assert self.gate.wait(10), "the test never opened the gate"
        self.run()

    def wait_device(self) -> None:
        self.run()


class LateCopier:
    """Copies every tensor asynchronously and reads its source only when someone waits: the
    latest a side stream may run them. The host waits of the deferred copies (the snapshot
    writer's) hold until ``gate`` opens; the device wait (before the step) runs them at once."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.marks = 0

    def start(self) -> None:
        self.marks = 0
        self.queued: list = []

    def asynchronous(self, source: torch.Tensor) -> bool:
        return True

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        self.queued.append((target, source))

    def mark(self) -> _Late:
        self.marks += 1
        copies, self.queued = self.queued, []
        return _Late(copies, self.gate if self.marks > 1 else None)


def test_only_asynchronous_copies_of_what_only_the_step_changes_stay_in_flight() -> None:
    assert deferred([True, True, False, False], [True, False, True, False]) == [
        True,
        False,
        False,
        False,
    ]
    assert overlaps({"cuda"}) and not overlaps(set()) and not overlaps({"cuda", "mps"})
    cpu_state = copier_for(set(), overlap=True)
    assert isinstance(cpu_state, SyncCopier) and cpu_state.mark() is DONE


def test_on_cpu_pack_copies_everything_before_it_returns() -> None:
    weight = torch.randn(5, 3)
    packed = snapshot_format.pack({"w": weight}, stepped=lambda tensor: True)
    assert packed.copied is DONE
    expected = weight.clone()
    weight.add_(1)  # the next step
    restored = snapshot_format.build(packed.tree, [_tensor(packed, 0)])
    assert torch.equal(restored["w"], expected)


def _tensor(packed: snapshot_format.Packed, index: int) -> torch.Tensor:
    entry = packed.table[index]
    raw = torch.frombuffer(packed.payload, dtype=torch.uint8)
    return snapshot_format.from_bytes(raw[entry["offset"] :][: entry["nbytes"]], entry).clone()


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    return model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 4)).square().mean().backward()  # forward: BatchNorm stats change
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 1}


@pytest.mark.parametrize("guarded", [True, False])
def test_the_next_optimizer_step_waits_for_the_snapshot_copies(
    tmp_path: Path, guarded: bool
) -> None:
    model, optimizer = _model()
    _step(model, optimizer)  # momentum buffers exist
    copier = LateCopier()
    snapshots = Snapshotter(tmp_path, copier=copier)
    handle = snapshots.guard(optimizer)
    if not guarded:
        handle.remove()
    persisted: list[str] = []
    snapshots.save(1, _state(model, optimizer), persisted.append)
    expected = {k: v.clone() for k, v in _state(model, optimizer)["model"].items()}
    momentum = optimizer.state_dict()["state"][0]["momentum_buffer"].clone()
    _step(model, optimizer)  # forward and backward overlap the copies; the step waits
    copier.gate.set()
    snapshots.wait()
    saved = read_state(tmp_path / persisted[0])
    same = all(torch.equal(saved["model"][k], v) for k, v in expected.items()) and torch.equal(
        saved["optimizer"]["state"][0]["momentum_buffer"], momentum
    )
    assert same == guarded
    # BatchNorm's statistics, changed by every forward, were copied before save() returned.
    assert torch.equal(saved["model"]["1.running_mean"], expected["1.running_mean"])


def test_what_the_step_does_not_change_is_copied_before_save_returns(tmp_path: Path) -> None:
    model, optimizer = _model()
    _step(model, optimizer)
    copier = LateCopier()
    snapshots = Snapshotter(tmp_path, copier=copier)
    snapshots.guard(optimizer)
    snapshots.save(1, _state(model, optimizer), lambda name: None)
    # Parameters and momentum are still queued; the buffers (BatchNorm) are not.
    assert snapshots._copied is not DONE
    queued = {source.data_ptr() for _, source in snapshots._copied.copies}
    assert model[1].running_mean.data_ptr() not in queued
    assert queued >= {p.data_ptr() for p in model.parameters()}
    snapshots.wait_copied()
    assert snapshots._copied is DONE
    copier.gate.set()
    snapshots.wait()


def test_a_rescue_reuses_the_snapshot_buffer_and_never_pins(tmp_path: Path) -> None:
    model, optimizer = _model()
    snapshots = Snapshotter(tmp_path / "snapshots")
    snapshots.save(1, _state(model, optimizer), lambda name: None, wait=True)
    first = snapshots.buffer.data
    assert first is not None
    rescues = Rescues(tmp_path / "rescues", "run", snapshots.buffer, buffer_wait_s=0.01)
    rescues.write(1, 0, _state(model, optimizer))
    assert snapshots.buffer.data is first  # written from the same buffer, not a new one
    found = rescues.newest_after(0)
    assert found is not None and torch.equal(found[1]["model"]["0.weight"], model[0].weight)
    # Busy (a snapshot in flight holds it): the rescue goes on without it.
    assert snapshots.buffer.take()
    try:
        rescues.write(2, 0, {**_state(model, optimizer), "step": 2})
    finally:
        snapshots.buffer.release()
    assert rescues.newest_after(1) is not None and snapshots.buffer.data is first


def test_a_buffer_that_does_not_fit_the_memory_limit_is_named(tmp_path: Path) -> None:
    assert memory_problem(2**30, None, None) is None
    assert memory_problem(2**30, 4 * 2**30, 2**30) is None
    problem = memory_problem(3 * 2**30, 4 * 2**30, 2 * 2**30)
    assert problem and "3.00 GiB" in problem and "4.00 GiB" in problem
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("123\n")
    assert cgroup_memory(tmp_path) == (None, 123)
    (tmp_path / "memory.max").write_text("4096\n")
    assert cgroup_memory(tmp_path) == (4096, 123)
    # Page cache is reclaimable: anonymous memory is what the buffer competes with.
    (tmp_path / "memory.stat").write_text("anon 100\nfile 23\n")
    assert cgroup_memory(tmp_path) == (4096, 100)
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(2**63 - 4096))
    assert cgroup_memory(v1) == (None, None)


def test_the_host_buffer_grows_and_is_reused() -> None:
    buffer = HostBuffer()
    first = buffer.fit(100, pinned=False)
    assert buffer.fit(50, pinned=False) is first and buffer.nbytes == 100
    assert buffer.fit(200, pinned=False) is not first and buffer.nbytes == 200
