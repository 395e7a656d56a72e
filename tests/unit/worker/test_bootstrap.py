"""One worker bootstrap: one settings object, given by the environment (how the master delivers
it) or by the runtime's flags generated from the same fields, and one factory of the loop's
parts (``ElasticLoop.build``) that the ``--model-def`` runner and the script API both use."""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch

from kfp_elastic import job_env
from kfp_elastic.etcd.embedded import EmbeddedEtcd
from kfp_elastic.job_env import JobEnv
from kfp_elastic.worker import elastic, runner
from kfp_elastic.worker.device import Placement
from kfp_elastic.worker.loop import ElasticLoop
from kfp_elastic.worker.model_def import load_model_def
from kfp_elastic.worker.options import build_parser, parse_args

ETCD_ENV = {"KFP_ELASTIC_ETCD_ENDPOINTS": "127.0.0.1:2379"}
# Every setting away from its default (run_id has no flag: torchrun's --rdzv-id gives it).
CHANGED = JobEnv(
    run_id="r",
    snapshot_dir="/snap/r",
    local_snapshot_dir="/local/r",
    memory_snapshot_dir="/dev/shm/r",
    sharded_snapshots="disk",
    disk_snapshot_every=3,
    output="/snap/r/model.pt",
    epochs=3,
    batch_size=16,
    learning_rate=0.5,
    batch_policy="linear",
    base_world_size=4,
    shard_size=10,
    seed=7,
    shuffle=False,
    snapshot_every=4,
    snapshot_overhead=0.05,
    snapshot_max_interval=60.0,
    step_time=0.25,
    nan_policy="skip",
    device="cpu",
    collective_timeout=90.0,
    collective_abort=3.0,
)


def _flags(settings: JobEnv) -> list[str]:
    """The runtime's flags that give ``settings`` (each spelled as the schema says)."""
    flags = []
    for f in fields(JobEnv):
        flag = job_env.flag_of(f.name)
        value = getattr(settings, f.name)
        if flag is None or value == f.default:
            continue
        flags += [flag] if isinstance(value, bool) else [flag, str(value)]
    return flags


def test_every_setting_differs_from_its_default_in_the_example() -> None:
    assert [f.name for f in fields(JobEnv) if getattr(CHANGED, f.name) == f.default] == []


def test_the_environment_and_the_flags_give_the_same_settings() -> None:
    by_env = parse_args(["--model-def", "m"], {**ETCD_ENV, **CHANGED.to_env()}).settings
    by_flags = parse_args(
        ["--model-def", "m", *_flags(CHANGED)], {**ETCD_ENV, "TORCHELASTIC_RUN_ID": "r"}
    ).settings
    assert by_env == CHANGED
    assert by_flags == CHANGED
    assert JobEnv.from_env(CHANGED.to_env()) == CHANGED  # the script API's way


def test_a_flag_wins_over_its_variable() -> None:
    env = {**ETCD_ENV, **CHANGED.to_env()}
    settings = parse_args(["--model-def", "m", "--epochs", "9", "--lr", "0.01"], env).settings
    assert (settings.epochs, settings.learning_rate, settings.seed) == (9, 0.01, 7)


def test_every_flag_and_its_help_come_from_the_schema() -> None:
    text = build_parser().format_help()
    for f in fields(JobEnv):
        flag = job_env.flag_of(f.name)
        if flag is not None:
            assert flag in text and job_env.env_of(f.name) in text
    assert "--lr" in text and "--policy" in text and "--no-shuffle" in text


def test_snapshot_every_takes_auto_either_way() -> None:
    env = {**ETCD_ENV, "KFP_ELASTIC_SNAPSHOT_DIR": "/s"}
    assert parse_args(["--model-def", "m", "--snapshot-every", "auto"], env).settings == (
        parse_args(["--model-def", "m"], {**env, "KFP_ELASTIC_SNAPSHOT_EVERY": "auto"}).settings
    )
    with pytest.raises(ValueError, match="KFP_ELASTIC_NAN_POLICY='maybe': must be one of"):
        JobEnv.from_env({"KFP_ELASTIC_NAN_POLICY": "maybe"})


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What each ``ElasticLoop.build`` call was given."""
    calls: list[dict[str, Any]] = []
    original = ElasticLoop.build.__func__  # type: ignore[attr-defined]

    def recorded(
        cls: type[ElasticLoop],
        trained: Any,
        optimizer: Any,
        settings: JobEnv,
        *args: Any,
        **kw: Any,
    ) -> ElasticLoop:
        calls.append({"trained": trained, "optimizer": optimizer, "settings": settings})
        return original(cls, trained, optimizer, settings, *args, **kw)

    monkeypatch.setattr(ElasticLoop, "build", classmethod(recorded))
    return calls


def test_the_runner_and_the_script_api_build_their_loop_through_one_factory(
    world_of_one: None,
    etcd_env: None,
    etcd: EmbeddedEtcd,
    run_id: str,
    tmp_path: Path,
    built: list[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "excepthook", lambda *_: None)  # State chains to it; restored
    options = parse_args(
        ["--model-def", "kfp_elastic.testing.model_defs.counting"]
        + ["--snapshot-dir", str(tmp_path / "runner"), "--local-snapshot-dir", str(tmp_path / "l")]
    )
    trainer = runner.Trainer(
        options, load_model_def(options.model_def), Placement(torch.device("cpu"), "gloo")
    )
    trainer.loop.close()
    model = torch.nn.Linear(1, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    settings = JobEnv(run_id=run_id, snapshot_dir=str(tmp_path / "script"), snapshot_every=3)
    state = elastic.State(model, optimizer, settings=settings)
    state.close()
    assert [call["trained"] for call in built] == [trainer.stepper, state._trained]
    assert [call["optimizer"] for call in built] == [trainer.optimizer, optimizer]
    assert [call["settings"] for call in built] == [options.settings, settings]
    # The parts follow the settings the same way for both.
    assert trainer.loop.rescues.directory == tmp_path / "l"
    assert state.loop.rescues.directory == tmp_path / "script"
    assert trainer.loop.snapshot_policy.every is None  # the contract's 0: auto
    assert state.loop.snapshot_policy.every == 3
    assert trainer.loop.run_id == state.loop.run_id == run_id
