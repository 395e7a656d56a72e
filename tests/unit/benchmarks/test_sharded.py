"""``python -m benchmarks sharded``'s pure parts: its options, its model's size, and how it reads
the runtime's log lines and step time stamps (nothing is trained here)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from benchmarks import sharded, sharded_model_def
from benchmarks.harness import RESULTS
from kfp_elastic.worker.sharded_snapshot import ShardedSnapshots, SnapshotCost
from tests.helpers import REPO_ROOT

LOG_FORMAT = "[%(asctime)s] worker %(levelname)s %(message)s"  # the runner's (runner.main)


def test_defaults_measure_both_paths_on_the_50m_model() -> None:
    args = sharded.parse_args([])
    assert args.paths == ["memory", "disk"]
    assert (args.hidden, args.repeats, args.victim_rank) == (4096, 1, 1)
    assert args.disk_snapshot_every == 10 and not args.quick and args.out is None


def test_quick_is_a_smaller_model_and_shorter_jobs() -> None:
    full, quick = sharded.parse_args([]), sharded.parse_args(["--quick", "--repeats", "3"])
    assert quick.quick and quick.repeats == 1
    assert quick.hidden < full.hidden
    assert quick.auto_seconds < full.auto_seconds and quick.every1_steps < full.every1_steps


@pytest.mark.parametrize(
    "argv",
    [
        ["--paths", "memory,tape"],
        ["--paths", ","],
        ["--victim-rank", "0"],  # rank 0 is never the victim: the survivors' commit path
        ["--repeats", "0"],
        ["--quick", "--out", str(RESULTS / "sharded" / "x.json")],
    ],
)
def test_bad_options_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        sharded.parse_args(argv)
    assert exit.value.code == 2


def test_one_path_alone() -> None:
    assert sharded.parse_args(["--paths", "disk"]).paths == ["disk"]


def count(hidden: int, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setenv(sharded_model_def.HIDDEN_ENV, str(hidden))
    with torch.device("meta"):  # the shapes only: no 200 MB of weights
        model = sharded_model_def.model()
    return sum(p.numel() for p in model.parameters())


def test_the_model_has_at_least_50m_parameters_and_quick_about_5m(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    full = count(sharded.parse_args([]).hidden, monkeypatch)
    assert full >= 50_000_000
    assert full == sharded_model_def.parameter_count(sharded_model_def.DEFAULT_HIDDEN)
    quick = count(sharded.parse_args(["--quick"]).hidden, monkeypatch)
    assert 4_000_000 <= quick <= 6_000_000
    assert quick == sharded_model_def.parameter_count(sharded.QUICK_HIDDEN)


def test_the_model_is_sharded_per_module_and_trained_with_adamw(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(sharded_model_def.HIDDEN_ENV, "16")
    assert sharded_model_def.SHARDING == "per-module"
    optimizer = sharded_model_def.optimizer(sharded_model_def.model().parameters())
    assert isinstance(optimizer, torch.optim.AdamW)


def test_the_timed_wrapper_keeps_the_sharding() -> None:
    env = {**os.environ, "TIMED_MODEL_DEF": sharded.MODEL, "PYTHONPATH": str(REPO_ROOT)}
    code = (
        "from kfp_elastic.worker.model_def import load_model_def as load; "
        f"print(load({sharded.TIMED!r}).sharding)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "per-module", out.stderr


def snapshot_line(caplog: pytest.LogCaptureFixture, step: int, rank: int, blocking: float) -> str:
    """The runtime's own "sharded snapshot" line, formatted as a worker logs it."""
    snapshots = SimpleNamespace(rank=rank, mode="memory", cost=None, last_cost_s=None)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kfp_elastic.worker.sharded_snapshot"):
        ShardedSnapshots._cost(snapshots, step, SnapshotCost(blocking, slot_bytes=640), step == 1)
    assert snapshots.last_cost_s == blocking
    (record,) = caplog.records
    return logging.Formatter(LOG_FORMAT).format(record)


