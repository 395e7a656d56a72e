"""Worker pod manifests, built without any I/O (a dry run: ``build_pod`` only returns a dict).

One worker pod runs one torchrun agent with the ``elastic-etcd`` rendezvous backend. Everything
a cluster needs to know is a field of :class:`WorkerPodSpec`; :func:`build_pod` validates it
and returns the plain Kubernetes Pod manifest that ``KubernetesLauncher`` submits unchanged, so
what a test asserts here is what the API server receives.
"""

from __future__ import annotations

from typing import Any

from kfp_elastic.contract.kubernetes_syntax import format_quantity
from kfp_elastic.etcd.settings import EtcdSettings
from kfp_elastic.master.pod_spec_checks import (  # noqa: F401 - names callers import from here
    _FIXED_LABELS,
    ATTEMPT_LABEL,
    COMPONENT_LABEL,
    CONTAINER_NAME,
    DEFAULT_GUARANTEED_PRIORITY_CLASS,
    DEFAULT_OPPORTUNISTIC_PRIORITY_CLASS,
    DEFAULT_SERVICE_ACCOUNT,
    ETCD_AUTH_MOUNT,
    ETCD_PASSWORD_KEY,
    ETCD_TLS_MOUNT,
    INDEX_LABEL,
    JOB_LABEL,
    KUEUE_PRIORITY_CLASS_LABEL,
    KUEUE_QUEUE_LABEL,
    LABEL_PREFIX,
    PASSWORD_SECRET_ENV,
    RESERVED_ENV,
    RUN_ID_LABEL,
    TLS_SECRET_ENV,
    parse_quantity,
    validate,
)
from kfp_elastic.master.worker_pod_spec import (  # noqa: F401 - names callers import from here
    WorkerPodSpec,
    pod_name,
)


def etcd_pod_fields(
    etcd: EtcdSettings, tls_secret: str | None, password_secret: str | None
) -> dict[str, Any]:
    """The ``WorkerPodSpec`` fields that give worker pods the master's etcd settings: the
    values as env, the files (TLS, password) from Secrets; raises ``ValueError`` naming the
    Secret that is missing."""
    if etcd.uses_tls and not tls_secret:
        raise ValueError(
            "etcd uses TLS: worker pods need its files from a Secret (ca.crt, tls.crt, tls.key): "
            f"--etcd-tls-secret or {TLS_SECRET_ENV}"
        )
    if etcd.user and not password_secret:
        raise ValueError(
            "etcd auth is on: worker pods need the password from a Secret (key 'password'): "
            f"--etcd-password-secret or {PASSWORD_SECRET_ENV}"
        )
    return {
        "env": etcd.to_env(files=False),
        "etcd_tls_secret": tls_secret if etcd.uses_tls else None,
        "etcd_password_secret": password_secret if etcd.user else None,
    }


def is_guaranteed(worker_index: int, min_workers: int) -> bool:
    """Whether slot ``worker_index`` is one of the job's guaranteed ones: the first MIN slots.
    Slots are stable (master/scaling.py launches a lost worker's replacement in its slot), so
    the job always has exactly MIN guaranteed slots, whichever workers are running."""
    return worker_index < min_workers


def priority_class_of(spec: WorkerPodSpec) -> str | None:
    """The PriorityClass of the pod for ``spec.worker_index``: guaranteed for the first
    ``min_nodes`` slots (may preempt opportunistic workers of any job), else opportunistic
    (never preempts)."""
    if is_guaranteed(spec.worker_index, spec.min_nodes):
        return spec.guaranteed_priority_class
    return spec.opportunistic_priority_class


def kueue_labels(spec: WorkerPodSpec) -> dict[str, str]:
    """The labels that submit the pod to Kueue's LocalQueue ``spec.kueue_queue`` as a workload
    of its own, with the WorkloadPriorityClass of the same name as its tier's PriorityClass
    (manifests/kueue creates both tiers' classes with the PriorityClasses' values); none
    without a queue. A pod without a class gets no priority label: Kueue then takes the pod's
    priority."""
    if spec.kueue_queue is None:
        return {}
    labels = {KUEUE_QUEUE_LABEL: spec.kueue_queue}
    priority_class = priority_class_of(spec)
    if priority_class:
        labels[KUEUE_PRIORITY_CLASS_LABEL] = priority_class
    return labels


def selector(job_name: str, run_id: str) -> str:
    """The worker pods a master of run ``run_id`` watches and adopts. Worker pods have no
    ownerReference (deleting the master pod must not delete them): a restarted master with the
    same run id finds them by these labels, never the pods of another run that used the same
    job name."""
    return f"{JOB_LABEL}={job_name},{RUN_ID_LABEL}={run_id},{COMPONENT_LABEL}=worker"


