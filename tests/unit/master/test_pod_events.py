"""Which timeline event becomes which Kubernetes Event (master/pod_events.py), without I/O."""

from __future__ import annotations

from kfp_elastic.master.pod_events import (
    MAX_MESSAGE,
    NORMAL,
    WARNING,
    PodEvent,
    Seen,
    clip,
    pod_event,
    seen_after,
)
from kfp_elastic.master.timeline import (
    Committed,
    EpochEnd,
    Event,
    FailureCounted,
    JobDone,
    JobFailed,
    LadderMoved,
    LaunchFailed,
    MasterStarted,
    RoundFormed,
    WorkerCompleted,
    WorkerLaunched,
    WorkerLost,
    WorkerRunning,
)


def events_of(timeline: list[Event], seen: Seen | None = None) -> list[PodEvent | None]:
    seen = seen or Seen(max_failures=1)
    out = []
    for event in timeline:
        recorded, seen = pod_event(event, seen)
        out.append(recorded)
    return out


def test_a_first_worker_is_created_and_a_lost_one_replaced_naming_the_pod_it_replaces() -> None:
    timeline: list[Event] = [
        WorkerLaunched(name="job-worker-1-0", index=1, attempt=0),
        # the replacement may be launched while the lost pod still terminates: its loss follows
        WorkerLaunched(
            name="job-worker-1-1",
            index=1,
            attempt=1,
            replaces="job-worker-1-0",
            replaces_cause="deleted_externally",
        ),
        WorkerLost(name="job-worker-1-0", index=1, cause="deleted_externally", message="gone"),
        WorkerLaunched(name="job-worker-1-2", index=1, attempt=2, replaces="job-worker-1-1"),
    ]
    assert events_of(timeline) == [
        PodEvent(
            "job-worker-1-0",
            "SuccessfulCreate",
            NORMAL,
            "Created worker pod job-worker-1-0 (worker 1, attempt 0)",
        ),
        PodEvent(
            "job-worker-1-1",
            "WorkerReplaced",
            NORMAL,
            "Created worker pod job-worker-1-1 (worker 1, attempt 1) to replace job-worker-1-0 "
            "(deleted_externally)",
        ),
        PodEvent(
            "job-worker-1-0",
            "WorkerLost",
            NORMAL,
            "Worker pod job-worker-1-0 (worker 1) lost (deleted_externally): gone",
        ),
        PodEvent(
            "job-worker-1-2",
            "WorkerReplaced",
            NORMAL,
            "Created worker pod job-worker-1-2 (worker 1, attempt 2) to replace job-worker-1-1",
        ),
    ]


def test_a_failed_worker_is_a_warning_with_its_exit_code() -> None:
    (failed,) = events_of(
        [WorkerLost(name="w-0-0", index=0, exit_code=1, cause="failed", failure=True, message="x")]
    )
    assert failed == PodEvent(
        "w-0-0", "WorkerFailed", WARNING, "Worker pod w-0-0 (worker 0) failed, exit code 1: x"
    )


