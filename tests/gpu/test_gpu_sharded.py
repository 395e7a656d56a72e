"""A sharded (FSDP2) model on the GPU through the sharded snapshots and back: from host memory
(``ShardedSnapshots.save`` / ``restore_from_memory``) and from disk (``save_to_disk`` /
``restore_from_disk``), equal to the saved state and on the GPU again."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.gpu.support import requires_cuda
from tests.ranks import run_ranks

pytestmark = [pytest.mark.gpu, requires_cuda]

# One rank (a world of 1) on the device argv[2] names; argv[1]: its directory. Its last stdout
# line is its report.
RANK = textwrap.dedent("""
    import json, sys
    from datetime import timedelta
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    from kfp_elastic.worker import sharded_snapshot as snapshots
    from kfp_elastic.worker.sharding import (
        SHARDED_KEYS, full_model_state, load_sharded_state, shard_model, sharded_state,
    )

    base, device = Path(sys.argv[1]), torch.device(sys.argv[2])
    if device.type == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timedelta(seconds=60))
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(13, 31), nn.ReLU(), nn.Linear(31, 7), nn.Linear(7, 5))
        model = shard_model(model.to(device), "per-module", None, device)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)

    def train(model, optimizer, step):
        x = torch.randn(8, 13, generator=torch.Generator().manual_seed(step)).to(device)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    def clone(value):
        if isinstance(value, torch.Tensor):
            return value.clone()
        if isinstance(value, dict):
            return {k: clone(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(clone(v) for v in value)
        return value

    def full(model, optimizer):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return clone({
            "model": full_model_state(model),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=options),
        })

    def equal(a, b):
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(
                equal(a[k], b[k]) for k in a
            )
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
        return a == b

    def devices(model, optimizer):
        tensors = [*model.parameters()] + [
            v for s in optimizer.state.values() for v in s.values() if isinstance(v, DTensor)
        ]
        return sorted({t.to_local().device.type for t in tensors})

    trained, trained_optimizer = build()
    for step in (1, 2, 3):
        train(trained, trained_optimizer, step)
    snaps = snapshots.ShardedSnapshots(base / "memory" / "node0", base / "disk", "node0")
    state = sharded_state(trained, trained_optimizer)
    committed = []
    snaps.save(3, state | {"step": 3}, committed.append, wait=True)
    disk = snaps.save_to_disk(3, {k: state[k] for k in SHARDED_KEYS}, {"step": 3})
    reference = full(trained, trained_optimizer)
    report = {"committed": committed, "trained_on": devices(trained, trained_optimizer)}
    for source in ("memory", "disk"):
        model, optimizer = build()
        template = sharded_state(model, optimizer) | {"step": 0}
        if source == "memory":
            restored = snapshots.restore_from_memory(snaps, template, 3, 1)
        else:
            restored = snapshots.restore_from_disk(template, disk)
        load_sharded_state(model, optimizer, restored.state)
        report[source] = {
            "equal": equal(full(model, optimizer), reference),
            "step": [restored.step, restored.state["step"]],
            "on": devices(model, optimizer),
        }
        # The restored model trains on as the one it was saved from.
        train(model, optimizer, 4)
        if source == "memory":
            train(trained, trained_optimizer, 4)
            after = full_model_state(trained)
        report[source]["next_step_equal"] = equal(full_model_state(model), after)
    snaps.close(remove=True)
    dist.destroy_process_group()
    print(json.dumps(report))
""")


def test_a_sharded_gpu_state_restores_from_memory_and_from_disk(tmp_path: Path) -> None:
    (report,) = run_ranks(
        RANK,
        str(tmp_path),
        "cuda",
        world=1,
        timeout=180,
        env_of=lambda rank: {
            "CUDA_VISIBLE_DEVICES": "0",
            "NCCL_SOCKET_IFNAME": "lo",
            "CUBLAS_WORKSPACE_CONFIG": ":4096:8",  # the same sums in the same order
        },
    )
    assert report["committed"] == ["memory-000000003"]
    assert report["trained_on"] == ["cuda"]
    for source in ("memory", "disk"):
        restored = report[source]
        assert restored["equal"] and restored["step"] == [3, 3], (source, restored)
        assert restored["on"] == ["cuda"], (source, restored)
        assert restored["next_step_equal"], (source, restored)
