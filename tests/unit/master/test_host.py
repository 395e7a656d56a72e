"""The one host of a master (master/host.py): a launch plan built without starting anything (local
and Kubernetes workers, embedded and external etcd, the SIGTERM rule), the same plan from the
CLI and the component for the same job, ``--dry-run`` that starts nothing, the job contract
validated once per start, and SIGTERM cancelling a master nobody could take over from."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kfp_elastic.components.elastic_train import run_job
from kfp_elastic.etcd.embedded import EmbeddedEtcd
from kfp_elastic.etcd.settings import EtcdSettings
from kfp_elastic.job_spec import (
    Entry,
    JobSpec,
    KubernetesSettings,
    Launch,
    LocalSettings,
    Size,
    Training,
)
from kfp_elastic.master import cli
from kfp_elastic.master.host import (
    CANCEL,
    EMBEDDED,
    EXTERNAL,
    STEP_DOWN,
    LaunchPlan,
    plan,
    signal_policy,
)
from tests.helpers import master_command

ETCD = EtcdSettings.for_endpoint("10.0.0.7:2379")
DIGITS = "kfp_elastic.worker.examples.digits"


def local_job(tmp_path: Path, etcd: EtcdSettings | None = ETCD, **size: int) -> JobSpec:
    return JobSpec(
        run_id="r",
        entry=Entry(model_def=DIGITS),
        size=Size(**{"min_workers": 1, "max_workers": 2, **size}),
        training=Training(device="cpu"),
        etcd=etcd,
        launch=Launch(local=LocalSettings(workdir=str(tmp_path / "work"))),
    )


def pod_job(etcd: EtcdSettings | None = ETCD) -> JobSpec:
    return JobSpec(
        run_id="r",
        entry=Entry(model_def=DIGITS),
        size=Size(min_workers=1, max_workers=3),
        training=Training(snapshot_dir="/mnt/snap/r"),
        etcd=etcd,
        launch=Launch(
            kind="kubernetes",
            kubernetes=KubernetesSettings(namespace="ml", image="worker:1", cpu="1"),
        ),
    )


# -- the plan ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("etcd", "kind", "sigterm"),
    [
        (EMBEDDED, "local", CANCEL),
        (EXTERNAL, "local", CANCEL),
        (EMBEDDED, "kubernetes", CANCEL),
        (EXTERNAL, "kubernetes", STEP_DOWN),  # a KFP retry of the task adopts the pods
    ],
)
def test_sigterm_steps_down_only_where_a_successor_can_adopt(
    etcd: str, kind: str, sigterm: str
) -> None:
    policy = signal_policy(etcd, kind)
    assert (policy.sigint, policy.sigterm) == (CANCEL, sigterm)
    assert policy.term_cancels == (sigterm == CANCEL)


def test_a_local_plan_resolves_the_workers_commands_and_environment(tmp_path: Path) -> None:
    launch = plan(local_job(tmp_path), env={"KFP_ELASTIC_ON_DEMAND_PRICE": "2"}, cwd=tmp_path)
    assert launch == plan(local_job(tmp_path), env=launch.env, cwd=tmp_path)  # pure: the same
    assert (launch.etcd.mode, launch.etcd.endpoints) == (EXTERNAL, "10.0.0.7:2379")
    assert launch.signals.sigterm == CANCEL and launch.pod is None
    assert launch.prices.on_demand == 2.0
    work = tmp_path / "work"
    assert launch.workdir == work and not work.exists()  # nothing made yet
    env = launch.worker_env()
    assert env["KFP_ELASTIC_ETCD_ENDPOINTS"] == "10.0.0.7:2379"
    assert env["KFP_ELASTIC_SNAPSHOT_DIR"] == str(work / "snapshots")
    commands = launch.local_agent_commands()
    assert sorted(commands) == ["worker-0-0", "worker-1-0"]
    command = commands["worker-1-0"]
    assert command[1:4] == [
        "-m",
        "kfp_elastic.master.supervise",
        str(work / "workers/worker-1-0.exit"),
    ]
    assert "--rdzv-endpoint=10.0.0.7:2379" in command and "--nnodes=1:2" in command
    assert command[-len(launch.spec.worker_argv()) :] == list(launch.spec.worker_argv())
    shown = yaml.safe_load(launch.describe())
    assert shown["signals"] == {"SIGINT": CANCEL, "SIGTERM": CANCEL, "own pod deleted": CANCEL}
    assert shown["local"]["commands"] == commands
    assert shown["local"]["environment"]["KFP_ELASTIC_RUN_ID"] == "r"


def test_an_embedded_etcd_keeps_its_data_in_the_work_directory(tmp_path: Path) -> None:
    launch = plan(local_job(tmp_path, etcd=None), cwd=tmp_path)
    assert launch.etcd.mode == EMBEDDED
    assert launch.etcd.data_dir == str(tmp_path / "work" / "etcd")
    assert launch.signals.sigterm == CANCEL
    shown = yaml.safe_load(launch.describe())
    assert shown["etcd"]["mode"] == EMBEDDED
    assert shown["local"]["environment"]["KFP_ELASTIC_ETCD_ENDPOINTS"].startswith("<")
    started = launch.with_etcd(EtcdSettings.for_endpoint("127.0.0.1:2999"))
    assert started.worker_env()["KFP_ELASTIC_ETCD_ENDPOINTS"] == "127.0.0.1:2999"
    assert started.etcd.data_dir == launch.etcd.data_dir


def test_a_kubernetes_plan_holds_the_worker_pods(tmp_path: Path) -> None:
    launch = plan(pod_job(), env={}, cwd=tmp_path)
    assert launch.local is None and launch.pod is not None
    assert launch.signals.sigterm == STEP_DOWN
    documents = list(yaml.safe_load_all(launch.describe()))
    summary, pods = documents[0], documents[1:]
    assert summary["etcd"] == {
        "mode": EXTERNAL,
        "endpoints": "10.0.0.7:2379",
        "key_prefix": "/kfp-elastic",
    }
    assert summary["signals"]["SIGTERM"] == STEP_DOWN
    # the first pod of each tier: worker 0 guaranteed, worker 1 (min_workers) opportunistic
    assert [p["metadata"]["name"] for p in pods] == ["r-worker-0-0", "r-worker-1-0"]
    assert {p["kind"] for p in pods} == {"Pod"} and pods[0]["metadata"]["namespace"] == "ml"
    assert pods[0]["spec"]["priorityClassName"] != pods[1]["spec"]["priorityClassName"]


def test_worker_pods_cannot_use_an_embedded_etcd(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot reach an etcd embedded"):
        plan(pod_job(etcd=None), env={}, cwd=tmp_path)


# -- the same plan from the CLI and the component ------------------------------------------------


def cli_plan(*flags: str) -> LaunchPlan:
    own, entry = cli.split_entry(list(flags))
    return cli.launch_plan(cli.build_parser().parse_args(own), entry)


def without_origin(launch: LaunchPlan) -> dict[str, Any]:
    summary = launch.summary()
    summary.pop("origin")
    return summary


@pytest.mark.parametrize("kind", ["local", "kubernetes"])
def test_the_cli_and_the_component_plan_the_same_job_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("KFP_ELASTIC_ETCD_ENDPOINTS", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(name, raising=False)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"shards": [[0, 0, 1437]]}))
    root, workdir = tmp_path / "snapshots", tmp_path / "job"
    from_cli = cli_plan(
        *("--run-id", "run-1", "--etcd", "10.0.0.7:2379", "--launcher", kind),
        *("--model-def", DIGITS, "--shard-manifest", str(manifest), "--epochs", "2"),
        *("--min-workers", "1", "--max-workers", "3", "--namespace", "ml", "--image", "w:1"),
        *("--workdir", str(workdir), "--snapshot-dir", str(root / "run-1")),
    )
    params = {
        "model_def": DIGITS,
        "command": "",
        "shard_manifest": str(manifest),
        "epochs": 2,
        "min_workers": 1,
        "max_workers": 3,
        "namespace": "ml",
        "image": "w:1",
    }
    spec = run_job.job_spec(
        params,
        run_id="run-1",
        launcher=kind,
        etcd_endpoint="10.0.0.7:2379",
        snapshot_dir=str(root),
        workdir=str(workdir),
        env={},
    )
    from_component, _ = run_job.plan_job(spec)
    assert from_component.origin == "kfp-run:run-1" and from_cli.origin is None
    assert without_origin(from_component) == without_origin(from_cli)
    if kind == "kubernetes":
        assert from_component.pods() == from_cli.pods()
        assert from_component.signals.sigterm == STEP_DOWN
    else:
        assert from_component.signals.sigterm == CANCEL


# -- --dry-run starts nothing -------------------------------------------------------------------


@pytest.fixture
def nothing_may_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """No child process, no socket bound or connected (etcd, the Kubernetes API)."""

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"a dry run started something: {args!r}")

    monkeypatch.setattr(subprocess, "Popen", forbidden)
    monkeypatch.setattr(EmbeddedEtcd, "start", forbidden)
    for method in ("bind", "connect", "connect_ex"):
        monkeypatch.setattr(socket.socket, method, forbidden)


def test_a_dry_run_prints_the_local_commands_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], nothing_may_start: None
) -> None:
    code = cli.main(
        ["--run-id", "dry", "--etcd", "embedded", "--min-workers", "2", "--max-workers", "2"]
        + ["--workdir", str(tmp_path / "work"), "--dry-run", "--model-def", DIGITS]
        + ["--device", "cpu"]
    )
    assert code == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["etcd"]["mode"] == EMBEDDED and shown["signals"]["SIGTERM"] == CANCEL
    assert sorted(shown["local"]["commands"]) == ["worker-0-0", "worker-1-0"]
    assert "--model-def" in shown["local"]["commands"]["worker-0-0"]
    assert not (tmp_path / "work").exists()


def test_a_dry_run_prints_the_worker_pods_and_calls_no_api(
    capsys: pytest.CaptureFixture[str], nothing_may_start: None
) -> None:
    code = cli.main(
        ["--run-id", "dry", "--etcd", "10.0.0.7:2379", "--launcher", "kubernetes"]
        + ["--namespace", "ml", "--image", "w:1", "--snapshot-dir", "/mnt/s", "--dry-run"]
        + ["--", "-m", "my_pkg.train", "--steps", "9"]
    )
    assert code == 0
    summary, *pods = yaml.safe_load_all(capsys.readouterr().out)
    assert summary["signals"]["SIGTERM"] == STEP_DOWN
    assert pods and pods[0]["kind"] == "Pod"
    args = pods[0]["spec"]["containers"][0]["args"]
    assert args[-4:] == ["-m", "my_pkg.train", "--steps", "9"]


def test_bad_input_fails_a_dry_run_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    command = master_command(
        run_id="dry", etcd="embedded", min_workers=3, max_workers=2, dry_run=True
    )
    done = subprocess.run([*command, "--", "-m", "x"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "max_workers (--max-workers / max_workers) must be >= min_workers=3" in done.stderr


# -- the contract is validated once per start ----------------------------------------------------


def test_a_start_validates_the_job_once_and_parses_its_prices_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, etcd: EmbeddedEtcd
) -> None:
    """A job whose only worker fails at once, through the whole CLI start: plan, run id's
    check, the checks before any worker starts, the master's run."""
    calls = {"validate": 0, "prices": 0}
    validate, prices = JobSpec.validate, KubernetesSettings.prices

    def counted_validate(self: JobSpec) -> None:
        calls["validate"] += 1
        validate(self)

    def counted_prices(self: KubernetesSettings, env: Any) -> Any:
        calls["prices"] += 1
        return prices(self, env)

    monkeypatch.setattr(JobSpec, "validate", counted_validate)
    monkeypatch.setattr(KubernetesSettings, "prices", counted_prices)
    script = tmp_path / "fails.py"
    script.write_text("raise SystemExit(3)\n")
    monkeypatch.chdir(tmp_path)
    code = cli.main(
        ["--run-id", "once", "--etcd", etcd.endpoint, "--min-workers", "1", "--max-workers", "1"]
        + ["--max-failures", "0", "--worker-max-restarts", "0", "--workdir", str(tmp_path / "w")]
        + ["--", str(script)]
    )
    assert code == 1
    assert calls == {"validate": 1, "prices": 1}
