"""What a job's workers are made of, from its ``JobSpec``, without I/O: the worker pod template,
the job settings a worker pod gets, and where a master finds its Kubernetes credentials and
namespace. ``master/host.py`` puts them into a job's launch plan.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from kfp_elastic.job_env import RUN_ID_ENV, JobEnv
from kfp_elastic.job_spec import MODULE_FLAGS, JobSpec, field_error
from kfp_elastic.master.pod_spec import WorkerPodSpec, etcd_pod_fields

log = logging.getLogger(__name__)

SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_NO_PYTHON = ("--no-python", "--no_python")


def worker_pod_template(spec: JobSpec, env: Mapping[str, str] | None = None) -> WorkerPodSpec:
    """The ``WorkerPodSpec`` every worker pod of ``spec`` is made from (a dry-run builder);
    ``env``: where settings not given come from (the ConfigMap's variables; default: this
    process's environment)."""
    k8s = spec.launch.kubernetes.resolved(os.environ if env is None else env)
    etcd = spec.etcd
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
        # With a ladder the master sets each level's class (master/ladder.py); level 0 first.
        guaranteed_priority_class=(k8s.ladder_levels() or (k8s.guaranteed_priority_class,))[0],
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


#: (connect, read) seconds of a one-off Kubernetes API call (the kubernetes client honours a
#: pair or an int; a float means no timeout at all): an API server that never answers fails
#: the call instead of holding the process.
API_REQUEST_TIMEOUT_S = (10.0, 30.0)


def cluster_priority_value(name: str) -> int | None:
    """PriorityClass ``name``'s value in the cluster (None: there is none, or the master's
    account may not read PriorityClasses, which are cluster-wide: then nothing can be checked,
    and a warning says so)."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    load_kubernetes_config()
    with client.ApiClient() as api:
        try:
            found = client.SchedulingV1Api(api).read_priority_class(
                name, _request_timeout=API_REQUEST_TIMEOUT_S
            )
        except ApiException as error:
            if error.status == 404:
                return None
            if error.status == 403:
                log.warning(
                    "cannot read PriorityClass %s (403): the ladder's classes are not checked; "
                    "kubectl apply -k manifests/priorityclass-reader grants the read (get on "
                    "priorityclasses.scheduling.k8s.io in a ClusterRole) to check them",
                    name,
                )
                raise PriorityClassesUnreadable(name) from error
            raise
    return int(found.value)


class PriorityClassesUnreadable(RuntimeError):
    """The master's account may not read PriorityClasses."""


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
