"""The launcher of a job, from its ``JobSpec``: the one place that turns the contract into local
worker processes or worker pods. ``kfp-elastic master`` and the ``elastic_train`` component both
call ``launcher_factory``.
"""

from __future__ import annotations

import importlib
import os
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from kfp_elastic.gpus import require_gpus, visible_gpus
from kfp_elastic.job_env import RUN_ID_ENV, SNAPSHOT_DIR_ENV, JobEnv
from kfp_elastic.job_spec import MODULE_FLAGS, JobSpec, field_error, is_file_reference
from kfp_elastic.master.job import LauncherFactory
from kfp_elastic.master.launcher import Launcher, next_attempts
from kfp_elastic.master.preflight import WorkerSide, check
from kfp_elastic.master.state import MasterState

K8S_LAUNCHER_MODULE = "kfp_elastic.master.k8s_launcher"
SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_NO_PYTHON = ("--no-python", "--no_python")


def launcher_factory(
    spec: JobSpec, *, files_here: bool = False, adopting: bool = False
) -> LauncherFactory:
    """What ``ElasticJob`` calls (with its ``MasterState``) to get the job's launcher; raises
    ``ValueError`` naming the field when the spec cannot be launched: ``validate()`` and the
    checks of ``master/preflight.py``, here, before any worker starts. ``files_here``: worker
    pods see this process's files and Python packages (the KFP component, which runs in the
    worker image with the same volumes); local workers always do. ``adopting``: the run has
    workers already (a restarted or retried master): only the cheap checks run again, not the
    model definition's and the dataset's load, which the running job has passed."""
    spec.validate()
    if spec.etcd is None:
        raise ValueError("etcd (--etcd / etcd_endpoint) is missing: the workers need it")
    if spec.launch.kind == "kubernetes":
        return _kubernetes(spec, files_here, adopting)
    return _local(spec, adopting)


def local_workdir(spec: JobSpec) -> Path:
    """The local launcher's directory (worker logs, exit records): the given one or a new
    temporary one."""
    given = spec.launch.local.workdir
    return Path(given or tempfile.mkdtemp(prefix=f"kfp-elastic-{spec.run_id}-")).resolve()


def _local(spec: JobSpec, adopting: bool) -> LauncherFactory:
    from kfp_elastic.master.local_launcher import LocalLauncher

    assert spec.etcd is not None
    cwd = Path.cwd()
    model_def = spec.entry.model_def
    if model_def and is_file_reference(model_def):  # a restarted master may run elsewhere
        spec = replace(spec, entry=replace(spec.entry, model_def=str((cwd / model_def).resolve())))
    workdir = local_workdir(spec)
    snapshot_dir = spec.snapshot_dir or os.environ.get(SNAPSHOT_DIR_ENV) or workdir / "snapshots"
    # Local workers share this machine's files: they get the very same etcd settings.
    env = {**spec.etcd.to_env(), **JobEnv.of(spec, str(snapshot_dir)).to_env()}
    endpoint = spec.etcd.endpoint_text
    device = spec.training.device if spec.entry.model_def else None
    # Refused now, before the master starts: the launcher checks the same when it is made.
    require_gpus(device, spec.size.max_workers * spec.size.nproc_per_worker, visible_gpus())
    check(
        spec,
        WorkerSide(
            spec.worker_argv(),
            {**os.environ, **env},
            cwd,
            files_here=not adopting,
            workdir=workdir,
        ),
    )

    def local(state: MasterState) -> Launcher:
        return LocalLauncher(
            run_id=spec.run_id,
            endpoint=endpoint,
            min_workers=spec.size.min_workers,
            max_workers=spec.size.max_workers,
            entry=spec.worker_argv(),
            workdir=workdir,
            nproc_per_worker=spec.size.nproc_per_worker,
            rdzv_conf=spec.worker_rdzv_conf(),
            env=env,
            registry=state,
            capacity=spec.launch.local.capacity,
            max_restarts=spec.launch.worker_max_restarts,
            device=device,
            cwd=cwd,
        )

    return local


