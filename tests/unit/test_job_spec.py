"""The job contract (kfp_elastic/job_spec.py): one set of defaults that every signature and
flag repeating one agrees with, one validation whose errors name the field with its flag and
parameter, and one host (master/host.py) for the CLI and the component."""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kfp_elastic import job_spec as contract
from kfp_elastic.components.elastic_train.component import elastic_train
from kfp_elastic.etcd.settings import EtcdSettings
from kfp_elastic.job_env import JobEnv
from kfp_elastic.job_spec import (
    Data,
    Entry,
    JobSpec,
    KubernetesSettings,
    Launch,
    LocalSettings,
    Policy,
    Size,
    Training,
    field_error,
    spec_from_params,
)
from kfp_elastic.master.cli import build_parser, make_spec, split_entry
from kfp_elastic.master.host import make_launcher, plan
from kfp_elastic.master.local_launcher import LocalLauncher
from kfp_elastic.master.wiring import worker_pod_template
from kfp_elastic.pipelines import run_local
from kfp_elastic.pipelines.elastic_training import elastic_training
from kfp_elastic.worker import options as worker_options

ETCD = EtcdSettings.for_endpoint("127.0.0.1:2379")
# The component and the pipeline train the example model by default; the CLI needs one given.
# Their command is one string (parse_command), empty: none.
KFP_DEFAULTS = {**contract.defaults(), "model_def": contract.DEFAULT_MODEL_DEF, "command": ""}


