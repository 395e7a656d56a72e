"""The pipeline: shard the dataset → elastic training → evaluation, with an exit handler.

Compiled into ``pipelines/elastic_training.yaml`` (``kfp-elastic compile``) for upload
to the KFP UI; ``kfp-elastic run-local`` runs it on this machine through kfp.local, built by the
same :func:`build_pipeline` without task retries (``LOCAL_TRAIN_RETRIES``).
"""

from kfp import dsl, kubernetes
from kfp.dsl.graph_component import GraphComponent

from kfp_elastic.components.elastic_train.component import elastic_train
from kfp_elastic.components.evaluate.component import evaluate
from kfp_elastic.components.shard_dataset.component import shard_dataset
from kfp_elastic.components.stop_workers.component import stop_workers
from kfp_elastic.etcd.settings import ENV_VARS as ETCD_ENV
from kfp_elastic.job_spec import KUBERNETES_ENV_VARS
from kfp_elastic.master.pod_spec_checks import (
    ETCD_AUTH_MOUNT,
    ETCD_TLS_MOUNT,
    MASTER_POD_LABELS,
)

# Where the snapshot PVC is mounted in the elastic_train pod (and, forwarded through
# dsl.TaskConfig, in every worker pod): snapshots and the final model live there.
SNAPSHOT_MOUNT = "/mnt/kfp-elastic"
# Made by manifests/base (kustomize): the etcd settings (KFP_ELASTIC_ETCD_*), the Secrets
# worker pods mount for etcd, worker image, priority class, ... (missing keys are left unset).
CONFIG_MAP = "kfp-elastic-config"
CONFIG_ENV = (*ETCD_ENV, *KUBERNETES_ENV_VARS)
# The master (the elastic_train task) mounts the same etcd Secrets as its worker pods, at the
# same paths, so the ConfigMap's KFP_ELASTIC_ETCD_CACERT/... name files in both. Optional: a
# plain-HTTP etcd without auth needs neither.
ETCD_TLS_SECRET = "kfp-elastic-etcd-client-tls"
ETCD_PASSWORD_SECRET = "kfp-elastic-etcd-password"
# KFP retries of the training task (the master): a preempted, evicted or crashed task pod is
# started again and the new master adopts the running workers (the job's state is in etcd); the
# retry of a run that already ended returns its recorded result at once, so a deterministic
# failure costs a few seconds per retry, never a re-run. Constants: KFP takes no pipeline
# parameter here. kfp.local runs with LOCAL_TRAIN_RETRIES: its embedded etcd dies with the task,
# so a retry there could only start the job over.
TRAIN_RETRIES = 3
TRAIN_RETRY_BACKOFF = "5s"  # then x2 per retry, at most TRAIN_RETRY_BACKOFF_MAX
TRAIN_RETRY_BACKOFF_MAX = "60s"
LOCAL_TRAIN_RETRIES = 0


def use_etcd(task: dsl.PipelineTask, env: tuple[str, ...]) -> None:
    """What a task needs to reach the cluster's etcd (cluster-only: kfp.local ignores it): the
    ConfigMap's ``env`` keys, the etcd client Secrets at the paths the ConfigMap names, and the
    labels the NetworkPolicy in manifests/base admits to etcd's client port."""
    kubernetes.use_config_map_as_env(task, CONFIG_MAP, {k: k for k in env}, optional=True)
    kubernetes.use_secret_as_volume(task, ETCD_TLS_SECRET, mount_path=ETCD_TLS_MOUNT, optional=True)
    kubernetes.use_secret_as_volume(
        task, ETCD_PASSWORD_SECRET, mount_path=ETCD_AUTH_MOUNT, optional=True
    )
    for key, value in MASTER_POD_LABELS.items():
        kubernetes.add_pod_label(task, key, value)