def _kubernetes(spec: JobSpec, files_here: bool, adopting: bool) -> LauncherFactory:
    template = worker_pod_template(spec)
    assert spec.etcd is not None
    env = {**os.environ, **spec.etcd.to_env(), **job_env(spec)}
    worker = WorkerSide(spec.worker_argv(), env, Path.cwd(), files_here=files_here and not adopting)
    # The Kubernetes client's import (≈ 1 s) and the model definition's check (a subprocess
    # that imports torch, ≈ 2 s) are both on the way from submission to the first worker pod:
    # import while the check's subprocess runs. The check still ends before any pod exists.
    importing = threading.Thread(
        target=importlib.import_module, args=(K8S_LAUNCHER_MODULE,), daemon=True
    )
    importing.start()
    check(spec, worker)
    importing.join()
    from kfp_elastic.master.k8s_launcher import KubernetesLauncher

    class OwnClientLauncher(KubernetesLauncher):
        """Closes the API client it was made with (one per launcher)."""

        def __init__(self, api: Any, first_attempts: Mapping[int, int]) -> None:
            super().__init__(template, template.namespace, api, first_attempts=first_attempts)
            self._api = api

        def close(self) -> None:
            super().close()
            self._api.close()

    def kubernetes(state: MasterState) -> Launcher:
        from kubernetes import client

        # Read the credentials when the master starts the launcher, not at import time.
        load_kubernetes_config()
        attempts = next_attempts(state.workers()) if state is not None else {}
        return OwnClientLauncher(client.ApiClient(), attempts)

    return kubernetes


def worker_pod_template(spec: JobSpec) -> Any:
    """The ``WorkerPodSpec`` every worker pod of ``spec`` is made from (a dry-run builder)."""
    from kfp_elastic.master.pod_spec import WorkerPodSpec, etcd_pod_fields

    k8s, etcd = spec.launch.kubernetes.resolved(os.environ), spec.etcd
    assert etcd is not None
    argv = list(spec.worker_argv())
    if argv[0] in _NO_PYTHON:
        raise field_error("command", "--no-python entries are not supported on kubernetes")
    module = argv[0] in MODULE_FLAGS
    script, script_args = (argv[1], argv[2:]) if module else (argv[0], argv[1:])
    overrides = k8s.pod_overrides
    etcd_fields = etcd_pod_fields(
        etcd, k8s.etcd_tls_secret or None, k8s.etcd_password_secret or None
    )
    etcd_fields["env"] = {**etcd_fields["env"], **job_env(spec)}
    return WorkerPodSpec(
        job_name=k8s.job_name or spec.run_id,
        run_id=spec.run_id,
        image=k8s.image,
        entrypoint=script,
        module=module,
        entrypoint_args=tuple(script_args),
        rdzv_endpoint=etcd.endpoint_text,
        min_nodes=spec.size.min_workers,
        max_nodes=spec.size.max_workers,
        nproc_per_node=spec.size.nproc_per_worker,
        rdzv_conf=spec.worker_rdzv_conf(),
        max_restarts=spec.launch.worker_max_restarts,
        guaranteed_priority_class=k8s.guaranteed_priority_class,
        opportunistic_priority_class=k8s.opportunistic_priority_class,
        kueue_queue=k8s.kueue_queue or None,
        service_account=k8s.service_account,
        cpu=k8s.cpu or None,
        memory=k8s.memory or None,
        snapshot_buffer=k8s.snapshot_buffer or None,
        gpu=spec.worker_pod_gpus(),
        shm_size=spec.worker_shm_size(),
        namespace=pod_namespace(k8s.namespace),
        tolerations=tuple(overrides.get("tolerations") or ()),
        node_loss_toleration_s=k8s.node_loss_toleration_s,
        node_selector=dict(overrides.get("node_selector") or {}),
        affinity=overrides.get("affinity") or None,
        volumes=tuple(overrides.get("volumes") or ()),
        volume_mounts=tuple(overrides.get("volume_mounts") or ()),
        **etcd_fields,
    )


def job_env(spec: JobSpec) -> dict[str, str]:
    """The job's settings for worker pods (``kfp_elastic/job_env.py``), less what the pod spec
    sets itself (the run id)."""
    env = JobEnv.of(spec, str(spec.snapshot_dir or "")).to_env()
    env.pop(RUN_ID_ENV)
    return env


def load_kubernetes_config() -> None:
    """In-cluster credentials (the pod's service account), else the kubeconfig."""
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        # $KUBECONFIG read now: the client fixes its default path when first imported.
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)


def pod_namespace(namespace: str = "") -> str:
    """``namespace``, else this pod's own, else ``default``."""
    return namespace or (SA_NAMESPACE.read_text().strip() if SA_NAMESPACE.exists() else "default")
