"""Sharded (FSDP2) snapshots in host memory (``worker/sharded_snapshot.py``): who keeps whose
copy, and a real gloo world of 3 snapshotting an unevenly sharded model and its AdamW state,
restored from its nodes' memory into worlds of 2, 3 and 4, and from disk when two neighbouring
nodes are gone."""

from __future__ import annotations

import json
import shutil
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kfp_elastic.worker.sharded_snapshot import ring_neighbours
from tests.ranks import run_ranks


@pytest.mark.parametrize(
    ("nodes", "neighbours"),
    [
        (["a"], [None]),
        (["a", "a", "a"], [None, None, None]),
        (["a", "b", "c"], [1, 2, 0]),
        (["a", "b"], [1, 0]),
        # Two ranks per node: the same local rank on the next node.
        (["a", "a", "b", "b"], [2, 3, 0, 1]),
        (["a", "a", "b", "b", "c", "c"], [2, 3, 4, 5, 0, 1]),
        # Uneven nodes: the rank that many places on, else the first after it on another node.
        (["a", "a", "b"], [2, 2, 0]),
        (["a", "b", "b"], [1, 0, 0]),
        (["a", "a", "a", "b"], [3, 3, 3, 0]),
    ],
)
def test_ring_neighbours(nodes: list[str], neighbours: list[int | None]) -> None:
    assert ring_neighbours(nodes) == neighbours
    for rank, neighbour in enumerate(neighbours):
        # A copy is never on its own node; a rank is without one only when its node is alone.
        assert neighbour is None or nodes[neighbour] != nodes[rank]
        assert (neighbour is None) == (len(set(nodes)) == 1)


