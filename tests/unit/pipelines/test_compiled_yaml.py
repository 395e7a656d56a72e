"""The compiled pipeline and components: committed YAML = a fresh compile, the YAML parses into
KFP's protos with no unknown field, the pipeline's shape (exit handler, passthroughs, settings)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.protobuf import json_format
from kfp.kubernetes import kubernetes_executor_config_pb2
from kfp.pipeline_spec import pipeline_spec_pb2

from kfp_elastic.components import BASE_IMAGE
from kfp_elastic.etcd.settings import ENV_VARS as ETCD_ENV
from kfp_elastic.job_spec import DEFAULT_WORKER_IMAGE, WORKER_IMAGE_ENV, KubernetesSettings
from kfp_elastic.pipelines import compile as compile_module
from kfp_elastic.pipelines.compile import ROOT, same_compile, stale, targets
from kfp_elastic.pipelines.elastic_training import (
    CONFIG_ENV,
    SNAPSHOT_MOUNT,
    TRAIN_RETRIES,
    local_pipeline,
)

PIPELINE_YAML = ROOT / "pipelines" / "elastic_training.yaml"
pytestmark = pytest.mark.filterwarnings(
    "ignore:.*non-Python base image:RuntimeWarning",
    "ignore:.*have no effect in the current local runner",
)


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def parse_spec(document: dict[str, Any]) -> pipeline_spec_pb2.PipelineSpec:
    return json_format.ParseDict(
        document, pipeline_spec_pb2.PipelineSpec(), ignore_unknown_fields=False
    )


# ------------------------------------------------------------------------------ compiled YAML


def test_committed_yaml_equals_a_fresh_compile() -> None:
    assert stale() == [], "run: kfp-elastic compile"
    assert compile_module.main(["--check"]) == 0


def test_only_the_kfp_patch_release_is_ignored() -> None:
    committed = "deploymentSpec: {}\nsdkVersion: kfp-2.17.0\n"
    assert same_compile(committed, committed.replace("kfp-2.17.0", "kfp-2.17.3"))
    assert not same_compile(committed, committed.replace("kfp-2.17.0", "kfp-2.18.0"))
    assert not same_compile(committed, committed.replace("{}", "{a: 1}"))


def _committed_copy(tmp_path: Path, source: Path, edit: tuple[str, str]) -> Path:
    """`source` as if compiled by another kfp 2.17 patch release, with `edit` applied."""
    text = source.read_text()
    assert edit[0] in text
    tmp_path.mkdir(exist_ok=True)
    copy = tmp_path / source.name
    text = re.sub(r"sdkVersion: kfp-2\.17\.\S+", "sdkVersion: kfp-2.17.99", text)
    copy.write_text(text.replace(edit[0], edit[1], 1))
    return copy


@pytest.mark.parametrize(
    "committed, edit",
    [
        ("components/stop_workers/component.yaml", ("image: ", "image: changed/")),
        ("pipelines/elastic_training.yaml", ("fixed-global-batch", "fixed-local-batch")),
    ],
    ids=["component", "pipeline"],
)
def test_a_real_change_is_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, committed: str, edit: tuple[str, str]
) -> None:
    source = ROOT / committed
    func = targets()[source]
    unchanged = _committed_copy(tmp_path / "unchanged", source, ("", ""))
    changed = _committed_copy(tmp_path, source, edit)
    monkeypatch.setattr(compile_module, "targets", lambda: {unchanged: func, changed: func})
    assert stale() == [changed]
    monkeypatch.setattr(compile_module, "ROOT", tmp_path)
    assert compile_module.main(["--check"]) == 1


@pytest.mark.parametrize("path", sorted(targets()), ids=lambda p: str(p.relative_to(ROOT)))
def test_yaml_parses_into_kfp_protos_without_unknown_fields(path: Path) -> None:
    spec_doc, *platform_docs = documents(path)
    spec = parse_spec(spec_doc)
    assert spec.schema_version == "2.1.0" and spec.sdk_version.startswith("kfp-2.17")
    for executor in spec.deployment_spec["executors"].values():
        container = executor["container"]
        assert container["image"] == BASE_IMAGE
        assert "pip install" not in " ".join(container["command"])  # install_kfp_package=False
    for platform_doc in platform_docs:
        platform = json_format.ParseDict(
            platform_doc, pipeline_spec_pb2.PlatformSpec(), ignore_unknown_fields=False
        )
        executors = json_format.MessageToDict(platform.platforms["kubernetes"])
        for config in executors["deploymentSpec"]["executors"].values():
            json_format.ParseDict(
                config,
                kubernetes_executor_config_pb2.KubernetesExecutorConfig(),
                ignore_unknown_fields=False,
            )


def test_pipeline_shape() -> None:
    spec_doc, platform_doc = documents(PIPELINE_YAML)
    spec = parse_spec(spec_doc)
    root = spec.root.dag.tasks
    assert set(root) == {"exit-handler-1", "stop-workers"}
    exit_task = root["stop-workers"]
    assert (
        exit_task.trigger_policy.strategy
        == pipeline_spec_pb2.PipelineTaskSpec.TriggerPolicy.ALL_UPSTREAM_TASKS_COMPLETED
    )
    inner = spec.components["comp-exit-handler-1"].dag.tasks
    assert set(inner) == {"shard-dataset", "elastic-train", "evaluate"}
    assert list(inner["elastic-train"].dependent_tasks) == ["shard-dataset"]
    assert list(inner["evaluate"].dependent_tasks) == ["elastic-train"]
    assert not inner["elastic-train"].caching_options.enable_cache
    # A preempted master pod is retried by KFP (the new master adopts the workers); nothing
    # else is: shard and evaluate are cheap to run again by hand, the exit handler must not loop.
    retry = inner["elastic-train"].retry_policy
    assert retry.max_retry_count == TRAIN_RETRIES >= 1
    assert 0 < retry.backoff_duration.seconds <= retry.backoff_max_duration.seconds <= 300
    assert not any(inner[t].HasField("retry_policy") for t in ("shard-dataset", "evaluate"))
    assert not exit_task.HasField("retry_policy")
    train_component = spec.components["comp-elastic-train"]
    assert {"model", "metrics", "report"} <= set(train_component.output_definitions.artifacts)
    assert set(train_component.output_definitions.parameters) == {
        "final_loss",
        "steps",
        "restarts",
        "goodput",
    }
    passthrough = {p.field for p in train_component.task_config_passthroughs}
    enum = pipeline_spec_pb2.TaskConfigPassthroughType
    assert passthrough == {
        enum.KUBERNETES_TOLERATIONS,
        enum.KUBERNETES_NODE_SELECTOR,
        enum.KUBERNETES_AFFINITY,
        enum.KUBERNETES_VOLUMES,
    }
    config = json_format.ParseDict(
        platform_doc["platforms"]["kubernetes"]["deploymentSpec"]["executors"][
            "exec-elastic-train"
        ],
        kubernetes_executor_config_pb2.KubernetesExecutorConfig(),
        ignore_unknown_fields=False,
    )
    assert config.pvc_mount[0].mount_path == SNAPSHOT_MOUNT
    assert (
        config.pvc_mount[0].pvc_name_parameter.component_input_parameter
        == "pipelinechannel--snapshot_pvc"
    )
    assert config.config_map_as_env[0].optional
    assert {e.env_var for e in config.config_map_as_env[0].key_to_env} == set(CONFIG_ENV)
    assert not config.field_path_as_env  # workers are owned by the run, not by this pod
    assert config.tolerations[0].key == "nvidia.com/gpu"
    # The exit handler reaches etcd like the master (it deletes the run's keys at the end).
    cleanup = json_format.ParseDict(
        platform_doc["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-stop-workers"],
        kubernetes_executor_config_pb2.KubernetesExecutorConfig(),
        ignore_unknown_fields=False,
    )
    assert {e.env_var for e in cleanup.config_map_as_env[0].key_to_env} == set(ETCD_ENV)
    assert [s.mount_path for s in cleanup.secret_as_volume] == [
        s.mount_path for s in config.secret_as_volume
    ]


def test_kfp_local_runs_the_same_pipeline_without_task_retries(tmp_path: Path) -> None:
    """Its embedded etcd dies with the training task: a retry could only start over."""
    from kfp import compiler

    compiler.Compiler().compile(local_pipeline(), str(tmp_path / "local.yaml"))
    local_spec = parse_spec(documents(tmp_path / "local.yaml")[0])
    inner = local_spec.components["comp-exit-handler-1"].dag.tasks
    assert not inner["elastic-train"].HasField("retry_policy")
    committed = parse_spec(documents(PIPELINE_YAML)[0])
    for task in inner.values():
        task.ClearField("retry_policy")
    committed_inner = committed.components["comp-exit-handler-1"].dag.tasks
    for task in committed_inner.values():
        task.ClearField("retry_policy")
    assert local_spec.components == committed.components  # otherwise the same pipeline


def test_the_worker_image_is_a_run_parameter_and_a_config_map_value() -> None:
    """Changing the worker image needs no recompile: the run's ``image`` parameter reaches the
    training task; left empty, the ConfigMap's KFP_ELASTIC_WORKER_IMAGE (mapped into the task)
    decides, else the default image."""
    spec_doc, platform_doc = documents(PIPELINE_YAML)
    spec = parse_spec(spec_doc)
    image = spec.root.input_definitions.parameters["image"]
    assert image.is_optional and image.default_value.string_value == ""
    assert WORKER_IMAGE_ENV in image.description and DEFAULT_WORKER_IMAGE in image.description
    train = spec.components["comp-exit-handler-1"].dag.tasks["elastic-train"]
    wired = train.inputs.parameters["image"].component_input_parameter
    assert wired == "pipelinechannel--image"
    exit_handler = spec.root.dag.tasks["exit-handler-1"]
    assert exit_handler.inputs.parameters[wired].component_input_parameter == "image"
    executors = platform_doc["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    (config_map,) = executors["exec-elastic-train"]["configMapAsEnv"]
    assert {"configMapKey": WORKER_IMAGE_ENV, "envVar": WORKER_IMAGE_ENV} in config_map["keyToEnv"]
    # What the master in that task then runs the worker pods with.
    settings = KubernetesSettings(image="")
    assert settings.resolved({}).image == DEFAULT_WORKER_IMAGE
    assert settings.resolved({WORKER_IMAGE_ENV: "reg/w:2"}).image == "reg/w:2"
    assert KubernetesSettings(image="reg/w:3").resolved({WORKER_IMAGE_ENV: "reg/w:2"}).image == (
        "reg/w:3"
    )