def run_selector(run_id: str) -> str:
    """Every worker pod of run ``run_id``, whatever its job name: what the pipeline's exit
    handler deletes."""
    return f"{RUN_ID_LABEL}={run_id},{COMPONENT_LABEL}=worker"


def build_pod(spec: WorkerPodSpec) -> dict[str, Any]:
    """The Pod manifest for ``spec``; raises ``ValueError`` naming the first bad field."""
    validate(spec)
    name = spec.pod_name
    identity = {
        JOB_LABEL: spec.job_name,
        RUN_ID_LABEL: spec.effective_run_id,
        INDEX_LABEL: str(spec.worker_index),
        ATTEMPT_LABEL: str(spec.attempt),
    }
    metadata: dict[str, Any] = {
        "name": name,
        "labels": {**spec.labels, **_FIXED_LABELS, **kueue_labels(spec), **identity},
    }
    if spec.namespace:
        metadata["namespace"] = spec.namespace
    if spec.annotations:
        metadata["annotations"] = dict(spec.annotations)

    volumes = [dict(v) for v in spec.volumes]
    mounts = [dict(m) for m in spec.volume_mounts]
    if spec.etcd_tls_secret:
        volumes.append(
            {
                "name": "etcd-tls",
                "secret": {"secretName": spec.etcd_tls_secret, "defaultMode": 0o440},
            }
        )
        mounts.append({"name": "etcd-tls", "mountPath": ETCD_TLS_MOUNT, "readOnly": True})
    if spec.etcd_password_secret:
        volumes.append(
            {
                "name": "etcd-auth",
                "secret": {
                    "secretName": spec.etcd_password_secret,
                    "defaultMode": 0o440,
                    "items": [{"key": ETCD_PASSWORD_KEY, "path": ETCD_PASSWORD_KEY}],
                },
            }
        )
        mounts.append({"name": "etcd-auth", "mountPath": ETCD_AUTH_MOUNT, "readOnly": True})
    if spec.shm_size:
        volumes.append(
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}}
        )
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})

    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.image,
        "command": list(spec.command),
        "args": torchrun_args(spec),
        "env": _env(spec),
        "resources": _resources(spec),
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    if spec.env_from_config_maps:
        container["envFrom"] = [{"configMapRef": {"name": n}} for n in spec.env_from_config_maps]
    if mounts:
        container["volumeMounts"] = mounts

    pod_security: dict[str, Any] = {"seccompProfile": {"type": "RuntimeDefault"}}
    if spec.run_as_user is not None:
        # fsGroup: a snapshot PVC must be writable by the non-root training user.
        pod_security.update(
            runAsNonRoot=True,
            runAsUser=spec.run_as_user,
            runAsGroup=spec.run_as_user,
            fsGroup=spec.run_as_user,
        )
    pod_spec: dict[str, Any] = {
        # Never: a failed torchrun agent is replaced by the master as a new attempt, which
        # keeps the failure visible and the replacement free to land on another node.
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": spec.termination_grace_period_s,
        # Workers talk only to etcd; no API token and no Service env vars in their pods.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security,
        "containers": [container],
    }
    priority_class = priority_class_of(spec)
    if priority_class:
        pod_spec["priorityClassName"] = priority_class
    if spec.service_account:
        pod_spec["serviceAccountName"] = spec.service_account
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    tolerations = [dict(t) for t in spec.tolerations] + node_loss_tolerations(spec)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if spec.affinity:
        pod_spec["affinity"] = dict(spec.affinity)
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in spec.image_pull_secrets]
    if volumes:
        pod_spec["volumes"] = volumes
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


# The taints Kubernetes' node lifecycle controller puts on a node that stops answering.
NODE_LOSS_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


def node_loss_tolerations(spec: WorkerPodSpec) -> list[dict[str, Any]]:
    """Tolerations that make Kubernetes evict a lost node's worker pod after
    ``node_loss_toleration_s`` instead of the 300 s its DefaultTolerationSeconds admission
    gives: the master replaces the worker on a node that runs only once its pod is gone. A
    taint the user's tolerations already cover (its key or an empty key, effect NoExecute or
    none: the admission plugin's test) is left to them."""
    if spec.node_loss_toleration_s is None:
        return []
    out = []
    for key in NODE_LOSS_TAINTS:
        if any(
            t.get("key", "") in (key, "") and t.get("effect", "") in ("NoExecute", "")
            for t in spec.tolerations
        ):
            continue
        out.append(
            {
                "key": key,
                "operator": "Exists",
                "effect": "NoExecute",
                "tolerationSeconds": spec.node_loss_toleration_s,
            }
        )
    return out


