"""The one description of an elastic job: what to run, its size, data, training, etcd, launcher
and the master's policy; one set of defaults and one ``validate()``.

The master CLI builds its flags from these fields, the KFP component builds a ``JobSpec`` from
its parameters, and the worker's settings (``kfp_elastic/job_env.py``) take their defaults from
here. KFP needs literal defaults in the component's and the pipeline's signatures:
``tests/unit/test_job_spec.py`` fails naming any of them (or a CLI default) that disagrees with
the defaults below.

Every field has a CLI flag and a component parameter, both spelled from its name (``min_workers``
→ ``--min-workers`` / ``min_workers``) unless its metadata says otherwise (``max_wait_s`` →
``--max-wait``); errors name the field with both (``field_error``).

It imports only what lies below it: the etcd layer and the pure pieces it shares with the other
parts (``kfp_elastic/contract/``: prices, Kubernetes syntax, the rendezvous settings, batch
policies, the data plan), so that every part may import the contract (docs/architecture.md).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

from kfp_elastic.contract.batch_policy import BatchPolicy
from kfp_elastic.contract.data_plan import (
    Manifest,
    Shard,
    manifest_from_shards,
    shards_for_length,
)
from kfp_elastic.contract.kubernetes_syntax import (
    DNS_LABEL_RULE,
    format_quantity,
    is_dns_label,
    parse_quantity,
)
from kfp_elastic.contract.prices import Prices, price_from_env
from kfp_elastic.contract.rendezvous_config import ETCD_KEYS, ConfigError, RendezvousConfig
from kfp_elastic.contract.sharded_memory import host_memory_per_process
from kfp_elastic.etcd.keys import run_prefix_of
from kfp_elastic.etcd.settings import DEFAULT_KEY_PREFIX, EtcdSettings

# -- the defaults (the only ones: every signature and flag that repeats one is tested) ----------
DEFAULT_MODEL_DEF = "kfp_elastic.worker.examples.digits"
RUNTIME_MODULE = "kfp_elastic.worker"  # the built-in training runtime (``--model-def``)
# What the built-in runtime imports besides torch: the agents' zygotes import it once, so a
# worker restart (every membership change) does not (see ``JobSpec.worker_rdzv_conf``).
RUNTIME_PRELOAD = ("kfp_elastic.worker.runner",)
DEFAULT_MIN_WORKERS = 1
DEFAULT_MAX_WORKERS = 2
DEFAULT_NPROC_PER_WORKER = 1
DEFAULT_EPOCHS = 1
DEFAULT_SEED = 0
DEFAULT_SHUFFLE = True
DEFAULT_BATCH_SIZE = 32  # per worker, at the base world size
DEFAULT_LEARNING_RATE = 0.1
DEFAULT_BATCH_POLICY = "fixed-global-batch"
# KFP parameters need one type: an int, where 0 means "auto" (as often as 1 % of the training
# time allows; the runtime's --snapshot-every also takes the word).
SNAPSHOT_EVERY_AUTO = 0
DEFAULT_SNAPSHOT_EVERY = SNAPSHOT_EVERY_AUTO
DEFAULT_STEP_TIME_S = 0.0  # no artificial minimum step time
DEFAULT_SHM_PER_PROCESS = "1Gi"  # /dev/shm of a pod with several processes, per process
# What a NaN/inf training loss does (worker/finite_loss.py): fail the job, or skip that step.
NAN_POLICIES = ("fail", "skip")
DEFAULT_NAN_POLICY = "fail"
DEFAULT_DEVICE = "auto"  # the node's accelerator (LOCAL_RANK's device) if it has one, else CPU
DEVICES = ("auto", "cpu", "cuda")
# Seconds any one collective may take before it fails (torch's defaults: NCCL 10 min, Gloo
# 30 min). Restoring broadcasts a whole state from rank 0, read from the persisted volume.
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
# Seconds a stopped (SIGTERM) NCCL worker whose steps stalled waits before it aborts its
# communicator and writes its rescue; torchrun SIGKILLs workers 30 s after SIGTERM.
DEFAULT_COLLECTIVE_ABORT_S = 5.0
#: The ``--rdzv-conf`` key that carries ``orphan_timeout_s`` to each worker's agent.
ORPHAN_CONF_KEY = "orphan_timeout"
#: The ``--rdzv-conf`` key that carries ``max_failures`` to each worker's agent.
MAX_FAILURES_CONF_KEY = "max_failures"
FINAL_MODEL_FILE = "model.pt"  # rank 0 writes the final weights here, in the snapshot directory
DEFAULT_LAUNCHER = "local"
LAUNCHERS = ("local", "kubernetes")
# torchrun --max-restarts of every worker: restarts of its local process group after a process
# failed. High, because the job's one failure budget (max_failures, counted in etcd across
# restarts: kfp_elastic/contract/failure_budget.py) ends a job whose workers keep failing, and
# membership changes do not count against it.
DEFAULT_WORKER_MAX_RESTARTS = 100
# Kubernetes settings left empty come from these variables (the kfp-elastic-config ConfigMap
# maps them into the master's pod), else from these defaults: see KubernetesSettings.resolved.
# What images/worker/Dockerfile builds (images/README.md), the ConfigMap's
# KFP_ELASTIC_WORKER_IMAGE, and the components' base image: one name (a test checks it).
DEFAULT_WORKER_IMAGE = "kfp-elastic-worker:0.1.0"
# Worker pods come in two tiers (manifests/base/priorityclasses.yaml): a job's first
# min_workers indexes are guaranteed (a class that may preempt opportunistic workers of any job),
# the others opportunistic (a lower class that never preempts). docs/master.md, "Sharing a
# cluster".
DEFAULT_GUARANTEED_PRIORITY_CLASS = "kfp-elastic-worker-guaranteed"
DEFAULT_OPPORTUNISTIC_PRIORITY_CLASS = "kfp-elastic-worker-opportunistic"
# The least-attained-service ladder (master/ladder.py; docs/scheduling.md, "Least-attained-service
# ladder"): a job's guaranteed workers move down these PriorityClasses (level 0 first) as its
# attained GPU time grows, so that short jobs go first, as in Tiresias (NSDI'19). Off unless a job
# names its levels (ladder_priority_classes). Three levels, as Tiresias' own simulator has
# (thresholds 3,250 and 7,200 GPU-seconds, about 0.9 and 2 GPU-hours, for traces of shorter
# jobs). The thresholds split the Philly trace that benchmarks/scheduling samples (its 74,428 jobs
# with duration >= 60 s and under 1,000 GPU-hours): 75 % of them end within 1 GPU-hour and 93 %
# within 10: 75 % of the jobs never leave level 0, 19 % end in level 1, the longest 7 % reach
# level 2, where 84 % of all GPU time is served (level 0 serves 5 %, level 1 10 %). Under the
# simulator's steady load (docs/scheduling.md, "Steady load") these defaults change mean JCT by
# at most 1 % against elastic FIFO: other thresholds were not searched.
DEFAULT_LADDER_PRIORITY_CLASSES = (
    "kfp-elastic-worker-level-0",
    "kfp-elastic-worker-level-1",
    "kfp-elastic-worker-level-2",
)
DEFAULT_LADDER_THRESHOLDS_GPU_H = (1.0, 10.0)
# A job below min_workers this long goes back to level 0 (Tiresias' starvation rule). Shorter than
# DEFAULT_MAX_WAIT_S (validate() insists for every job): a demoted job whose guaranteed workers
# were preempted by higher levels must be promoted before it would fail for waiting; half of it
# leaves the other half for its pods to be re-created at level 0 and scheduled.
DEFAULT_LADDER_STARVATION_S = 300.0
# Each move re-creates the job's guaranteed workers (a pod's priority is fixed when it is
# created): one membership change each. At most one every 2 minutes keeps the ladder's share of
# a job's restarts small, and being no longer than the starvation time (validate() insists), it
# never holds back a starving job's promotion (master/ladder.py says why).
DEFAULT_LADDER_MIN_MOVE_INTERVAL_S = 120.0
DEFAULT_SERVICE_ACCOUNT = "kfp-elastic-worker"
WORKER_IMAGE_ENV = "KFP_ELASTIC_WORKER_IMAGE"
GUARANTEED_PRIORITY_CLASS_ENV = "KFP_ELASTIC_WORKER_GUARANTEED_PRIORITY_CLASS"
OPPORTUNISTIC_PRIORITY_CLASS_ENV = "KFP_ELASTIC_WORKER_OPPORTUNISTIC_PRIORITY_CLASS"
# Before the tiers: one class for every worker. Still read, as the fallback of both tiers, so
# that a ConfigMap that only has this key keeps working.
PRIORITY_CLASS_ENV = "KFP_ELASTIC_WORKER_PRIORITY_CLASS"
SERVICE_ACCOUNT_ENV = "KFP_ELASTIC_WORKER_SERVICE_ACCOUNT"
TLS_SECRET_ENV = "KFP_ELASTIC_ETCD_CLIENT_TLS_SECRET"
PASSWORD_SECRET_ENV = "KFP_ELASTIC_ETCD_PASSWORD_SECRET"
# Prices per worker slot-hour (master/cost.py): guaranteed workers and the fixed-size comparison
# at the on-demand price, opportunistic workers at the spot price. 0: not given (no cost shown;
# no spot price: opportunistic workers at the on-demand price). docs/scheduling.md.
DEFAULT_ON_DEMAND_PRICE = 0.0
DEFAULT_SPOT_PRICE = 0.0
ON_DEMAND_PRICE_ENV = "KFP_ELASTIC_ON_DEMAND_PRICE"
SPOT_PRICE_ENV = "KFP_ELASTIC_SPOT_PRICE"
# Every variable KubernetesSettings.resolved reads (the etcd connection's are in
# kfp_elastic/etcd/settings.py ENV_VARS): the kfp-elastic-config ConfigMap's keys come from these.
KUBERNETES_ENV_VARS = (
    TLS_SECRET_ENV,
    PASSWORD_SECRET_ENV,
    WORKER_IMAGE_ENV,
    GUARANTEED_PRIORITY_CLASS_ENV,
    OPPORTUNISTIC_PRIORITY_CLASS_ENV,
    PRIORITY_CLASS_ENV,
    SERVICE_ACCOUNT_ENV,
    ON_DEMAND_PRICE_ENV,
    SPOT_PRICE_ENV,
)
# tolerationSeconds of worker pods for the not-ready and unreachable NoExecute taints: how long
# a worker pod stays bound to a lost node (after Kubernetes' node monitor grace, 40-50 s) before
# it is evicted and the master replaces it. Kubernetes gives pods without their own 300 s; the
# rendezvous drops a lost worker within lease_ttl anyway, so waiting longer only delays its
# replacement.
DEFAULT_NODE_LOSS_TOLERATION_S = 10
DEFAULT_MAX_WAIT_S = 600.0
DEFAULT_MAX_FAILURES = 3
DEFAULT_FINISH_GRACE_S = 30.0
DEFAULT_LEADER_TTL_S = 5.0
# Seconds worker pods go on without a master before they stop on their own (a snapshot first,
# then exit ORPHANED_EXIT_CODE: ``rendezvous/orphan.py``). Worker pods have no owner, so a run
# terminated in the KFP UI or a pipeline whose exit handler never runs would leave them holding
# their GPUs forever. Longer than a KFP retry of the training task takes to bring a master back,
# which then adopts them: KFP's ``set_retry`` retries at once by default (backoff_duration 0 s,
# as Argo's retryStrategy without a backoff), this project's pipeline after 5 s, 10 s, 20 s
# (pipelines/elastic_training.py), and a new master pod still has to be scheduled, pull its
# image, start and wait out the old leader lease (``leader_ttl_s``): about a minute on a busy
# cluster. Five minutes leaves room for that; it is also how long GPUs stay held after a run
# was terminated. A pipeline with a longer retry backoff needs a longer timeout.
DEFAULT_ORPHAN_TIMEOUT_S = 300.0
# The master's check of the model definition imports torch and runs the user's code (the
# dataset's first load among it): a slow dataset is not a mistake, only a check that never ends.
DEFAULT_MODEL_DEF_CHECK_TIMEOUT_S = 300.0
DEFAULT_RECONCILE_INTERVAL_S = 0.5


def _option(default: Any = MISSING, help: str = "", **names: Any) -> Any:
    """A field with its help text; ``flag=``/``param=`` when not spelled from the field name,
    ``None`` when the CLI or the component has no such option; ``factory=`` for mutable
    defaults."""
    factory = names.pop("factory", MISSING)
    metadata = {"help": help, **names}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def flag_of(name: str, section: type | None = None) -> str | None:
    """The CLI flag of field ``name`` (of ``section``; any section when not given)."""
    meta = _metadata(name, section)
    return meta["flag"] if "flag" in meta else "--" + name.replace("_", "-")


def param_of(name: str, section: type | None = None) -> str | None:
    """The KFP component parameter of field ``name``."""
    meta = _metadata(name, section)
    return meta["param"] if "param" in meta else name


def field_error(name: str, problem: str, section: type | None = None) -> ValueError:
    """A ``ValueError`` naming field ``name`` and how a user sets it: ``min_workers
    (--min-workers / min_workers) must be >= 1, got 0``."""
    flag = flag_of(name, section) or ("after --" if name == "command" else None)
    ways = [w for w in (flag, param_of(name, section)) if w]
    return ValueError(f"{name} ({' / '.join(ways)}) {problem}" if ways else f"{name} {problem}")


@dataclass(frozen=True)
class Entry:
    """What each torchrun agent runs: the built-in runtime with ``model_def`` (and the
    ``Training`` settings), or ``command``: a script and its arguments, or ``-m MODULE ...``."""

    model_def: str = _option("", "module or file with model/loss/dataset (built-in runtime)")
    # The CLI takes it after ``--``; the component as one string (``parse_command``).
    command: tuple[str, ...] = _option(
        (), "your own script: SCRIPT [ARGS] or -m MODULE [ARGS]", flag=None
    )


MODULE_FLAGS = ("-m", "--module")


def is_file_reference(model_def: str) -> bool:
    """Whether a model definition is named as a file (``my_model.py``, ``models/net.py``)
    rather than as a module (``pkg.module``)."""
    return model_def.endswith(".py") or "/" in model_def or "\\" in model_def


def parse_command(text: str) -> tuple[str, ...]:
    """A command given as one string (the component's ``command`` parameter), split like a
    shell does: ``"-m my_pkg.train --lr 0.1"`` or ``"/app/train.py --lr 0.1"``."""
    try:
        return tuple(shlex.split(text))
    except ValueError as error:
        raise field_error("command", f"{text!r}: {error}", Entry) from None


@dataclass(frozen=True)
class Size:
    min_workers: int = _option(DEFAULT_MIN_WORKERS, "fewest workers to train with")
    max_workers: int = _option(DEFAULT_MAX_WORKERS, "most workers")
    nproc_per_worker: int = _option(
        DEFAULT_NPROC_PER_WORKER, "processes per worker (torchrun --nproc-per-node; GPUs per pod)"
    )


@dataclass(frozen=True)
class Data:
    """The samples and their order; the master publishes the shard manifest from these."""

    dataset_length: int | None = _option(None, "samples (with --shard-size)", param=None)
    shard_size: int | None = _option(None, "samples per shard", param=None)
    shard_manifest: str | None = _option(
        None, 'JSON file {"shards": [[id, start, end], ...]}', param="shard_manifest"
    )
    epochs: int = _option(DEFAULT_EPOCHS, "passes over the data")
    seed: int = _option(DEFAULT_SEED, "shuffle and initialization seed")
    shuffle: bool = _option(
        DEFAULT_SHUFFLE,
        "keep the shards in order (do not shuffle)",
        flag="--no-shuffle",
        param=None,
    )


@dataclass(frozen=True)
class Training:
    """Settings of the built-in runtime (``Entry.model_def``)."""

    batch_size: int = _option(DEFAULT_BATCH_SIZE, "per worker, at the base world size")
    learning_rate: float = _option(DEFAULT_LEARNING_RATE, "at the base world size", flag="--lr")
    batch_policy: str = _option(
        DEFAULT_BATCH_POLICY, "fixed-global-batch | linear | sqrt (how a world size change scales)"
    )
    snapshot_every: int = _option(
        DEFAULT_SNAPSHOT_EVERY,
        "steps between snapshots (and data position commits); 0 = auto: as often as 1 %% of "
        "the training time allows",
    )
    step_time: float = _option(DEFAULT_STEP_TIME_S, "minimum seconds per step (demos)")
    nan_policy: str = _option(
        DEFAULT_NAN_POLICY,
        "fail | skip: a NaN/inf loss fails the job (naming the step and rank) or skips the step",
    )
    snapshot_dir: str = _option(
        "", "shared snapshot directory (default: $KFP_ELASTIC_SNAPSHOT_DIR, else WORKDIR/snapshots)"
    )
    device: str = _option(
        DEFAULT_DEVICE,
        "auto | cpu | cuda: each process's device (auto: LOCAL_RANK's GPU if there is one)",
        param=None,
    )
    collective_timeout_s: float = _option(
        DEFAULT_COLLECTIVE_TIMEOUT_S,
        "seconds one collective (allreduce, broadcast) may take before it fails",
        flag="--collective-timeout",
        param=None,
    )
    collective_abort_s: float = _option(
        DEFAULT_COLLECTIVE_ABORT_S,
        "seconds without a finished step after SIGTERM or a broken round before a NCCL worker "
        "aborts its communicators (a peer died) and writes its rescue",
        flag="--collective-abort",
        param=None,
    )


@dataclass(frozen=True)
class LocalSettings:
    workdir: str = _option("", "worker logs and exit records (default: a temporary directory)")
    capacity: int | None = _option(
        None, "run at most this many workers (others stay Pending)", flag="--local-capacity"
    )


@dataclass(frozen=True)
class KubernetesSettings:
    """Worker pods. Empty strings mean "from the environment, else the default" (``resolved``)."""

    image: str = _option(
        "", f"worker image (empty: ${WORKER_IMAGE_ENV}, else {DEFAULT_WORKER_IMAGE})"
    )
    namespace: str = _option("", "empty: the master pod's own namespace, else default")
    guaranteed_priority_class: str = _option(
        "",
        "PriorityClass of workers 0..min_workers-1, which may preempt other jobs' opportunistic "
        f"workers (empty: ${GUARANTEED_PRIORITY_CLASS_ENV}, else ${PRIORITY_CLASS_ENV}, else "
        f"{DEFAULT_GUARANTEED_PRIORITY_CLASS})",
    )
    opportunistic_priority_class: str = _option(
        "",
        "PriorityClass of workers min_workers..max_workers-1, which never preempt (empty: "
        f"${OPPORTUNISTIC_PRIORITY_CLASS_ENV}, else ${PRIORITY_CLASS_ENV}, else "
        f"{DEFAULT_OPPORTUNISTIC_PRIORITY_CLASS})",
    )
    priority_class: str = _option(
        "",
        "one PriorityClass for every worker pod, no tiers (empty: the two classes above; not "
        "together with them)",
    )
    kueue_queue: str = _option(
        "",
        "Kueue LocalQueue the worker pods are submitted to, each its own workload with its "
        "tier's WorkloadPriorityClass (manifests/kueue; empty: no Kueue)",
    )
    ladder_priority_classes: str = _option(
        "",
        "least-attained-service ladder: PriorityClasses of workers 0..min_workers-1 by level, "
        "comma-separated, level 0 (a job with the least GPU time) first, e.g. "
        f"{','.join(DEFAULT_LADDER_PRIORITY_CLASSES)} (manifests/base); not together with "
        "priority_class or guaranteed_priority_class (empty: no ladder); the master moves the "
        "job down as its GPU time grows (docs/scheduling.md)",
    )
    ladder_thresholds_gpu_h: str = _option(
        ",".join(f"{h:g}" for h in DEFAULT_LADDER_THRESHOLDS_GPU_H),
        "the ladder's thresholds: attained GPU-hours at which a job leaves each level but the "
        "last, comma-separated and increasing (one fewer than the levels)",
        flag="--ladder-thresholds",
    )
    ladder_starvation_s: float = _option(
        DEFAULT_LADDER_STARVATION_S,
        "seconds below min_workers after which a job on a lower ladder level goes back to "
        "level 0 (with a ladder: shorter than max_wait_s)",
        flag="--ladder-starvation",
    )
    ladder_min_move_interval_s: float = _option(
        DEFAULT_LADDER_MIN_MOVE_INTERVAL_S,
        "fewest seconds between two ladder moves of one job, each of which re-creates its "
        "guaranteed workers (with a ladder: at most ladder_starvation_s)",
        flag="--ladder-min-move-interval",
    )
    service_account: str = _option(
        "",
        f"worker pods' service account (empty: ${SERVICE_ACCOUNT_ENV}, else "
        f"{DEFAULT_SERVICE_ACCOUNT})",
    )
    cpu: str = _option("", "CPU request per worker pod (empty: none)", param="worker_cpu")
    memory: str = _option(
        "", "memory request and limit per worker pod (empty: none)", param="worker_memory"
    )
    snapshot_buffer: str = _option(
        "",
        "host memory each worker process pins for snapshots and rescues: the training state's "
        "size (parameters + optimizer state, e.g. 9Gi for 1 B fp32 parameters with momentum); "
        "added, once per process, to the worker pod's memory request and limit (empty: not "
        "known before the start, count it in the memory yourself)",
        param="worker_snapshot_buffer",
    )
    sharded_state: str = _option(
        "",
        "a sharded (FSDP2) model's state size (parameters + optimizer state, e.g. 12Gi): each "
        "worker pod's memory-backed /dev/shm, and with it its memory request and limit, grows "
        "by what its processes keep in host memory (its shards and a neighbour's copy, two "
        "snapshots each: 4 x size / (min_workers x nproc_per_worker) per process; empty: none)",
        param="worker_sharded_state",
    )
    gpus: int = _option(
        0,
        "GPUs per worker pod (0: one per process when the built-in runtime runs on cuda)",
        flag="--gpu",
        param="worker_gpus",
    )
    shm_size: str = _option(
        "",
        "memory-backed /dev/shm per worker pod, e.g. 8Gi (NCCL and DataLoader workers use it; "
        f"empty: {DEFAULT_SHM_PER_PROCESS} per process when a pod has several, else the "
        "container runtime's 64Mi)",
        param="worker_shm_size",
    )
    job_name: str = _option("", "pod name prefix (DNS label; empty: the run id)", param=None)
    etcd_tls_secret: str = _option(
        "",
        "Secret (ca.crt, tls.crt, tls.key) worker pods mount for etcd TLS "
        f"(empty: ${TLS_SECRET_ENV})",
        param=None,
    )
    etcd_password_secret: str = _option(
        "",
        "Secret whose key 'password' worker pods mount as their etcd password file "
        f"(empty: ${PASSWORD_SECRET_ENV})",
        param=None,
    )
    node_loss_toleration_s: int = _option(
        DEFAULT_NODE_LOSS_TOLERATION_S,
        "seconds a worker pod stays on a not-ready or unreachable node before Kubernetes "
        "evicts it and the master replaces it (tolerationSeconds; Kubernetes' default: 300)",
        flag="--node-loss-toleration",
        param=None,
    )
    on_demand_price: float = _option(
        DEFAULT_ON_DEMAND_PRICE,
        "price per worker slot-hour on on-demand nodes: guaranteed workers and the fixed-size "
        f"comparison (0: ${ON_DEMAND_PRICE_ENV}, else no cost shown)",
    )
    spot_price: float = _option(
        DEFAULT_SPOT_PRICE,
        "price per worker slot-hour on spot nodes: opportunistic workers (0: "
        f"${SPOT_PRICE_ENV}, else the on-demand price)",
    )
    # tolerations, node_selector, affinity, volumes, volume_mounts (the KFP task's settings)
    pod_overrides: Mapping[str, Any] = _option(factory=dict, flag=None, param=None)

    def check_priority_classes(self) -> None:
        """``priority_class`` (one class for all), the tier classes and the ladder's levels
        exclude each other where they name worker 0's class: which one would it get? Raises
        ``ValueError`` naming both."""
        tiers = [
            name
            for name in ("guaranteed_priority_class", "opportunistic_priority_class")
            if getattr(self, name)
        ]
        if self.priority_class and tiers:
            raise field_error(
                "priority_class",
                f"puts every worker in one class ({self.priority_class!r}) and cannot be "
                f"combined with {' and '.join(f'{n}={getattr(self, n)!r}' for n in tiers)}: "
                "give priority_class alone, or the tier classes alone",
                KubernetesSettings,
            )
        if not self.ladder_priority_classes.strip():
            return
        for name in ("priority_class", "guaranteed_priority_class"):
            if getattr(self, name):
                raise field_error(
                    "ladder_priority_classes",
                    "gives workers 0..min_workers-1 the ladder's classes and cannot be combined "
                    f"with {name}={getattr(self, name)!r}: give one of them",
                    KubernetesSettings,
                )

    def ladder_levels(self) -> tuple[str, ...]:
        """The ladder's PriorityClasses, level 0 first (empty: no ladder); ``check_ladder``
        refuses an empty name between two commas."""
        text = self.ladder_priority_classes.strip()
        return tuple(name.strip() for name in text.split(",")) if text else ()

    def ladder_thresholds_gpu_s(self) -> tuple[float, ...]:
        """The ladder's thresholds in GPU-seconds (the setting is in GPU-hours); ``ValueError``
        naming the setting for one that is not a number."""
        text = self.ladder_thresholds_gpu_h.strip()
        try:
            hours = [float(item) for item in text.split(",")] if text else []
        except ValueError:
            raise field_error(
                "ladder_thresholds_gpu_h",
                f"must be comma-separated numbers of GPU-hours, got {text!r}",
                KubernetesSettings,
            ) from None
        return tuple(h * 3600.0 for h in hours)

    def check_ladder(self, max_wait_s: float) -> None:
        """The ladder's settings (``JobSpec.validate`` calls it with the job's ``max_wait_s``):
        its numbers always, how they fit the levels and the job when levels are given.
        ``ValueError`` naming the setting at fault."""

        def fail(name: str, problem: str) -> ValueError:
            return field_error(name, problem, KubernetesSettings)

        starvation, interval = self.ladder_starvation_s, self.ladder_min_move_interval_s
        if starvation <= 0:
            raise fail("ladder_starvation_s", f"must be > 0, got {starvation}")
        if interval < 0:
            raise fail("ladder_min_move_interval_s", f"must be >= 0, got {interval}")
        thresholds = self.ladder_thresholds_gpu_s()
        if any(t <= 0 for t in thresholds) or any(a >= b for a, b in pairwise(thresholds)):
            raise fail(
                "ladder_thresholds_gpu_h",
                f"must be positive and increasing, got {self.ladder_thresholds_gpu_h!r}",
            )
        levels = self.ladder_levels()
        if not levels:
            return
        self.check_priority_classes()
        bad = [name for name in levels if not is_dns_label(name)]
        if bad:
            raise fail(
                "ladder_priority_classes", f"{bad[0]!r} is not {DNS_LABEL_RULE} (a PriorityClass)"
            )
        repeated = sorted({name for name in levels if levels.count(name) > 1})
        if repeated:
            raise fail(
                "ladder_priority_classes",
                f"names {', '.join(repeated)} twice: each level needs a class of its own",
            )
        if len(levels) < 2:
            raise fail("ladder_priority_classes", f"needs two levels or more, got {levels[0]!r}")
        if len(thresholds) != len(levels) - 1:
            raise fail(
                "ladder_thresholds_gpu_h",
                f"needs {len(levels) - 1} thresholds for {len(levels)} ladder levels "
                f"(one to leave each level but the last), got {len(thresholds)}: "
                f"{self.ladder_thresholds_gpu_h!r}",
            )
        if starvation >= max_wait_s:
            raise fail(
                "ladder_starvation_s",
                f"must be shorter than max_wait_s={max_wait_s:g}, got {starvation:g}: a job "
                "below min_workers for max_wait_s fails before the ladder takes it back to "
                "level 0",
            )
        if interval > starvation:
            raise fail(
                "ladder_min_move_interval_s",
                f"must be at most ladder_starvation_s={starvation:g}, got {interval:g}: else the "
                "rate limit could hold back a starving job's return to level 0",
            )

    def resolved(self, env: Mapping[str, str]) -> KubernetesSettings:
        """Empty settings filled from ``env`` (the ConfigMap's variables), else the defaults.
        The tier classes: the job's ``priority_class`` for both, else each one's own setting,
        its variable, the single-class variable, its default."""
        self.check_priority_classes()
        one_class = self.priority_class
        return replace(
            self,
            image=self.image or env.get(WORKER_IMAGE_ENV) or DEFAULT_WORKER_IMAGE,
            guaranteed_priority_class=one_class
            or self.guaranteed_priority_class
            or env.get(GUARANTEED_PRIORITY_CLASS_ENV)
            or env.get(PRIORITY_CLASS_ENV)
            or DEFAULT_GUARANTEED_PRIORITY_CLASS,
            opportunistic_priority_class=one_class
            or self.opportunistic_priority_class
            or env.get(OPPORTUNISTIC_PRIORITY_CLASS_ENV)
            or env.get(PRIORITY_CLASS_ENV)
            or DEFAULT_OPPORTUNISTIC_PRIORITY_CLASS,
            service_account=self.service_account
            or env.get(SERVICE_ACCOUNT_ENV)
            or DEFAULT_SERVICE_ACCOUNT,
            etcd_tls_secret=self.etcd_tls_secret or env.get(TLS_SECRET_ENV, ""),
            etcd_password_secret=self.etcd_password_secret or env.get(PASSWORD_SECRET_ENV, ""),
            on_demand_price=self.on_demand_price or price_from_env(env, ON_DEMAND_PRICE_ENV),
            spot_price=self.spot_price or price_from_env(env, SPOT_PRICE_ENV),
        )

    def prices(self, env: Mapping[str, str]) -> Prices:
        """The prices per slot-hour (``contract/prices.py``): the job's, else ``env``'s (the
        ConfigMap's variables); ``ValueError`` naming the setting for a bad one, before any worker
        starts."""
        resolved = self.resolved(env)
        for name in ("on_demand_price", "spot_price"):
            if getattr(resolved, name) < 0:
                raise field_error(name, f"must be >= 0, got {getattr(resolved, name)}", type(self))
        if resolved.spot_price and not resolved.on_demand_price:
            raise field_error(
                "on_demand_price",
                f"is needed with spot_price={resolved.spot_price:g}: guaranteed workers and the "
                f"fixed-size comparison run on on-demand nodes (or ${ON_DEMAND_PRICE_ENV})",
                type(self),
            )
        return Prices(resolved.on_demand_price, resolved.spot_price)


@dataclass(frozen=True)
class Launch:
    kind: str = _option(DEFAULT_LAUNCHER, "local | kubernetes", flag="--launcher", param=None)
    rdzv_conf: Mapping[str, str] = _option(
        help="more --rdzv-conf keys for the workers, KEY=VALUE,... (not the etcd connection: "
        "the workers get the master's)",
        factory=dict,
        param=None,
    )
    worker_max_restarts: int = _option(
        DEFAULT_WORKER_MAX_RESTARTS, "torchrun --max-restarts of each worker", param=None
    )
    local: LocalSettings = field(default_factory=LocalSettings)
    kubernetes: KubernetesSettings = field(default_factory=KubernetesSettings)


@dataclass(frozen=True)
class Policy:
    """The master's rules."""

    max_wait_s: float = _option(
        DEFAULT_MAX_WAIT_S, "seconds below min_workers before the job fails", flag="--max-wait"
    )
    max_failures: int = _option(
        DEFAULT_MAX_FAILURES,
        "worker failures the job tolerates, counted once each in etcd across in-place restarts "
        "and replaced workers; one more fails the job (preemptions and a peer's loss do not "
        "count; a NaN loss under --nan-policy fail fails it at once)",
    )
    finish_grace_s: float = _option(
        DEFAULT_FINISH_GRACE_S,
        "seconds workers get to exit once the job is complete",
        flag="--finish-grace",
        param=None,
    )
    leader_ttl_s: float = _option(
        DEFAULT_LEADER_TTL_S,
        "leader lease TTL; a dead master's successor waits this long",
        flag="--leader-ttl",
        param=None,
    )
    orphan_timeout_s: float = _option(
        DEFAULT_ORPHAN_TIMEOUT_S,
        "seconds the workers go on without a master (none holds the run's leadership) before "
        "they snapshot and stop on their own; longer than a KFP retry takes to start a new "
        "master, which adopts them",
        flag="--orphan-timeout",
    )
    model_def_check_timeout_s: float = _option(
        DEFAULT_MODEL_DEF_CHECK_TIMEOUT_S,
        "seconds the master's check of the model definition may take before any worker starts "
        "(it loads the model and its dataset once); raise it for a dataset whose first load is "
        "slower",
        flag="--model-def-check-timeout",
    )
    reconcile_interval_s: float = _option(DEFAULT_RECONCILE_INTERVAL_S, flag=None, param=None)


@dataclass(frozen=True)
class ScalingPolicy:
    """What ``master/scaling.py`` decides with: the job's size and the master's limits
    (``JobSpec.scaling``)."""

    min_workers: int
    max_workers: int
    max_wait_s: float = DEFAULT_MAX_WAIT_S


SECTIONS: tuple[type, ...] = (
    Entry,
    Size,
    Data,
    Training,
    Launch,
    LocalSettings,
    KubernetesSettings,
    Policy,
)


def _metadata(name: str, section: type | None) -> Mapping[str, Any]:
    for candidate in (section,) if section else (*SECTIONS, JobSpec):
        for f in fields(candidate):
            if f.name == name:
                return f.metadata
    raise KeyError(f"no job spec field {name!r}")


def defaults() -> dict[str, Any]:
    """Field name → default, for every field with a literal default (the ones to agree on)."""
    found: dict[str, Any] = {}
    for section in SECTIONS:
        for f in fields(section):
            if f.default is not MISSING:
                found[f.name] = f.default
    return found


@dataclass(frozen=True)
class JobSpec:
    run_id: str
    entry: Entry = field(default_factory=lambda: Entry(command=("-m", RUNTIME_MODULE)))
    size: Size = field(default_factory=Size)
    data: Data = field(default_factory=Data)
    training: Training = field(default_factory=Training)
    etcd: EtcdSettings | None = None  # None: tests and tools that only need the key prefix
    launch: Launch = field(default_factory=Launch)
    policy: Policy = field(default_factory=Policy)

    @property
    def key_prefix(self) -> str:
        return self.etcd.key_prefix if self.etcd is not None else DEFAULT_KEY_PREFIX

    @property
    def run_prefix(self) -> str:
        return run_prefix_of(self.key_prefix, self.run_id)

    @property
    def scaling(self) -> ScalingPolicy:
        return ScalingPolicy(
            self.size.min_workers, self.size.max_workers, max_wait_s=self.policy.max_wait_s
        )

    @property
    def snapshot_dir(self) -> Path | None:
        return Path(self.training.snapshot_dir) if self.training.snapshot_dir else None

    def worker_argv(self) -> tuple[str, ...]:
        """What torchrun runs in every worker: the command, or the built-in runtime with the
        model definition. The training settings reach both in the workers' environment
        (``kfp_elastic/job_env.py``)."""
        if self.entry.command:
            return tuple(self.entry.command)
        return ("-m", RUNTIME_MODULE, "--model-def", self.entry.model_def)

    def worker_rdzv_conf(self) -> dict[str, str]:
        """The ``--rdzv-conf`` of every worker: ``launch.rdzv_conf``, and for the built-in runtime
        a ``warm_start_preload`` of the runtime, so that each restart forks a worker that has it
        imported already. Neither the model definition nor a command is preloaded: their
        top-level code would run once in the zygote, with the agent's environment instead of
        the worker's (``RANK``, ``LOCAL_RANK``, ...); a user who knows that theirs does not
        care adds it (or ``transformers``, ...) with ``warm_start_preload`` in ``rdzv_conf``,
        which is kept as it is."""
        conf = dict(self.launch.rdzv_conf)
        if not self.entry.command and "warm_start_preload" not in conf:
            conf["warm_start_preload"] = ":".join(RUNTIME_PRELOAD)
        # Workers started by a master stop on their own once it has been gone this long.
        conf[ORPHAN_CONF_KEY] = f"{self.policy.orphan_timeout_s:g}"
        # Their agents stop restarting in place once the job's failure budget is spent.
        conf[MAX_FAILURES_CONF_KEY] = str(self.policy.max_failures)
        return conf

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field at fault (with its flag and parameter), before
        anything starts."""
        if not self.run_id or "/" in self.run_id:
            raise field_error("run_id", f"must be non-empty and without '/', got {self.run_id!r}")
        entry, size, data, training = self.entry, self.size, self.data, self.training
        at_least = {
            "min_workers": (size.min_workers, 1),
            "nproc_per_worker": (size.nproc_per_worker, 1),
            "epochs": (data.epochs, 1),
            "batch_size": (training.batch_size, 1),
            "snapshot_every": (training.snapshot_every, 0),
            "step_time": (training.step_time, 0),
            "max_failures": (self.policy.max_failures, 0),
            "gpus": (self.launch.kubernetes.gpus, 0),
            "worker_max_restarts": (self.launch.worker_max_restarts, 0),
            "node_loss_toleration_s": (self.launch.kubernetes.node_loss_toleration_s, 0),
            "on_demand_price": (self.launch.kubernetes.on_demand_price, 0),
            "spot_price": (self.launch.kubernetes.spot_price, 0),
        }
        for name, (value, low) in at_least.items():
            if value < low:
                raise field_error(name, f"must be >= {low}, got {value}")
        if size.max_workers < size.min_workers:
            raise field_error(
                "max_workers", f"must be >= min_workers={size.min_workers}, got {size.max_workers}"
            )
        positive = {
            "learning_rate": training.learning_rate,
            "collective_timeout_s": training.collective_timeout_s,
            "collective_abort_s": training.collective_abort_s,
            "max_wait_s": self.policy.max_wait_s,
            "finish_grace_s": self.policy.finish_grace_s,
            "leader_ttl_s": self.policy.leader_ttl_s,
            "orphan_timeout_s": self.policy.orphan_timeout_s,
            "model_def_check_timeout_s": self.policy.model_def_check_timeout_s,
            "reconcile_interval_s": self.policy.reconcile_interval_s,
        }
        for name, number in positive.items():
            if number <= 0:
                raise field_error(name, f"must be > 0, got {number}")
        try:
            BatchPolicy.parse(training.batch_policy)
        except ValueError as error:
            raise field_error("batch_policy", str(error)) from None
        if training.nan_policy not in NAN_POLICIES:
            raise field_error(
                "nan_policy",
                f"must be one of {', '.join(NAN_POLICIES)}, got {training.nan_policy!r}",
            )
        if training.device not in DEVICES:
            raise field_error(
                "device", f"must be one of {', '.join(DEVICES)}, got {training.device!r}"
            )
        if self.launch.kind not in LAUNCHERS:
            raise field_error(
                "kind", f"must be one of {', '.join(LAUNCHERS)}, got {self.launch.kind!r}"
            )
        etcd_keys = sorted(set(self.launch.rdzv_conf) & {*ETCD_KEYS, "password"})
        if etcd_keys:
            raise field_error(
                "rdzv_conf",
                f"{etcd_keys}: give the etcd connection with the --etcd-* flags (or the "
                "KFP_ELASTIC_ETCD_* variables); the master hands it to every worker",
            )
        if ORPHAN_CONF_KEY in self.launch.rdzv_conf:
            raise field_error(
                "rdzv_conf",
                f"{ORPHAN_CONF_KEY}: give it as orphan_timeout_s (--orphan-timeout / "
                "orphan_timeout_s); the master hands it to every worker",
            )
        empty = sorted(key for key, value in self.launch.rdzv_conf.items() if str(value) == "")
        if empty:
            raise field_error("rdzv_conf", f"{empty} without a value: torchrun needs KEY=VALUE")
        try:  # what every agent would refuse, refused here once, before any worker starts
            RendezvousConfig.from_params(
                "127.0.0.1:2379", "check", 1, 1, None, self.worker_rdzv_conf(), env={}
            )
        except ConfigError as error:
            raise field_error("rdzv_conf", str(error)) from None
        self.launch.kubernetes.check_priority_classes()
        self.launch.kubernetes.check_ladder(self.policy.max_wait_s)
        queue = self.launch.kubernetes.kueue_queue
        if queue and not is_dns_label(queue):
            raise field_error(
                "kueue_queue",
                f"must name a Kueue LocalQueue: {DNS_LABEL_RULE}, got {queue!r}",
                KubernetesSettings,
            )
        if self.launch.kind == "kubernetes":
            self.worker_pod_gpus()  # a GPU count that does not fit the processes fails here
        quantities = ("cpu", "memory", "snapshot_buffer", "shm_size", "sharded_state")
        for name in quantities:  # here, not at the first pod
            quantity = getattr(self.launch.kubernetes, name)
            if not quantity:
                continue
            try:
                size = parse_quantity(quantity)
            except ValueError as error:
                raise field_error(name, str(error), KubernetesSettings) from None
            if size < 0:
                raise field_error(
                    name, f"must not be negative, got {quantity!r}", KubernetesSettings
                )
        capacity = self.launch.local.capacity
        if capacity is not None and capacity < 0:
            raise field_error("capacity", f"must be >= 0, got {capacity}")
        if bool(entry.model_def) == bool(entry.command):
            raise field_error(
                "model_def", "or a command (after -- / command): give exactly one of them", Entry
            )
        head = entry.command[0] if entry.command else ""
        if head in MODULE_FLAGS and len(entry.command) < 2:
            raise field_error("command", f"{head} needs a module name", Entry)
        if head.startswith("-") and head not in (*MODULE_FLAGS, "--no-python", "--no_python"):
            raise field_error(
                "command", f"must start with a script path or -m MODULE, got {head!r}", Entry
            )
        if entry.model_def and self.launch.kind == "kubernetes" and not training.snapshot_dir:
            raise field_error(
                "snapshot_dir",
                "is needed by the kubernetes launcher: a directory on a volume that every "
                "worker pod mounts (e.g. a ReadWriteMany PVC)",
            )
        if data.shard_manifest and data.dataset_length is not None:
            raise field_error("shard_manifest", "or dataset_length: give one, not both")
        if (data.shard_size is None) != (data.dataset_length is None) and not data.shard_manifest:
            raise field_error("dataset_length", "and shard_size go together")
        if self.etcd is not None:
            self.etcd.validate()  # ConfigError names the flag or variable
        self.manifest()  # a bad manifest fails here

    def worker_pod_gpus(self) -> int:
        """``nvidia.com/gpu`` of each worker pod: ``gpus`` when given, else one per process
        when the built-in runtime computes on CUDA (``--device cuda``). The built-in runtime
        gives each process ``LOCAL_RANK``'s GPU, so a pod with another count than its
        processes is refused (``ValueError``): fewer would put two ranks on one GPU (NCCL
        refuses), more would leave GPUs idle."""
        gpus, nproc = self.launch.kubernetes.gpus, self.size.nproc_per_worker
        if not self.entry.model_def or self.training.device == "cpu":
            return gpus
        if gpus == 0:
            return nproc if self.training.device == "cuda" else 0
        if gpus != nproc:
            raise field_error(
                "gpus",
                f"is {gpus} GPUs per pod but nproc_per_worker is {nproc} processes: the built-in "
                "runtime uses one GPU per process (leave gpus at 0 to get one per process)",
            )
        return gpus

    def worker_shm_size(self) -> str | None:
        """``/dev/shm`` of each worker pod: ``shm_size``, else ``DEFAULT_SHM_PER_PROCESS`` per
        process for pods with several (their ranks talk through shared memory; the runtime's
        64 MiB makes NCCL fail), else none of our own; plus, for a sharded model
        (``sharded_state``), what its processes keep of it there
        (``contract/sharded_memory.py``)."""
        k8s = self.launch.kubernetes
        nproc = self.size.nproc_per_worker
        base = k8s.shm_size
        if not base and nproc > 1:
            number, unit = DEFAULT_SHM_PER_PROCESS[:-2], DEFAULT_SHM_PER_PROCESS[-2:]
            base = f"{int(number) * nproc}{unit}"
        if not k8s.sharded_state:
            return base or None
        ranks = self.size.min_workers * nproc
        shards = nproc * host_memory_per_process(int(parse_quantity(k8s.sharded_state)), ranks)
        return format_quantity(int(parse_quantity(base or "0")) + shards)

    def manifest(self) -> Manifest | None:
        """The shard manifest the master publishes (None: the workers plan their own)."""
        data = self.data
        if data.shard_manifest:
            try:
                document = json.loads(Path(data.shard_manifest).read_text())
                shards = [Shard(*map(int, row)) for row in document["shards"]]
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise field_error("shard_manifest", f"{data.shard_manifest}: {error}") from error
            return manifest_from_shards(shards, data.epochs, data.seed, data.shuffle)
        if data.dataset_length is not None and data.shard_size is not None:
            shards = shards_for_length(data.dataset_length, data.shard_size)
            return manifest_from_shards(shards, data.epochs, data.seed, data.shuffle)
        return None

    def to_record(self) -> dict[str, Any]:
        """The spec as JSON values, for the master's record in etcd: the etcd connection only
        as the variables a child gets (files, never a password)."""
        record = asdict(replace(self, etcd=None))
        etcd = self.etcd
        record["etcd"] = etcd and {
            "endpoints": etcd.endpoint_text,
            "key_prefix": etcd.key_prefix,
            "tls": etcd.uses_tls,
            "user": etcd.user,
        }
        return json.loads(json.dumps(record))


def spec_from_params(params: Mapping[str, Any], **values: Any) -> JobSpec:
    """The job a KFP component's parameters describe: ``params`` by parameter name
    (``worker_cpu``, ``max_wait_s``, ...; each must be one of the contract's), ``values`` by
    field name for what the component works out itself (``run_id``, ``etcd``, ``kind``,
    ``workdir``, ``pod_overrides``, ...). Nothing is validated here: ``validate()`` does it."""
    by_param = {
        param_of(f.name, section): (section, f.name)
        for section in SECTIONS
        for f in fields(section)
        if "help" in f.metadata and param_of(f.name, section)
    }
    unknown = sorted(set(params) - set(by_param))
    if unknown:
        raise ValueError(f"not parameters of the job contract: {', '.join(unknown)}")
    given: dict[type, dict[str, Any]] = {section: {} for section in SECTIONS}
    for param, value in params.items():
        section, name = by_param[param]
        given[section][name] = value
    top = {f.name for f in fields(JobSpec)}
    for name, value in values.items():
        if name in top:
            continue
        section = next((s for s in SECTIONS if name in {f.name for f in fields(s)}), None)
        if section is None:
            raise ValueError(f"no job spec field {name!r}")
        given[section][name] = value

    def build(section: type, **more: Any) -> Any:
        return section(**given[section], **more)

    return JobSpec(
        entry=build(Entry),
        size=build(Size),
        data=build(Data),
        training=build(Training),
        launch=build(Launch, local=build(LocalSettings), kubernetes=build(KubernetesSettings)),
        policy=build(Policy),
        **{name: value for name, value in values.items() if name in top},
    )
