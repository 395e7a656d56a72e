"""Helpers shared by the components: run ids, where we run, stopping a run's leftovers."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
import uuid
from collections.abc import Mapping

from kfp_elastic.etcd import settings as etcd_settings
from kfp_elastic.etcd.settings import EtcdSettings
from kfp_elastic.job_env import RUN_ID_ENV  # every local worker process of a run carries it
from kfp_elastic.processes import pids_with_env, sigkill_tagged

MAX_RUN_ID = 40  # pod names are {run_id}-worker-{index}-{attempt}, at most 63 characters


def normalize_run_id(raw: str) -> str:
    """A run id usable as an etcd key part, a label value and a pod name prefix.

    KFP gives a UUID (cluster) or a number (kfp.local); both become ``kfp-<id>``. An empty
    value gets a random id."""
    text = re.sub(r"[^a-z0-9-]+", "-", (raw or "").strip().lower()).strip("-")
    if not text:
        text = uuid.uuid4().hex[:12]
    if not text[0].isalpha():
        text = f"kfp-{text}"
    return text[:MAX_RUN_ID].rstrip("-")


def in_cluster() -> bool:
    """True inside a Kubernetes pod (the kubelet sets this variable in every container)."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


def run_pids(value: str, env: str = RUN_ID_ENV) -> set[int]:
    """Live local processes (not this one) whose environment has ``env=value``: the workers
    of run ``value`` by default."""
    return pids_with_env(env, value)


def reap_local_processes(value: str, grace_s: float = 3.0, env: str = RUN_ID_ENV) -> list[int]:
    """SIGTERM, then SIGKILL after ``grace_s``, every local process with ``env=value`` (the
    workers of run ``value`` by default); returns the pids that were alive."""
    pids = run_pids(value, env)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and run_pids(value, env):
        time.sleep(0.1)
    sigkill_tagged(env, value)
    return sorted(pids)


def delete_run_pods(run_id: str, namespace: str = "") -> list[str]:
    """Delete every worker pod of run ``run_id`` (by label: they have no owner that garbage
    collection would follow); returns their names."""
    from kubernetes import client

    from kfp_elastic.master.pod_spec import run_selector
    from kfp_elastic.master.wiring import (
        API_REQUEST_TIMEOUT_S,
        load_kubernetes_config,
        pod_namespace,
    )

    load_kubernetes_config()
    namespace = pod_namespace(namespace)
    core = client.CoreV1Api()
    pods = core.list_namespaced_pod(
        namespace, label_selector=run_selector(run_id), _request_timeout=API_REQUEST_TIMEOUT_S
    )
    names = [pod.metadata.name for pod in pods.items]
    for name in names:
        with contextlib.suppress(client.ApiException):
            core.delete_namespaced_pod(
                name,
                namespace,
                propagation_policy="Background",
                _request_timeout=API_REQUEST_TIMEOUT_S,
            )
    return names


ENDPOINTS_ENV = etcd_settings.BY_NAME["endpoints"].env


def etcd_from(endpoint: str, env: Mapping[str, str] | None = None) -> EtcdSettings | None:
    """How a task reaches etcd (its ``etcd_endpoint`` parameter over the ``KFP_ELASTIC_ETCD_*``
    environment the ConfigMap gives it); None when neither names an endpoint."""
    env = os.environ if env is None else env
    if not (endpoint or env.get(ENDPOINTS_ENV)):
        return None
    return etcd_settings.from_sources({"endpoints": endpoint}, env, {"endpoints": "etcd_endpoint"})


def forget_run(
    run_id: str, env: Mapping[str, str] | None = None, settings: EtcdSettings | None = None
) -> int | None:
    """Delete every etcd key of run ``run_id`` (``{key_prefix}/{run_id}/``: rendezvous, master
    state, timeline, progress, shard queues); the number deleted, or None when there are no etcd
    settings: ``settings`` not given and ``KFP_ELASTIC_ETCD_ENDPOINTS`` unset in ``env`` (an
    embedded etcd died with its run). The exit handler and ``kfp-elastic forget`` call it.

    The keys a run writes without a lease outlive it by design (a KFP retry of the training task
    continues from them); once the pipeline has ended nothing reads them again, and a cluster
    that runs many pipelines would otherwise fill etcd's space quota with finished runs.
    """
    from kfp_elastic.etcd.client import connect

    settings = settings or etcd_from("", env)
    if settings is None:
        return None
    client = connect(settings)
    try:
        deleted = client.delete_prefix(settings.run_prefix(run_id) + "/")
        return int(getattr(deleted, "deleted", 0))
    finally:
        client.close()
