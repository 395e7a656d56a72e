"""The whole pipeline DAG under kfp.local (embedded etcd, 2 local workers, one of them preempted
mid-training); bad parameters fail the run with a clear message."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from kfp_elastic.components.common import run_pids
from kfp_elastic.pipelines.run_local import SESSION_ENV, artifact_metadata, outputs
from kfp_elastic.worker.evaluate import evaluate
from tests.helpers import run_pipeline_locally as run_locally

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*non-Python base image:RuntimeWarning",
    "ignore:.*have no effect in the current local runner",
)


# ------------------------------------------------------------------------------ kfp.local


@pytest.mark.timeout(300)
def test_pipeline_runs_locally_through_a_preemption(
    tmp_path: Path, session: str, capfd: pytest.CaptureFixture[str]
) -> None:
    error, run = run_locally(
        tmp_path,
        min_workers=2,
        max_workers=2,
        epochs=1,
        num_shards=8,
        snapshot_every=5,
        step_time=0.25,
        inject_faults="preempt:worker-1@step5",
    )
    log = capfd.readouterr().out
    assert error is None, log[-5000:]
    found = outputs(run)
    assert {"model", "report", "train metrics", "evaluation", "worker logs"} <= set(found)

    metrics = artifact_metadata(run / "elastic-train", "metrics")
    assert metrics["steps"] == 23  # 1437 samples / global batch 64, one epoch
    assert metrics["restarts"] >= 1 and metrics["workers_lost"] >= 1
    assert metrics["disruptions"] >= 1 and metrics["worker_failures"] == 0
    assert 0 < metrics["goodput"] <= 1 and metrics["final_loss"] > 0
    assert metrics["max_world_size"] == 2
    assert metrics["slot_seconds_guaranteed"] > 0 and metrics["slot_seconds_opportunistic"] == 0

    model = torch.load(found["model"], weights_only=True)
    assert set(model) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    scores = evaluate("kfp_elastic.worker.examples.digits", found["model"])
    evaluation = json.loads(found["evaluation"].read_text())["artifacts"]
    assert evaluation["metrics"]["artifacts"][0]["metadata"]["accuracy"] == pytest.approx(
        scores.accuracy, abs=1e-6
    )
    matrix = evaluation["classification"]["artifacts"][0]["metadata"]["confusionMatrix"]
    assert len(matrix["rows"]) == len(matrix["annotationSpecs"]) == 10
    assert all(len(row["row"]) == 10 for row in matrix["rows"])

    report = found["report"].read_text()
    assert len(re.findall(r"<svg ", report)) == 2 and "preempt:worker-1@step5" in report
    for line in (
        "round 1 formed: world size 2",
        "fault injected: preempt worker-1-0",
        "worker-1-0 lost: preempted",
        "job succeeded",
        "stop_workers: pipeline SUCCEEDED",
    ):
        assert line in log, line
    assert not run_pids(session, SESSION_ENV)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("params", "failed_task", "message"),
    [
        (
            {"min_workers": 3, "max_workers": 2},
            "elastic-train",
            "max_workers (--max-workers / max_workers) must be >= min_workers=3, got 2",
        ),
        (
            {"model_def": "no_such_package.model"},
            "shard-dataset",
            "--model-def no_such_package.model: module not found",
        ),
        ({"dataset": "EMPTY"}, "shard-dataset", "has no samples: nothing to train on"),
    ],
    ids=["min-over-max", "unknown-model-def", "empty-dataset"],
)
def test_bad_parameters_fail_the_run_with_a_clear_message(
    tmp_path: Path,
    session: str,
    capfd: pytest.CaptureFixture[str],
    params: dict[str, Any],
    failed_task: str,
    message: str,
) -> None:
    if params.get("dataset") == "EMPTY":
        (tmp_path / "empty.csv").write_text("x,y\n")
        params = {**params, "dataset": str(tmp_path / "empty.csv")}
    error, run = run_locally(tmp_path / "runs", **params)
    log = capfd.readouterr().out
    assert error is not None and failed_task in error
    assert message in log
    assert "stop_workers: pipeline FAILED" in log  # the exit handler ran
    assert not (run / "elastic-train" / "model").exists()