def test_job_level_events_are_about_the_masters_own_pod() -> None:
    timeline: list[Event] = [
        LaunchFailed(index=2, message='pods "w-2-0" is forbidden: exceeded quota'),
        RoundFormed(round=1, nodes=2, world_size=4),
        RoundFormed(round=2, nodes=2, world_size=4),  # same size: no Event
        RoundFormed(round=3, nodes=1, world_size=2),
        LadderMoved(from_level=0, level=1, priority_class="low", attained_gpu_s=12.5, reason="r"),
        LadderMoved(from_level=1, level=0, priority_class="high", action="promote_starved"),
        JobDone(message="committed progress is complete", failures=0),
        JobFailed(message="cancelled (SIGINT)", failures=2),
    ]
    assert events_of(timeline) == [
        PodEvent(
            None,
            "FailedCreate",
            WARNING,
            'Error creating worker pod for worker 2: pods "w-2-0" is forbidden: exceeded quota',
        ),
        PodEvent(
            None,
            "WorldResized",
            NORMAL,
            "Round 1 formed a world of 2 workers (world size 4), from 0 workers",
        ),
        None,
        PodEvent(
            None,
            "WorldResized",
            NORMAL,
            "Round 3 formed a world of 1 worker (world size 2), from 2 workers",
        ),
        PodEvent(
            None,
            "LadderDemoted",
            NORMAL,
            "Demoted from ladder level 0 to 1: guaranteed workers are re-created in "
            "PriorityClass low (attained 12.5 GPU-s): r",
        ),
        PodEvent(
            None,
            "LadderPromoted",
            NORMAL,
            "Promoted from ladder level 1 to 0: guaranteed workers are re-created in "
            "PriorityClass high (attained 0 GPU-s)",
        ),
        PodEvent(
            None,
            "JobSucceeded",
            NORMAL,
            "Job succeeded: committed progress is complete (0 failures counted)",
        ),
        PodEvent(None, "JobFailed", WARNING, "Job failed: cancelled (SIGINT) (2 failures counted)"),
    ]


def test_failures_are_counted_on_their_worker_and_the_budget_spent_once() -> None:
    def failure(count: int, **more: object) -> FailureCounted:
        return FailureCounted(
            incident=f"i{count}",
            worker="w-0-0",
            rank=1,
            round=3,
            error="boom",
            count=count,
            **more,  # type: ignore[arg-type]
        )

    counted, spent, again = events_of([failure(1), failure(2), failure(3)])
    assert counted == PodEvent(
        "w-0-0",
        "FailureCounted",
        WARNING,
        "Failure 1 of max_failures=1 counted: w-0-0 (rank 1, round 3): boom",
    )
    assert spent == PodEvent(
        None,
        "FailureBudgetExceeded",
        WARNING,
        "Failure budget spent by failure 2 of max_failures=1: w-0-0 (rank 1, round 3): boom",
    )
    assert again is not None and again.reason == "FailureCounted"  # said once
    (fatal,) = events_of([failure(1, fatal=True)])
    assert fatal is not None and fatal.reason == "FailureBudgetExceeded"
    assert fatal.message.startswith("Failure budget spent by a fatal failure: w-0-0")
    # a launch's failure names no worker: about the master's pod
    (launch,) = events_of([FailureCounted(incident="l", error="no", count=1)])
    assert launch == PodEvent(
        None, "FailureCounted", WARNING, "Failure 1 of max_failures=1 counted: the master: no"
    )


def test_progress_and_bookkeeping_record_no_event() -> None:
    quiet: list[Event] = [
        MasterStarted(master="m"),
        WorkerRunning(name="w-0-0", index=0),
        WorkerCompleted(name="w-0-0", index=0, exit_code=0),
        Committed(step=3),
        EpochEnd(epoch=0, step=3),
    ]
    assert events_of(quiet) == [None] * len(quiet)


def test_a_new_master_starts_from_what_the_timeline_it_found_says() -> None:
    found: list[Event] = [
        RoundFormed(round=1, nodes=1, world_size=1),
        FailureCounted(incident="a", worker="w-0-0", error="x", count=2),  # spent (max 1)
    ]
    seen = seen_after(found, Seen(max_failures=1))
    assert seen == Seen(max_failures=1, nodes=1, budget_spent=True)
    resized, counted = events_of(
        [
            RoundFormed(round=2, nodes=1, world_size=1),
            FailureCounted(incident="b", worker="w-0-1", error="y", count=3),
        ],
        seen,
    )
    assert resized is None  # the world it found had that size already
    assert counted is not None and counted.reason == "FailureCounted"  # spent: said already


def test_messages_are_clipped_to_what_an_event_takes() -> None:
    assert clip("x" * 10) == "x" * 10
    long = clip("x" * 5000)
    assert len(long) == MAX_MESSAGE and long.endswith("...")
