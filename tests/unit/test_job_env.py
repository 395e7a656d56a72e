"""The job's settings in the workers' environment (kfp_elastic/job_env.py): one schema that the
local launcher and the worker pods set and ``kfp_elastic.worker.elastic`` reads; a command entry
(a script or ``-m MODULE`` plus arguments) validated with errors naming field, flag, parameter."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from kfp_elastic import job_spec as contract
from kfp_elastic.components.elastic_train import run_job
from kfp_elastic.etcd.settings import EtcdSettings
from kfp_elastic.job_env import JobEnv
from kfp_elastic.job_spec import Data, Entry, JobSpec, Launch, LocalSettings, Training
from kfp_elastic.master.cli import build_parser, make_spec, split_entry
from kfp_elastic.master.host import make_launcher, plan
from kfp_elastic.master.pod_spec import build_pod
from kfp_elastic.master.wiring import worker_pod_template
from kfp_elastic.rendezvous.plugin import hand_etcd_settings_to_workers

ETCD = EtcdSettings.for_endpoint("127.0.0.1:2379")
COMMAND = ("-m", "my_pkg.train", "--lr", "0.1")


def command_job(**sections: object) -> JobSpec:
    return JobSpec(run_id="r", entry=Entry(command=COMMAND), etcd=ETCD, **sections)  # type: ignore[arg-type]


def test_the_settings_round_trip_through_the_environment() -> None:
    spec = command_job(
        data=Data(epochs=3, seed=7, shuffle=False),
        training=Training(batch_size=16, learning_rate=0.5, snapshot_every=4),
    )
    settings = JobEnv.of(spec, "/snap/r")
    env = settings.to_env()
    assert env["KFP_ELASTIC_EPOCHS"] == "3" and env["KFP_ELASTIC_SHUFFLE"] == "0"
    assert env["KFP_ELASTIC_OUTPUT"] == "/snap/r/model.pt"
    assert JobEnv.from_env(env) == settings


def test_unset_variables_take_the_contract_defaults_and_torchruns_run_id() -> None:
    settings = JobEnv.from_env({"TORCHELASTIC_RUN_ID": "plain"})
    assert settings.run_id == "plain" and settings.snapshot_dir == ""
    assert settings.epochs == contract.DEFAULT_EPOCHS
    assert settings.batch_size == contract.DEFAULT_BATCH_SIZE
    assert settings.snapshot_every == contract.DEFAULT_SNAPSHOT_EVERY
    assert JobEnv.from_env({"KFP_ELASTIC_RUN_ID": "m", "TORCHELASTIC_RUN_ID": "t"}).run_id == "m"


@pytest.mark.parametrize(
    ("variable", "value"), [("KFP_ELASTIC_EPOCHS", "two"), ("KFP_ELASTIC_SHUFFLE", "maybe")]
)
def test_a_bad_variable_is_named(variable: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"{variable}='{value}'"):
        JobEnv.from_env({variable: value})


def test_local_workers_get_the_job_settings(tmp_path: Path, monkeypatch) -> None:
    # The user's module, in the directory the master starts in (checked before any worker).
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_pkg" / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    spec = command_job(
        data=Data(epochs=2),
        launch=Launch(local=LocalSettings(workdir=str(tmp_path))),
    )
    launcher = make_launcher(plan(spec), None)
    env = launcher.env
    assert tuple(launcher.entry) == COMMAND
    assert env["KFP_ELASTIC_RUN_ID"] == "r" and env["KFP_ELASTIC_EPOCHS"] == "2"
    assert env["KFP_ELASTIC_SNAPSHOT_DIR"] == str(tmp_path.resolve() / "snapshots")
    assert env["KFP_ELASTIC_ETCD_ENDPOINTS"] == "127.0.0.1:2379"
    assert JobEnv.from_env(env) == JobEnv.of(spec, env["KFP_ELASTIC_SNAPSHOT_DIR"])


def test_worker_pods_run_the_command_with_the_job_settings() -> None:
    spec = command_job(
        training=Training(batch_size=8, snapshot_dir="/mnt/snap/r"),
        launch=Launch(kind="kubernetes"),
    )
    template = worker_pod_template(spec)
    assert template.module and template.entrypoint == "my_pkg.train"
    assert template.entrypoint_args == ("--lr", "0.1")
    container = build_pod(template)["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KFP_ELASTIC_RUN_ID"] == "r" and env["KFP_ELASTIC_BATCH_SIZE"] == "8"
    assert env["KFP_ELASTIC_SNAPSHOT_DIR"] == "/mnt/snap/r"
    assert env["KFP_ELASTIC_ETCD_ENDPOINTS"] == "127.0.0.1:2379"
    assert container["args"][-4:] == ["-m", "my_pkg.train", "--lr", "0.1"]
    script = replace(spec, entry=Entry(command=("/app/train.py", "3")))
    template = worker_pod_template(script)
    assert not template.module and template.entrypoint == "/app/train.py"


def test_plain_torchrun_workers_get_the_agents_etcd_settings() -> None:
    environ = {"KFP_ELASTIC_ETCD_KEY_PREFIX": "/from-master"}
    hand_etcd_settings_to_workers(
        EtcdSettings.for_endpoint("10.0.0.1:2379", key_prefix="/x"), environ
    )
    assert environ["KFP_ELASTIC_ETCD_ENDPOINTS"] == "10.0.0.1:2379"
    assert environ["KFP_ELASTIC_ETCD_KEY_PREFIX"] == "/from-master"  # a master's setting stays


# ------------------------------------------------------------------ the command entry


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (Entry(command=("-m",)), "command (after -- / command) -m needs a module name"),
        (
            Entry(command=("--lr", "1")),
            "command (after -- / command) must start with a script path or -m MODULE",
        ),
        (
            Entry(model_def="m", command=("train.py",)),
            "model_def (--model-def / model_def) or a command (after -- / command)",
        ),
    ],
)
def test_command_errors_name_the_field_its_flag_and_its_parameter(
    entry: Entry, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        replace(command_job(), entry=entry).validate()


def test_the_cli_runs_what_follows_the_double_dash() -> None:
    own, entry = split_entry(["--run-id", "r", "--", *COMMAND])
    spec = make_spec(build_parser().parse_args(own), entry, ETCD)
    assert spec.entry == Entry(command=COMMAND) and spec.worker_argv() == COMMAND
    spec.validate()


def test_the_component_command_replaces_the_default_model(tmp_path: Path) -> None:
    spec = run_job.job_spec(
        {"model_def": contract.DEFAULT_MODEL_DEF, "command": "-m my_pkg.train --lr '0.1'"},
        run_id="r",
        launcher="local",
        workdir=str(tmp_path),
    )
    assert spec.entry == Entry(command=COMMAND)
    both = run_job.job_spec(
        {"model_def": "other.model", "command": "train.py"},
        run_id="r",
        launcher="local",
        workdir=str(tmp_path),
    )
    with pytest.raises(ValueError, match=re.escape("model_def (--model-def / model_def) or a")):
        both.validate()
    with pytest.raises(ValueError, match="command .* No closing quotation"):
        run_job.job_spec({"command": "train.py 'x"}, run_id="r", launcher="local")