def disagreements(defaults: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    return [
        f"{name}={value!r} (contract: {expected[name]!r})"
        for name, value in defaults.items()
        if name in expected and value != expected[name]
    ]


def by_param(defaults: dict[str, Any]) -> dict[str, Any]:
    """Contract field name -> default, for the parameters named after a contract field."""
    names = {
        contract.param_of(f, section): f
        for section in contract.SECTIONS
        for f in section.__dataclass_fields__
        if "help" in section.__dataclass_fields__[f].metadata
    }
    return {names[p]: value for p, value in defaults.items() if names.get(p)}


def signature_defaults(function: Any) -> dict[str, Any]:
    return {
        name: p.default
        for name, p in inspect.signature(function).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


# ------------------------------------------------------------------ one set of defaults


def test_the_component_signature_agrees_with_the_contract() -> None:
    defaults = by_param(signature_defaults(elastic_train.python_func))
    assert {"min_workers", "snapshot_every", "max_wait_s", "gpus", "cpu"} <= set(defaults)
    assert disagreements(defaults, KFP_DEFAULTS) == []


def test_the_pipeline_signature_agrees_with_the_contract() -> None:
    defaults = by_param(signature_defaults(elastic_training.pipeline_func))
    assert {"min_workers", "max_workers", "epochs", "memory"} <= set(defaults)
    assert disagreements(defaults, KFP_DEFAULTS) == []


def test_the_master_cli_defaults_are_the_contract() -> None:
    args = vars(build_parser().parse_args(["--run-id", "x"]))
    flagged = {name for name in contract.defaults() if name in args}
    assert {"min_workers", "max_workers", "max_wait_s", "kind", "capacity", "gpus"} <= flagged
    assert disagreements(args, contract.defaults()) == []


def test_the_worker_runtime_defaults_are_the_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KFP_ELASTIC_ETCD_ENDPOINTS", "127.0.0.1:2379")
    args = worker_options.parse_args(["--model-def", "m", "--snapshot-dir", "/tmp/s"]).settings
    runtime = {
        "epochs": args.epochs,
        "seed": args.seed,
        "batch_size": args.batch_size,
        "learning_rate": args.learning_rate,
        "batch_policy": args.batch_policy,
        "snapshot_every": args.snapshot_every,
        "step_time": args.step_time,
        "device": args.device,
        "collective_timeout_s": args.collective_timeout,
        "collective_abort_s": args.collective_abort,
    }
    assert disagreements(runtime, contract.defaults()) == []


def test_run_local_overrides_only_its_named_demo_values() -> None:
    args = vars(run_local.parse_args([]))
    expected = {**KFP_DEFAULTS, **run_local.DEMO}
    assert disagreements(args, expected) == []
    demo = {name: args[name] for name in run_local.DEMO}
    assert demo == run_local.DEMO


def test_a_disagreeing_default_is_named() -> None:
    def component(min_workers: int = 2, worker_gpus: int = 0, log_level: str = "x") -> None: ...

    found = disagreements(by_param(signature_defaults(component)), KFP_DEFAULTS)
    assert found == ["min_workers=2 (contract: 1)"]


# ------------------------------------------------------------------ one validation


def job(**sections: Any) -> JobSpec:
    return JobSpec(run_id="r", entry=Entry(model_def="m"), **sections)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (job(size=Size(min_workers=0)), "min_workers (--min-workers / min_workers) must be >= 1"),
        (
            job(size=Size(min_workers=3, max_workers=2)),
            "max_workers (--max-workers / max_workers) must be >= min_workers=3, got 2",
        ),
        (job(size=Size(nproc_per_worker=0)), "nproc_per_worker (--nproc-per-worker / "),
        (job(data=Data(epochs=0)), "epochs (--epochs / epochs) must be >= 1, got 0"),
        (job(training=Training(batch_size=0)), "batch_size (--batch-size / batch_size)"),
        (job(training=Training(learning_rate=0)), "learning_rate (--lr / learning_rate) must be >"),
        (job(training=Training(snapshot_every=-1)), "snapshot_every (--snapshot-every / "),
        (job(training=Training(batch_policy="cubic")), "batch_policy (--batch-policy / "),
        (job(training=Training(device="tpu")), "device (--device) must be one of auto, cpu, cuda"),
        (
            job(training=Training(collective_timeout_s=0)),
            "collective_timeout_s (--collective-timeout) must be > 0",
        ),
        (
            job(training=Training(collective_abort_s=-1)),
            "collective_abort_s (--collective-abort) must be > 0",
        ),
        (job(policy=Policy(max_wait_s=0)), "max_wait_s (--max-wait / max_wait_s) must be > 0"),
        (job(policy=Policy(max_failures=-1)), "max_failures (--max-failures / max_failures)"),
        (job(policy=Policy(leader_ttl_s=0)), "leader_ttl_s (--leader-ttl) must be > 0"),
        (
            job(launch=Launch(kubernetes=KubernetesSettings(gpus=-1))),
            "gpus (--gpu / worker_gpus) must be >= 0",
        ),
        (
            job(launch=Launch(kubernetes=KubernetesSettings(shm_size="lots"))),
            "shm_size (--shm-size / worker_shm_size) 'lots' is not a Kubernetes quantity",
        ),
        (
            job(launch=Launch(kubernetes=KubernetesSettings(memory="4 GB"))),
            "memory (--memory / worker_memory) '4 GB' is not a Kubernetes quantity",
        ),
        (
            job(launch=Launch(kubernetes=KubernetesSettings(cpu="two"))),
            "cpu (--cpu / worker_cpu) 'two' is not a Kubernetes quantity",
        ),
        (
            job(launch=Launch(kubernetes=KubernetesSettings(shm_size="-1Gi"))),
            "shm_size (--shm-size / worker_shm_size) must not be negative, got '-1Gi'",
        ),
        (
            job(launch=Launch(kubernetes=KubernetesSettings(kueue_queue="Team_A"))),
            "kueue_queue (--kueue-queue / kueue_queue) must name a Kueue LocalQueue: a DNS-1123",
        ),
        (job(launch=Launch(kind="slurm")), "kind (--launcher) must be one of local, kubernetes"),
        (job(launch=Launch(local=LocalSettings(capacity=-1))), "capacity (--local-capacity / "),
        (job(launch=Launch(rdzv_conf={"cacert": "x"})), "rdzv_conf (--rdzv-conf) ['cacert']"),
        (
            job(launch=Launch(rdzv_conf={"lease_ttl": ""})),
            "rdzv_conf (--rdzv-conf) ['lease_ttl'] without a value",
        ),
        (
            job(launch=Launch(rdzv_conf={"lease_tll": "5"})),  # what every agent would refuse
            "rdzv_conf (--rdzv-conf) unknown --rdzv-conf key 'lease_tll'",
        ),
        (
            job(launch=Launch(kind="kubernetes")),
            "snapshot_dir (--snapshot-dir / snapshot_dir) is needed by the kubernetes launcher",
        ),
        (job(data=Data(dataset_length=10)), "dataset_length (--dataset-length) and shard_size"),
        (
            job(data=Data(dataset_length=10, shard_size=5, shard_manifest="m.json")),
            "shard_manifest (--shard-manifest / shard_manifest) or dataset_length",
        ),
        (job(data=Data(shard_manifest="/no/such.json")), "shard_manifest (--shard-manifest / "),
        (replace(job(), run_id="a/b"), "run_id (--run-id / run_id) must be non-empty"),
        (replace(job(), entry=Entry()), "model_def (--model-def / model_def) or a command"),
        (
            replace(job(), entry=Entry(model_def="m", command=("x.py",))),
            "model_def (--model-def / model_def) or a command",
        ),
    ],
)
def test_errors_name_the_field_its_flag_and_its_parameter(spec: JobSpec, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        spec.validate()


G, OPP, ONE = (
    contract.GUARANTEED_PRIORITY_CLASS_ENV,
    contract.OPPORTUNISTIC_PRIORITY_CLASS_ENV,
    contract.PRIORITY_CLASS_ENV,
)


@pytest.mark.parametrize(
    ("settings", "env", "expected"),
    [
        (
            {},
            {},
            (
                contract.DEFAULT_GUARANTEED_PRIORITY_CLASS,
                contract.DEFAULT_OPPORTUNISTIC_PRIORITY_CLASS,
            ),
        ),
        ({}, {G: "g", OPP: "o"}, ("g", "o")),
        # a ConfigMap from before the tiers: its one class for every worker
        ({}, {ONE: "low"}, ("low", "low")),
        ({}, {ONE: "low", G: "g"}, ("g", "low")),  # each tier's own variable first
        ({"guaranteed_priority_class": "mine"}, {G: "g", OPP: "o"}, ("mine", "o")),
        (
            {"opportunistic_priority_class": "mine"},
            {},
            (contract.DEFAULT_GUARANTEED_PRIORITY_CLASS, "mine"),
        ),
        # the job's single class: every worker, whatever the ConfigMap says
        ({"priority_class": "one"}, {G: "g", OPP: "o"}, ("one", "one")),
    ],
)
def test_the_worker_classes_resolve_job_then_configmap_then_default(
    settings: dict[str, str], env: dict[str, str], expected: tuple[str, str]
) -> None:
    k8s = KubernetesSettings(**settings).resolved(env)
    assert (k8s.guaranteed_priority_class, k8s.opportunistic_priority_class) == expected


@pytest.mark.parametrize("tier", ["guaranteed_priority_class", "opportunistic_priority_class"])
def test_one_class_for_all_and_a_tier_class_together_are_refused(tier: str) -> None:
    k8s = KubernetesSettings(priority_class="low", **{tier: "x"})
    message = (
        "priority_class (--priority-class / priority_class) puts every worker in one class "
        f"('low') and cannot be combined with {tier}='x': give priority_class alone"
    )
    for refuse in (job(launch=Launch(kubernetes=k8s)).validate, lambda: k8s.resolved({})):
        with pytest.raises(ValueError, match=re.escape(message)):
            refuse()


# ------------------------------------------------------------------ the ladder's settings

LADDER = ",".join(contract.DEFAULT_LADDER_PRIORITY_CLASSES)


def laddered(**settings: Any) -> JobSpec:
    """A job with the default ladder, and ``settings`` of KubernetesSettings / Policy."""
    policy = {k: settings.pop(k) for k in ("max_wait_s",) if k in settings}
    k8s = KubernetesSettings(**{"ladder_priority_classes": LADDER, **settings})
    return job(launch=Launch(kubernetes=k8s), policy=Policy(**policy))


def test_a_ladder_validates_and_none_is_the_default() -> None:
    assert KubernetesSettings().ladder_levels() == ()
    laddered().validate()
    two = laddered(ladder_priority_classes="a, b", ladder_thresholds_gpu_h=" 0.5 ")
    two.validate()
    assert two.launch.kubernetes.ladder_levels() == ("a", "b")
    assert two.launch.kubernetes.ladder_thresholds_gpu_s() == (1800.0,)
    # without levels its numbers are still checked, not how they fit levels or max_wait_s
    job(launch=Launch(kubernetes=KubernetesSettings(ladder_thresholds_gpu_h="1,2,3"))).validate()
    job(policy=Policy(max_wait_s=60)).validate()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            laddered(ladder_starvation_s=0),
            "ladder_starvation_s (--ladder-starvation / ladder_starvation_s) must be > 0, got 0",
        ),
        (
            laddered(ladder_min_move_interval_s=-1),
            "ladder_min_move_interval_s (--ladder-min-move-interval / "
            "ladder_min_move_interval_s) must be >= 0, got -1",
        ),
        (
            laddered(ladder_thresholds_gpu_h="1h,10h"),
            "ladder_thresholds_gpu_h (--ladder-thresholds / ladder_thresholds_gpu_h) must be "
            "comma-separated numbers of GPU-hours, got '1h,10h'",
        ),
        (
            laddered(ladder_thresholds_gpu_h="10,1"),
            "ladder_thresholds_gpu_h (--ladder-thresholds / ladder_thresholds_gpu_h) must be "
            "positive and increasing, got '10,1'",
        ),
        (laddered(ladder_thresholds_gpu_h="0,1"), "must be positive and increasing, got '0,1'"),
        (laddered(ladder_thresholds_gpu_h="1,1"), "must be positive and increasing, got '1,1'"),
        (
            laddered(ladder_thresholds_gpu_h="1"),
            "ladder_thresholds_gpu_h (--ladder-thresholds / ladder_thresholds_gpu_h) needs 2 "
            "thresholds for 3 ladder levels (one to leave each level but the last), got 1: '1'",
        ),
        (
            laddered(ladder_priority_classes="Level_0,level-1", ladder_thresholds_gpu_h="1"),
            "ladder_priority_classes (--ladder-priority-classes / ladder_priority_classes) "
            "'Level_0' is not a DNS-1123 label",
        ),
        (
            laddered(ladder_priority_classes="a,,b"),
            "ladder_priority_classes (--ladder-priority-classes / ladder_priority_classes) '' "
            "is not a DNS-1123 label",
        ),
        (
            laddered(ladder_priority_classes="a,b,a"),
            "ladder_priority_classes (--ladder-priority-classes / ladder_priority_classes) "
            "names a twice: each level needs a class of its own",
        ),
        (
            laddered(ladder_priority_classes="a", ladder_thresholds_gpu_h=""),
            "ladder_priority_classes (--ladder-priority-classes / ladder_priority_classes) "
            "needs two levels or more, got 'a'",
        ),
        (
            laddered(max_wait_s=300),
            "ladder_starvation_s (--ladder-starvation / ladder_starvation_s) must be shorter "
            "than max_wait_s=300, got 300: a job below min_workers for max_wait_s fails before "
            "the ladder takes it back to level 0",
        ),
        (
            laddered(ladder_starvation_s=60),
            "ladder_min_move_interval_s (--ladder-min-move-interval / "
            "ladder_min_move_interval_s) must be at most ladder_starvation_s=60, got 120",
        ),
        (
            laddered(priority_class="one"),
            "ladder_priority_classes (--ladder-priority-classes / ladder_priority_classes) "
            "gives workers 0..min_workers-1 the ladder's classes and cannot be combined with "
            "priority_class='one': give one of them",
        ),
        (
            laddered(guaranteed_priority_class="g"),
            "cannot be combined with guaranteed_priority_class='g'",
        ),
        (
            job(launch=Launch(kubernetes=KubernetesSettings(ladder_thresholds_gpu_h="x"))),
            "ladder_thresholds_gpu_h (--ladder-thresholds / ladder_thresholds_gpu_h) must be",
        ),
    ],
)
def test_the_ladders_errors_name_the_setting(spec: JobSpec, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        spec.validate()


def test_a_ladder_with_its_opportunistic_class_only_is_accepted() -> None:
    """The ladder replaces the guaranteed class; the opportunistic one stays the job's."""
    laddered(opportunistic_priority_class="mine").validate()


def test_the_ladder_settings_come_from_flags_and_parameters() -> None:
    argv = [
        "--run-id",
        "r",
        "--model-def",
        "m",
        "--ladder-priority-classes",
        "a,b",
        "--ladder-thresholds",
        "2",
        "--ladder-starvation",
        "200",
        "--ladder-min-move-interval",
        "30",
    ]
    from_flags = make_spec(build_parser().parse_args(argv), [], ETCD).launch.kubernetes
    from_params = spec_from_params(
        {
            "model_def": "m",
            "ladder_priority_classes": "a,b",
            "ladder_thresholds_gpu_h": "2",
            "ladder_starvation_s": 200.0,
            "ladder_min_move_interval_s": 30.0,
        },
        run_id="r",
    ).launch.kubernetes
    for k8s in (from_flags, from_params):
        assert k8s.ladder_levels() == ("a", "b") and k8s.ladder_thresholds_gpu_s() == (7200.0,)
        assert (k8s.ladder_starvation_s, k8s.ladder_min_move_interval_s) == (200.0, 30.0)


def test_the_defaults_validate() -> None:
    job().validate()
    JobSpec(run_id="r", entry=Entry(command=("train.py",)), etcd=ETCD).validate()


def test_field_error_spells_flag_and_parameter_from_the_name() -> None:
    assert (
        str(field_error("min_workers", "is bad"))
        == "min_workers (--min-workers / min_workers) is bad"
    )
    assert str(field_error("memory", "x")) == "memory (--memory / worker_memory) x"
    assert str(field_error("finish_grace_s", "x")) == "finish_grace_s (--finish-grace) x"


# ------------------------------------------------------------------ deriving


def test_the_builtin_entry_gets_the_training_settings_in_its_environment() -> None:
    spec = job(
        data=Data(epochs=2, seed=7),
        training=Training(
            batch_size=8,
            snapshot_every=0,
            snapshot_dir="/snap/r",
            device="cuda",
            collective_timeout_s=90,
            collective_abort_s=3,
        ),
    )
    argv = spec.worker_argv()
    assert argv == ("-m", "kfp_elastic.worker", "--model-def", "m")
    env = {**ETCD.to_env(), **JobEnv.of(spec, "/snap/r").to_env()}
    settings = worker_options.parse_args(list(argv[2:]), env).settings
    assert (settings.epochs, settings.seed, settings.batch_size) == (2, 7, 8)
    assert settings.snapshot_every == 0 and settings.batch_policy == "fixed-global-batch"
    assert settings.output == "/snap/r/model.pt" and settings.device == "cuda"
    assert (settings.collective_timeout, settings.collective_abort) == (90, 3)
    command = replace(spec, entry=Entry(command=("train.py", "--x")))
    assert command.worker_argv() == ("train.py", "--x")


def test_the_component_parameters_build_the_spec() -> None:
    spec = spec_from_params(
        {
            "min_workers": 2,
            "worker_cpu": "2",
            "worker_shm_size": "8Gi",
            "max_wait_s": 9.0,
            "model_def": "m",
        },
        run_id="r",
        kind="kubernetes",
        pod_overrides={"tolerations": []},
    )
    assert spec.size.min_workers == 2 and spec.launch.kubernetes.cpu == "2"
    assert spec.launch.kubernetes.shm_size == "8Gi" and spec.worker_shm_size() == "8Gi"
    assert spec.policy.max_wait_s == 9.0 and spec.launch.kind == "kubernetes"
    assert spec.launch.kubernetes.pod_overrides == {"tolerations": []}
    with pytest.raises(ValueError, match="not parameters of the job contract: log_level"):
        spec_from_params({"log_level": "INFO"}, run_id="r")


def test_the_cli_builds_the_builtin_entry_from_model_def() -> None:
    own, entry = split_entry(["--run-id", "r", "--model-def", "m", "--batch-size", "4"])
    spec = make_spec(build_parser().parse_args(own), entry, ETCD)
    assert spec.entry == Entry(model_def="m") and spec.training.batch_size == 4
    own, entry = split_entry(["--run-id", "r", "--", "--model-def", "m"])
    assert make_spec(build_parser().parse_args(own), entry, ETCD).worker_argv() == (
        "-m",
        "kfp_elastic.worker",
        "--model-def",
        "m",
    )


def test_the_record_is_json_and_holds_no_password(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("hunter2")
    etcd = EtcdSettings.for_endpoint("e:2379", user="u", password_file=str(tmp_path / "pw"))
    record = replace(job(), etcd=etcd).to_record()
    assert json.loads(json.dumps(record)) == record
    assert record["size"]["min_workers"] == 1 and record["etcd"]["user"] == "u"
    assert "hunter2" not in json.dumps(record)


# ------------------------------------------------------------------ one host


def test_the_local_launcher_gets_the_whole_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")  # the master's check finds the script
    spec = JobSpec(
        run_id="r",
        entry=Entry(command=("train.py",)),
        size=Size(min_workers=1, max_workers=3, nproc_per_worker=2),
        etcd=ETCD,
        launch=Launch(
            rdzv_conf={"last_call_timeout": "1"},
            worker_max_restarts=7,
            local=LocalSettings(workdir=str(tmp_path), capacity=1),
        ),
    )
    launcher = make_launcher(plan(spec), None)
    assert isinstance(launcher, LocalLauncher)
    assert launcher.rdzv_conf == {
        "last_call_timeout": "1",
        "orphan_timeout": "300",
        "max_failures": "3",
    }
    assert launcher.capacity == 1
    assert launcher.max_restarts == 7 and launcher.nnodes == "1:3"
    assert launcher.nproc_per_worker == 2 and launcher.workdir == tmp_path.resolve()
    assert launcher.env["KFP_ELASTIC_ETCD_ENDPOINTS"] == "127.0.0.1:2379"
    assert launcher.env["KFP_ELASTIC_SNAPSHOT_DIR"] == str(tmp_path.resolve() / "snapshots")


def test_the_worker_pods_get_the_same_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KFP_ELASTIC_WORKER_GUARANTEED_PRIORITY_CLASS", "from-configmap")
    monkeypatch.delenv("KFP_ELASTIC_WORKER_OPPORTUNISTIC_PRIORITY_CLASS", raising=False)
    monkeypatch.delenv("KFP_ELASTIC_WORKER_PRIORITY_CLASS", raising=False)
    monkeypatch.delenv("KFP_ELASTIC_WORKER_IMAGE", raising=False)
    spec = JobSpec(
        run_id="r",
        entry=Entry(model_def="m"),
        size=Size(min_workers=1, max_workers=3),
        training=Training(snapshot_dir="/mnt/snap/r"),
        etcd=ETCD,
        launch=Launch(
            kind="kubernetes",
            rdzv_conf={"last_call_timeout": "1"},
            worker_max_restarts=7,
            kubernetes=KubernetesSettings(namespace="ml", gpus=1),
        ),
    )
    template = worker_pod_template(spec)
    assert template.kueue_queue is None  # no Kueue unless asked for
    queued = replace(
        spec, launch=replace(spec.launch, kubernetes=KubernetesSettings(kueue_queue="q"))
    )
    assert worker_pod_template(queued).kueue_queue == "q"
    assert template.snapshot_buffer is None
    assert template.rdzv_conf == spec.worker_rdzv_conf() and template.max_restarts == 7
    assert template.rdzv_conf["last_call_timeout"] == "1"
    assert template.guaranteed_priority_class == "from-configmap"
    assert template.opportunistic_priority_class == contract.DEFAULT_OPPORTUNISTIC_PRIORITY_CLASS
    assert template.service_account == contract.DEFAULT_SERVICE_ACCOUNT
    assert template.image == contract.DEFAULT_WORKER_IMAGE and template.gpu == 1
    assert (template.min_nodes, template.max_nodes, template.namespace) == (1, 3, "ml")
    assert template.module and template.entrypoint == "kfp_elastic.worker"
    assert template.entrypoint_args == spec.worker_argv()[2:]


@pytest.mark.parametrize(
    ("device", "gpus", "nproc", "expected"),
    [
        ("cuda", 0, 4, 4),  # one GPU per process unless told otherwise
        ("cuda", 2, 2, 2),
        ("auto", 0, 2, 0),  # auto on a pod without GPUs: the CPU
        ("auto", 2, 2, 2),
        ("cpu", 1, 2, 1),  # as given: the runtime does not use it
    ],
)
def test_a_cuda_job_gets_a_gpu_per_process(device, gpus, nproc, expected) -> None:
    spec = JobSpec(
        run_id="r",
        entry=Entry(model_def="m"),
        size=Size(nproc_per_worker=nproc),
        training=Training(device=device, snapshot_dir="/mnt/snap"),
        etcd=ETCD,
        launch=Launch(kind="kubernetes", kubernetes=KubernetesSettings(gpus=gpus)),
    )
    spec.validate()
    assert spec.worker_pod_gpus() == expected
    assert worker_pod_template(spec).gpu == expected


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_gpus_that_do_not_fit_the_processes_are_refused(device: str) -> None:
    spec = JobSpec(
        run_id="r",
        entry=Entry(model_def="m"),
        size=Size(nproc_per_worker=4),
        training=Training(device=device, snapshot_dir="/mnt/snap"),
        etcd=ETCD,
        launch=Launch(kind="kubernetes", kubernetes=KubernetesSettings(gpus=2)),
    )
    with pytest.raises(ValueError, match="gpus .* is 2 GPUs per pod but nproc_per_worker is 4"):
        spec.validate()


@pytest.mark.parametrize(
    ("nproc", "given", "expected"), [(1, "", None), (4, "", "4Gi"), (4, "16Gi", "16Gi")]
)
def test_pods_with_several_processes_get_a_shared_memory_volume(nproc, given, expected) -> None:
    spec = JobSpec(
        run_id="r",
        entry=Entry(model_def="m"),
        size=Size(nproc_per_worker=nproc),
        training=Training(snapshot_dir="/mnt/snap"),
        etcd=ETCD,
        launch=Launch(kind="kubernetes", kubernetes=KubernetesSettings(shm_size=given)),
    )
    template = worker_pod_template(spec)
    assert template.shm_size == expected
    if expected:
        from kfp_elastic.master.pod_spec import build_pod

        pod = build_pod(template)
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": expected}


def test_a_sharded_state_grows_each_pods_shared_memory_and_memory_by_what_it_keeps() -> None:
    """12 GiB of sharded state, at least 2 workers x 2 processes: each rank keeps 4 x 3 GiB
    (its shards and a neighbour's copy, two snapshots each), a pod 24 GiB on top of the 2 GiB
    /dev/shm its two processes get anyway; the pod's memory counts the /dev/shm."""
    from kfp_elastic.master.pod_spec import build_pod, pod_memory

    spec = JobSpec(
        run_id="r",
        entry=Entry(model_def="m"),
        size=Size(min_workers=2, max_workers=4, nproc_per_worker=2),
        training=Training(snapshot_dir="/mnt/snap"),
        etcd=ETCD,
        launch=Launch(
            kind="kubernetes",
            kubernetes=KubernetesSettings(sharded_state="12Gi", memory="8Gi"),
        ),
    )
    spec.validate()
    template = worker_pod_template(spec)
    assert template.shm_size == "26Gi"
    assert pod_memory(template.memory, template) == "34Gi"
    volumes = {v["name"]: v for v in build_pod(template)["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "26Gi"}
    bad = job(launch=Launch(kubernetes=KubernetesSettings(sharded_state="big")))
    with pytest.raises(ValueError, match="sharded_state .* 'big' is not a Kubernetes quantity"):
        bad.validate()


def test_the_builtin_runtime_is_preloaded_by_the_zygotes() -> None:
    from kfp_elastic.contract.rendezvous_config import RendezvousConfig

    builtin = job(launch=Launch(rdzv_conf={"last_call_timeout": "1"}))
    conf = builtin.worker_rdzv_conf()
    assert conf == {
        "last_call_timeout": "1",
        "warm_start_preload": "kfp_elastic.worker.runner",
        "orphan_timeout": "300",
        "max_failures": "3",
    }
    agent = RendezvousConfig.from_params("127.0.0.1:2379", "r", 1, 2, None, conf, env={})
    assert agent.preload_modules == ("kfp_elastic.worker.runner",)
    # Neither the model definition nor a command is imported ahead (their top-level code would
    # see the agent's environment); the user's choice is kept.
    command = JobSpec(run_id="r", entry=Entry(command=("train.py",)))
    assert "warm_start_preload" not in command.worker_rdzv_conf()
    own = job(launch=Launch(rdzv_conf={"warm_start_preload": "transformers"}))
    assert own.worker_rdzv_conf()["warm_start_preload"] == "transformers"


def test_the_snapshot_buffer_reaches_the_pods_and_a_bad_one_is_named() -> None:
    def spec(buffer: str) -> JobSpec:  # as the component builds it from its parameters
        return spec_from_params(
            {"model_def": "m", "worker_memory": "4Gi", "worker_snapshot_buffer": buffer},
            run_id="r",
            etcd=ETCD,
            kind="kubernetes",
            snapshot_dir="/mnt/snap/r",
        )

    good = spec("9Gi")
    good.validate()
    assert good.launch.kubernetes.snapshot_buffer == "9Gi"
    assert worker_pod_template(good).snapshot_buffer == "9Gi"
    message = "snapshot_buffer (--snapshot-buffer / worker_snapshot_buffer) '9 GB' is not"
    with pytest.raises(ValueError, match=re.escape(message)):
        spec("9 GB").validate()