def build_pipeline(train_retries: int = TRAIN_RETRIES) -> GraphComponent:
    """The pipeline, with ``train_retries`` KFP retries of the training task."""

    @dsl.pipeline(
        name="elastic-training",
        description="Elastic, preemption-proof PyTorch DDP training: shard the dataset, train "
        "with min..max workers that are replaced when preempted, evaluate the model.",
    )
    def elastic_training(
        model_def: str = "kfp_elastic.worker.examples.digits",
        dataset: str = "",
        num_shards: int = 16,
        min_workers: int = 1,
        max_workers: int = 2,
        nproc_per_worker: int = 1,
        epochs: int = 1,
        batch_size: int = 32,
        learning_rate: float = 0.1,
        batch_policy: str = "fixed-global-batch",
        snapshot_every: int = 0,
        step_time: float = 0.0,
        nan_policy: str = "fail",
        launcher: str = "auto",
        etcd_endpoint: str = "",
        image: str = "",
        priority_class: str = "",
        guaranteed_priority_class: str = "",
        opportunistic_priority_class: str = "",
        kueue_queue: str = "",
        ladder_priority_classes: str = "",
        ladder_thresholds_gpu_h: str = "1,10",
        ladder_starvation_s: float = 300.0,
        ladder_min_move_interval_s: float = 120.0,
        worker_cpu: str = "",
        worker_memory: str = "",
        worker_gpus: int = 0,
        worker_snapshot_buffer: str = "",
        worker_shm_size: str = "",
        worker_sharded_state: str = "",
        snapshot_pvc: str = "kfp-elastic-snapshots",
        inject_faults: str = "",
        max_wait_s: float = 600.0,
        max_failures: int = 3,
        orphan_timeout_s: float = 300.0,
        model_def_check_timeout_s: float = 300.0,
        on_demand_price: float = 0.0,
        spot_price: float = 0.0,
    ) -> None:
        """Shard the dataset, train with min..max elastic workers, evaluate the model.

        Args:
            image: the worker pods' image; empty: the kfp-elastic-config ConfigMap's
                KFP_ELASTIC_WORKER_IMAGE (kfp-elastic-worker:0.1.0 in manifests/base), else
                kfp-elastic-worker:0.1.0. Set either without recompiling the pipeline.
            guaranteed_priority_class: PriorityClass of workers 0..min_workers-1 (they may
                preempt other jobs' opportunistic workers); empty: the ConfigMap's
                KFP_ELASTIC_WORKER_GUARANTEED_PRIORITY_CLASS, else kfp-elastic-worker-guaranteed.
            opportunistic_priority_class: PriorityClass of the other workers (never preempt);
                empty: the ConfigMap's KFP_ELASTIC_WORKER_OPPORTUNISTIC_PRIORITY_CLASS, else
                kfp-elastic-worker-opportunistic.
            priority_class: one PriorityClass for every worker instead (no tiers); not
                together with the two above.
            kueue_queue: a Kueue LocalQueue (manifests/kueue: kfp-elastic) the worker pods
                are submitted to, one workload each, with their tier's WorkloadPriorityClass;
                empty: no Kueue.
            ladder_priority_classes: the least-attained-service ladder's PriorityClasses for
                workers 0..min_workers-1, level 0 first (manifests/base has
                kfp-elastic-worker-level-0,kfp-elastic-worker-level-1,kfp-elastic-worker-level-2);
                not together with the two classes above; empty: no ladder. The job moves down
                as its GPU-hours pass ladder_thresholds_gpu_h, back to level 0 after
                ladder_starvation_s below min_workers, at most one move per
                ladder_min_move_interval_s (docs/scheduling.md, "Least-attained-service ladder").
            worker_snapshot_buffer: the training state's size (e.g. "9Gi"): each process pins
                one host buffer of it for GPU snapshots; added, times the processes per pod, to
                each worker pod's memory request and limit when worker_memory is given.
            worker_shm_size: /dev/shm per worker pod, added to its memory request and limit
                when worker_memory is given; empty: 1Gi per process when a pod has several,
                else the container runtime's 64Mi.
            worker_sharded_state: a sharded (FSDP2) model's state size (e.g. "12Gi"): added to
                each worker pod's /dev/shm and memory as its processes keep it in host memory.
            on_demand_price: price per worker slot-hour on on-demand nodes (guaranteed
                workers, and the fixed-size job the report compares with); 0: the ConfigMap's
                KFP_ELASTIC_ON_DEMAND_PRICE, else no cost shown.
            spot_price: price per worker slot-hour on spot nodes (opportunistic workers); 0:
                the ConfigMap's KFP_ELASTIC_SPOT_PRICE, else the on-demand price.
        """
        run_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER
        cleanup = stop_workers(run_id=run_id, launcher=launcher)
        cleanup.set_display_name("stop leftover workers")
        cleanup.set_caching_options(False)
        use_etcd(cleanup, ETCD_ENV)  # it deletes the run's etcd keys at the end
        with dsl.ExitHandler(cleanup, name="elastic-training-job"):
            shards = shard_dataset(dataset=dataset, model_def=model_def, num_shards=num_shards)
            shards.set_display_name("shard dataset")

            train = elastic_train(
                shard_manifest=shards.outputs["manifest"],
                model_def=model_def,
                min_workers=min_workers,
                max_workers=max_workers,
                nproc_per_worker=nproc_per_worker,
                epochs=epochs,
                batch_size=batch_size,
                learning_rate=learning_rate,
                batch_policy=batch_policy,
                snapshot_every=snapshot_every,
                step_time=step_time,
                nan_policy=nan_policy,
                launcher=launcher,
                etcd_endpoint=etcd_endpoint,
                image=image,
                priority_class=priority_class,
                guaranteed_priority_class=guaranteed_priority_class,
                opportunistic_priority_class=opportunistic_priority_class,
                kueue_queue=kueue_queue,
                ladder_priority_classes=ladder_priority_classes,
                ladder_thresholds_gpu_h=ladder_thresholds_gpu_h,
                ladder_starvation_s=ladder_starvation_s,
                ladder_min_move_interval_s=ladder_min_move_interval_s,
                worker_cpu=worker_cpu,
                worker_memory=worker_memory,
                worker_gpus=worker_gpus,
                worker_snapshot_buffer=worker_snapshot_buffer,
                worker_shm_size=worker_shm_size,
                worker_sharded_state=worker_sharded_state,
                inject_faults=inject_faults,
                max_wait_s=max_wait_s,
                max_failures=max_failures,
                orphan_timeout_s=orphan_timeout_s,
                model_def_check_timeout_s=model_def_check_timeout_s,
                on_demand_price=on_demand_price,
                spot_price=spot_price,
                run_id=run_id,
            )
            train.set_display_name("elastic training")
            train.set_caching_options(False)  # it starts workers and may inject faults
            if train_retries:
                train.set_retry(
                    num_retries=train_retries,
                    backoff_duration=TRAIN_RETRY_BACKOFF,
                    backoff_factor=2.0,
                    backoff_max_duration=TRAIN_RETRY_BACKOFF_MAX,
                )
            # Cluster-only settings (kfp.local ignores them):
            kubernetes.mount_pvc(train, pvc_name=snapshot_pvc, mount_path=SNAPSHOT_MOUNT)
            use_etcd(train, CONFIG_ENV)
            # No ownerReference from the worker pods to this task's pod: a KFP retry (or a preempted
            # task pod) starts a new master that adopts the running workers by their run-id label;
            # the run's end and the exit handler (stop_workers) delete them.
            # Forwarded to the worker pods (dsl.TaskConfig): workers may land on GPU nodes.
            kubernetes.add_toleration(
                train, key="nvidia.com/gpu", operator="Exists", effect="NoSchedule"
            )

            scores = evaluate(model=train.outputs["model"], model_def=model_def)
            scores.set_display_name("evaluate")

    return elastic_training


elastic_training = build_pipeline()


def local_pipeline() -> GraphComponent:
    """The pipeline as kfp.local runs it (``kfp-elastic run-local``, the tests)."""
    return build_pipeline(LOCAL_TRAIN_RETRIES)