def test_snapshot_costs_are_read_from_the_runtimes_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lines = [
        snapshot_line(caplog, 1, 0, 0.5),
        snapshot_line(caplog, 1, 1, 0.75),
        snapshot_line(caplog, 2, 0, 0.25),
        snapshot_line(caplog, 2, 1, 0.125),
        snapshot_line(caplog, 3, 0, 0.1),  # rank 1's line missing: not a whole snapshot
    ]
    costs = sharded.snapshot_costs("\n".join(["noise", *lines]))
    assert [(c.step, c.rank, c.blocking_s, c.slot_bytes) for c in costs][:2] == [
        (1, 0, 0.5, 640),
        (1, 1, 0.75, 640),
    ]
    assert sharded.blocking_by_step(costs, world=2) == {1: (0.75, True), 2: (0.25, False)}


def test_restored_lines_after_the_kill() -> None:
    text = "\n".join(
        [
            "[2026-11-28 10:00:00,000] worker INFO restored rank=0 world=3 step=0 epoch=0 "
            "position=0 from=nothing (a new run) rng=fresh received_bytes=0 sent_bytes=0 "
            "copied_bytes=0",
            "[2026-11-28 10:00:09,500] worker INFO restored rank=1 world=2 step=10 epoch=0 "
            "position=240 from=memory (3 slots) rng=derived received_bytes=5 sent_bytes=7 "
            "copied_bytes=11",
            "[2026-11-28 10:00:09,600] worker INFO restored rank=0 world=2 step=10 epoch=0 "
            "position=240 from=disk dcp-000000010 rng=derived received_bytes=0 sent_bytes=0 "
            "copied_bytes=0",
        ]
    )
    first = sharded.worker_lines(text, "restored rank=1")[0][0]
    found = sharded.restored_lines(text, after=first - 1)
    assert [(r.rank, r.world, r.step, r.source) for r in found] == [
        (1, 2, 10, "memory"),
        (0, 2, 10, "disk"),
    ]
    assert (found[0].detail, found[0].received, found[0].sent, found[0].copied) == (
        "(3 slots)",
        5,
        7,
        11,
    )
    assert found[1].detail == "dcp-000000010"


def test_a_step_is_done_when_every_rank_finished_it_and_the_blocking_share() -> None:
    events = [
        {"t": 10.0 + step + 0.1 * rank, "step": step, "rank": rank, "world": 2, "pid": rank}
        for step in range(1, 6)
        for rank in range(2)
    ] + [{"t": 99.0, "step": 6, "rank": 0, "world": 2, "pid": 0}]  # rank 1 not done yet
    done = sharded.step_done_times(events, world=2)
    assert done == {step: pytest.approx(10.1 + step) for step in range(1, 6)}
    # Snapshots after steps 2 (0.5 s) and 4 (0.25 s, with a disk save); step 5 is outside.
    blocking = {2: (0.5, False), 4: (0.25, True), 5: (9.0, False)}
    window = sharded.window_share(done, blocking, first=1, last=5)
    assert window["snapshots"] == 2 and window["snapshots_with_disk_save"] == 1
    assert window["seconds"] == pytest.approx(4.0)
    assert window["blocking_share"] == pytest.approx(0.75 / 4.0)
    assert window["median_plain_step_s"] == pytest.approx(1.0)


def test_goals() -> None:
    met = sharded.goals(
        {
            "memory": {"kill_to_first_step_s": 2.0, "blocking_share_auto": 0.01},
            "disk": {"kill_to_first_step_s": 10.0},
        }
    )
    assert list(met.values()) == [True, True, True]
    missed = sharded.goals(
        {
            "memory": {"kill_to_first_step_s": 4.0, "blocking_share_auto": 0.06},
            "disk": {"kill_to_first_step_s": 10.0},
        }
    )
    assert list(missed.values()) == [False, False, False]
    assert list(sharded.goals({"memory": {}}).values()) == [None, None, None]
