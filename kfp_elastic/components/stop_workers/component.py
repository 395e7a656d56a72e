"""KFP component (exit handler): stop every worker a run may have left behind."""

from kfp import dsl

from kfp_elastic.components import BASE_IMAGE


@dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)
def stop_workers(
    status: dsl.PipelineTaskFinalStatus,
    run_id: str = "",
    launcher: str = "auto",
    namespace: str = "",
) -> str:
    """Delete the run's worker pods (cluster) or kill its worker processes (local), then the
    run's keys in etcd.

    ``elastic_train`` stops its workers when it ends normally, but when its pod is deleted
    (run cancelled, master pod preempted) the master steps down and leaves them running for a
    successor; as the pipeline's exit handler this task makes sure none outlives the run. The
    run's etcd keys (master state, timeline, progress, shard queues) are kept for KFP retries of
    the training task; once the pipeline has ended, this task deletes them (the report and
    metrics artifacts keep what they showed), so finished runs do not fill etcd's quota.

    Args:
        status: the final status of the pipeline's tasks (KFP fills it in).
        run_id: the run id given to ``elastic_train``.
        launcher: auto | local | kubernetes, as given to ``elastic_train``.
        namespace: where the worker pods are (default: this pod's namespace).

    Returns:
        What was stopped, one line.
    """
    from kfp_elastic.components.common import (
        delete_run_pods,
        forget_run,
        in_cluster,
        normalize_run_id,
        reap_local_processes,
    )

    if not run_id.strip():
        print("stop_workers: no run_id given, nothing to stop", flush=True)
        return "nothing stopped"
    rid = normalize_run_id(run_id)
    print(
        f"stop_workers: pipeline {status.state}"
        + (f" ({status.error_message})" if status.error_message else "")
        + f", run {rid}",
        flush=True,
    )
    kubernetes = launcher == "kubernetes" or (launcher == "auto" and in_cluster())
    if kubernetes:
        try:
            pods = delete_run_pods(rid, namespace)
        except Exception as error:  # noqa: BLE001 - an exit handler reports, never fails
            line = f"could not delete the worker pods of {rid}: {error!r}"
        else:
            line = f"deleted {len(pods)} worker pods of {rid}: {', '.join(pods) or '-'}"
    else:
        pids = reap_local_processes(rid)
        line = f"stopped {len(pids)} worker processes of {rid}"
    print(f"stop_workers: {line}", flush=True)
    try:
        forgotten = forget_run(rid)
    except Exception as error:  # noqa: BLE001 - an exit handler reports, never fails
        print(f"stop_workers: could not delete the etcd keys of {rid}: {error!r}", flush=True)
    else:
        if forgotten is not None:
            print(f"stop_workers: deleted {forgotten} etcd keys of {rid}", flush=True)
    return line