def torchrun_args(spec: WorkerPodSpec) -> list[str]:
    """The container args: torchrun flags, then the entrypoint and its arguments."""
    # No etcd settings here: args show in the pod spec; agents read them from the env.
    conf = dict(spec.rdzv_conf)
    args = [
        f"--nnodes={spec.min_nodes}:{spec.max_nodes}",
        f"--nproc-per-node={spec.nproc_per_node}",
        f"--rdzv-backend={spec.rdzv_backend}",
        f"--rdzv-endpoint={spec.rdzv_endpoint}",
        f"--rdzv-id={spec.effective_run_id}",
    ]
    if conf:
        args.append("--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items()))
    # Peers must reach this agent by pod IP: a pod's hostname does not resolve cluster-wide.
    args += [f"--max-restarts={spec.max_restarts}", "--local-addr=$(POD_IP)"]
    args += list(spec.torchrun_args)
    args += ["-m", spec.entrypoint] if spec.module else [spec.entrypoint]
    return args + list(spec.entrypoint_args)


def _env(spec: WorkerPodSpec) -> list[dict[str, Any]]:
    def field_ref(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    env = [
        {"name": "POD_NAME", **field_ref("metadata.name")},
        {"name": "POD_NAMESPACE", **field_ref("metadata.namespace")},
        {"name": "POD_IP", **field_ref("status.podIP")},
        {"name": "NODE_NAME", **field_ref("spec.nodeName")},
        {"name": "KFP_ELASTIC_JOB", "value": spec.job_name},
        {"name": "KFP_ELASTIC_RUN_ID", "value": spec.effective_run_id},
        {"name": "KFP_ELASTIC_WORKER_INDEX", "value": str(spec.worker_index)},
        {"name": "KFP_ELASTIC_ATTEMPT", "value": str(spec.attempt)},
    ]
    return env + _etcd_file_env(spec) + [{"name": k, "value": str(v)} for k, v in spec.env.items()]


def _etcd_file_env(spec: WorkerPodSpec) -> list[dict[str, Any]]:
    """KFP_ELASTIC_ETCD_* variables naming the files the pod mounts from Secrets."""
    files: dict[str, str] = {}
    if spec.etcd_tls_secret:
        files.update(
            KFP_ELASTIC_ETCD_CACERT=f"{ETCD_TLS_MOUNT}/ca.crt",
            KFP_ELASTIC_ETCD_CERT=f"{ETCD_TLS_MOUNT}/tls.crt",
            KFP_ELASTIC_ETCD_KEY=f"{ETCD_TLS_MOUNT}/tls.key",
        )
    if spec.etcd_password_secret:
        files["KFP_ELASTIC_ETCD_PASSWORD_FILE"] = f"{ETCD_AUTH_MOUNT}/{ETCD_PASSWORD_KEY}"
    return [{"name": k, "value": v} for k, v in files.items()]


def _resources(spec: WorkerPodSpec) -> dict[str, Any]:
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if spec.cpu is not None:
        requests["cpu"] = str(spec.cpu)
    if spec.cpu_limit is not None:
        limits["cpu"] = str(spec.cpu_limit)
    memory = pod_memory(spec.memory, spec)
    if memory is not None:
        requests["memory"] = memory
    if spec.memory_limit is not None or memory is not None:
        limits["memory"] = pod_memory(spec.memory_limit, spec) or memory
    if spec.gpu:
        # Extended resources cannot be overcommitted: Kubernetes wants limits == requests.
        requests[spec.gpu_resource] = limits[spec.gpu_resource] = str(spec.gpu)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def processes(spec: WorkerPodSpec) -> int:
    """Worker processes of one pod: ``nproc_per_node``, or its GPUs for a word (``gpu``,
    ``auto``), at least one."""
    if isinstance(spec.nproc_per_node, int) or str(spec.nproc_per_node).isdigit():
        return int(spec.nproc_per_node)
    return max(1, spec.gpu)


def pod_memory(memory: str | None, spec: WorkerPodSpec) -> str | None:
    """``memory`` (Kubernetes quantities) plus what the pod adds to its processes' own: one
    snapshot buffer per process (pinned host memory) and the memory-backed ``/dev/shm``, whose
    contents the kernel charges to the container's memory cgroup (a full ``/dev/shm`` under a
    limit that did not count it is an OOM kill). Without a ``memory`` there is no limit to
    overrun and nothing is added."""
    if memory is None:
        return memory
    extra = processes(spec) * parse_quantity(spec.snapshot_buffer or "0")
    extra += parse_quantity(spec.shm_size or "0")
    if not extra:
        return memory
    return format_quantity(int(parse_quantity(memory) + extra))
