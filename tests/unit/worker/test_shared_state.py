"""A restored state reaches the other ranks as tensors (``collective.shared_state``): byte for
byte, in chunks, and never pickled through ``broadcast_object_list``."""

from __future__ import annotations

import textwrap
from pathlib import Path

from kfp_elastic.worker.snapshot_format import layout, pieces
from tests.helpers import run_gloo_ranks


def test_a_chunk_holds_the_bytes_of_the_tensors_it_overlaps_and_no_padding() -> None:
    table = [
        {"offset": 0, "nbytes": 10},
        {"offset": 64, "nbytes": 100},
        {"offset": 192, "nbytes": 0},
    ]
    assert pieces(table, 0, 64) == [(0, 0, 0, 10)]
    assert pieces(table, 60, 40) == [(1, 0, 4, 36)]
    assert pieces(table, 100, 100) == [(1, 36, 0, 64)]
    assert pieces(table, 0, 1000) == [(0, 0, 0, 10), (1, 0, 64, 100)]
    # Every byte of every tensor is in exactly one piece of a whole walk in chunks.
    import torch

    laid = layout(
        {"a": torch.zeros(33, dtype=torch.float64), "b": [torch.ones(7), torch.tensor(1)]}
    )
    seen = [0] * len(laid.table)
    for start in range(0, laid.size, 50):
        for index, _, _, length in pieces(laid.table, start, min(50, laid.size - start)):
            seen[index] += length
    assert seen == [e["nbytes"] for e in laid.table]


RANK = textwrap.dedent("""
    import hashlib, json, pickle, sys
    import torch, torch.distributed as dist
    from kfp_elastic.worker.collective import shared_state

    original = dist.broadcast_object_list
    def small_objects_only(objects, src=0, group=None, device=None, **kwargs):
        if dist.get_rank() == src:
            size = len(pickle.dumps(objects))
            assert size < 64 * 1024, f"{size} bytes pickled through broadcast_object_list"
        return original(objects, src=src, group=group, device=device, **kwargs)
    dist.broadcast_object_list = small_objects_only

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    def state(seed):
        g = torch.Generator().manual_seed(seed)
        return {
            "model": {"w": torch.randn(300, 301, generator=g),
                      "half": torch.randn(1001, generator=g).to(torch.bfloat16),
                      "t": torch.randn(40, 50, generator=g).t()},
            "optimizer": {"state": {0: {"step": torch.tensor(5.0),
                                        "m": torch.randint(0, 9, (77,), generator=g)}},
                          "param_groups": [{"lr": 0.1, "params": [0]}]},
            "mask": torch.rand(33, generator=g) > 0.5,
            "empty": torch.empty(0, 3),
            "pair": (1, "x"), "step": 12, "losses": [0.5, 0.25],
        }
    def digest(value):
        if isinstance(value, torch.Tensor):
            raw = value.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            return [str(value.dtype), list(value.shape), hashlib.sha256(raw).hexdigest()]
        if isinstance(value, dict):
            return {str(k): digest(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [type(value).__name__, [digest(v) for v in value]]
        return value
    out = {}
    for src, chunk in ((0, 4096), (1, 64 << 20)):
        got = shared_state(state(src) if rank == src else None, src=src, chunk_bytes=chunk)
        out[f"{src}"] = digest(got)
        out[f"{src}-expected"] = digest(state(src))
    print(json.dumps({"rank": rank, **out}))
    dist.destroy_process_group()
""")


def test_two_gloo_ranks_restore_a_state_byte_for_byte_without_pickling_it(
    tmp_path: Path,
) -> None:
    reports = run_gloo_ranks(RANK)
    for report in reports:
        for src in ("0", "1"):
            assert report[src] == report[f"{src}-expected"], (report["rank"], src)
