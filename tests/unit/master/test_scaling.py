"""master.scaling: pure decisions from worker statuses (no I/O)."""

from __future__ import annotations

from kfp_elastic.master.launcher import Reason, WorkerPhase, WorkerStatus
from kfp_elastic.master.pod_spec import is_guaranteed
from kfp_elastic.master.scaling import ScalingPolicy, decide, outcome_of, replaced_worker

P, R, S, F, D = (
    WorkerPhase.PENDING,
    WorkerPhase.RUNNING,
    WorkerPhase.SUCCEEDED,
    WorkerPhase.FAILED,
    WorkerPhase.DELETED,
)
POLICY = ScalingPolicy(min_workers=2, max_workers=3, max_wait_s=60)


def w(
    index: int,
    phase: WorkerPhase = R,
    reason: Reason | None = None,
    attempt: int = 0,
    code: int | None = None,
    message: str = "",
) -> WorkerStatus:
    return WorkerStatus(f"w-{index}-{attempt}", phase, reason, message, code, index, attempt)


def test_start_asks_for_max() -> None:
    d = decide(POLICY, [], set(), None, now=0.0)
    assert d.launch == (0, 1, 2) and d.give_up is None and d.delete == ()
    assert d.below_min_since == 0.0  # nothing runs yet: the clock starts


def test_full_job_launches_nothing() -> None:
    d = decide(POLICY, [w(0), w(1), w(2)], set(), 5.0, now=10.0)
    assert d.launch == () and d.below_min_since is None and d.running == 3


def test_pending_workers_keep_their_slot_and_nothing_extra_is_created() -> None:
    workers = [w(0), w(1, P, Reason.UNSCHEDULABLE), w(2, P, Reason.UNSCHEDULABLE)]
    d = decide(POLICY, workers, set(), None, now=1.0)
    assert d.launch == () and d.pending == 2 and d.running == 1
    assert d.below_min_since == 1.0


def test_preempted_worker_is_replaced_without_a_failure() -> None:
    workers = [w(0), w(1, F, Reason.PREEMPTED, code=143), w(2)]
    d = decide(POLICY, workers, set(), None, now=1.0)
    assert d.launch == (1,) and d.delete == ("w-1-0",)
    (lost,) = d.ended
    assert (lost.cause, lost.failure, lost.exit_code) == ("preempted", False, 143)


def test_running_worker_being_taken_away_is_replaced_early() -> None:
    workers = [w(0), w(1, R, Reason.EVICTED), w(2)]
    d = decide(POLICY, workers, set(), None, now=1.0)
    assert d.launch == (1,) and d.ended == () and d.delete == ()


def test_lost_guaranteed_workers_are_replaced_in_their_guaranteed_slots() -> None:
    # Workers 0 and 1 (of MIN=2) preempted: the job runs on opportunistic worker 2 alone. Their
    # replacements take slots 0 and 1 again, so they are guaranteed (pod_spec.priority_class_of)
    # and may preempt opportunistic workers to get back in; the new opportunistic slot stays 2.
    workers = [w(0, F, Reason.PREEMPTED), w(1, F, Reason.NODE_LOST), w(2)]
    d = decide(POLICY, workers, set(), None, now=1.0)
    assert d.launch == (0, 1)
    assert [is_guaranteed(i, POLICY.min_workers) for i in d.launch] == [True, True]
    lost_extra = decide(POLICY, [w(0), w(1), w(2, F, Reason.PREEMPTED)], set(), None, now=1.0)
    assert lost_extra.launch == (2,) and not is_guaranteed(2, POLICY.min_workers)


def test_replacement_with_others_pending_keeps_exactly_max_requested() -> None:
    workers = [w(0, F, Reason.NODE_LOST), w(1, P, Reason.UNSCHEDULABLE), w(2)]
    d = decide(POLICY, workers, set(), None, now=1.0)
    assert d.launch == (0,)  # 1 pending + 1 running + 1 new = max


def test_a_failed_worker_is_a_failure_and_is_replaced() -> None:
    # Whether failures end the job is the failure budget's rule (tests/unit/test_failure_budget.py).
    workers = [w(0), w(1, F, Reason.ERROR, code=1, message="exit code 1"), w(2)]
    d = decide(POLICY, workers, set(), None, now=1.0)
    assert d.launch == (1,) and d.give_up is None
    (failed,) = d.ended
    assert (failed.cause, failed.failure, failed.message) == ("failed", True, "exit code 1")


