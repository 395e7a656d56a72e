"""The convergence experiment's pure parts: the two runs' plans, commit rows, the verdict."""

from __future__ import annotations

import pytest

from benchmarks.scheduling import convergence, suite
from benchmarks.scheduling.convergence import Plan, commit_row, plans, verdict, worlds_seen
from kfp_elastic.testing.model_defs import clustered_classes
from kfp_elastic.worker.model_def import load_model_def
from kfp_elastic.worker.policy import LrDecay
from kfp_elastic.worker.progress import Committed


def test_gang_keeps_its_world_and_elastic_starts_at_half_then_grows() -> None:
    gang, elastic = plans(4, grow_at=3)
    assert gang == Plan("gang", 4, 0, None, "4:4")
    assert elastic == Plan("elastic", 2, 2, 3, "2:4")
    assert plans(3, 1)[1] == Plan("elastic", 1, 2, 1, "1:3")
    assert plans(2, None)[1] == Plan("elastic", 1, 0, None, "1:2")  # --quick: no growth


def test_commit_row_says_where_in_the_data_the_commit_is() -> None:
    record = Committed(step=375, epoch=1, position=8000, world_size=1, lr=0.025, losses=(1.0, 2.0))
    row = commit_row(record, samples=16000)
    assert (row["progress"], row["world"], row["lr"], row["train_loss"]) == (1.5, 1, 0.025, 1.5)


def test_worlds_seen_merges_repeats() -> None:
    rows = [{"world": w} for w in (1, 1, 0, 2, 2, 1, 2)]
    assert worlds_seen(rows) == [1, 2, 1, 2]


@pytest.mark.parametrize(
    ("gang", "elastic", "points", "result"),
    [(0.88, 0.884, 0.4, "PASS"), (0.88, 0.875, -0.5, "PASS"), (0.88, 0.874, -0.6, "FAIL")],
)
def test_verdict_passes_within_the_goal(
    gang: float, elastic: float, points: float, result: str
) -> None:
    summary = verdict(gang, elastic, 0.5)
    assert (summary["difference_points"], summary["verdict"]) == (points, result)


def test_quick_and_bad_options() -> None:
    assert suite.COMMANDS["convergence"] is convergence
    quick = convergence.parse_args(["--quick"])
    assert (quick.epochs, quick.world, quick.grow_at) == (2, 2, None)
    for bad in (["--world", "1"], ["--grow-at", "12"], ["--epochs", "0"]):
        with pytest.raises(SystemExit):
            convergence.parse_args(bad)


def test_the_task_is_a_model_definition_with_a_step_decay() -> None:
    md = load_model_def(convergence.MODEL_DEF)
    assert md.lr_decay == LrDecay((7.0, 10.0), 0.1)
    train, test = md.dataset("train"), md.dataset("test")
    assert (len(train), len(test)) == (
        clustered_classes.TRAIN_SAMPLES,
        clustered_classes.TEST_SAMPLES,
    )
    assert len({int(label) for _, label in test}) == clustered_classes.CLASSES
