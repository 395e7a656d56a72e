"""Validation of :class:`master.worker_pod_spec.WorkerPodSpec` and the names it checks against.

Kept apart from the manifest builder so that each stays readable: everything here is pure
(Kubernetes naming rules, quantities, tolerations, volumes, the rendezvous settings), and a
failed check raises ``ValueError`` saying which field is wrong and how to fix it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from kfp_elastic.contract.kubernetes_syntax import DNS_LABEL_RULE, is_dns_label, parse_quantity
from kfp_elastic.contract.rendezvous_config import (
    ETCD_KEYS,
    ConfigError,
    RendezvousConfig,
    parse_endpoints,
)
from kfp_elastic.job_spec import (
    DEFAULT_GUARANTEED_PRIORITY_CLASS as DEFAULT_GUARANTEED_PRIORITY_CLASS,
)
from kfp_elastic.job_spec import (
    DEFAULT_OPPORTUNISTIC_PRIORITY_CLASS as DEFAULT_OPPORTUNISTIC_PRIORITY_CLASS,
)
from kfp_elastic.job_spec import DEFAULT_SERVICE_ACCOUNT as DEFAULT_SERVICE_ACCOUNT
from kfp_elastic.job_spec import PASSWORD_SECRET_ENV as PASSWORD_SECRET_ENV
from kfp_elastic.job_spec import TLS_SECRET_ENV as TLS_SECRET_ENV
from kfp_elastic.master.worker_pod_spec import WorkerPodSpec

# DEFAULT_*_PRIORITY_CLASS, DEFAULT_SERVICE_ACCOUNT: the names manifests/base creates (the job
# contract, kfp_elastic/job_spec.py, holds them; the ConfigMap kfp-elastic-config repeats them).
CONTAINER_NAME = "worker"

LABEL_PREFIX = "kfp-elastic.io/"
JOB_LABEL = LABEL_PREFIX + "job"
RUN_ID_LABEL = LABEL_PREFIX + "run-id"
INDEX_LABEL = LABEL_PREFIX + "worker-index"
ATTEMPT_LABEL = LABEL_PREFIX + "attempt"
COMPONENT_LABEL = "app.kubernetes.io/component"
PART_OF_LABEL = "app.kubernetes.io/part-of"
# The master's pod (the KFP training task, or a pod running `kfp-elastic master`) carries these;
# with the worker pods' labels below they are what manifests/base/networkpolicy.yaml lets reach
# etcd's client port.
MASTER_POD_LABELS = {PART_OF_LABEL: "kfp-elastic", COMPONENT_LABEL: "master"}
# Kueue's pod integration (docs/master.md, "Kueue users"): the LocalQueue a pod is submitted
# to, and the WorkloadPriorityClass of its workload (manifests/kueue).
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_CLASS_LABEL = "kueue.x-k8s.io/priority-class"
_FIXED_LABELS = {
    PART_OF_LABEL: "kfp-elastic",
    COMPONENT_LABEL: "worker",
    "app.kubernetes.io/managed-by": "kfp-elastic-master",
}

# Where the etcd client certificate Secret is mounted (manifests/README.md uses the same path).
ETCD_TLS_MOUNT = "/etc/kfp-elastic/etcd-tls"
# Where the etcd password Secret is mounted: its key ``password`` becomes this directory's file
# ``password`` (a file, never an env value or an argument: both show in the pod spec).
ETCD_AUTH_MOUNT = "/etc/kfp-elastic/etcd-auth"
ETCD_PASSWORD_KEY = "password"
# TLS_SECRET_ENV, PASSWORD_SECRET_ENV (kfp_elastic/job_spec.py): the variables naming the Secrets
# worker pods mount; the kfp-elastic-config ConfigMap (manifests/) sets them.
_BUILTIN_VOLUMES = {"etcd-tls", "etcd-auth", "dshm"}
# etcd settings that name files in the pod: set by build_pod from the Secrets it mounts.
ETCD_FILE_ENV = frozenset(
    {
        "KFP_ELASTIC_ETCD_CACERT",
        "KFP_ELASTIC_ETCD_CERT",
        "KFP_ELASTIC_ETCD_KEY",
        "KFP_ELASTIC_ETCD_PASSWORD_FILE",
    }
)
# Set on every worker by build_pod; a caller's env may not override them.
RESERVED_ENV = frozenset(
    {
        "POD_NAME",
        "POD_NAMESPACE",
        "POD_IP",
        "NODE_NAME",
        "KFP_ELASTIC_JOB",
        "KFP_ELASTIC_RUN_ID",
        "KFP_ELASTIC_WORKER_INDEX",
        "KFP_ELASTIC_ATTEMPT",
        *ETCD_FILE_ENV,
    }
)

_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
_NPROC_WORDS = {"auto", "cpu", "gpu", "xpu"}
_TOLERATION_KEYS = {"key", "operator", "value", "effect", "tolerationSeconds"}
_TOLERATION_EFFECTS = {"", "NoSchedule", "PreferNoSchedule", "NoExecute"}
_PULL_POLICIES = {"Always", "IfNotPresent", "Never"}


def validate(spec: WorkerPodSpec) -> None:
    """Raise ``ValueError`` naming the first field of ``spec`` a cluster would reject."""
    _dns_label("job_name", spec.job_name)
    integers = ["worker_index", "attempt", "max_restarts", "termination_grace_period_s", "gpu"]
    if spec.node_loss_toleration_s is not None:
        integers.append("node_loss_toleration_s")
    for key in integers:
        value = getattr(spec, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{key}={value!r} must be an integer >= 0")
    if len(spec.pod_name) > 63:
        raise ValueError(
            f"pod name {spec.pod_name!r} is longer than 63 characters (the pod's "
            "hostname); shorten job_name"
        )
    run_id = spec.effective_run_id
    if len(run_id) > 63 or not re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", run_id):
        raise ValueError(
            f"run_id={run_id!r}: use at most 63 letters, digits, '.', '_' or '-', "
            "starting and ending with a letter or digit (it is a label value)"
        )
    if spec.namespace is not None:
        _dns_label("namespace", spec.namespace)
    if spec.kueue_queue is not None:
        _dns_label("kueue_queue", spec.kueue_queue)
        for key in ("guaranteed_priority_class", "opportunistic_priority_class"):
            if getattr(spec, key) is not None:  # also the value of a Kueue label
                _label(key, KUEUE_PRIORITY_CLASS_LABEL, getattr(spec, key))
    if not spec.image or any(c.isspace() for c in spec.image):
        raise ValueError(f"image={spec.image!r} must be a non-empty image reference")
    if not spec.entrypoint:
        raise ValueError("entrypoint must name the training script or module")
    if not spec.command or not all(spec.command):
        raise ValueError("command must be a non-empty list of non-empty strings")
    for key in ("min_nodes", "max_nodes"):
        value = getattr(spec, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key}={value!r} must be an integer >= 1")
    if spec.min_nodes > spec.max_nodes:
        raise ValueError(f"min_nodes={spec.min_nodes} > max_nodes={spec.max_nodes}")
    nproc = spec.nproc_per_node
    if isinstance(nproc, bool) or not (
        (isinstance(nproc, int) and nproc >= 1) or nproc in _NPROC_WORDS
    ):
        raise ValueError(
            f"nproc_per_node={nproc!r} must be an integer >= 1 or one of {sorted(_NPROC_WORDS)}"
        )
    _validate_rdzv(spec)
    _validate_resources(spec)
    for key in (
        "guaranteed_priority_class",
        "opportunistic_priority_class",
        "service_account",
        "etcd_tls_secret",
        "etcd_password_secret",
    ):
        if getattr(spec, key) is not None:
            _dns_subdomain(key, getattr(spec, key))
    for name in (*spec.env_from_config_maps, *spec.image_pull_secrets):
        _dns_subdomain("env_from_config_maps/image_pull_secrets", name)
    if spec.image_pull_policy is not None and spec.image_pull_policy not in _PULL_POLICIES:
        raise ValueError(
            f"image_pull_policy={spec.image_pull_policy!r} must be one of {sorted(_PULL_POLICIES)}"
        )
    for what, mapping in (("labels", spec.labels), ("node_selector", spec.node_selector)):
        for key, value in mapping.items():
            _label(what, key, value)
    reserved = set(spec.labels) & (
        set(_FIXED_LABELS) | {JOB_LABEL, RUN_ID_LABEL, INDEX_LABEL, ATTEMPT_LABEL}
    )
    if spec.kueue_queue is not None:
        reserved |= set(spec.labels) & {KUEUE_QUEUE_LABEL, KUEUE_PRIORITY_CLASS_LABEL}
    if reserved:
        raise ValueError(f"labels {sorted(reserved)} are set by the launcher; do not pass them")
    for key in spec.annotations:
        _label_key("annotations", key)
    for name in spec.env:
        if not _ENV_NAME.fullmatch(name):
            raise ValueError(f"env name {name!r} is not a valid environment variable name")
        if name in RESERVED_ENV:
            raise ValueError(f"env {name!r} is set by the launcher; do not pass it")
    for toleration in spec.tolerations:
        _validate_toleration(toleration)
    _validate_volumes(spec)


def _validate_rdzv(spec: WorkerPodSpec) -> None:
    if "$(" not in spec.rdzv_endpoint:  # a kubelet reference is only known in the pod
        try:
            parse_endpoints(spec.rdzv_endpoint, "--rdzv-endpoint")
        except ConfigError as exc:
            raise ValueError(f"rdzv_endpoint: {exc}") from None
    for key, value in spec.rdzv_conf.items():
        if not key or any(c in f"{key}{value}" for c in ",= ") or not str(value):
            raise ValueError(
                f"rdzv_conf {key}={value!r}: keys and values must be non-empty "
                "and contain no ',', '=' or spaces"
            )
    if spec.rdzv_backend == "elastic-etcd":
        known = set(RendezvousConfig.setting_names()) | {"timeout"}
        unknown = sorted(set(spec.rdzv_conf) - known)
        if unknown:
            raise ValueError(
                f"rdzv_conf keys {unknown} are unknown to elastic-etcd; known: {sorted(known)}"
            )
    etcd_keys = sorted(set(spec.rdzv_conf) & set(ETCD_KEYS))
    if etcd_keys:
        raise ValueError(
            f"rdzv_conf {etcd_keys}: etcd settings reach worker pods as KFP_ELASTIC_ETCD_* env "
            "(etcd_tls_secret / etcd_password_secret for files); do not pass them in rdzv_conf"
        )
    if spec.etcd_password_secret and "KFP_ELASTIC_ETCD_USER" not in spec.env:
        raise ValueError("etcd_password_secret needs env KFP_ELASTIC_ETCD_USER (the etcd user)")


def _validate_resources(spec: WorkerPodSpec) -> None:
    values: dict[str, Decimal] = {}
    for key in ("cpu", "memory", "cpu_limit", "memory_limit", "shm_size", "snapshot_buffer"):
        raw = getattr(spec, key)
        if raw is None:
            continue
        try:
            values[key] = parse_quantity(raw)
        except ValueError as exc:
            raise ValueError(f"{key}: {exc}") from None
        if values[key] < 0:
            raise ValueError(f"{key}={raw!r} must not be negative")
    for request, limit in (("cpu", "cpu_limit"), ("memory", "memory_limit")):
        if request in values and limit in values and values[limit] < values[request]:
            raise ValueError(
                f"{limit}={getattr(spec, limit)!r} is below {request}={getattr(spec, request)!r}"
            )
    if spec.gpu:
        _label_key("gpu_resource", spec.gpu_resource)


def _validate_toleration(toleration: Mapping[str, Any]) -> None:
    extra = set(toleration) - _TOLERATION_KEYS
    if extra:
        raise ValueError(f"toleration {dict(toleration)} has unknown fields {sorted(extra)}")
    operator = toleration.get("operator", "Equal")
    if operator not in ("Equal", "Exists"):
        raise ValueError(f"toleration operator {operator!r} must be Equal or Exists")
    if operator == "Exists" and toleration.get("value"):
        raise ValueError(f"toleration {dict(toleration)}: operator Exists takes no value")
    if operator == "Equal" and not toleration.get("key"):
        raise ValueError(f"toleration {dict(toleration)}: operator Equal needs a key")
    if toleration.get("effect", "") not in _TOLERATION_EFFECTS:
        raise ValueError(
            f"toleration effect {toleration.get('effect')!r} must be one of "
            f"{sorted(_TOLERATION_EFFECTS - {''})}"
        )
    if "tolerationSeconds" in toleration and toleration.get("effect") != "NoExecute":
        raise ValueError("tolerationSeconds only applies to effect NoExecute")


def _validate_volumes(spec: WorkerPodSpec) -> None:
    names: set[str] = set()
    for volume in spec.volumes:
        name = volume.get("name", "")
        _dns_label("volume name", name)
        if name in names or name in _BUILTIN_VOLUMES:
            raise ValueError(f"volume name {name!r} is used twice (or is reserved)")
        names.add(name)
    paths: set[str] = set()
    for mount in spec.volume_mounts:
        if mount.get("name") not in names:
            raise ValueError(f"volume mount {dict(mount)} names no volume in `volumes`")
        path = mount.get("mountPath", "")
        if not path.startswith("/") or path in paths:
            raise ValueError(f"volume mount path {path!r} must be absolute and unique")
        paths.add(path)


def _dns_label(what: str, value: str) -> None:
    if not is_dns_label(value):
        raise ValueError(f"{what}={value!r} is not {DNS_LABEL_RULE}")


def _dns_subdomain(what: str, value: str) -> None:
    if not isinstance(value, str) or len(value) > 253 or not _DNS_SUBDOMAIN.fullmatch(value):
        raise ValueError(f"{what}={value!r} is not a DNS-1123 subdomain name")


def _label_key(what: str, key: str) -> None:
    prefix, _, name = key.rpartition("/")
    if prefix:
        _dns_subdomain(f"{what} key prefix", prefix)
    if len(name) > 63 or not _LABEL_NAME.fullmatch(name):
        raise ValueError(f"{what} key {key!r} is not a valid Kubernetes label/annotation key")


def _label(what: str, key: str, value: str) -> None:
    _label_key(what, key)
    valid = isinstance(value, str) and (not value or _LABEL_NAME.fullmatch(value))
    if not valid or len(value) > 63:
        raise ValueError(
            f"{what}: label value {value!r} for {key!r} is not a valid label value "
            "(at most 63 letters, digits, '-', '_' or '.')"
        )