# One rank of a gloo world; argv[1] is the JSON of what it does (the phase) and where. Its
# last stdout line is its report.
RANK = textwrap.dedent("""
    import json, sys
    from datetime import timedelta
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    from kfp_elastic.worker import sharded_snapshot as snapshots
    from kfp_elastic.worker.memory_reshard import PeerMemoryReader, ShardsLost, holdings
    from kfp_elastic.worker.shard_memory import NodeSlots, SlotError
    from kfp_elastic.worker.sharding import (
        SHARDED_KEYS, full_model_state, load_sharded_state, shard_model, sharded_state,
    )

    config = json.loads(sys.argv[1])
    phase, base = config["phase"], Path(config["base"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    node = config["nodes"][rank]

    def build():
        torch.manual_seed(0)
        # Uneven dim-0 sizes: 31, 7 and 5 rows shard unevenly over 2, 3 and 4 ranks (the last
        # layer leaves rank 3 of 4 an empty shard).
        model = nn.Sequential(nn.Linear(13, 31), nn.ReLU(), nn.Linear(31, 7), nn.Linear(7, 5))
        model = shard_model(model, "per-module", None, torch.device("cpu"))
        return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)

    def train(model, optimizer, step):
        # The same batch on every rank: the averaged gradient is that batch's at any world size.
        x = torch.randn(8, 13, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    def full(model, optimizer):
        # Cloned: the full optimizer state shares plain tensors (``step``) with the optimizer.
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return clone({
            "model": full_model_state(model),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=options),
        })

    def clone(value):
        if isinstance(value, torch.Tensor):
            return value.clone()
        if isinstance(value, dict):
            return {k: clone(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(clone(v) for v in value)
        return value

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

    def own_bytes(state):
        # The bytes of this rank's shards (its DTensors' local chunks, whole plain tensors) and
        # of the non-tensor values (``torch.save``'s, as a slot holds them).
        items = snapshots.state_items({k: state[k] for k in SHARDED_KEYS})
        return sum(item.nbytes for item, _ in items)

    def shard_bytes(state):
        # The bytes of this rank's DTensor chunks only.
        return sum(
            t.to_local().numel() * t.to_local().element_size()
            for key in SHARDED_KEYS
            for t in flatten_state_dict(state[key])[0].values()
            if isinstance(t, DTensor)
        )

    def make(memory, disk_every=0):
        return snapshots.ShardedSnapshots(
            Path(memory) / node, base / "disk", node, disk_every=disk_every
        )

    def compare(model, optimizer, report):
        got = full(model, optimizer)
        train(model, optimizer, 4)
        after = full_model_state(model)
        if rank == 0:
            reference = torch.load(base / "reference.pt", weights_only=False)
            report["model_equal"] = equal(got["model"], reference["state"]["model"])
            report["optimizer_equal"] = equal(got["optimizer"], reference["state"]["optimizer"])
            report["optimizer_steps"] = sorted(
                {float(s["step"]) for s in got["optimizer"]["state"].values()}
            )
            report["next_step_max_diff"] = max(
                (after[k] - reference["after"][k]).abs().max().item() for k in after
            )
            report["next_step_equal"] = equal(after, reference["after"])

    model, optimizer = build()
    report = {"rank": rank, "world": world, "node": node}
    if phase == "save":
        snaps = make(config["memory"], disk_every=1)
        for step in (1, 2, 3):
            train(model, optimizer, step)
        state = sharded_state(model, optimizer)
        committed = []
        snaps.save(3, state | {"step": 3, "position": 24}, committed.append, wait=True)
        reference = full(model, optimizer)
        train(model, optimizer, 4)
        after = full_model_state(model)
        if rank == 0:
            torch.save({"state": reference, "after": after}, base / "reference.pt")
        report["committed"] = committed
        report["neighbours"] = snaps.neighbours
        report["slots"] = sorted([s, r, w] for s, r, w, _ in snaps.slots.names())
        report["state_bytes"] = own_bytes(state)
        report["cost"] = [snaps.cost.slot_bytes, snaps.cost.sent_bytes, snaps.cost.received_bytes]
        snaps.close()
    elif phase == "memory":
        snaps = make(config["memory"])
        template = sharded_state(model, optimizer) | {"step": 0, "position": 0}
        restored = snapshots.restore_from_memory(snaps, template, 3, 3)
        load_sharded_state(model, optimizer, restored.state)
        report["step"] = [restored.step, restored.state["step"], restored.state["position"]]
        report["moved"] = [restored.moved.received, restored.moved.sent, restored.moved.copied]
        report["own_bytes"] = own_bytes(template)
        report["shard_bytes"] = shard_bytes(template)
        compare(model, optimizer, report)
    elif phase == "lost":
        snaps = make(config["memory"])
        try:
            holdings(snaps.slots, 3, 3)
            report["lost"] = None
        except ShardsLost as error:
            report["lost"] = str(error)
        template = sharded_state(model, optimizer) | {"step": 0, "position": 0}
        directory = snapshots.newest_disk_snapshot(base / "disk", 3)
        restored = snapshots.restore_from_disk(template, directory)
        load_sharded_state(model, optimizer, restored.state)
        report["step"] = [restored.step, restored.state["step"], restored.state["position"]]
        compare(model, optimizer, report)
    elif phase == "refused":
        snaps = make(config["memory"])
        receive = NodeSlots.receive
        if rank == config["failing"]:
            def refuse(self, raw_header):
                raise SlotError("no room for the copy")  # as from a full tmpfs
            NodeSlots.receive = refuse
        train(model, optimizer, 1)
        committed = []
        snaps.save(1, sharded_state(model, optimizer) | {"step": 1}, committed.append)
        try:
            snaps.wait()
            report["error"] = None
        except Exception as error:
            report["error"] = f"{type(error).__name__}: {error}"
        report["committed"] = list(committed)
        report["files"] = sorted(p.name for p in snaps.slots.directory.iterdir())
        # The next snapshot, with room again, commits.
        NodeSlots.receive = receive
        train(model, optimizer, 2)
        snaps.save(2, sharded_state(model, optimizer) | {"step": 2}, committed.append, wait=True)
        report["then"] = committed
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(report))
""")

NODES = ["node0", "node1", "node2"]


def _run(phase: str, base: Path, memory: Path, nodes: Sequence[str], **extra: Any) -> list[Any]:
    config = {"phase": phase, "base": str(base), "memory": str(memory), "nodes": list(nodes)}
    return run_ranks(RANK, json.dumps(config | extra), world=len(nodes), timeout=50)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    """A world of 3 (each rank a node) that trained 3 steps and snapshotted them in memory and
    on disk; ``reference.pt``: the full state then and the model after a 4th step."""
    base = tmp_path_factory.mktemp("sharded")
    reports = _run("save", base, base / "memory", NODES)
    return base, reports


def _memory_of(base: Path, into: Path, nodes: Sequence[str]) -> Path:
    """A copy of the saved world's node directories, of ``nodes`` only (a restore may drop
    slots: each test gets its own)."""
    for node in nodes:
        source = base / "memory" / node
        if source.exists():
            shutil.copytree(source, into / node)
    return into


