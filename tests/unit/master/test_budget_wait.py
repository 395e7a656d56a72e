"""While the failure budget is exceeded by a peer's account of the last failure, the master waits
for the failing rank's own account before it fails the job (``failure_budget.FailureBudget``):
in that wait it starts nothing, since a replacement would join a round that fails again and
add a count the job's result then reports."""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Iterator

from pyetcd.client import MultiEndpointEtcd3Client

from kfp_elastic.contract.failure_budget import SOURCE_AGENT, CountedFailure, record_failure
from kfp_elastic.job_spec import Entry, JobSpec, Policy, Size
from kfp_elastic.master.job import ElasticJob, JobResult
from kfp_elastic.master.launcher import (
    Launcher,
    Reason,
    WorkerEvent,
    WorkerHandle,
    WorkerPhase,
    WorkerStatus,
)
from kfp_elastic.master.state import MasterState
from tests.helpers import wait_for

WORKER_FIELDS = [f.name for f in dataclasses.fields(WorkerStatus)]


class ScriptedLauncher(Launcher):
    """Workers that run as soon as they are launched; a test ends them by hand."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerStatus] = {}
        self.lock = threading.Lock()
        self.changes: queue.Queue[WorkerStatus] = queue.Queue()

    def _set(self, status: WorkerStatus) -> None:
        self.workers[status.name] = status
        self.changes.put(status)

    def launch(self, worker_index: int) -> WorkerHandle:
        with self.lock:
            attempt = sum(1 for w in self.workers.values() if w.worker_index == worker_index)
            name = f"worker-{worker_index}-{attempt}"
            self._set(
                WorkerStatus(name, WorkerPhase.RUNNING, worker_index=worker_index, attempt=attempt)
            )
        return WorkerHandle(name, worker_index, attempt)

    def end(self, name: str, reason: Reason) -> None:
        with self.lock:
            old = self.workers[name]
            self._set(
                WorkerStatus(
                    name, WorkerPhase.FAILED, reason, worker_index=old.worker_index, attempt=0
                )
            )

    def delete(self, name: str) -> None:
        with self.lock:
            old = self.workers.get(name)
            if old is not None and not old.ended:
                self._set(
                    WorkerStatus(
                        name, WorkerPhase.DELETED, Reason.DELETED, worker_index=old.worker_index
                    )
                )

    def list_workers(self) -> list[WorkerStatus]:
        with self.lock:
            return list(self.workers.values())

    def events(self, stop: threading.Event) -> Iterator[WorkerEvent]:
        while not stop.is_set():
            try:
                status = self.changes.get(timeout=0.05)
            except queue.Empty:
                continue
            yield WorkerEvent(**{f: getattr(status, f) for f in WORKER_FIELDS})


def _account(own: bool) -> CountedFailure:
    return CountedFailure(
        incident="round-1-1",
        source=SOURCE_AGENT,
        error="RuntimeError: boom (rank 1)" if own else "DistBackendError: Connection closed",
        worker="worker-1-0" if own else "worker-0-0",
        rank=1 if own else 0,
        round=1,
        own_error=own,
        peers_error=not own,
    )


def test_nothing_starts_while_the_budget_waits_for_the_failing_ranks_own_account(
    client: MultiEndpointEtcd3Client, run_id: str
) -> None:
    spec = JobSpec(
        run_id=run_id,
        size=Size(min_workers=1, max_workers=2),
        entry=Entry(command=("train.py",)),
        policy=Policy(max_failures=0, leader_ttl_s=30, reconcile_interval_s=0.05),
    )
    launcher = ScriptedLauncher()

    def make(state: MasterState) -> Launcher:
        return launcher

    job = ElasticJob(spec, client, make)
    results: list[JobResult] = []
    thread = threading.Thread(target=lambda: results.append(job.run()))
    thread.start()
    try:
        wait_for(lambda: len(launcher.workers) == 2, 30, 0.05, "two workers launched")
        # The peer's account spends the budget (0 tolerated); worker-1-0 has gone meanwhile, so
        # its slot is free, and worker-0-0 still runs: the master waits for the own account.
        record_failure(client, spec.run_prefix, _account(own=False))
        launcher.end("worker-1-0", Reason.PREEMPTED)
        stop = threading.Event()
        stop.wait(1.0)  # twenty reconciles
        assert sorted(launcher.workers) == ["worker-0-0", "worker-1-0"], launcher.workers
        assert not results  # still waiting (OWN_ACCOUNT_WAIT_S)
        record_failure(client, spec.run_prefix, _account(own=True))
        thread.join(30)
    finally:
        job.request_stop(cancel=True)
        thread.join(30)
    assert [r.state for r in results] == ["failed"], results
    message = results[0].message
    assert message.startswith("1 worker failure exceed --max-failures=0; last: worker-1-0: ")
    assert "RuntimeError: boom" in message
    assert sorted(launcher.workers) == ["worker-0-0", "worker-1-0"]
