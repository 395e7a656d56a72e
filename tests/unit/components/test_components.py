"""The KFP components' functions, called directly (``python_func``), and their pure helpers.

No kfp.local here (see test_pipeline.py); the elastic_train calls only cover what must fail
before any process starts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from kfp import dsl

from kfp_elastic.components.common import normalize_run_id, run_pids
from kfp_elastic.components.elastic_train.component import elastic_train
from kfp_elastic.components.elastic_train.faults import (
    Fault,
    FaultInjector,
    Progress,
    is_due,
    parse_faults,
    pick_target,
)
from kfp_elastic.components.elastic_train.run_job import job_spec, plan_job
from kfp_elastic.components.evaluate.component import evaluate
from kfp_elastic.components.shard_dataset.component import shard_dataset
from kfp_elastic.components.shard_dataset.shard import (
    build_manifest,
    check_shards,
    count_path,
    plan_shards,
    read_manifest,
    resolve,
)
from kfp_elastic.components.stop_workers.component import stop_workers
from kfp_elastic.contract.data_plan import Shard
from kfp_elastic.job_env import JobEnv
from kfp_elastic.job_spec import Data, JobSpec
from kfp_elastic.master.timeline import Committed, Event, JobDone, MasterStarted, RoundFormed
from kfp_elastic.worker.examples import digits
from kfp_elastic.worker.model_def import ModelDefError
from tests.helpers import REPO_ROOT

DIGITS = "kfp_elastic.worker.examples.digits"
DIGITS_TRAIN = 1437


def artifact(kind: type, tmp_path: Path, name: str, **metadata: Any) -> Any:
    return kind(name=name, uri=str(tmp_path / name), metadata=dict(metadata))


@pytest.fixture
def manifest(tmp_path: Path) -> Any:
    out = artifact(dsl.Dataset, tmp_path, "manifest")
    shard_dataset.python_func(manifest=out, num_shards=4)
    return out


# ------------------------------------------------------------------------------ run ids


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("6f1c2a9e-0b1d-4c5e-9f00-123456789abc", "kfp-6f1c2a9e-0b1d-4c5e-9f00-123456789abc"),
        ("12345678", "kfp-12345678"),
        ("My_Run 7", "my-run-7"),
        ("job-1", "job-1"),
    ],
)
def test_run_ids_become_dns_labels(raw: str, expected: str) -> None:
    assert normalize_run_id(raw) == expected
    assert len(normalize_run_id(raw)) <= 40


def test_an_empty_run_id_gets_a_random_one() -> None:
    first, second = normalize_run_id(""), normalize_run_id("")
    assert first != second and first[0].isalpha()


# ------------------------------------------------------------------------------ shard_dataset


def test_shard_dataset_of_the_example_is_what_the_master_reads(
    tmp_path: Path, manifest: Any
) -> None:
    shards, document = read_manifest(manifest.path)
    assert document["num_samples"] == DIGITS_TRAIN == manifest.metadata["num_samples"]
    assert [s.size for s in shards] == [359, 359, 359, 360]
    published = JobSpec(run_id="r", data=Data(epochs=2, shard_manifest=manifest.path)).manifest()
    assert published is not None and published.num_samples == DIGITS_TRAIN
    assert published.epochs == 2 and len(published.shards) == 4


def test_shard_dataset_returns_the_sample_count(tmp_path: Path) -> None:
    out = artifact(dsl.Dataset, tmp_path, "manifest")
    assert (
        shard_dataset.python_func(manifest=out, dataset="example:digits", shard_size=500)
        == DIGITS_TRAIN
    )
    assert [row[1:] for row in json.loads(Path(out.path).read_text())["shards"]] == [
        [0, 500],
        [500, 1000],
        [1000, 1437],
    ]


def test_dataset_forms(tmp_path: Path) -> None:
    assert resolve("", DIGITS) == ("model-def", DIGITS)
    assert resolve("example:digits", "") == ("model-def", DIGITS)
    assert resolve("model-def:pkg.mod", "") == ("model-def", "pkg.mod")
    assert resolve("file:///data/x.csv", "") == ("path", "/data/x.csv")
    assert resolve("data/x.csv", "") == ("path", "data/x.csv")
    with pytest.raises(ValueError, match="mount it"):
        resolve("gs://bucket/data", "")
    with pytest.raises(ValueError, match="example:digits"):
        resolve("example:mnist", "")


def test_counting_files(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"x": 1}\n\n{"x": 2}\n{"x": 3}\n')
    (tmp_path / "b.csv").write_text("x,y\n1,2\n3,4\n")
    torch.save(torch.zeros(7, 3), tmp_path / "c.pt")
    torch.save((torch.zeros(5, 2), torch.zeros(5)), tmp_path / "d.pt")
    directory = tmp_path / "images"
    (directory / "sub").mkdir(parents=True)
    for name in ("1.png", "2.png", "sub/3.png", ".hidden"):
        (directory / name).write_text("x")
    assert [count_path(tmp_path / n) for n in ("a.jsonl", "b.csv", "c.pt", "d.pt", "images")] == [
        3,
        2,
        7,
        5,
        3,
    ]
    (tmp_path / "e.bin").write_text("?")
    with pytest.raises(ValueError, match="cannot count samples"):
        count_path(tmp_path / "e.bin")
    with pytest.raises(ValueError, match="does not exist"):
        count_path(tmp_path / "missing.csv")


def test_plan_shards() -> None:
    assert [(s.start, s.end) for s in plan_shards(10, num_shards=3)] == [(0, 3), (3, 6), (6, 10)]
    assert [s.size for s in plan_shards(10, shard_size=4)] == [4, 4, 2]
    assert len(plan_shards(5)) == 5 and len(plan_shards(1000)) == 16
    for kwargs, message in (
        ({"num_shards": 11}, "more than the 10 samples"),
        ({"num_shards": 2, "shard_size": 2}, "not both"),
        ({"shard_size": -1}, ">= 0"),
    ):
        with pytest.raises(ValueError, match=message):
            plan_shards(10, **kwargs)
    with pytest.raises(ValueError, match="empty"):
        plan_shards(0)


def test_an_empty_dataset_fails_with_a_clear_message(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="has no samples: nothing to train on"):
        shard_dataset.python_func(manifest=artifact(dsl.Dataset, tmp_path, "m"), dataset=str(empty))


def test_an_unknown_model_def_fails_with_a_clear_message(tmp_path: Path) -> None:
    with pytest.raises(ModelDefError, match="module not found"):
        build_manifest("", "no_such_package.model")


def test_manifests_must_tile_the_samples(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="gap"):
        check_shards([Shard(0, 0, 5), Shard(1, 6, 10)])
    with pytest.raises(ValueError, match="no shards"):
        check_shards([])
    (tmp_path / "bad.json").write_text('{"shards": "x"}')
    with pytest.raises(ValueError, match="unreadable"):
        read_manifest(tmp_path / "bad.json")


# ------------------------------------------------------------------------------ faults


def test_parse_faults() -> None:
    faults = parse_faults(" preempt:worker-1@20s, kill:worker-0@step10 ,kill:worker-2@1.5")
    assert faults == (
        Fault("preempt", 1, at_s=20.0, text="preempt:worker-1@20s"),
        Fault("kill", 0, at_step=10, text="kill:worker-0@step10"),
        Fault("kill", 2, at_s=1.5, text="kill:worker-2@1.5"),
    )
    assert parse_faults("") == ()
    for spec, message in (
        ("reboot:worker-1@2s", "unknown action"),
        ("preempt:node-1@2s", "cannot parse"),
        ("preempt:worker-1", "cannot parse"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_faults(spec)
    with pytest.raises(ValueError, match="worker-0 .. worker-1"):
        parse_faults("kill:worker-2@1s", max_workers=2)


def test_faults_are_due_after_the_first_round() -> None:
    by_time, by_step = Fault("kill", 0, at_s=5.0), Fault("kill", 0, at_step=10)
    events: list[Event] = [MasterStarted(t=100.0)]
    assert not is_due(by_time, Progress.of(events), now=200.0)  # no round yet
    events += [RoundFormed(t=110.0), Committed(t=112, step=9)]
    progress = Progress.of(events)
    assert not is_due(by_time, progress, now=114.9) and is_due(by_time, progress, now=115.0)
    assert not is_due(by_step, progress, now=115.0)
    events.append(Committed(t=113, step=10))
    assert is_due(by_step, Progress.of(events), now=115.0)
    events.append(JobDone(t=120))
    assert not is_due(by_step, Progress.of(events), now=121.0)


def _status(name: str, index: int, phase: str = "Running", reason: str | None = None) -> Any:
    return SimpleNamespace(
        name=name,
        worker_index=index,
        phase=phase,
        reason=reason,
        ended=phase in ("Succeeded", "Failed", "Deleted"),
    )


def test_fault_injector_waits_for_a_running_worker_of_the_slot() -> None:
    workers = [_status("worker-0-0", 0), _status("worker-1-0", 1, "Failed")]
    acted: list[tuple[str, str]] = []
    injector = FaultInjector(
        parse_faults("preempt:worker-1@step1"),
        lambda: workers,
        lambda action, name: acted.append((action, name)),
        clock=lambda: 10.0,
    )
    events = [RoundFormed(t=1.0), Committed(t=2, step=3)]
    assert injector.poll(events) == [] and acted == []
    workers.append(_status("worker-1-1", 1))
    assert [r.target for r in injector.poll(events)] == ["worker-1-1"]
    assert injector.poll(events) == [] and acted == [("preempt", "worker-1-1")]
    assert pick_target([_status("w", 1, reason="Preempted")], 1) is None


# ------------------------------------------------------------------------------ elastic_train


COMPONENT_ONLY = ("launcher", "etcd_endpoint", "snapshot_dir")


def _request(manifest_path: str, **changes: Any) -> JobSpec:
    """The JobSpec the component builds from its parameters (``changes`` by parameter name)."""
    given = {"launcher": "local", **changes}
    params = {k: v for k, v in given.items() if k not in COMPONENT_ONLY}
    own = {k: v for k, v in given.items() if k in COMPONENT_ONLY}
    return job_spec(
        {"model_def": DIGITS, "shard_manifest": manifest_path, **params}, run_id="r", env={}, **own
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"min_workers": 3, "max_workers": 2}, "max_workers (--max-workers / max_workers) must be"),
        ({"min_workers": 0}, "min_workers (--min-workers / min_workers) must be >= 1, got 0"),
        ({"epochs": 0}, "epochs (--epochs / epochs) must be >= 1"),
        ({"batch_policy": "cubic"}, "batch_policy (--batch-policy / batch_policy) unknown"),
        ({"worker_gpus": -1}, "gpus (--gpu / worker_gpus) must be >= 0"),
        ({"launcher": "slurm"}, "launcher must be auto, local or kubernetes"),
        ({"launcher": "kubernetes"}, "needs etcd_endpoint"),
        (
            {"launcher": "kubernetes", "etcd_endpoint": "etcd:2379"},
            "snapshot_dir (--snapshot-dir / snapshot_dir) is needed by the kubernetes launcher",
        ),
    ],
)
def test_bad_train_inputs_are_named(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        plan_job(_request("unused", **changes))


def test_bad_faults_are_named(manifest: Any) -> None:
    with pytest.raises(ValueError, match="max_workers=2"):
        plan_job(_request(manifest.path), "kill:worker-5@1s")


def test_the_masters_check_compares_the_model_def_with_the_manifest(
    tmp_path: Path, manifest: Any
) -> None:
    from kfp_elastic.master.preflight import PreflightError, WorkerSide, check

    def preflight(spec: JobSpec) -> None:
        env = {"KFP_ELASTIC_ETCD_ENDPOINTS": "127.0.0.1:1", **os.environ}
        env |= JobEnv.of(spec, spec.training.snapshot_dir).to_env()  # what the workers get
        check(spec, WorkerSide(spec.worker_argv(), env, REPO_ROOT, workdir=tmp_path / "work"))

    preflight(_request(manifest.path, snapshot_dir=str(tmp_path / "s")))
    with pytest.raises(PreflightError, match="no_such.module: module not found"):
        preflight(_request(manifest.path, model_def="no_such.module"))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"shards": [[0, 0, 100]], "source": "/data/x"}))
    with pytest.raises(PreflightError, match="covers 100 samples .* has 1437"):
        preflight(_request(str(other)))


def _train_artifacts(tmp_path: Path) -> dict[str, Any]:
    return {
        "model": artifact(dsl.Model, tmp_path, "model"),
        "metrics": artifact(dsl.Metrics, tmp_path, "metrics"),
        "report": artifact(dsl.HTML, tmp_path, "report"),
        "task_config": dsl.TaskConfig(),
    }


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"min_workers": 3, "max_workers": 2}, ValueError, "must be >= min_workers=3"),
        ({"model_def": "no_such.module"}, ValueError, "no_such.module: module not found"),
    ],
)
def test_elastic_train_fails_before_starting_anything(
    tmp_path: Path, manifest: Any, changes: dict[str, Any], error: type, message: str
) -> None:
    started = time.monotonic()
    with pytest.raises(error, match=message):
        elastic_train.python_func(
            shard_manifest=manifest,
            **_train_artifacts(tmp_path),
            launcher="local",
            run_id="bad-input",
            **changes,
        )
    assert time.monotonic() - started < 30
    assert not run_pids("bad-input")
    assert not (tmp_path / "job" / "workers").exists()


def test_elastic_train_dry_run_reports_the_plan_and_starts_nothing(
    tmp_path: Path, manifest: Any
) -> None:
    artifacts = _train_artifacts(tmp_path)
    outputs = elastic_train.python_func(
        shard_manifest=manifest, **artifacts, launcher="local", run_id="dry-run", dry_run=True
    )
    assert tuple(outputs) == (0.0, 0, 0, 0.0)
    page = Path(artifacts["report"].path).read_text()
    assert "Launch plan of dry-run" in page and "kfp_elastic.master.supervise" in page
    assert "mode: embedded" in page and "SIGTERM: cancel" in page
    assert not run_pids("dry-run")
    assert not (tmp_path / "job").exists()


# ------------------------------------------------------------------------------ evaluate


def _model_file(tmp_path: Path, **metadata: Any) -> Any:
    model = artifact(dsl.Model, tmp_path, "model", **metadata)
    torch.save(digits.model().state_dict(), model.path)
    return model


def test_evaluate_logs_what_the_ui_renders(tmp_path: Path) -> None:
    metrics = artifact(dsl.Metrics, tmp_path, "metrics")
    classification = artifact(dsl.ClassificationMetrics, tmp_path, "classification")
    accuracy = evaluate.python_func(
        model=_model_file(tmp_path),
        metrics=metrics,
        classification=classification,
        model_def=DIGITS,
    )
    assert 0.0 <= accuracy <= 1.0
    assert metrics.metadata["accuracy"] == pytest.approx(accuracy, abs=1e-6)
    assert metrics.metadata["samples"] == 360 and metrics.metadata["loss"] > 0
    matrix = classification.metadata["confusionMatrix"]
    labels = [spec["displayName"] for spec in matrix["annotationSpecs"]]
    rows = [row["row"] for row in matrix["rows"]]
    assert labels == [str(i) for i in range(10)]
    assert len(rows) == len(labels) and all(len(row) == len(labels) for row in rows)
    assert sum(map(sum, rows)) == 360


def test_evaluate_takes_the_model_def_from_the_model_metadata(tmp_path: Path) -> None:
    kwargs = {
        "metrics": artifact(dsl.Metrics, tmp_path, "metrics"),
        "classification": artifact(dsl.ClassificationMetrics, tmp_path, "cm"),
    }
    assert evaluate.python_func(model=_model_file(tmp_path, model_def=DIGITS), **kwargs) >= 0
    with pytest.raises(ValueError, match="model_def is empty"):
        evaluate.python_func(model=_model_file(tmp_path), **kwargs)


# ------------------------------------------------------------------------------ stop_workers


def final_status(state: str, error: str = "") -> dsl.PipelineTaskFinalStatus:
    """What KFP hands an exit handler."""
    return dsl.PipelineTaskFinalStatus(
        state=state,
        pipeline_job_resource_name="p",
        pipeline_task_name="t",
        error_code=1 if error else 0,
        error_message=error,
    )


def test_stop_workers_kills_the_processes_of_its_run_only(run_id: str) -> None:
    rid = normalize_run_id(run_id)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    mine = subprocess.Popen(sleeper, env={**os.environ, "KFP_ELASTIC_RUN_ID": rid})
    other = subprocess.Popen(sleeper, env={**os.environ, "KFP_ELASTIC_RUN_ID": rid + "-x"})
    try:
        status = final_status("FAILED", "boom")
        deadline = time.monotonic() + 10
        while not run_pids(rid) and time.monotonic() < deadline:
            time.sleep(0.05)
        line = stop_workers.python_func(status=status, run_id=run_id, launcher="local")
        assert line == f"stopped 1 worker processes of {rid}"
        assert mine.wait(10) is not None and other.poll() is None
        assert stop_workers.python_func(status=status, run_id="") == "nothing stopped"
    finally:
        for proc in (mine, other):
            proc.kill()
            proc.wait(10)


def test_stop_workers_deletes_the_run_keys_in_etcd_and_no_others(
    run_id: str, etcd: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kfp_elastic.etcd.client import connect

    rid = normalize_run_id(run_id)
    settings = etcd.client_settings()
    mine, other = settings.run_prefix(rid), settings.run_prefix(rid + "-x")
    client = connect(settings)
    try:
        for key in ("master/status", "events/0000000001", "shards/epoch/0/todo/3"):
            client.put(f"{mine}/{key}", "{}")
            client.put(f"{other}/{key}", "{}")
        status = final_status("SUCCEEDED")
        monkeypatch.delenv("KFP_ELASTIC_ETCD_ENDPOINTS", raising=False)
        stop_workers.python_func(status=status, run_id=run_id, launcher="local")
        assert "etcd keys" not in capsys.readouterr().out  # no etcd configured: nothing to do
        for name, value in settings.to_env().items():
            monkeypatch.setenv(name, value)
        stop_workers.python_func(status=status, run_id=run_id, launcher="local")
        assert f"deleted 3 etcd keys of {rid}" in capsys.readouterr().out
        assert not list(client.get_prefix(f"{mine}/"))
        assert len(list(client.get_prefix(f"{other}/"))) == 3
    finally:
        client.close()