def test_a_world_of_three_snapshots_each_rank_with_a_copy_on_the_next_node(
    saved: tuple[Path, list[Any]],
) -> None:
    _, reports = saved
    assert [r["committed"] for r in reports] == [["memory-000000003"], [], []]
    assert all(r["neighbours"] == [1, 2, 0] for r in reports)
    # Each node: its rank's slot and the copy of the rank before it (the ring neighbour's).
    assert [r["slots"] for r in reports] == [
        [[3, 0, 3], [3, 2, 3]],
        [[3, 0, 3], [3, 1, 3]],
        [[3, 1, 3], [3, 2, 3]],
    ]
    for rank, report in enumerate(reports):
        slot, sent, received = report["cost"]
        assert sent == slot >= report["state_bytes"] > 0
        assert received == reports[(rank - 1) % 3]["cost"][0]


@pytest.mark.parametrize(
    "nodes",
    [
        pytest.param(["node0", "node1"], id="3-to-2-node2-from-its-copy"),
        pytest.param(["node0", "node1", "node2"], id="3-to-3"),
        pytest.param(["node0", "node1", "node2", "node3"], id="3-to-4-with-an-empty-node"),
    ],
)
def test_a_snapshot_in_memory_restores_exactly_into_any_world(
    saved: tuple[Path, list[Any]], tmp_path: Path, nodes: list[str]
) -> None:
    base, saving = saved
    memory = _memory_of(base, tmp_path / "memory", nodes)
    reports = _run("memory", base, memory, nodes)
    first = reports[0]
    assert first["model_equal"] and first["optimizer_equal"]
    assert first["optimizer_steps"] == [3.0]
    # One more step trains as the uninterrupted world of 3 did (to rounding: the gradient is
    # averaged over another number of ranks).
    if len(nodes) == 3:
        assert first["next_step_equal"], first["next_step_max_diff"]
    assert first["next_step_max_diff"] <= 1e-6
    state_bytes = sum(r["state_bytes"] for r in saving)
    for report in reports:
        assert report["step"] == [3, 3, 24]
        received, _, copied = report["moved"]
        # No rank gets more than its new shards; the world moves at most the state.
        assert received + copied <= report["own_bytes"], report
    assert sum(r["moved"][0] for r in reports) <= state_bytes
    assert sum(r["moved"][0] for r in reports) == sum(r["moved"][1] for r in reports)
    if len(nodes) == 3:
        # Every rank's shards are on its own node: only the values every rank has (optimizer
        # steps, parameter groups) may come from another rank.
        for report in reports:
            assert report["moved"][0] <= report["own_bytes"] - report["shard_bytes"], report
            assert report["moved"][2] >= report["shard_bytes"] > 0, report


def test_two_lost_neighbours_are_found_on_every_rank_and_the_disk_snapshot_restores(
    saved: tuple[Path, list[Any]], tmp_path: Path
) -> None:
    """Nodes 1 and 2 are gone: rank 1's slot (node 1) and its copy (node 2) with them."""
    base, _ = saved
    memory = _memory_of(base, tmp_path / "memory", ["node0"])
    reports = _run("lost", base, memory, ["node0", "node3"])
    for report in reports:
        assert report["lost"] is not None and "[1]" in report["lost"], report
        assert report["step"] == [3, 3, 24]
    assert reports[0]["model_equal"] and reports[0]["optimizer_equal"]
    assert reports[0]["next_step_max_diff"] <= 1e-6


def test_a_copy_that_cannot_be_written_fails_the_snapshot_on_every_rank(tmp_path: Path) -> None:
    """Rank 1 cannot place rank 0's copy: no rank waits for ever, every rank's ``wait()``
    raises, rank 0 commits nothing, and no half-written copy is left."""
    reports = _run("refused", tmp_path, tmp_path / "memory", NODES, failing=1)
    for report in reports:
        assert report["error"] is not None, report
        assert report["committed"] == []
        assert not [name for name in report["files"] if name.startswith(".")], report
    assert "no room for the copy" in reports[1]["error"]
    # The failed step's slots are dropped (never committed): the next snapshot reuses their
    # pages, never the committed snapshot's.
    assert all(report["files"] == [] for report in reports), reports
    assert [r["then"] for r in reports] == [["memory-000000002"], [], []]
