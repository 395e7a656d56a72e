"""What makes one worker pod (:class:`WorkerPodSpec`) and its name: the fields that the
manifest builder (``master/pod_spec.py``) turns into a pod and its checks
(``master/pod_spec_checks.py``) validate, below both of them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kfp_elastic.job_spec import (
    DEFAULT_GUARANTEED_PRIORITY_CLASS,
    DEFAULT_NODE_LOSS_TOLERATION_S,
    DEFAULT_OPPORTUNISTIC_PRIORITY_CLASS,
    DEFAULT_SERVICE_ACCOUNT,
)


@dataclass(frozen=True, kw_only=True)
class WorkerPodSpec:
    """Everything that makes one worker pod. Quantities use Kubernetes notation ("500m", "4Gi").

    ``rdzv_endpoint`` may be a kubelet reference such as ``$(KFP_ELASTIC_ETCD_ENDPOINTS)`` when
    the variable comes from ``env`` or ``env_from_config_maps`` (e.g. ``kfp-elastic-config``).
    """

    job_name: str
    image: str
    entrypoint: str  # training script path, or a module name when module=True
    rdzv_endpoint: str
    min_nodes: int
    max_nodes: int
    run_id: str | None = None  # --rdzv-id; the job name when unset
    worker_index: int = 0
    attempt: int = 0
    namespace: str | None = None
    entrypoint_args: tuple[str, ...] = ()
    module: bool = False
    nproc_per_node: int | str = 1
    rdzv_backend: str = "elastic-etcd"
    rdzv_conf: Mapping[str, str] = field(default_factory=dict)
    # Restarts of the local worker group after a worker process failed; membership changes
    # (a peer preempted or joining) do not count against it.
    max_restarts: int = 3
    torchrun_args: tuple[str, ...] = ()  # extra torchrun flags, placed before the entrypoint
    # torchrun with a faster start (``rendezvous/agent.py``); ``("torchrun",)`` works too.
    command: tuple[str, ...] = ("kfp-elastic", "agent")
    cpu: str | int | float | None = None
    memory: str | None = None
    cpu_limit: str | int | float | None = None  # no CPU limit by default: throttling hurts DDP
    memory_limit: str | None = None  # defaults to ``memory``: an overrun is an OOM kill, not a
    # noisy neighbour
    # Host memory each process pins for snapshots and rescues (the training state's size,
    # ``worker/host_copy.py``): added, once per process, to the memory request and limit.
    snapshot_buffer: str | None = None
    gpu: int = 0
    gpu_resource: str = "nvidia.com/gpu"
    # Worker indexes below min_nodes get the guaranteed class, the others the opportunistic one
    # (``priority_class_of``); None: no class (priority 0, or the cluster's globalDefault).
    guaranteed_priority_class: str | None = DEFAULT_GUARANTEED_PRIORITY_CLASS
    opportunistic_priority_class: str | None = DEFAULT_OPPORTUNISTIC_PRIORITY_CLASS
    # A Kueue LocalQueue (``kueue_labels``); None: the pods are not submitted to Kueue.
    kueue_queue: str | None = None
    service_account: str | None = DEFAULT_SERVICE_ACCOUNT
    tolerations: tuple[Mapping[str, Any], ...] = ()
    # tolerationSeconds for the not-ready and unreachable NoExecute taints (a lost node); None
    # leaves the cluster's default (300 s). A toleration of the user's for them wins.
    node_loss_toleration_s: int | None = DEFAULT_NODE_LOSS_TOLERATION_S
    node_selector: Mapping[str, str] = field(default_factory=dict)
    affinity: Mapping[str, Any] | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    env_from_config_maps: tuple[str, ...] = ()
    volumes: tuple[Mapping[str, Any], ...] = ()
    volume_mounts: tuple[Mapping[str, Any], ...] = ()
    # etcd settings that are not files (endpoints, user, key prefix) come in ``env`` as
    # KFP_ELASTIC_ETCD_* (EtcdSettings.to_env(files=False)); the files come from Secrets:
    etcd_tls_secret: str | None = None  # Secret with ca.crt/tls.crt/tls.key for etcd mTLS
    etcd_password_secret: str | None = None  # Secret whose key "password" is the etcd password
    # Memory-backed /dev/shm (NCCL, DataLoader workers): what is written there counts against
    # the container's memory limit, so its size is added once to the memory request and limit.
    shm_size: str | None = None
    termination_grace_period_s: int = 30
    image_pull_policy: str | None = None
    image_pull_secrets: tuple[str, ...] = ()
    run_as_user: int | None = 1000  # the uid of images/worker; None keeps the image's user

    @property
    def effective_run_id(self) -> str:
        return self.run_id if self.run_id is not None else self.job_name

    @property
    def pod_name(self) -> str:
        return pod_name(self.job_name, self.worker_index, self.attempt)


def pod_name(job_name: str, worker_index: int, attempt: int) -> str:
    # The attempt keeps names unique: a replacement never collides with a terminating pod.
    return f"{job_name}-worker-{worker_index}-{attempt}"
