"""KFP component: run one elastic DDP job (the master + its workers) and report on it."""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import HTML, Dataset, Input, Metrics, Model, Output

from kfp_elastic.components import BASE_IMAGE

# Forwarded from the task (kfp-kubernetes settings) to the worker pods the master creates.
# Volumes also apply to this task's own pod: it reads the final model from the shared volume.
PASSTHROUGHS = [
    dsl.TaskConfigField.KUBERNETES_TOLERATIONS,
    dsl.TaskConfigField.KUBERNETES_NODE_SELECTOR,
    dsl.TaskConfigField.KUBERNETES_AFFINITY,
    dsl.TaskConfigPassthrough(field=dsl.TaskConfigField.KUBERNETES_VOLUMES, apply_to_task=True),
]


@dsl.component(
    base_image=BASE_IMAGE, install_kfp_package=False, task_config_passthroughs=PASSTHROUGHS
)
def elastic_train(
    shard_manifest: Input[Dataset],
    model: Output[Model],
    metrics: Output[Metrics],
    report: Output[HTML],
    task_config: dsl.TaskConfig,
    model_def: str = "kfp_elastic.worker.examples.digits",
    command: str = "",
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
    seed: int = 0,
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
    service_account: str = "",
    namespace: str = "",
    worker_cpu: str = "",
    worker_memory: str = "",
    worker_gpus: int = 0,
    worker_snapshot_buffer: str = "",
    worker_shm_size: str = "",
    worker_sharded_state: str = "",
    snapshot_dir: str = "",
    inject_faults: str = "",
    max_wait_s: float = 600.0,
    max_failures: int = 3,
    orphan_timeout_s: float = 300.0,
    model_def_check_timeout_s: float = 300.0,
    on_demand_price: float = 0.0,
    spot_price: float = 0.0,
    run_id: str = "",
    log_level: str = "WARNING",
    dry_run: bool = False,
) -> NamedTuple(
    "Outputs", [("final_loss", float), ("steps", int), ("restarts", int), ("goodput", float)]
):
    """Train ``model_def`` on the shards of ``shard_manifest`` with min..max elastic workers.

    The master runs in this task: under kfp.local (or ``launcher="local"``) the workers are
    local torchrun processes and etcd is embedded unless ``etcd_endpoint`` is given; in a
    cluster (``launcher="auto"`` inside a pod) they are pods below the default priority that
    the master replaces when they are preempted: workers 0..min_workers-1 guaranteed (they may
    preempt other jobs' opportunistic workers), the others opportunistic (never preempt).
    Settings not given fall back to the ``kfp-elastic-config`` ConfigMap's variables when the
    pipeline maps them into the task.

    Args:
        shard_manifest: the output of ``shard_dataset``.
        model: the final weights (``state_dict`` of ``model_def.model()``, ``torch.save``).
        metrics: final_loss, steps, restarts, lost_steps, goodput and more (docs/pipelines.md).
        report: HTML page: what it costs, world size over time, loss curve, restarts and
            their causes.
        task_config: filled by KFP from the task's Kubernetes settings (tolerations, node
            selector, affinity, volumes); they are applied to the worker pods.
        model_def: module with model(), loss(model, batch), dataset(split).
        command: your own training script instead of ``model_def``: ``"-m pkg.train ARGS"``
            or ``"/app/train.py ARGS"`` (in the worker image), run under torchrun with the
            job's settings in its environment (docs/runtime.md, "Bring your own script").
            Given, it replaces the default ``model_def``. Rank 0 writes the final model to
            ``$KFP_ELASTIC_OUTPUT`` (``kfp_elastic.worker.elastic`` does it).
        min_workers: fewest workers to train with; max_workers: most.
        nproc_per_worker: processes per worker (GPUs per pod).
        batch_policy: fixed-global-batch | linear | sqrt (how a world size change scales).
        snapshot_every: steps between snapshots (and commits of the data position); 0 =
            auto: as often as 1 % of training time allows.
        step_time: minimum seconds per step (slows a tiny demo down so faults land mid-run).
        nan_policy: fail | skip: a NaN/inf training loss fails the job (its error names the
            step and rank) or skips that step.
        launcher: auto | local | kubernetes.
        etcd_endpoint: HOST:PORT[,...]; empty: $KFP_ELASTIC_ETCD_ENDPOINTS, else embedded.
            TLS files, user and password file come from the KFP_ELASTIC_ETCD_* variables
            (docs/security.md); the workers get the same settings.
        image: worker image (default $KFP_ELASTIC_WORKER_IMAGE, else this component's image).
        guaranteed_priority_class: PriorityClass of workers 0..min_workers-1; empty:
            $KFP_ELASTIC_WORKER_GUARANTEED_PRIORITY_CLASS, else kfp-elastic-worker-guaranteed.
        opportunistic_priority_class: PriorityClass of the other workers; empty:
            $KFP_ELASTIC_WORKER_OPPORTUNISTIC_PRIORITY_CLASS, else
            kfp-elastic-worker-opportunistic.
        priority_class: one PriorityClass for every worker instead (no tiers); not together
            with the two above.
        kueue_queue: a Kueue LocalQueue (e.g. ``kfp-elastic`` from manifests/kueue): each
            worker pod is submitted to it as a workload of its own, with the
            WorkloadPriorityClass named as its tier's PriorityClass; empty: no Kueue
            (docs/master.md, "Kueue users").
        ladder_priority_classes: the least-attained-service ladder's PriorityClasses for
            workers 0..min_workers-1, comma-separated, level 0 first (e.g.
            ``kfp-elastic-worker-level-0,kfp-elastic-worker-level-1,kfp-elastic-worker-level-2``
            from manifests/base); empty: no ladder. With ``ladder_thresholds_gpu_h`` (attained
            GPU-hours at which a job leaves each level but the last), ``ladder_starvation_s``
            and ``ladder_min_move_interval_s``; the classes' values are checked before any
            worker starts, and the master re-creates the guaranteed workers in each level's
            class as the job's GPU time grows (docs/scheduling.md, "Least-attained-service
            ladder").
        worker_snapshot_buffer: the training state's size (parameters + optimizer state),
            a Kubernetes quantity such as ``"9Gi"``: each training process pins one host
            buffer of it for GPU snapshots and rescues, and the master adds it, times the
            processes per pod, to each worker pod's memory request and limit (only when
            ``worker_memory`` is given); empty: nothing added (docs/runtime.md, Devices).
        worker_shm_size: memory-backed ``/dev/shm`` per worker pod, e.g. ``"8Gi"`` (NCCL and
            DataLoader workers use it; its contents count as the pod's memory, so the master
            adds it to the memory request and limit when ``worker_memory`` is given); empty:
            1Gi per process when a pod has several, else the container runtime's 64Mi.
        worker_sharded_state: a sharded (FSDP2) model's state size (parameters + optimizer
            state, e.g. ``"12Gi"``): each worker pod's ``/dev/shm`` and memory grow by what its
            processes keep in host memory (4 x size / (min_workers x nproc_per_worker) each).
        snapshot_dir: shared directory for snapshots; empty: the task's first mounted volume
            (cluster) or a local directory next to the outputs.
        inject_faults: e.g. ``preempt:worker-1@step10,kill:worker-0@40s`` (demos, tests).
        max_wait_s: seconds below min_workers before the job fails.
        max_failures: worker failures the job tolerates, counted once each across
            in-place restarts and replaced workers; one more fails the job (preemptions do
            not count; a NaN loss under nan_policy fail fails it at once).
        orphan_timeout_s: seconds the workers go on without a master (the run terminated,
            the task's pod gone and not retried) before they snapshot and stop on their own;
            longer than a KFP retry of this task takes to start (docs/master.md).
        model_def_check_timeout_s: seconds the check of the model definition (it loads the
            model and its dataset once, before any worker starts) may take; raise it for a
            dataset whose first load is slower.
        on_demand_price: price per worker slot-hour (one pod) on on-demand nodes: what
            guaranteed workers cost, and the fixed-size job the report compares with; 0:
            $KFP_ELASTIC_ON_DEMAND_PRICE, else no cost shown (slot-hours only).
        spot_price: price per worker slot-hour on spot nodes: what opportunistic workers cost;
            0: $KFP_ELASTIC_SPOT_PRICE, else the on-demand price.
        run_id: names the job in etcd and its pods; the pipeline passes the KFP run id.
        log_level: level of the master's own logs (progress lines are always printed).
        dry_run: print the launch plan (etcd mode, signal policy, the worker pods as YAML or
            the local processes' commands) into the log and the report, start nothing, and
            return zeros (docs/master.md, "Launch plan").
    """
    import os
    from collections import namedtuple

    from kfp_elastic.components.common import normalize_run_id
    from kfp_elastic.components.elastic_train import run_job
    from kfp_elastic.components.elastic_train.report import render
    from kfp_elastic.components.elastic_train.summary import summarize
    from kfp_elastic.master.cost import SlotUsage

    run_job.quiet_logs(log_level)
    rid = normalize_run_id(run_id)
    mounts = list(task_config.volume_mounts or []) if task_config else []
    overrides = {
        "tolerations": task_config.tolerations if task_config else None,
        "node_selector": task_config.node_selector if task_config else None,
        "affinity": task_config.affinity if task_config else None,
        "volumes": task_config.volumes if task_config else None,
        "volume_mounts": mounts,
    }
    if not snapshot_dir and mounts:
        snapshot_dir = os.path.join(mounts[0]["mountPath"], "snapshots")
    spec = run_job.job_spec(
        {
            "model_def": model_def,
            "command": command,
            "shard_manifest": shard_manifest.path,
            "min_workers": min_workers,
            "max_workers": max_workers,
            "nproc_per_worker": nproc_per_worker,
            "epochs": epochs,
            "batch_size": batch_size,
            "learning_rate": learning_rate,
            "batch_policy": batch_policy,
            "snapshot_every": snapshot_every,
            "step_time": step_time,
            "nan_policy": nan_policy,
            "seed": seed,
            "image": image,
            "priority_class": priority_class,
            "guaranteed_priority_class": guaranteed_priority_class,
            "opportunistic_priority_class": opportunistic_priority_class,
            "kueue_queue": kueue_queue,
            "ladder_priority_classes": ladder_priority_classes,
            "ladder_thresholds_gpu_h": ladder_thresholds_gpu_h,
            "ladder_starvation_s": ladder_starvation_s,
            "ladder_min_move_interval_s": ladder_min_move_interval_s,
            "service_account": service_account,
            "namespace": namespace,
            "worker_cpu": worker_cpu,
            "worker_memory": worker_memory,
            "worker_gpus": worker_gpus,
            "worker_snapshot_buffer": worker_snapshot_buffer,
            "worker_shm_size": worker_shm_size,
            "worker_sharded_state": worker_sharded_state,
            "max_wait_s": max_wait_s,
            "max_failures": max_failures,
            "orphan_timeout_s": orphan_timeout_s,
            "model_def_check_timeout_s": model_def_check_timeout_s,
            "on_demand_price": on_demand_price,
            "spot_price": spot_price,
        },
        run_id=rid,
        launcher=launcher,
        etcd_endpoint=etcd_endpoint,
        snapshot_dir=snapshot_dir,
        workdir=os.path.join(os.path.dirname(report.path), "job"),
        pod_overrides=overrides,
    )
    kind = spec.launch.kind
    what = f"command {command}" if spec.entry.command else f"model {model_def}"
    print(
        f"elastic_train: run {rid}, {min_workers}..{max_workers} workers, launcher {kind}, " + what,
        flush=True,
    )
    outputs = namedtuple("Outputs", ["final_loss", "steps", "restarts", "goodput"])
    if dry_run:
        text = run_job.plan_job(spec, inject_faults)[0].describe()
        print(text, flush=True)
        with open(report.path, "w") as stream:
            stream.write(run_job.plan_page(rid, text))
        return outputs(0.0, 0, 0, 0.0)
    result = run_job.run(spec, inject_faults, say=lambda line: print(line, flush=True))
    prices = result.prices
    summary = summarize(
        result.events,
        result.end_t,
        [(i.t, i.fault.action, i.target) for i in result.injected],
        prices=prices,
        usage=SlotUsage(min_workers, max_workers, nproc_per_worker),
    )
    start = result.events[0].t if result.events else result.end_t
    settings = {
        "run_id": rid,
        "model_def": spec.entry.model_def or "-",
        "command": command or "-",
        "workers": f"{min_workers}..{max_workers}",
        "nproc_per_worker": nproc_per_worker,
        "epochs": epochs,
        "batch_size": batch_size,
        "batch_policy": batch_policy,
        "snapshot_every": snapshot_every,
        "launcher": kind,
        "inject_faults": inject_faults or "-",
        "prices per slot-hour": f"on-demand {prices.on_demand:g}, spot {prices.spot:g}"
        if prices.given
        else "-",
    }
    local = kind == "local"
    with open(report.path, "w") as stream:
        stream.write(
            render(
                summary,
                title=f"Elastic training {rid}",
                settings=settings,
                injected=[(i.t - start, i.fault.text, i.target) for i in result.injected],
                log_dir=str(result.workdir / "workers") if local else "",
                prices=prices,
            )
        )
    for name, value in summary.metrics().items():
        metrics.log_metric(name, value)
    print(
        "elastic_train: " + ", ".join(f"{k}={v}" for k, v in summary.metrics().items()), flush=True
    )
    if result.state != "succeeded":
        where = f"; worker logs in {result.workdir / 'workers'}" if local else ""
        raise RuntimeError(f"elastic training {rid} {result.state}: {result.message}{where}")
    run_job.export_model(result, model.path)
    model.metadata.update(
        {
            "model_def": spec.entry.model_def,
            "command": command,
            "framework": "pytorch",
            "format": "state_dict",
            "run_id": rid,
            "steps": summary.steps,
        }
    )
    return outputs(summary.final_loss, summary.steps, summary.restarts, summary.goodput)
