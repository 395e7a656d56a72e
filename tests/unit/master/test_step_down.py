"""The master's step-down (SIGTERM, or its pod being deleted: master/own_pod.py): it records the
hand-over on the timeline and releases the leadership before it closes anything else, since a
master whose pod is deleted may have well under a second left."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from pyetcd.client import MultiEndpointEtcd3Client

from kfp_elastic.job_spec import Entry, JobSpec, Policy
from kfp_elastic.master.job import ElasticJob, JobResult
from kfp_elastic.master.launcher import (
    Launcher,
    WorkerEvent,
    WorkerHandle,
    WorkerPhase,
    WorkerStatus,
)
from kfp_elastic.master.own_pod import REASON
from kfp_elastic.master.state import MasterState
from kfp_elastic.master.timeline import MasterStarted, MasterSteppedDown, read_timeline
from tests.helpers import wait_for


class PendingLauncher(Launcher):
    """Workers that stay Pending; ``close`` notes who leads the run at that moment."""

    def __init__(self, state: MasterState) -> None:
        self.state = state
        self.names: list[str] = []
        self.leader_at_close: Any = "not closed"

    def launch(self, worker_index: int) -> WorkerHandle:
        self.names.append(f"worker-{worker_index}-0")
        return WorkerHandle(self.names[-1], worker_index, 0)

    def delete(self, name: str) -> None:
        raise AssertionError("a step-down leaves the workers")

    def list_workers(self) -> list[WorkerStatus]:
        return [WorkerStatus(n, WorkerPhase.PENDING) for n in self.names]

    def events(self, stop: threading.Event) -> Iterator[WorkerEvent]:
        stop.wait()
        return iter(())

    def close(self) -> None:
        self.leader_at_close = self.state.leader()


def test_step_down_records_the_hand_over_and_releases_before_closing(
    client: MultiEndpointEtcd3Client, run_id: str
) -> None:
    spec = JobSpec(
        run_id=run_id, entry=Entry(command=("train.py",)), policy=Policy(leader_ttl_s=30)
    )
    launchers: list[PendingLauncher] = []

    def make(state: MasterState) -> Launcher:
        launchers.append(PendingLauncher(state))
        return launchers[0]

    job = ElasticJob(spec, client, make)
    results: list[JobResult] = []
    thread = threading.Thread(target=lambda: results.append(job.run()))
    thread.start()
    try:
        wait_for(
            lambda: any(
                isinstance(e, MasterStarted) for e in read_timeline(client, spec.run_prefix)
            ),
            30,
            0.05,
            "the master started",
        )
        # The step-down leaves launched workers alone: wait until there are some.
        wait_for(lambda: launchers and launchers[0].names, 30, 0.05, "the master launched")
        job.request_stop(cancel=False, reason=REASON)
        thread.join(30)
    finally:
        job.request_stop(cancel=True)
        thread.join(30)
    assert [r.state for r in results] == ["stepped_down"] and REASON in results[0].message
    last = read_timeline(client, spec.run_prefix)[-1]
    assert isinstance(last, MasterSteppedDown)
    assert (last.master, last.reason) == (job.state.identity, REASON)
    # Released before the launcher closed (not after a 30 s lease TTL): the next master may
    # take over while this one still closes; the workers were left alone.
    assert launchers[0].leader_at_close is None
    assert (
        launchers[0].names and MasterState(client, spec.run_prefix).status()["state"] == "running"
    )