def test_ended_workers_are_reported_once_and_deleted_until_gone() -> None:
    workers = [w(0), w(1, F, Reason.PREEMPTED), w(2), w(1, R, attempt=1)]
    d = decide(POLICY, workers, {"w-1-0"}, None, now=1.0)
    assert d.ended == () and d.delete == ("w-1-0",) and d.launch == ()
    gone = [w(0), w(1, D, Reason.PREEMPTED), w(2), w(1, R, attempt=1)]
    assert decide(POLICY, gone, {"w-1-0"}, None, now=1.0).delete == ()


def test_below_min_longer_than_max_wait_gives_up_with_the_pending_reasons() -> None:
    workers = [
        w(0),
        w(1, P, Reason.UNSCHEDULABLE, message="0/3 nodes: Insufficient cpu"),
        w(2, P, Reason.UNSCHEDULABLE),
    ]
    d = decide(POLICY, workers, set(), None, now=100.0)
    assert d.give_up is None and d.below_min_since == 100.0
    d = decide(POLICY, workers, set(), d.below_min_since, now=159.0)
    assert d.give_up is None
    d = decide(POLICY, workers, set(), d.below_min_since, now=160.0)
    assert d.give_up is not None and d.launch == ()
    assert "only 1 of --min-workers=2" in d.give_up and "--max-wait=60s" in d.give_up
    assert "w-1-0 (Unschedulable: 0/3 nodes: Insufficient cpu)" in d.give_up


def test_back_at_min_resets_the_clock() -> None:
    d = decide(POLICY, [w(0), w(1)], set(), 10.0, now=50.0)
    assert d.below_min_since is None and d.launch == (2,)


def test_completion_stops_launches_and_the_clock() -> None:
    workers = [w(0, S, Reason.COMPLETED, code=0), w(1, F, Reason.PREEMPTED)]
    d = decide(POLICY, workers, set(), 0.0, now=1000.0)
    assert d.completed and d.launch == () and d.give_up is None and d.below_min_since is None
    d = decide(POLICY, [w(1, F, Reason.ERROR)], set(), 0.0, now=1000.0, finishing=True)
    assert d.give_up is None and d.launch == ()
    assert d.ended[0].cause == "failed" and not d.ended[0].failure


def test_finishing_deletes_pending_workers_so_they_do_not_take_freed_slots() -> None:
    workers = [w(0, S, Reason.COMPLETED, code=0), w(1), w(2, P)]
    d = decide(POLICY, workers, set(), None, now=10.0)
    assert d.completed and d.launch == ()
    assert d.delete == ("w-0-0", "w-2-0")  # the running worker ends on its own
    assert decide(POLICY, [w(1), w(2, P)], set(), None, now=10.0).delete == ()


def test_outcome_of_unknown_reasons() -> None:
    assert outcome_of(w(0, F)).cause == "failed" and outcome_of(w(0, F)).failure
    assert outcome_of(w(0, D)).cause == "deleted_externally"
    assert not outcome_of(w(0, D, Reason.DELETED_EXTERNALLY)).failure
    assert outcome_of(w(0, S)).completed
    assert outcome_of(w(0, F, Reason.DELETED)).cause == "deleted"


def test_a_new_worker_replaces_the_latest_of_its_index_and_says_why_that_one_went() -> None:
    table = {
        "w-0-0": {"index": 0, "attempt": 0, "ended": "preempted"},
        "w-1-0": {"index": 1, "attempt": 0, "ended": "evicted"},
        "w-1-1": {"index": 1, "attempt": 1},
        "w-2-0": {"index": 2, "attempt": 0},
    }
    statuses = {
        # still terminating: the reason it is being taken away
        "w-1-1": WorkerStatus("w-1-1", WorkerPhase.RUNNING, Reason.DELETED_EXTERNALLY),
    }
    assert replaced_worker(0, table, statuses) == ("w-0-0", "preempted")  # recorded end
    assert replaced_worker(1, table, statuses) == ("w-1-1", "deleted_externally")
    assert replaced_worker(2, table, statuses) == ("w-2-0", "unknown")  # nothing says why
    assert replaced_worker(3, table, statuses) is None  # the index's first worker
