"""Each rank keeps its own random generators across a snapshot and a restore.

Two gloo ranks gather their generators into rank 0's snapshot (``collective.gathered``, as the
runtime's commit does) and each gets its own back (``restore_rng_state``); in a world of another
size every rank seeds from (seed, rank, step) instead.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch

from kfp_elastic.worker.train_step import (
    RNG_BY_RANK,
    derived_seed,
    restore_rng_state,
    rng_state,
)
from tests.helpers import run_gloo_ranks


def test_derived_seeds_differ_by_rank_and_step_and_repeat() -> None:
    seeds = {derived_seed(7, rank, step) for rank in range(4) for step in (0, 10)}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)
    assert derived_seed(7, 1, 10) == derived_seed(7, 1, 10) != derived_seed(8, 1, 10)


def test_a_rank_without_generators_of_its_own_is_seeded_from_seed_rank_and_step() -> None:
    assert restore_rng_state({"step": 3}, 1, 2, seed=7) == f"derived seed {derived_seed(7, 1, 3)}"
    drawn = torch.rand(3)
    torch.manual_seed(derived_seed(7, 1, 3))
    assert torch.equal(drawn, torch.rand(3))
    saved = rng_state()
    expected = torch.rand(3)
    assert restore_rng_state({RNG_BY_RANK: [saved], "step": 3}, 0, 1, seed=7) == "own"
    assert torch.equal(torch.rand(3), expected)


RANK = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from kfp_elastic.worker.collective import gathered
    from kfp_elastic.worker.snapshot import Snapshotter
    from kfp_elastic.worker.train_step import RNG_BY_RANK, restore_rng_state, rng_state
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)  # the ranks' generators differ
    torch.rand(5)
    by_rank = gathered(rng_state())
    snapshots = Snapshotter(sys.argv[1])
    if rank == 0:
        snapshots.save(4, {"step": 4, RNG_BY_RANK: by_rank}, lambda name: None, wait=True)
    dist.barrier()
    after_save = torch.rand(4).tolist()
    torch.manual_seed(0)  # a restarted process: every rank starts alike
    state = snapshots.load("snapshot-000000004.pt")
    same = restore_rng_state(state, rank, world, seed=7)
    restored = torch.rand(4).tolist()
    other = restore_rng_state(state, rank, world + 1, seed=7)
    grown = torch.rand(4).tolist()
    print(json.dumps({"rank": rank, "after_save": after_save, "restored": restored,
                      "same": same, "other": other, "grown": grown}))
    dist.destroy_process_group()
""")


def test_two_gloo_ranks_get_their_own_generators_back(tmp_path: Path) -> None:
    reports = run_gloo_ranks(RANK, str(tmp_path))
    first, second = sorted(reports, key=lambda r: r["rank"])
    for report in (first, second):
        assert report["same"] == "own" and report["restored"] == report["after_save"]
        assert report["other"].startswith("derived seed")
    assert first["restored"] != second["restored"], "rank 1 got rank 0's generators"
    assert first["grown"] != second["grown"]


def test_a_rescue_gives_the_ranks_it_lacks_its_writers_generators() -> None:
    writer = rng_state()
    expected = torch.rand(3)
    rescue = {RNG_BY_RANK: [None, writer], "step": 2, **writer}
    assert restore_rng_state(rescue, 1, 2, seed=1) == "own"
    assert restore_rng_state(rescue, 0, 2, seed=1) == "writer's"
    assert torch.equal(torch.rand(3), expected)
    assert restore_rng_state(rescue, 0, 3, seed=1).startswith("derived seed")  # world grew
    assert restore_rng_state({"step": 2, **writer}, 0, 2, seed=1).startswith("derived seed")
